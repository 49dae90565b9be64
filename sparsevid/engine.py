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

import ctypes
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .adapters import VideoInputs, text_step
from .attention import Run, active
from .fast import buffers, static_step
from .cache import KVCache, LayerSelection, Prompt
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

    def generator(self, device) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(self.seed)


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
    pool all run (another run's: `cache.BufferPool`), or the CPU peak resident growth."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) - (pool.idle_bytes() if pool is not None else 0), "cuda"
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


@torch.inference_mode()
def prefill(loaded: Loaded, inputs: VideoInputs, run: Run) -> torch.Tensor:
    """Run the prompt through the model, filling the caches, at the positions the adapter computed.
    Returns the last position's logits [V] and sets `run.position_offset` (decode position minus
    cache length)."""
    positions, next_position = loaded.adapter.positions(loaded.model, inputs)
    kw = dict(inputs.model_kwargs, **({} if positions is None else dict(position_ids=positions)))
    try:
        with active(run):
            out = loaded.model(**kw, past_key_values=run.cache, use_cache=True, logits_to_keep=1)
    finally:
        run.prune = None  # pruning is for this prefill only (decode steps are never pruned)
    run.position_offset = next_position - inputs.m
    run.cache.finish_prefill(inputs.m)
    return out.logits[0, -1]


@torch.inference_mode()
def step(loaded: Loaded, run: Run, tokens: list[int], mode: str | None = None,
         num_layers: int | None = None, pad_to: int | None = None) -> torch.Tensor:
    """Feed `tokens` after the current length of `mode`'s cache (through the first `num_layers`
    layers, all by default). Returns logits [q, V].

    One decode path: `fast.static_step` over the cache's buffers, through a compiled (CPU) or
    captured (CUDA) graph where `loaded.fast` is enabled, else eagerly; the eager
    `adapters.text_step` only serves a run that watches its decode attention (calibration).
    `pad_to`: with captured graphs, a verification pass is fed as `pad_to` rows (the extra rows
    repeat the last token after the real ones; causality keeps them from the real rows' logits), so
    one graph serves every γ."""
    cache = run.cache
    if mode is not None:
        cache.mode = mode
    dev = loaded.device
    fast = loaded.fast
    q = rows = len(tokens)
    if pad_to and fast is not None and fast.enabled and dev.type == "cuda":
        rows = max(q, pad_to)
    ids = torch.tensor([tokens + tokens[-1:] * (rows - q)], device=dev)
    pos = loaded.adapter.position_ids(cache.length + run.position_offset, rows, dev)
    logits = None
    if run.on_decode_attention is None:
        if fast is not None:
            logits = fast.step(cache, cache.mode, ids, pos, num_layers)  # None: eager
            run.fast_steps += logits is not None
        bufs = None if logits is not None else buffers(cache, cache.mode, num_layers)
        if bufs is not None:
            layers, scales, offsets, _ = bufs
            logits = static_step(loaded.model, ids, pos, layers, scales, offsets + cache.length)
    if logits is None:
        with active(run):
            logits = text_step(loaded.model, ids, pos, cache, num_layers)
    cache.advance(q)
    return logits[0, :q]


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


@torch.inference_mode()
def decode(loaded: Loaded, inputs: VideoInputs, *, method: str = "dense", policy=None, max_new_tokens: int = 96,
           sampling: Sampling = Sampling(), on_token: Callable[[int], None] | None = None,
           keep_stats: bool = False, run_out: list | None = None, capacity_tokens: int = 0) -> Trace:
    """Dense decoding (policy None) or a policy applied directly (lossy; compact caches only).
    `run_out`, if given, receives the `Run` (its prefill statistics, for evaluation figures).
    `capacity_tokens`: size the cache for that many tokens (a warm-up run sized as the runs it
    prepares, so their buffers and graphs are the ones it captured)."""
    dev = loaded.device
    eos = sampling.eos(loaded)
    run = new_run(loaded, inputs, max(max_new_tokens, capacity_tokens) + 1, policy, store_dense=policy is None,
                  keep_stats=keep_stats)
    gen = sampling.generator(dev)
    sync(dev)
    _reset_peak(dev)
    t0 = time.perf_counter()
    tok = choose(prefill(loaded, inputs, run), sampling, gen)
    sync(dev)
    t1 = time.perf_counter()
    tokens, steps = [], []
    while True:
        tokens.append(tok)
        if on_token is not None:
            on_token(tok)
        if tok in eos or len(tokens) >= max_new_tokens:
            break
        ts = time.perf_counter()
        tok = choose(step(loaded, run, [tok])[-1], sampling, gen)
        sync(dev)
        steps.append(time.perf_counter() - ts)
    t2 = time.perf_counter()
    peak = _peak(dev, loaded.pool)
    if run_out is not None:
        run_out.append(run)
    kv_bytes = run.cache.nbytes()
    run.cache.release()
    return Trace(method, "dense" if policy is None else "direct", tokens, loaded.adapter.decode(tokens), t1 - t0,
                 t2 - t1, kv_bytes, step_s=steps, layers=layer_records(run.selections, run.rows, inputs.m),
                 peak_memory_bytes=peak[0], peak_memory_source=peak[1], fast_steps=run.fast_steps)


class PolicyDraft:
    """Draft = the model over the compact caches built by `policy` at prefill (StD, Streaming,
    HT-Sparse, SparseMM as drafts). A layer the policy keeps whole reads the dense cache.

    The draft cache holds every committed token except `pending` (1 token, or 2 when the whole
    draft was accepted and `refresh` is off). With `refresh`, after each round the accepted
    tokens' KV in the compact caches is replaced by dense's (n+1 entries copied).
    """

    def __init__(self, policy, refresh: bool = True):
        self.policy, self.refresh = policy, refresh

    def begin(self, run: Run, committed: list[int]) -> None:
        self.pending = committed[-1:]

    def feed(self) -> list[int]:
        return self.pending

    def forward(self, loaded: Loaded, run: Run, tokens: list[int]) -> torch.Tensor:
        cache = run.cache
        if self.refresh and cache.sparse_len < cache.dense_len:  # catch up after dense rounds, in one copy
            cache.refresh_sparse(cache.sparse_len, cache.dense_len)
            cache.sparse_len = cache.dense_len
        return step(loaded, run, tokens, mode="sparse")

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

    def __init__(self, layers: int):
        self.layers = layers

    def begin(self, run: Run, committed: list[int]) -> None:
        self.last = committed[-1:]
        self._start = None  # dense length before this round's draft writes

    def feed(self) -> list[int]:
        return self.last

    def forward(self, loaded: Loaded, run: Run, tokens: list[int]) -> torch.Tensor:
        if self._start is None:
            self._start = run.cache.dense_len
        return step(loaded, run, tokens, mode="dense", num_layers=self.layers)

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
    `window` readings (one slow reading on a noisy machine moves a median little; the first dense
    step after prefill runs cold and is not kept), and the per-position
    acceptance α (`metrics.position_acceptance`); `metrics.best_gamma` picks the γ with the most
    expected tokens per second, 0 (a plain dense step) when speculation cannot beat dense by 5 %.
    The draft is first tried on `probe` tokens, and again after `reprobe` dense steps in a row, in
    case acceptance has changed; each time a probe ends in dense steps again the wait doubles (up
    to `max_wait`), so a run whose draft cannot pay costs about what dense costs. Lossless whatever
    it picks."""

    def __init__(self, gamma: int, adaptive: bool, draft_is_dense: bool, reprobe: int = 16, probe: int = 3,
                 warm: int = 2, window: int = 9, max_wait: int = 256):
        self.gamma, self.adaptive, self.draft_is_dense, self.reprobe = gamma, adaptive, draft_is_dense, reprobe
        self.wait, self.max_wait = reprobe, max_wait  # dense steps in a row before the next probe
        self.probe = probe  # a probe drafts few tokens: a draft that fails costs little
        self.warm = warm  # dense steps measured before the first probe
        self.window = window
        self.dense_s: list[float] = []  # recent readings, newest last
        self.draft_s: list[float] = []
        self.row_s: list[float] = []
        self.accepted = self.tested = self.dense_run = self.dense_steps = 0

    def _median(self, xs: list[float]) -> float | None:
        return statistics.median(xs) if xs else None

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
    def alpha(self) -> float:
        """Per-position acceptance: accepted / positions tested (a round tests its accepted tokens and
        the first rejected one; tokens drafted after a rejection were never tested), with one
        accepted pseudo-position so that an untested draft starts at 1."""
        return (self.accepted + 1) / (self.tested + 1)

    def choose(self, room: int) -> tuple[int, str]:
        """(γ, why) for a round that may still commit `room` draft tokens besides the bonus."""
        g_max = min(self.gamma, room)
        if not self.adaptive:
            return g_max, "fixed"
        if self.draft_is_dense:
            return 0, "draft = dense"
        if self.dense_steps < self.warm:
            return 0, "dense step"
        if self.t_draft is None or self.dense_run >= self.wait:
            return min(self.probe, g_max), "probe"
        g = best_gamma(self.alpha, g_max, self.t_draft, self.t_dense, self.t_row or 0.0)
        if g == 0 and self.dense_run == 0:  # the draft just ran and does not pay: wait longer next time
            self.wait = min(2 * self.wait, self.max_wait)
        elif g > 0:
            self.wait = self.reprobe
        return g, "best"

    def observe(self, drafted: int, draft_s: float, verify_s: float, accepted: int) -> None:
        def keep(xs: list[float], x: float) -> None:
            xs.append(x)
            del xs[:-self.window]

        self.dense_run = self.dense_run + 1 if drafted == 0 else 0
        if drafted == 0:
            self.dense_steps += 1
            if self.dense_steps > 1 or self.warm < 2:  # the first dense step after prefill runs cold
                keep(self.dense_s, verify_s)
            return
        keep(self.draft_s, draft_s / drafted)
        if self.t_dense is not None:
            keep(self.row_s, max(0.0, verify_s - self.t_dense) / drafted)
        self.accepted += accepted
        self.tested += accepted + (accepted < drafted)


@torch.inference_mode()
def speculative_decode(loaded: Loaded, inputs: VideoInputs, draft, *, method: str = "std", gamma: int = 9,
                       adaptive: bool = False, max_new_tokens: int = 96, sampling: Sampling = Sampling(),
                       on_token: Callable[[int], None] | None = None, capacity_tokens: int = 0) -> Trace:
    """Speculative decoding with any draft, verified by dense: lossless (the StD paper, Leviathan et al.'s acceptance rule).

    One round: the draft proposes up to γ tokens autoregressively; dense scores them all in one
    forward over the full cache; the longest prefix dense agrees with is accepted, then dense's own
    next token is added as a bonus. Greedy: agreement means dense's argmax. Sampling: accept draft
    token x with probability min(1, p(x)/q(x)), else resample from norm(max(p - q, 0)). Rollback
    of either cache is a change of its length. With `adaptive`, each round's γ (at most `gamma`,
    0 = a plain dense step) comes from the run's measured costs (`GammaPlan`).
    """
    dev = loaded.device
    eos = sampling.eos(loaded)
    refresh = getattr(draft, "refresh", True)
    run = new_run(loaded, inputs, max(max_new_tokens, capacity_tokens) + gamma + 2, draft.policy, store_dense=True,
                  copy_all=not refresh)
    gen = sampling.generator(dev)
    sync(dev)
    _reset_peak(dev)
    t0 = time.perf_counter()
    out = [choose(prefill(loaded, inputs, run), sampling, gen)]
    sync(dev)
    t1 = time.perf_counter()
    if on_token is not None:
        on_token(out[0])
    rounds: list[Round] = []
    draft.begin(run, out)
    if draft.policy is not None:  # a draft that keeps every entry everywhere is dense: never run it
        keeps_all = all(sel.query_mask is None and sel.head_scale is None and min(sel.lengths) >= inputs.m
                        for sel in run.selections.values())
    else:
        keeps_all = draft.layers >= loaded.num_layers
    plan = GammaPlan(gamma, adaptive, draft_is_dense=keeps_all)
    while plan.adaptive and plan.draft_is_dense and out[-1] not in eos and len(out) < max_new_tokens:
        ts = time.perf_counter()  # the draft is the model itself: plain dense decoding, no round overhead
        out.append(choose(step(loaded, run, out[-1:], mode="dense")[-1], sampling, gen))
        sync(dev)
        rounds.append(Round([], 0, out[-1], 0.0, time.perf_counter() - ts, gamma=0, why="draft = dense"))
        if on_token is not None:
            on_token(out[-1])
    while out[-1] not in eos and len(out) < max_new_tokens:
        g, why = plan.choose(max_new_tokens - len(out) - 1)  # room for the bonus token
        ts = time.perf_counter()
        proposed, q_probs, fed, feed = [], [], 0, draft.feed()
        for _ in range(g):
            lg = draft.forward(loaded, run, feed)[-1]
            fed += len(feed)
            if sampling.greedy:
                t = int(lg.argmax())
            else:
                q_probs.append(probs_from_logits(lg, sampling))
                t = int(torch.multinomial(q_probs[-1], 1, generator=gen))
            proposed.append(t)
            feed = [t]
            if t in eos:
                break
        draft.before_verify(run)
        sync(dev)
        tv = time.perf_counter()
        lg = step(loaded, run, out[-1:] + proposed, mode="dense",  # [len(proposed) + 1, V]
                  pad_to=gamma + 1 if proposed else None)
        accepted, bonus = _accept(lg, proposed, q_probs, sampling, gen)
        committed = []
        for t in proposed[:accepted] + [bonus]:
            committed.append(t)
            if t in eos or len(out) + len(committed) >= max_new_tokens:
                break
        # Dense cache: keep the KV of every committed token but the newest (roll back the rest).
        run.cache.dense_len += len(committed) - (len(proposed) + 1)
        out.extend(committed)
        sync(dev)
        te = time.perf_counter()
        plan.observe(len(proposed), tv - ts, te - tv, accepted)
        rounds.append(Round(proposed, accepted, bonus if len(committed) == accepted + 1 else None, tv - ts, te - tv,
                            gamma=g, why=why))
        if on_token is not None:
            for t in committed:
                on_token(t)
        if out[-1] in eos or len(out) >= max_new_tokens:
            break
        draft.end_round(run, fed, out)
    t2 = time.perf_counter()
    peak = _peak(dev, loaded.pool)
    L, m = loaded.num_layers, inputs.m
    if draft.policy is not None:  # mean entries a draft step reads per KV head and layer: K + m_t
        lens = [sum(s.lengths) / len(s.lengths) for s in run.selections.values()]
        draft_entries = (sum(lens) + m * (L - len(lens))) / L
    else:
        draft_entries = m * draft.layers / L
    kv_bytes = run.cache.nbytes()
    run.cache.release()
    return Trace(method, "speculative", out, loaded.adapter.decode(out), t1 - t0, t2 - t1, kv_bytes,
                 rounds=rounds, layers=layer_records(run.selections, run.rows, inputs.m), draft_entries=draft_entries,
                 draft_layers=getattr(draft, "layers", None), gamma=gamma, peak_memory_bytes=peak[0],
                 peak_memory_source=peak[1], fast_steps=run.fast_steps)


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
