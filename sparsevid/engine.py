"""The decoding engine: prefill, then decoding on a preallocated cache; dense, direct or speculative.

- `decode`: dense (the full cache) or a selection policy applied directly (lossy: only the compact
  caches are held);
- `speculative_decode`: a draft (a policy's compact caches, or the first L_e layers) proposes γ
  tokens, dense verifies them in one pass (the StD paper): lossless.

Every decode step goes through `step` (`fast.static_step` over the run's buffers: a captured CUDA
graph, a compiled CPU graph, or eager) with positions the adapter computed once per run, so a run
never writes on the loaded model. Each run returns a plain `traces.Trace`.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import dataclasses
import functools
import inspect
import statistics
import time
import weakref
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from . import kernels
from .adapters import VideoInputs, text_step
from .attention import Run, active
from .fast import buffers, stack_buffers, static_step
from .cache import KVCache, LayerSelection, Prompt, Stack, StackRows
from .models import Loaded
from .metrics import best_gamma
from .traces import LayerRecord, Round, Trace


@dataclass
class Sampling:
    """Greedy when temperature == 0; else temperature + nucleus (top_p) sampling from `seed`.

    ignore_eos: decode exactly max_new_tokens (benchmarks of fixed length, as serving benchmarks do).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = False

    def eos(self, loaded) -> set[int]:
        return set() if self.ignore_eos else set(loaded.adapter.eos_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def generator(self, device, seed: int | None = None) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(self.seed if seed is None else seed)


def probs_from_logits(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] after temperature and top-p (float32)."""
    p = torch.softmax(logits.float() / s.temperature, dim=-1)
    if s.top_p < 1.0:
        sp, idx = p.sort(dim=-1, descending=True)
        drop = sp.cumsum(-1) - sp > s.top_p  # keep the smallest prefix reaching top_p
        sp = sp.masked_fill(drop, 0.0)
        p = torch.zeros_like(p).scatter_(-1, idx, sp)
        p = p / p.sum(-1, keepdim=True)
    return p


def choose(logits: torch.Tensor, s: Sampling, gen: torch.Generator | None) -> int:
    """Next token from logits [V]."""
    if s.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(probs_from_logits(logits, s), 1, generator=gen))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_RSS_BASE: list[int] = []  # resident bytes at the last CPU `_reset_peak`


def _status_bytes(field: str) -> int:
    """A `/proc/self/status` memory field (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak(device: torch.device) -> None:
    """CUDA: reset the allocator's peak. CPU (Linux, glibc): hand freed heap back to the system
    (`malloc_trim`), reset the process's peak resident size (`/proc/self/clear_refs`, 5) and note
    the resident size now, so `_peak` measures this run's own growth."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    _RSS_BASE.clear()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        _RSS_BASE.append(_status_bytes("VmRSS"))
    except (OSError, KeyError):  # not Linux/glibc: no CPU measurement
        pass


def _peak(device: torch.device, pool=None) -> tuple[int | None, str | None]:
    """(bytes, source): CUDA peak allocated since `_reset_peak` less the buffers that waited in the
    pool all run (`cache.BufferPool`: its fewest idle bytes since the run began; by the time this is
    read the run has given its own buffers back), or the CPU peak resident growth."""
    if device.type == "cuda":
        idle = 0 if pool is None else pool.idle_bytes() if pool.low is None else pool.low
        return torch.cuda.max_memory_allocated(device) - idle, "cuda"
    if not _RSS_BASE:
        return None, None
    return max(0, _status_bytes("VmHWM") - _RSS_BASE[0]), "rss"


def prompt_of(loaded: Loaded, inputs: VideoInputs) -> Prompt:
    return Prompt(inputs.m, inputs.visual_positions, inputs.query_start, loaded.num_layers, loaded.num_heads,
                  loaded.num_kv_heads)


def new_run(loaded: Loaded, inputs: VideoInputs, capacity_extra: int, policy=None, store_dense: bool = True,
            keep_stats: bool = False, copy_all: bool = False) -> Run:
    cache = KVCache(loaded.num_layers, inputs.m + capacity_extra, store_dense=store_dense, pool=loaded.pool)
    return Run(cache, prompt_of(loaded, inputs), policy, keep_stats, copy_all)


@dataclass
class Prefilled:
    """A prompt's state right after its prefill, kept to decode it again without prefilling it
    (`runs.compare`'s decode-only timing passes): the run, whose caches hold the prompt's KV
    (decoding writes only past the prompt, so they stay as the prefill left them), the prefill's
    last logits [V] and its seconds (its video's vision tower included). Pass it as a row's
    `prefilled` (`decode_rows`, `speculative_decode_rows`: one row at a time) and the row starts
    from here, the same first token and the same caches; `release` when done with it."""

    run: Run
    logits: torch.Tensor
    prefill_s: float

    def rewind(self) -> Run:
        """The run as its prefill left it (what an earlier decoding wrote forgotten: lengths)."""
        self.run.cache.rewind()
        self.run.fast_steps = 0
        return self.run

    def release(self) -> None:
        self.run.cache.release()


VIDEO_PIXELS = "pixel_values_videos"  # the one model input only the vision tower reads


def takes_encoder_outputs(loaded: Loaded) -> bool:
    """The model's forward takes precomputed vision-tower outputs (transformers' `mm_encoder_outputs`,
    in the pinned 5.23; with a transformers without it, each prefill runs the tower itself)."""
    return _takes_encoder_outputs(type(loaded.model.model))


@functools.lru_cache(maxsize=None)
def _takes_encoder_outputs(cls) -> bool:
    return "mm_encoder_outputs" in inspect.signature(cls.forward).parameters


@torch.inference_mode()
def encode(loaded: Loaded, inputs: VideoInputs) -> float:
    """Run the video's vision tower once per video and model: its outputs are kept in
    `inputs.vision` (shared by the questions of one video, `Adapter.build_questions`) and every
    prefill of those inputs (each method of a comparison, each timing pass, each question) hands
    them to the model as transformers' `mm_encoder_outputs` instead of the pixels: the tensors the
    model would compute, so the same tokens. Returns the tower's seconds (measured the
    one time it ran; 0 for a prompt without video). A run encodes its prompts before its own
    timing and memory window (`Rows`) and counts these seconds in its prefill time, so every run's
    figures are what it costs on its own, whichever run encoded."""
    if VIDEO_PIXELS not in inputs.model_kwargs or not takes_encoder_outputs(loaded):
        return 0.0  # the prefill runs the tower itself
    held = inputs.vision
    if held.get("model") is not loaded.model:
        t0 = time.perf_counter()
        inner = loaded.model.model
        params = inspect.signature(inner.get_video_features).parameters
        out = inner.get_video_features(**{k: x for k, x in inputs.model_kwargs.items() if k in params},
                                       return_dict=True)
        out = type(out)(pooler_output=out.pooler_output)  # what the prefill reads (not the patches' states)
        sync(loaded.device)
        held.update(model=loaded.model, outputs=out, seconds=time.perf_counter() - t0)
    return held["seconds"]


@torch.inference_mode()
def prefill(loaded: Loaded, inputs: VideoInputs, run: Run) -> torch.Tensor:
    """Run the prompt through the model, filling the caches, at the positions the adapter computed
    (the video's vision-tower outputs computed once per inputs: `encode`). Returns the last
    position's logits [V] and sets `run.position_offset` (decode position minus cache length)."""
    encode(loaded, inputs)
    kw = dict(inputs.model_kwargs)
    if inputs.vision.get("model") is loaded.model:  # the tower's outputs in place of the pixels
        del kw[VIDEO_PIXELS]
        kw["mm_encoder_outputs"] = {"video": inputs.vision["outputs"]}
    positions, next_position = loaded.adapter.positions(loaded.model, inputs)
    kw.update({} if positions is None else dict(position_ids=positions))
    try:
        with active(run):
            out = loaded.model(**kw, past_key_values=run.cache, use_cache=True, logits_to_keep=1)
    finally:
        run.prune = None  # pruning is for this prefill only (decode steps are never pruned)
    run.position_offset = next_position - inputs.m
    run.cache.finish_prefill(inputs.m)
    run.cache.prompt_ids = inputs.model_kwargs["input_ids"][0].cpu()  # (compared between rows: `cache.Stack`)
    return out.logits[0, -1]


@torch.inference_mode()
def step(loaded: Loaded, run: Run, tokens: list[int], mode: str | None = None,
         num_layers: int | None = None, pad_to: int | None = None) -> torch.Tensor:
    """`step_rows` of one run: logits [q, V] of `tokens`."""
    return step_rows(loaded, [run], [tokens], mode, num_layers, pad_to)[0]


def batch_buffers(loaded: Loaded, caches: list, mode: str, num_layers: int | None):
    """The step's buffers (`fast.buffers`) of one cache, or of several decoded together: their
    `cache.Stack` (stacked once per set of rows: again after rows end, without theirs; a prompt that
    joins where a row ended takes that row in place where it fits, `Stack.replace`)."""
    if len(caches) == 1:
        return buffers(caches[0], mode, num_layers)
    stack = next((c.stack for c in caches if c.stack is not None), None)
    if stack is None or len(stack.caches) != len(caches) or not all(
            a is b or stack.replace(i, b) for i, (a, b) in enumerate(zip(stack.caches, caches))):
        stack = Stack(caches, loaded.num_heads, loaded.pool)
    return stack_buffers(stack, mode, num_layers)


@contextlib.contextmanager
def step_threads(loaded: Loaded, per_head: bool = False):
    """A decode step's intra-op threads on the CPU: `loaded.step_threads` where it is set (chosen by
    measurement, `runs.choose_step_threads`; `loaded.head_threads` for a step over a per-head layout
    where that is set, `runs.compile_steps`), torch's own count again afterwards (prefill keeps it).
    Inside, `kernels.WIDE_THREADS` is torch's own count: a large eager attention call runs on it."""
    n, old = (per_head and loaded.head_threads) or loaded.step_threads, torch.get_num_threads()
    if not n or n == old or loaded.device.type != "cpu":
        yield
        return
    kernels.WIDE_THREADS = old
    try:
        with kernels.threads(n):
            yield
    finally:
        kernels.WIDE_THREADS = None


@torch.inference_mode()
def step_rows(loaded: Loaded, runs: list[Run], feeds: list[list[int]], mode: str | None = None,
              num_layers: int | None = None, pad_to: int | None = None) -> list[torch.Tensor]:
    """Feed each run its tokens (`feeds[b]`; [] for a row that sits this step out) after the current
    length of `mode`'s cache (through the first `num_layers` layers, all by default), all rows in
    one step. Returns per row logits [len(feeds[b]), V].

    One decode path: `fast.static_step` over the caches' buffers (several runs: their `cache.Stack`,
    each row at its own lengths and positions), through a compiled (CPU) or captured (CUDA) graph
    where `loaded.fast` is enabled, else eagerly; the eager `adapters.text_step` only serves a run
    that watches its decode attention (calibration). Rows are fed max(len(feeds[b])) tokens, a
    shorter feed padded by repeating its last token: the padding rows come after the real ones
    (causality keeps them from the real rows' logits) and write past the row's length, where
    nothing reads before it is overwritten. `pad_to`: with captured graphs, a verification pass is
    fed as `pad_to` rows, so one graph serves every γ."""
    caches = [r.cache for r in runs]
    if mode is not None:
        for c in caches:
            c.mode = mode
    dev = loaded.device
    fast = loaded.fast
    rows = max(max(len(f) for f in feeds), padded_rows(loaded, pad_to) or 0)
    idle = _idle_rows(caches)
    slot = list(range(len(runs))) if idle is None else idle[1]  # each run's row of the step
    B = len(runs) if idle is None else len(idle[0].caches)
    fed, at = [[0]] * B, [None] * B  # an idle row (it ended): token 0 at its first generated position
    for b, r, f in zip(slot, runs, feeds):
        fed[b], at[b] = f or [0], r
    ids = torch.tensor([f + f[-1:] * (rows - len(f)) for f in fed], device=dev)
    pos = torch.cat([loaded.adapter.position_ids(0 if r is None else r.cache.length + r.position_offset, rows, dev)
                     for r in at], dim=-2)
    watched = len(runs) == 1 and runs[0].on_decode_attention is not None
    if watched:
        bufs = None
    elif idle is not None:
        bufs = stack_buffers(idle[0], caches[0].mode, num_layers)
    else:
        bufs = batch_buffers(loaded, caches, caches[0].mode, num_layers)
    with step_threads(loaded, per_head=bufs is not None and bufs[3]):
        if bufs is None:  # eager, through the run (one row: calibration, or a layer with nothing to read)
            with active(runs[0]):
                logits = text_step(loaded.model, ids, pos, caches[0], num_layers)
        else:
            stacked = caches if idle is None else idle[0].caches
            lengths = torch.tensor([c.length if r is not None else c.prompt_len for c, r in zip(stacked, at)],
                                   device=dev)[:, None]
            start = bufs[2] + lengths
            logits = None if fast is None else fast.step(bufs, start, ids, pos)  # None: eager
            if logits is not None:
                for r in runs:
                    r.fast_steps += 1
            else:
                logits = static_step(loaded.model, ids, pos, bufs[0], bufs[1], start)
    for c, f in zip(caches, feeds):
        c.advance(len(f))
    return [logits[b, :len(f)] for b, f in zip(slot, feeds)]


def padded_rows(loaded: Loaded, pad_to: int | None) -> int | None:
    """The rows every verification pass computes where captured graphs pad it to `pad_to` (CUDA with
    `loaded.fast` enabled: one graph serves every γ), else None (a pass computes the rows it is fed)."""
    fast = loaded.fast
    return pad_to if pad_to and fast is not None and fast.enabled and loaded.device.type == "cuda" else None


def _idle_rows(caches: list) -> tuple | None:
    """(stack, each cache's row in it) where several caches are rows of one `cache.Stack`, in its
    order, with rows of the stack that have ended between them, and the live rows more than half of
    it: the step runs over the whole stack, the ended rows idle (their output unused), instead of
    stacking the live rows again (which copies all their KV: at long prompts a row ending every
    few rounds cost more than the idle rows' reads). None otherwise."""
    stack = caches[0].stack if len(caches) > 1 else None
    if stack is None or len(caches) >= len(stack.caches) or 2 * len(caches) <= len(stack.caches):
        return None
    rows, j = [], 0
    for c in caches:
        while j < len(stack.caches) and stack.caches[j] is not c:
            j += 1
        if j == len(stack.caches) or c.stack is not stack:
            return None
        rows.append(j)
        j += 1
    return stack, rows


def layer_records(selections: dict[int, LayerSelection], rows: dict[int, torch.Tensor] | None = None,
                  m: int | None = None) -> dict[int, LayerRecord]:
    """The run's selections as plain records (numpy, on the CPU), in prompt positions: a pruned
    layer's (`rows[layer]`: the original positions [m'] of the rows it processed, m the prompt
    length) kept positions, query mask and selected tokens are mapped back through its rows."""
    def np_(x):
        return None if x is None else x.detach().cpu().numpy()

    rows = rows or {}
    out = {}
    for layer, sel in sorted(selections.items()):
        r = rows.get(layer)
        r = None if r is None else r.cpu()
        keep, qmask, info = sel.keep, sel.query_mask, dict(sel.info)
        if r is not None:
            keep = [r[k.cpu()] for k in keep]
            if qmask is not None:
                full = torch.zeros(qmask.shape[0], m, dtype=torch.bool)
                full[:, r] = qmask.cpu()
                qmask = full
            if isinstance(info.get("tokens"), torch.Tensor):
                info["tokens"] = r[info["tokens"].cpu()]
        out[layer] = LayerRecord([k.cpu().numpy().astype(np.int32) for k in keep], np_(qmask), np_(sel.head_scale),
                                 {k: np_(v) if isinstance(v, torch.Tensor) else v for k, v in info.items()},
                                 rows=None if r is None else r.numpy().astype(np.int32))
    return out


def _row_callback(on_token):
    """A one-row run's `on_token(tok)` as a batch's `on_token(row, tok)`."""
    return None if on_token is None else (lambda row, tok: on_token(tok))


class _Rows:
    """The rows of a batched run (continuous batching): each prompt is prefilled on its own and
    joins the live rows, at most `width` at once (default: all); when a row ends (`done(b)`), it
    leaves and the next waiting prompt joins, so a batch stays full while prompts wait. Per row: its
    run (`make_run(inputs)`), tokens (`outs[b]`; the first chosen from its prefill, with its own
    random generator, `seeds[b]`, default `sampling.seed`), prefill seconds, and its decode
    seconds and step times: the sum of the steps (or rounds) it took part in (`timed`), so another
    row's prefill between two steps is not counted in its decode time. `finish(b)` is called as row
    b ends (its trace, then its cache is released). One row at a time (width 1) may also start from
    a kept prefill (`prefilled[b]`, a `Prefilled`: no prefill, its seconds counted) or keep its own
    (`keep`: a list that receives each row's `Prefilled` as its prefill ends; its cache is then the
    list owner's to release)."""

    def __init__(self, loaded: Loaded, inputs: list[VideoInputs], make_run, sampling: Sampling,
                 seeds: list[int] | None, on_token, max_new_tokens: int, width: int | None = None, begin=None,
                 finish=None, prefilled: list | None = None, keep: list | None = None):
        B = len(inputs)
        self.prefilled, self.keep = prefilled or [None] * B, keep
        assert (prefilled is None and keep is None) or min(width or B, B) == 1, "kept prefills: one row at a time"
        self.loaded, self.inputs, self.make_run, self.sampling, self.on_token = loaded, inputs, make_run, sampling, on_token
        self.eos, self.max_new_tokens = sampling.eos(loaded), max_new_tokens
        self.begin, self.finish = begin, finish
        self.width = min(width or B, B)
        self.runs: list[Run | None] = [None] * B
        self.outs: list[list[int]] = [[] for _ in range(B)]
        self.prefill_s, self.decode_s = [0.0] * B, [0.0] * B
        self.total_s = 0.0  # every step (round) once: the batch's decode time
        self.step_s: list[list[float]] = [[] for _ in range(B)]
        self.gens = [sampling.generator(loaded.device, seed) for seed in (seeds or [None] * B)]
        self.waiting = list(range(B))
        self.live: list[int] = []
        self.vision_s = [encode(loaded, x) for x in inputs]  # before the window its time and memory are read in
        sync(loaded.device)
        _reset_peak(loaded.device)
        if loaded.pool is not None:
            loaded.pool.mark()

    def done(self, b: int) -> bool:
        """Row b has ended: an end token, or max_new_tokens tokens."""
        return self.outs[b][-1] in self.eos or len(self.outs[b]) >= self.max_new_tokens

    def admit(self) -> list[int]:
        """Prefill waiting prompts while fewer than `width` rows are live (the first call: the first
        `width` prompts, whose caches are reserved in the stack's layout first: `cache.StackRows`,
        so their prefills write where the batch's steps read); the live rows."""
        if not self.live and len(self.waiting) == len(self.inputs) and self.width > 1:
            first = self.waiting[:self.width]
            for b in first:
                self.runs[b] = self.make_run(self.inputs[b])
            StackRows([self.runs[b].cache for b in first], self.loaded.pool)
        while len(self.live) < self.width and (b := self.join()) is not None:
            self.live.append(b)
        return self.live

    def join(self) -> int | None:
        """Prefill waiting prompts until one does not end at its first token: its row (None: none left)."""
        while self.waiting:
            if (b := self._prefill_next()) is not None:
                return b
        return None

    def _prefill_next(self) -> int | None:
        b = self.waiting.pop(0)
        x, kept = self.inputs[b], self.prefilled[b]
        if kept is not None:  # decode again from a kept prefill: the same first token, the same caches
            self.runs[b] = kept.rewind()
            self.outs[b] = [choose(kept.logits, self.sampling, self.gens[b])]
            self.prefill_s[b] = kept.prefill_s
        else:
            run = self.runs[b] = self.runs[b] or self.make_run(x)
            t0 = time.perf_counter()
            logits = prefill(self.loaded, x, run)
            self.outs[b] = [choose(logits, self.sampling, self.gens[b])]
            sync(self.loaded.device)
            self.prefill_s[b] = time.perf_counter() - t0 + self.vision_s[b]  # its video's vision tower counted
            if self.keep is not None:
                self.keep.append(Prefilled(run, logits, self.prefill_s[b]))
        if self.on_token is not None:
            self.on_token(b, self.outs[b][0])
        if self.begin is not None:
            self.begin(b)
        if self.done(b):
            self.end(b)
            return None
        return b

    def timed(self, seconds: float) -> None:
        """A step (or round) of the live rows took `seconds`."""
        self.total_s += seconds
        for b in self.live:
            self.decode_s[b] += seconds
            self.step_s[b].append(seconds)

    def end(self, b: int) -> None:
        if self.finish is not None:
            self.finish(b)
        if self.prefilled[b] is None and self.keep is None:  # a kept prefill's owner releases it
            self.runs[b].cache.release()

    def close(self, traces: list[Trace]) -> None:
        """The pass is over: each trace gets the pass's peak memory and batch time and says whether
        its prefill was reused."""
        peak = _peak(self.loaded.device, self.loaded.pool)
        for b, t in enumerate(traces):
            t.peak_memory_bytes, t.peak_memory_source = peak
            t.batch_decode_s = self.total_s
            t.prefill_reused = self.prefilled[b] is not None

    def next(self) -> list[int]:
        """After a step: rows that are done leave, waiting prompts join; the live rows. A prompt that
        joins takes the place of one that left, so the other rows keep their places (and their
        stacked buffers: `cache.Stack.replace`)."""
        slots = []
        for i, b in enumerate(self.live):
            if self.done(b):
                self.end(b)
                slots.append(i)
        for i in slots:
            self.live[i] = self.join()
        self.live = [b for b in self.live if b is not None]
        return self.admit()


def _choose_rows(logits: list[torch.Tensor], s: Sampling, gens: list) -> list[int]:
    """Each row's next token from its logits [V] (greedy: one argmax for the batch, one sync)."""
    if s.greedy:
        return torch.stack(logits).argmax(-1).tolist()
    return [choose(lg, s, g) for lg, g in zip(logits, gens)]


@torch.inference_mode()
def decode(loaded: Loaded, inputs: VideoInputs, *, on_token: Callable[[int], None] | None = None,
           **kw) -> Trace:
    """`decode_rows` of one prompt."""
    return decode_rows(loaded, [inputs], on_token=_row_callback(on_token), **kw)[0]


@torch.inference_mode()
def decode_rows(loaded: Loaded, inputs: list[VideoInputs], *, method: str = "dense", policy=None,
                max_new_tokens: int = 96, sampling: Sampling = Sampling(),
                on_token: Callable[[int, int], None] | None = None, keep_stats: bool = False,
                run_out: list | None = None, capacity_tokens: int = 0, seeds: list[int] | None = None,
                width: int | None = None, prefilled: list | None = None, keep: list | None = None) -> list[Trace]:
    """Dense decoding (policy None) or a policy applied directly (lossy; compact caches only) of one
    or several prompts decoded together (batched: one step serves every row; each row is prefilled
    on its own, keeps its own lengths, positions and selections, and leaves the batch when it ends).
    `on_token(row, token)` as each row's tokens come. `run_out`, if given, receives each `Run` (its
    prefill statistics, for evaluation figures). `capacity_tokens`: size the caches for that many
    tokens (a warm-up run sized as the runs it prepares, so their buffers and graphs are the ones
    it captured). `width`: at most that many rows live at once, a waiting prompt joining as a row
    ends (continuous batching, `_Rows`; default all at once). A row's `decode_s` is the sum of the
    steps it took part in. `seeds`: each row's random seed when sampling (default `sampling.seed` for
    every row: each row draws as its own one-row run would). `prefilled` / `keep` (one row at a
    time): start rows from kept prefills / keep theirs (`Prefilled`)."""
    dev = loaded.device
    traces: list[Trace | None] = [None] * len(inputs)

    def finish(b: int) -> None:
        run, out, x = rows.runs[b], rows.outs[b], inputs[b]
        if run_out is not None:
            run_out.append(run)
        traces[b] = Trace(method, "dense" if policy is None else "direct", out, loaded.adapter.decode(out),
                          rows.prefill_s[b], rows.decode_s[b], run.cache.nbytes(), step_s=rows.step_s[b],
                          layers=layer_records(run.selections, run.rows, x.m), fast_steps=run.fast_steps,
                          batch=rows.width)

    rows = _Rows(loaded, inputs, lambda x: new_run(loaded, x, max(max_new_tokens, capacity_tokens) + 1, policy,
                                                   store_dense=policy is None, keep_stats=keep_stats),
                 sampling, seeds, on_token, max_new_tokens, width, finish=finish, prefilled=prefilled, keep=keep)
    live = rows.admit()
    while live:
        ts = time.perf_counter()
        logits = step_rows(loaded, [rows.runs[b] for b in live], [rows.outs[b][-1:] for b in live])
        for b, tok in zip(live, _choose_rows([lg[-1] for lg in logits], sampling, [rows.gens[b] for b in live])):
            rows.outs[b].append(tok)
            if on_token is not None:
                on_token(b, tok)
        sync(dev)
        rows.timed(time.perf_counter() - ts)
        live = rows.next()
    rows.close(traces)
    return traces


class PolicyDraft:
    """Draft = the model over the compact caches built by `policy` at prefill (StD, Streaming,
    HT-Sparse, SparseMM as drafts). A layer the policy keeps whole reads the dense cache.

    The draft cache holds every committed token except `pending` (1 token, or 2 when the whole
    draft was accepted and `refresh` is off). With `refresh`, after each round the accepted
    tokens' KV in the compact caches is replaced by dense's (n+1 entries copied).
    """

    mode, num_layers = "sparse", None  # a draft step: the compact caches, every layer

    def __init__(self, policy, refresh: bool = True):
        self.policy, self.refresh = policy, refresh

    def begin(self, run: Run, committed: list[int]) -> None:
        self.pending = committed[-1:]

    def feed(self) -> list[int]:
        return self.pending

    def prepare(self, run: Run) -> None:
        """Before a draft step that feeds this row."""
        cache = run.cache
        if self.refresh and cache.sparse_len < cache.dense_len:  # catch up after dense rounds, in one copy
            cache.refresh_sparse(cache.sparse_len, cache.dense_len)
            cache.sparse_len = cache.dense_len

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's next-token logits [V] from its step's (the same; a test draft may change them)."""
        return logits

    def before_verify(self, run: Run) -> None:
        """The compact caches keep the draft's entries until the round ends."""

    def end_round(self, run: Run, n_draft_fed: int, out: list[int]) -> None:
        """After verification: `out` is every committed token; the dense cache holds all but the last."""
        cache = run.cache
        committed_len = cache.dense_len
        if self.refresh:
            if n_draft_fed:  # a round with no draft (γ = 0) leaves them behind: `forward` catches up
                cache.refresh_sparse(cache.sparse_len - n_draft_fed, committed_len)
                cache.sparse_len = committed_len
            self.pending = out[-1:]
        else:  # the draft keeps its own KV for the committed tokens it was fed
            cache.sparse_len = min(cache.sparse_len, committed_len)
            self.pending = out[-(committed_len + 1 - cache.sparse_len):]


class LayerSkipDraft:
    """Draft = the first `layers` decoder layers + final norm + LM head (tuning-free).

    Its KV in those layers is exactly dense's, so it reads and writes the dense cache; the dense
    verification pass rewrites the same positions, and the length is restored after drafting.
    """

    policy = None
    mode = "dense"

    def __init__(self, layers: int):
        self.layers = self.num_layers = layers

    def begin(self, run: Run, committed: list[int]) -> None:
        self.last = committed[-1:]
        self._start = None  # dense length before this round's draft writes

    def feed(self) -> list[int]:
        return self.last

    def prepare(self, run: Run) -> None:
        if self._start is None:
            self._start = run.cache.dense_len

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def before_verify(self, run: Run) -> None:
        """Forget the draft's dense-cache writes: verification rewrites those positions."""
        if self._start is not None:
            run.cache.dense_len = self._start
            self._start = None

    def end_round(self, run: Run, n_draft_fed: int, out: list[int]) -> None:
        self.last = out[-1:]


class GammaPlan:
    """Each round's γ from the run's own measured costs (adaptive γ): t_dense (a dense step), t_draft
    (a draft step), t_row (each extra token of a verification pass), each the median of its last
    `window` readings (one slow reading on a noisy machine moves a median little), and the
    per-position acceptance α (`alpha`: Laplace's rule over the positions tested);
    `metrics.best_gamma` picks the γ with the most expected tokens per second, 0 (a plain dense step)
    when speculation cannot beat dense by 5 %.

    The run starts with dense steps until their time has settled: the first steps after a prefill
    run slower (measured: 3.2-4.9 ms falling to 1.6-2.9 ms over 4-10 steps at 4,608 and 9,216 visual
    tokens), and a t_dense read there makes any draft look cheap. So at least `warm` dense steps,
    more while the fastest of the last three is 5 % below every earlier one (up to `warm_max`), and
    t_dense starts from the last three. The draft is then tried on `probe` tokens, and again after
    `reprobe` dense steps in a row, in case acceptance has changed. A probe that rejects nothing but
    leaves α too short to pay is followed by another at once (evidence gathers while the draft is
    right: at 9,216 visual tokens a 3-token probe accepted in full ran about 1.3x a dense step's
    rate, yet after one such probe α = 0.8 and the doubled wait left at most two probes in 48
    tokens); each time a probe with a rejection ends in dense steps the wait doubles (up to
    `max_wait`), and it stops where the costs of two drafting rounds or more say that even a draft
    whose every token is accepted cannot pay. On one drafting round only where it could not pay even
    at `first_read` of its measured costs: a run's first draft steps read slower (at batch 8 and
    4,608 visual tokens a first 3-token probe 24-28 ms where the later ones took 20-22, and one such
    reading had stopped the run's drafting for good), but where a draft step costs what a dense step
    costs (the embedded model at 1,152 visual tokens on a CPU: a first probe's draft steps 1.1-1.2
    dense steps, warm ones 1.0), a second probe on a short answer is 10 % of its decoding lost. So a
    run whose draft cannot pay costs about what dense costs.

    A run at a shape where the model's previous adaptive run of the same method found the draft
    hopeless (`carried`: `HopelessShapes`) skips its probes: it runs dense steps from the start,
    and tries the draft only after `max_wait` of them. The first run at a shape still pays its
    probes (at 4,608 visual tokens on a 2-core Xeon, two 3-token probes and the slower dense steps
    after them: 3-5 % of a 48-token answer); a comparison's timing passes (`runs.compare`, whose
    shown runs forget the verdicts and probe) and repeated runs at that length do not.

    Rows decoded together share each round: γ is best for the live rows' mean Ω over each row's own
    α (`rows`), not for their pooled α (Ω is convex in α: rows accepting everything beside rows
    accepting little want a longer γ than their pooled rate says). Where captured graphs pad every
    verification to γ_max + 1 rows (`padded`), a pass costs the same for every γ, and t_row is its
    cost over the padded rows, not over the tokens drafted (a 3-token probe in a 10-row pass would
    otherwise read three times the cost per row). Lossless whatever it picks."""

    def __init__(self, gamma: int, adaptive: bool, draft_is_dense: bool, reprobe: int = 16, probe: int = 3,
                 warm: int = 4, warm_max: int = 10, window: int = 9, max_wait: int = 256, padded: int | None = None,
                 carried: bool = False):
        self.gamma, self.adaptive, self.draft_is_dense, self.reprobe = gamma, adaptive, draft_is_dense, reprobe
        self.padded = padded  # rows every verification computes (`padded_rows`), else None
        self.carried = carried  # the previous run at this shape found the draft hopeless: no probe at first
        self.found_hopeless = False  # this run found that no γ up to `gamma` could pay
        self.wait, self.max_wait = (max_wait if carried else reprobe), max_wait  # dense steps in a row before a probe
        self.probe = probe  # a probe drafts few tokens: a draft that fails costs little
        self.warm, self.warm_max = warm, warm_max  # dense steps measured before the first probe
        self.falling = True  # the last dense steps were still getting faster (warming up)
        self.window = window
        self.dense_s: list[float] = []  # recent readings, newest last
        self.draft_s: list[float] = []
        self.row_s: list[float] = []
        self.warm_s: list[float] = []  # every dense step's reading while warming up
        self.accepted = self.tested = self.dense_run = self.dense_steps = 0
        self.full = False  # the last drafting round had no rejection (every row accepted every token tested)
        self.rows: dict[int, list[int]] = {}  # row -> [accepted, tested], where rows are decoded together

    first_read = 0.7  # later rounds may cost as little as this share of a first drafting round (it read up to 1.4x)

    def _median(self, xs: list[float]) -> float | None:
        return statistics.median(xs) if xs else None

    @property
    def warming(self) -> bool:
        """Still measuring dense steps before the first probe (their time has not settled yet)."""
        return self.dense_steps < self.warm or (self.falling and self.dense_steps < self.warm_max)

    @property
    def t_dense(self) -> float | None:
        return self._median(self.dense_s)

    @property
    def t_draft(self) -> float | None:
        return self._median(self.draft_s)

    @property
    def t_row(self) -> float | None:
        return self._median(self.row_s)

    @property
    def costs(self) -> tuple[float | None, float | None, float]:
        """(t_draft, t_dense, t_row) as `best_gamma` and `hopeless` take them (t_row 0 before any)."""
        return self.t_draft, self.t_dense, self.t_row or 0.0

    @property
    def alpha(self) -> float:
        """Per-position acceptance: of the positions tested (a round tests its accepted tokens and the
        first rejected one; tokens drafted after a rejection were never tested), the share accepted,
        by Laplace's rule: (accepted + 1) / (tested + 2), the chance that the next one is accepted
        under a uniform prior. So a probe accepting 3 of 3 reads 0.8, not 1: on that one probe a run
        at 4,608 visual tokens went to γ = 9 where its draft was accepted 67-82 % and ran at 0.86x."""
        return (self.accepted + 1) / (self.tested + 2)

    def alphas(self, live: list[int] | None) -> float | list[float]:
        """Each live row's α (as `alpha`, from that row's counts; a run of one row: its `alpha`)."""
        if not live or not self.rows:
            return self.alpha
        return [(a + 1) / (t + 2) for a, t in (self.rows.get(b, (0, 0)) for b in live)]

    def choose(self, room: int, live: list[int] | None = None) -> tuple[int, str]:
        """(γ, why) for a round that may still commit `room` draft tokens besides the bonus (`live`:
        the rows of this round, where several are decoded together)."""
        g_max = min(self.gamma, room)
        if not self.adaptive:
            return g_max, "fixed"
        if self.draft_is_dense:
            return 0, "draft = dense"
        if self.warming:
            return 0, "dense step"
        if self.carried and self.t_draft is None and self.dense_run < self.wait:
            return 0, "hopeless here before"
        if self.t_draft is None or self.dense_run >= self.wait:
            return min(self.probe, g_max), "probe"
        costs = self.costs
        g = best_gamma(self.alphas(live), g_max, *costs, padded=self.padded)
        if g == 0 and self.dense_run == 0:  # the draft just ran and does not pay yet
            if self.hopeless(g_max, costs):
                self.wait = self.max_wait  # not even a draft accepted in full could pay
                self.found_hopeless = self.found_hopeless or g_max == self.gamma
            elif self.full:  # nothing rejected: evidence is still short, so probe again at once
                return min(self.probe, g_max), "probe"
            else:
                self.wait = min(2 * self.wait, self.max_wait)  # a rejection: wait longer next time
        elif g > 0:
            self.wait = self.reprobe
        return g, "best"

    def hopeless(self, g_max: int, costs: tuple[float, float, float]) -> bool:
        """Not even a draft whose every token is accepted could pay at these (t_draft, t_dense, t_row):
        on two drafting rounds or more as measured, on one at `first_read` of its draft and row costs."""
        if len(self.draft_s) == 1:
            costs = (costs[0] * self.first_read, costs[1], costs[2] * self.first_read)
        return best_gamma(1.0, g_max, *costs, padded=self.padded) == 0

    def conclude(self) -> None:
        """At the run's end: whether its costs so far say the draft is hopeless (`found_hopeless`),
        where the answer ended before a round could ask (a 15-token answer can end right after the
        probe that would decide it, and the next run would pay its probes again)."""
        if (self.adaptive and not self.found_hopeless and self.draft_s and self.t_dense is not None
                and self.hopeless(self.gamma, self.costs)):
            self.found_hopeless = True

    def observe(self, drafted: int, draft_s: float, verify_s: float, accepted: int = 0, tested: int | None = None,
                rows: dict[int, tuple[int, int]] | None = None) -> None:
        """A round: `drafted` draft steps in `draft_s`, its verification in `verify_s`, `accepted`
        draft tokens accepted of `tested` positions tested (default: one row's round); or `rows`,
        {row: (accepted, tested)} (the round's counts are their sums)."""
        if rows is not None:
            accepted, tested = sum(a for a, _ in rows.values()), sum(t for _, t in rows.values())
        def keep(xs: list[float], x: float) -> None:
            xs.append(x)
            del xs[:-self.window]

        self.dense_run = self.dense_run + 1 if drafted == 0 else 0
        if drafted == 0:
            if self.warming:  # only the last three readings count
                w = self.warm_s
                w.append(verify_s)
                self.falling = len(w) <= 3 or min(w[-3:]) < 0.95 * min(w[:-3])
                self.dense_s[:] = w[-3:]
            else:
                keep(self.dense_s, verify_s)
            self.dense_steps += 1
            return
        keep(self.draft_s, draft_s / drafted)
        if self.t_dense is not None:  # a padded pass computed padded - 1 rows besides dense's one
            keep(self.row_s, max(0.0, verify_s - self.t_dense) / (self.padded - 1 if self.padded else drafted))
        tested = accepted + (accepted < drafted) if tested is None else tested
        self.full = accepted == tested if rows is None else all(a == t for a, t in rows.values())
        self.accepted += accepted
        self.tested += tested
        for b, (a, t) in (rows or {}).items():
            counts = self.rows.setdefault(b, [0, 0])
            counts[0] += a
            counts[1] += t


class HopelessShapes:
    """Where a model's adaptive runs found the draft hopeless (`GammaPlan.found_hopeless`): a key
    of method, γ, the rows' prompt lengths and the draft's settings -> runs left that skip their
    probes (`GammaPlan.carried`). A verdict serves `uses` runs, then a run probes again and renews
    or drops it (a slow stretch of a shared machine must not stop drafting for good); a run that
    drafted and did not find it hopeless drops it. Kept per model while it is loaded (`VERDICTS`)."""

    uses = 2
    VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {key: runs left}

    def __init__(self, loaded: Loaded):
        self.left: dict[tuple, int] = self.VERDICTS.setdefault(loaded.model, {})

    @staticmethod
    def key(method: str, gamma: int, inputs: list[VideoInputs], draft) -> tuple:
        config = getattr(draft, "policy", None)
        values = ((f.name, getattr(config, f.name)) for f in dataclasses.fields(config)) \
            if dataclasses.is_dataclass(config) else ()
        settings = tuple((k, v) for k, v in values if isinstance(v, (int, float, str, bool, type(None))))  # not tensors
        return method, gamma, tuple(x.m for x in inputs), getattr(draft, "layers", None), settings

    def forget(self) -> None:
        """Drop every verdict (`runs.compare`: the runs it shows probe as a fresh process's would)."""
        self.left.clear()

    def carried(self, key: tuple) -> bool:
        return self.left.get(key, 0) > 0

    def update(self, key: tuple, plan: GammaPlan) -> None:
        if plan.found_hopeless:
            self.left[key] = self.uses
        elif plan.carried and plan.t_draft is None:  # it used the verdict (it never drafted)
            self.left[key] = self.left.get(key, 1) - 1
        else:
            self.left.pop(key, None)


@torch.inference_mode()
def speculative_decode(loaded: Loaded, inputs: VideoInputs, draft, *, on_token: Callable[[int], None] | None = None,
                       **kw) -> Trace:
    """`speculative_decode_rows` of one prompt."""
    return speculative_decode_rows(loaded, [inputs], draft, on_token=_row_callback(on_token), **kw)[0]


@torch.inference_mode()
def speculative_decode_rows(loaded: Loaded, inputs: list[VideoInputs], draft, *, method: str = "std",
                            gamma: int = 9, adaptive: bool = False, max_new_tokens: int = 96,
                            sampling: Sampling = Sampling(), on_token: Callable[[int, int], None] | None = None,
                            capacity_tokens: int = 0, seeds: list[int] | None = None,
                            width: int | None = None, prefilled: list | None = None,
                            keep: list | None = None) -> list[Trace]:
    """Speculative decoding with any draft, verified by dense: lossless (the StD paper, Leviathan et
    al.'s acceptance rule), of one or several prompts decoded together (each row with its own copy
    of `draft`, its own caches, lengths and random generator).

    One round: the draft proposes up to γ tokens autoregressively (all rows in one step; a row that
    proposed an end token or has no room sits the remaining steps out); dense scores every row's
    tokens in one forward over the full caches; per row, the longest prefix dense agrees with is
    accepted, then dense's own next token is added as a bonus. Greedy: agreement means dense's
    argmax. Sampling: accept draft token x with probability min(1, p(x)/q(x)), else resample from
    norm(max(p - q, 0)). Rollback of either cache is a change of its length, per row. A row that
    ends leaves the batch. With `adaptive`, each round's γ (at most `gamma`, 0 = a plain dense step)
    comes from the batch's measured costs and every row's acceptance (`GammaPlan`). `seeds`, `width`
    (continuous batching), `prefilled` and `keep`: as in `decode_rows`.
    """
    dev = loaded.device
    eos = sampling.eos(loaded)
    refresh = getattr(draft, "refresh", True)
    B, L = len(inputs), loaded.num_layers
    drafts, keeps_all = [draft] * B, [False] * B
    rounds: list[list[Round]] = [[] for _ in range(B)]
    traces: list[Trace | None] = [None] * B

    def begin(b: int) -> None:
        run = rows.runs[b]
        drafts[b] = copy.copy(draft)
        drafts[b].begin(run, rows.outs[b])
        if draft.policy is not None:  # a draft that keeps every entry everywhere is dense: never run it
            keeps_all[b] = all(sel.query_mask is None and sel.head_scale is None and min(sel.lengths) >= inputs[b].m
                               for sel in run.selections.values())
        else:
            keeps_all[b] = draft.layers >= L

    def finish(b: int) -> None:
        run, out, x = rows.runs[b], rows.outs[b], inputs[b]
        if draft.policy is not None:  # mean entries a draft step reads per KV head and layer: K + m_t
            lens = [sum(s.lengths) / len(s.lengths) for s in run.selections.values()]
            draft_entries = (sum(lens) + x.m * (L - len(lens))) / L
        else:
            draft_entries = x.m * draft.layers / L
        traces[b] = Trace(method, "speculative", out, loaded.adapter.decode(out), rows.prefill_s[b], rows.decode_s[b],
                          run.cache.nbytes(), rounds=rounds[b], layers=layer_records(run.selections, run.rows, x.m),
                          draft_entries=draft_entries, draft_layers=getattr(draft, "layers", None), gamma=gamma,
                          fast_steps=run.fast_steps, batch=rows.width)

    rows = _Rows(loaded, inputs, lambda x: new_run(loaded, x, max(max_new_tokens, capacity_tokens) + gamma + 2,
                                                   draft.policy, store_dense=True, copy_all=not refresh),
                 sampling, seeds, on_token, max_new_tokens, width, begin=begin, finish=finish, prefilled=prefilled,
                 keep=keep)
    runs, outs, gens = rows.runs, rows.outs, rows.gens
    shapes, shape = HopelessShapes(loaded), HopelessShapes.key(method, gamma, inputs, draft)
    plan = GammaPlan(gamma, adaptive, draft_is_dense=False, padded=padded_rows(loaded, gamma + 1),
                     carried=adaptive and shapes.carried(shape))
    live = rows.admit()
    while live:
        plan.draft_is_dense = all(keeps_all[b] for b in live)
        if plan.adaptive and plan.draft_is_dense:  # the draft is the model itself: plain dense decoding
            g, why = 0, "draft = dense"
        else:
            g, why = plan.choose(max(max_new_tokens - len(outs[b]) - 1 for b in live), live)  # room for the bonus
        ts = time.perf_counter()
        room = {b: min(g, max_new_tokens - len(outs[b]) - 1) for b in live}
        proposed = {b: [] for b in live}
        q_probs = {b: [] for b in live}
        fed = {b: 0 for b in live}
        feed = {b: drafts[b].feed() for b in live}
        steps = 0
        while True:
            drafting = [b for b in live if len(proposed[b]) < room[b] and not (proposed[b] and proposed[b][-1] in eos)]
            if not drafting:
                break
            for b in drafting:
                drafts[b].prepare(runs[b])
            logits = step_rows(loaded, [runs[b] for b in live], [feed[b] if b in drafting else [] for b in live],
                               mode=draft.mode, num_layers=draft.num_layers)
            steps += 1
            for b, lg in zip(live, logits):
                if b not in drafting:
                    continue
                lg = drafts[b].scores(lg[-1])
                fed[b] += len(feed[b])
                if sampling.greedy:
                    t = int(lg.argmax())
                else:
                    q_probs[b].append(probs_from_logits(lg, sampling))
                    t = int(torch.multinomial(q_probs[b][-1], 1, generator=gens[b]))
                proposed[b].append(t)
                feed[b] = [t]
        for b in live:
            drafts[b].before_verify(runs[b])
        sync(dev)
        tv = time.perf_counter()
        logits = step_rows(loaded, [runs[b] for b in live], [outs[b][-1:] + proposed[b] for b in live],
                           mode="dense", pad_to=gamma + 1 if steps else None)  # [len(proposed) + 1, V] per row
        committed, acc, tests = {}, {}, {}
        for b, lg in zip(live, logits):
            accepted, bonus = acc[b] = _accept(lg, proposed[b], q_probs[b], sampling, gens[b])
            tests[b] = (accepted, accepted + (accepted < len(proposed[b])))
            committed[b] = []
            for t in proposed[b][:accepted] + [bonus]:
                committed[b].append(t)
                if t in eos or len(outs[b]) + len(committed[b]) >= max_new_tokens:
                    break
            # Dense cache: keep the KV of every committed token but the newest (roll back the rest).
            runs[b].cache.dense_len += len(committed[b]) - (len(proposed[b]) + 1)
            outs[b].extend(committed[b])
            if on_token is not None:
                for t in committed[b]:
                    on_token(b, t)
        for b in live:  # the draft's caches catch up (refresh: dense's KV of the accepted tokens), timed
            if not rows.done(b):
                drafts[b].end_round(runs[b], fed[b], outs[b])
        sync(dev)
        te = time.perf_counter()
        plan.observe(steps, tv - ts, te - tv, rows=tests)
        rows.timed(te - ts)
        for b in live:
            rounds[b].append(Round(proposed[b], acc[b][0], committed[b][-1] if len(committed[b]) == acc[b][0] + 1 else None,
                                   tv - ts, te - tv, gamma=g, why=why))
        live = rows.next()
    rows.close(traces)
    if adaptive:
        plan.conclude()
        shapes.update(shape, plan)
    return traces


def _accept(lg: torch.Tensor, proposed: list[int], q_probs: list[torch.Tensor], sampling: Sampling, gen):
    """Verification logits [n+1, V] -> (number accepted, bonus token)."""
    if sampling.greedy:
        target = lg.argmax(-1).tolist()
        a = 0
        while a < len(proposed) and proposed[a] == target[a]:
            a += 1
        return a, target[a]
    p = probs_from_logits(lg, sampling)
    for i, t in enumerate(proposed):
        u = torch.rand((), generator=gen, device=p.device)
        if u * q_probs[i][t] <= p[i, t]:  # u < p/q without dividing by a zero q
            continue
        residual = (p[i] - q_probs[i]).clamp_min(0)
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=gen))
    return len(proposed), int(torch.multinomial(p[len(proposed)], 1, generator=gen))
