"""Running methods by name on one prompt, and the side-by-side comparison against dense.

`compare` is the timing shell of the app, `run` and `eval` (`bench` interleaves the same way): the
model is warmed up on the prompt before anything is timed, every method's run lies between two dense
runs and is compared with their mean (so no method gains from running first or last, and a drift
of the machine's speed cancels to first order), and every ratio comes from `metrics` over the
traces.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import time
from typing import Callable

import torch

from . import kernels
from .adapters import VideoInputs
from .engine import (HopelessShapes, LayerSkipDraft, PolicyDraft, Prefilled, Sampling, decode, decode_rows,
                     speculative_decode_rows)
from .methods import METHODS, check_settings, configure, parse_methods
from .metrics import efficiency_pct, ratios
from .models import Loaded
from .traces import ModelShape, PromptInfo, Trace


def model_shape(loaded: Loaded) -> ModelShape:
    c = loaded.text_config
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    return ModelShape(loaded.num_layers, loaded.num_heads, loaded.num_kv_heads, loaded.head_dim, c.hidden_size,
                      c.intermediate_size, c.vocab_size, torch.finfo(loaded.dtype).bits // 8, weights)


def prompt_info(inputs: VideoInputs) -> PromptInfo:
    return PromptInfo(inputs.m, inputs.query_start, inputs.visual_positions.cpu().numpy(),
                      inputs.token_grid.cpu().numpy(), tuple(int(x) for x in inputs.grid))


def _with_head_scores(config, loaded: Loaded):
    """A SparseMM config with the model's calibrated scores (uniform, with a warning, when none)."""
    from .calibration import load_scores

    hs = load_scores(loaded)
    return dataclasses.replace(config, scores=hs.scores), hs


# `compare` keeps each method's first prefill for its decode-only passes while the caches kept add up
# to at most this many bytes (their prompt's KV); a method past it prefills in every pass. The embedded
# model's dense cache at 256 frames is 14 MB; a 2B checkpoint's at ~30k prompt tokens ~1.7 GB each.
KEEP_PREFILL_BYTES = 1 << 30


def run_method(loaded: Loaded, inputs: VideoInputs, name: str, settings: dict | None = None,
               max_new_tokens: int = 96, sampling: Sampling = Sampling(),
               on_token: Callable[[int], None] | None = None, capacity_tokens: int = 0,
               prefilled: Prefilled | None = None, keep: list | None = None) -> Trace:
    """Run method `name` on the prompt with settings {key: value} (see `methods.all_options`);
    `capacity_tokens`: its cache sized for that many tokens (`engine.decode`). `prefilled`: decode
    from this kept prefill of the same method and prompt instead of prefilling; `keep`: a list that
    receives this run's prefill (`engine.Prefilled`; its owner releases it)."""
    cb = None if on_token is None else (lambda row, tok: on_token(tok))
    return run_rows(loaded, [inputs], name, settings, max_new_tokens, sampling, cb, capacity_tokens,
                    prefilled=None if prefilled is None else [prefilled], keep=keep)[0]


def run_rows(loaded: Loaded, inputs: list[VideoInputs], name: str, settings: dict | None = None,
             max_new_tokens: int = 96, sampling: Sampling = Sampling(),
             on_token: Callable[[int, int], None] | None = None, capacity_tokens: int = 0,
             seeds: list[int] | None = None, width: int | None = None, prefilled: list | None = None,
             keep: list | None = None) -> list[Trace]:
    """`run_method` of several prompts decoded together (batched decoding): one trace per row;
    `on_token(row, token)`; `seeds`: each row's random seed when sampling (default: `sampling.seed`);
    `width`: at most that many rows at once, the next prompt joining as a row ends (continuous
    batching; default: all at once); `prefilled` / `keep`: per row, as in `run_method`."""
    method = METHODS[name]
    config, spec = configure(name, settings)
    hs = None
    if getattr(config, "needs_head_scores", False):
        config, hs = _with_head_scores(config, loaded)
    kw = dict(method=name, max_new_tokens=max_new_tokens, sampling=sampling, on_token=on_token,
              capacity_tokens=capacity_tokens, seeds=seeds, width=width, prefilled=prefilled, keep=keep)
    if method.kind == "dense":
        traces = decode_rows(loaded, inputs, **kw)
    elif method.kind == "direct":
        traces = decode_rows(loaded, inputs, policy=config, **kw)
    else:
        draft = (LayerSkipDraft(config.draft_layers(loaded.num_layers)) if hasattr(config, "draft_layers")
                 else PolicyDraft(config, refresh=spec.refresh))
        traces = speculative_decode_rows(loaded, inputs, draft, gamma=spec.gamma, adaptive=spec.adaptive_gamma, **kw)
    for trace in traces:
        if config is not None:
            trace.config = {k: v for k, v in dataclasses.asdict(config).items() if k not in ("scores", "caps")
                            and not k.startswith("_")}
            trace.config["route_prefill"] = bool(getattr(config, "route_prefill", False))
        if spec is not None:
            trace.config.update(dataclasses.asdict(spec))
        if hs is not None:
            trace.head_scores = dict(score_map=hs.head_scores.numpy(), kv_scores=hs.scores.numpy(),
                                     caps=config.caps.numpy() if config.caps is not None else None,
                                     file=hs.meta.get("file") or "uniform (no calibration file)",
                                     uniform=bool(hs.meta.get("uniform")), top5_mass=hs.top_mass())
    return traces


def figures(trace: Trace, dense: Trace, loaded: Loaded, inputs: VideoInputs) -> dict:
    """Every figure of a method's run against dense's: `metrics.ratios`, and for a direct policy
    its costs as % of dense (`metrics.efficiency_pct`)."""
    prompt = prompt_info(inputs)
    out = ratios(trace, dense, prompt)
    if trace.kind == "direct":
        out.update(efficiency_pct(trace, dense, model_shape(loaded), prompt))
    return out


def choose_step_threads(loaded: Loaded, inputs: VideoInputs, tokens: int = 17, long_step_s: float = 0.05) -> str:
    """CPU: run decode steps on torch's thread count or on one thread, whichever measures faster on
    this machine and model (once per model; `SPARSEVID_STEP_THREADS=N` sets it instead). A decode
    step of a small model is hundreds of small ops; where the other threads sleep between them
    (`OMP_WAIT_POLICY=PASSIVE`, which a shared machine needs) waking them can cost more than the op:
    a 2-row matmul of the embedded model took 96 us on two threads against 16 us on one. Measured
    on eager dense steps of this prompt, one row and two rows decoded together, the two settings
    alternating step by step (medians; the first step is not kept); a model whose one-row step
    takes longer than `long_step_s` on all threads keeps them without the two-row pass (its ops are
    large: threads pay, and its steps are costly to time). The CPU op's two-thread threshold
    (`kernels.WIDE_GRAPH_WORK`) is measured first: on one thread an eager step's attention takes the
    op's own threads as a compiled step's does (`kernels.op_threads`), so the eager steps timed here
    cost what the compiled ones will. Timed with the op's calls on one thread instead (an eager rule
    of their own), a 4,608-visual-token prompt's 1- and 2-row steps tied (6.22 vs 6.21 ms summed)
    and the choice fell on two threads, where the compiled one-row step took 1.23-1.29 ms against
    0.97 ms on one. Returns `loaded.threads_note`."""
    if loaded.step_threads is not None:
        return loaded.threads_note
    n = torch.get_num_threads()
    if n > 1 and kernels.backend(loaded.device) == "cpu" and loaded.dtype == torch.float32 \
            and kernels.WIDE_GRAPH_WORK is None:  # once per machine, in the warm-up, never in a timed run
        kernels.WIDE_GRAPH_WORK = kernels.measure_graph_work()
    if os.environ.get("SPARSEVID_STEP_THREADS"):
        loaded.step_threads = max(1, int(os.environ["SPARSEVID_STEP_THREADS"]))
        loaded.threads_note = f"steps on {loaded.step_threads} thread(s) (SPARSEVID_STEP_THREADS)"
        return _graph_work(loaded, n)
    if loaded.device.type != "cpu" or n == 1:
        loaded.step_threads = n
        return ""
    fast = loaded.fast
    enabled = fast is not None and fast.enabled
    if fast is not None:
        fast.enabled = False  # eager: compiled graphs are then compiled at the chosen count
    took: dict[int, list[list[float]]] = {n: [[], []], 1: [[], []]}
    try:
        for rows in (1, 2):
            order: list[int] = []

            def alternate(row: int, tok: int) -> None:  # the thread count of the step that follows
                if row == 0:
                    loaded.step_threads = (n, 1)[len(order) % 2]
                    order.append(loaded.step_threads)

            trace = decode_rows(loaded, [inputs] * rows, max_new_tokens=tokens, sampling=Sampling(ignore_eos=True),
                                on_token=alternate)[0]
            for threads, s in list(zip(order, trace.step_s))[1:]:
                took[threads][rows - 1].append(s)
            if statistics.median(took[n][0]) > long_step_s:
                break
    finally:
        if fast is not None:
            fast.enabled = enabled
    cost = {t: sum(statistics.median(x) for x in took[t] if x) for t in took}
    loaded.step_threads = 1 if took[n][1] and cost[1] < cost[n] else n
    ms = {t: " / ".join(f"{statistics.median(x) * 1e3:.2f}" for x in took[t] if x) for t in took}
    if not took[n][1]:
        loaded.threads_note = (f"steps on {n} threads: an eager dense step takes {ms[n]} ms on {n}, "
                               f"{ms[1]} ms on 1 (large ops: threads pay)")
    else:
        loaded.threads_note = (f"steps on {loaded.step_threads} thread(s): eager dense step of 1 / 2 rows "
                               f"{ms[1]} ms on 1 thread, {ms[n]} ms on {n}")
    return _graph_work(loaded, n)


def _graph_work(loaded: Loaded, n: int) -> str:
    """Where steps run on fewer than the process's `n` threads through the CPU op: the threshold
    from which its calls take the `n` (`kernels.WIDE_GRAPH_WORK`, measured in `choose_step_threads`),
    said in `loaded.threads_note`."""
    if loaded.step_threads < n and kernels.backend(loaded.device) == "cpu" and loaded.dtype == torch.float32:
        loaded.threads_note += (f"; a step's attention call on {n} threads from "
                                f"{kernels.WIDE_GRAPH_WORK:,} (pairs x entries x (rows + 3), measured)")
    return loaded.threads_note


def drafting(settings: dict | None) -> dict:
    """`settings` for a warm-up run: adaptive γ off, so that a speculative method drafts and verifies
    from its first round. Adaptive γ first measures dense steps until their time settles (up to
    `GammaPlan.warm_max`), so a short warm-up run could end before its draft ran and leave the
    draft's and the verification's graphs to be compiled or captured in a timed run."""
    return {**(settings or {}), "adaptive_gamma": "off"}


def warm_rows(loaded: Loaded, inputs: list[VideoInputs], names, settings: dict | None, max_new_tokens: int,
              on_token: Callable[[int, int], None] | None = None) -> None:
    """`warm_up` for a batch of len(inputs) rows: where batches step through graphs (CUDA: one
    captured graph per batch size; CPU (unless SPARSEVID_CPU_BATCH_COMPILE=0): one compiled graph for
    every size), a short run of each method on these rows captures or compiles them here, not in a
    timed run (on CUDA the full batch's; a batch that shrinks to a new size as rows end still
    captures that size at its first step). Once per batch size, methods and settings."""
    fast = loaded.fast
    if len(inputs) < 2 or fast is None or not fast.enabled or (loaded.device.type != "cuda" and not fast.batched):
        return
    key = ("rows", len(inputs), tuple(names), tuple(sorted((settings or {}).items())), max_new_tokens)
    if key in fast.warmed:
        return
    for name in dict.fromkeys(["dense", *names]):
        run_rows(loaded, inputs, name, drafting(settings), 8, Sampling(ignore_eos=True), on_token,
                 capacity_tokens=max_new_tokens)
    fast.warmed.add(key)
    for x in inputs:
        x.vision.clear()  # as `warm_up`: the timed runs' vision seconds are measured warm


def compile_steps(loaded, inputs, names=("dense",), settings=None, max_new_tokens: int = 12, lock=None,
                  capacity_tokens: int = 96) -> str:
    """Compile (CPU) or capture (CUDA) every step kind `names` will use (two short runs of each on
    `inputs`, their caches sized for `capacity_tokens`, as the runs that follow) and, in auto
    mode, keep the compiled steps only if a dense step measures faster than eager (interleaved,
    medians). With `lock` (the app's run lock), each method's runs hold it and the steps stay eager
    in between, so the app serves eager runs until compilation is done. Returns `message`."""
    choose_step_threads(loaded, inputs)
    fast = loaded.fast
    if fast is None:
        return "eager"
    n = loaded.step_threads or torch.get_num_threads()
    if fast.mode == "auto" and loaded.device.type == "cpu" and n > 1 and loaded.head_threads is None:
        loaded.head_threads = 1  # per-head layouts compiled for one thread; measured against eager below
    fast.prepared = True
    fast.warmed.add(_warm_key(inputs, names, settings, capacity_tokens))
    sampling = Sampling(ignore_eos=True)
    lock = lock if lock is not None else contextlib.nullcontext()
    took, failed = 0.0, False
    for name in dict.fromkeys(["dense", *names]):
        with lock:
            fast.enabled = True
            t0 = time.perf_counter()
            for warm in (drafting(settings), settings):  # a second run: another γ, another length
                run_method(loaded, inputs, name, warm, max_new_tokens, sampling, capacity_tokens=capacity_tokens)
            took += time.perf_counter() - t0
            failed = not fast.enabled  # compilation failed: `message` says why
            fast.enabled = False
        if failed:
            return fast.message
    with lock:
        if fast.mode == "on":
            fast.enabled, fast.message = True, f"compiled ({took:.0f} s)"
            return fast.message
        steps = {True: [], False: []}
        for _ in range(3):
            for on in (True, False):
                fast.enabled = on
                steps[on] += run_method(loaded, inputs, "dense", settings, max_new_tokens, sampling).step_s
        on, off = statistics.median(steps[True]), statistics.median(steps[False])
        fast.enabled = on < off
        fast.message = (f"compiled ({took:.0f} s): dense step {on * 1e3:.2f} ms vs eager {off * 1e3:.2f} ms"
                        if fast.enabled else
                        f"eager: the compiled dense step measured {on * 1e3:.2f} ms vs eager {off * 1e3:.2f} ms")
        if fast.enabled:
            fast.message += _choose_head_steps(loaded, inputs, names, settings, max_new_tokens, n)
    return fast.message


def _choose_head_steps(loaded: Loaded, inputs: VideoInputs, names, settings: dict | None, max_new_tokens: int,
                       n: int) -> str:
    """How steps over a per-head layout (ragged lengths, masks, scales: HT-Sparse, SparseMM) run, by
    measurement on the first of `names` that has one: compiled (for `loaded.head_threads`, which
    `compile_steps` set to one thread where steps run on n > 1: a compiled per-head graph on two
    threads measured 0.62x of dense's step for HT-Sparse, each of its kernels a parallel region
    that wakes the sleeping thread) or eager on one or on n threads, whichever decodes fastest (a
    run of each, medians of its steps; a draft's runs draft from their first round, `drafting`, and
    its steps are its draft steps). The answer does not depend on the choice. Returns words for the
    message ("" where no method has such a layout or compiled won on the step count)."""
    fast, sampling, settings = loaded.fast, Sampling(ignore_eos=True), drafting(settings)
    compiled_on = loaded.head_threads or n

    def steps(name: str) -> list[float]:
        t = run_method(loaded, inputs, name, settings, max_new_tokens, sampling)
        return t.step_s or [r.draft_s / len(r.proposed) for r in t.rounds if r.proposed]

    for name in (m for m in names if m != "dense"):
        before = fast.per_head_calls
        took = {("compiled", compiled_on): steps(name)}
        if fast.per_head_calls == before:
            continue  # this method's steps have no per-head layout
        fast.enabled = False
        for threads in dict.fromkeys([compiled_on, n]):
            loaded.head_threads = threads
            took[("eager", threads)] = steps(name)
        fast.enabled = True
        ms = {w: statistics.median(s) * 1e3 for w, s in took.items()}
        (way, threads) = min(ms, key=ms.get)
        fast.per_head, loaded.head_threads = way == "compiled", threads
        if (way, threads) == ("compiled", n):
            return ""
        measured = ", ".join(f"{w} on {t}: {v:.2f} ms" for (w, t), v in ms.items())
        return f"; per-head steps {way} on {threads} thread(s) ({name}: {measured})"
    return ""  # no per-head layout measured: one compiled later takes `head_threads` as set


class Cancelled(Exception):
    """A comparison stopped because its `should_stop` said so."""


def _warm_key(inputs: VideoInputs, names, settings, capacity_tokens: int) -> tuple:
    return inputs.m, capacity_tokens, tuple(names), tuple(sorted((settings or {}).items()))


def warm_up(loaded: Loaded, inputs: VideoInputs, on_token: Callable[[int], None] | None = None,
            names=("dense",), settings: dict | None = None, max_new_tokens: int = 96) -> None:
    """Prepare everything the timed runs of `names` on this prompt will use, so that nothing is
    compiled or captured inside them: with fast steps enabled (`fast.enable`), every step kind
    of `names` is compiled (first time: `compile_steps`) or, for a prompt of a new length, run
    once in a short run of each method with the timed runs' cache size (CUDA: the same buffers,
    so their graphs are captured here; CPU: a new length recompiles here if it must). Then one
    short dense run: first-call costs (allocator, kernels, caches) are paid here."""
    choose_step_threads(loaded, inputs)
    fast = loaded.fast
    if fast is not None and not fast.prepared:
        compile_steps(loaded, inputs, names, settings, capacity_tokens=max_new_tokens)
    elif fast is not None and fast.enabled and _warm_key(inputs, names, settings, max_new_tokens) not in fast.warmed:
        for name in dict.fromkeys(["dense", *names]):
            run_method(loaded, inputs, name, drafting(settings), 8, Sampling(ignore_eos=True),
                       capacity_tokens=max_new_tokens)
        fast.warmed.add(_warm_key(inputs, names, settings, max_new_tokens))
    decode(loaded, inputs, max_new_tokens=2, sampling=Sampling(ignore_eos=True), on_token=on_token,
           capacity_tokens=max_new_tokens)
    inputs.vision.clear()  # the first timed run encodes the video again, warm: the seconds every run counts


def dense_pair_s(before: Trace, after: Trace) -> float:
    """The dense decode time a method's run is compared with: the mean of the dense runs just before
    and just after it (`Trace.dense_pair_s`; `compare` and `bench` pair the same way)."""
    return (before.decode_s + after.decode_s) / 2


def _median_times(runs: list[Trace], pairs: list[float] | None = None) -> Trace:
    """The first run, with prefill and decode times the medians over `runs` (same tokens; the
    prefill's over the runs that prefilled), each run's decode time kept and, for a method, the
    dense decode time each run is paired with."""
    t = runs[0]
    prefills = [r.prefill_s for r in runs if not r.prefill_reused] or [r.prefill_s for r in runs]
    return dataclasses.replace(t, prefill_s=statistics.median(prefills), prefill_reused=False,
                               decode_s=statistics.median(r.decode_s for r in runs),
                               decode_runs_s=[r.decode_s for r in runs], dense_pair_s=list(pairs or []),
                               batch_decode_s=statistics.median(r.batch_decode_s or r.decode_s for r in runs),
                               step_s=sorted(s for r in runs for s in r.step_s))


def compare(loaded: Loaded, inputs: VideoInputs, names: list[str] | str, settings: dict | None = None,
            max_new_tokens: int = 96, sampling: Sampling = Sampling(),
            on_token: Callable[[str, int], None] | None = None,
            on_result: Callable[[Trace], None] | None = None, warmup: bool = True,
            should_stop: Callable[[], bool] | None = None, repeats: int = 1,
            on_pass: Callable[[int], None] | None = None, max_repeats: int | None = None,
            budget_s: float = 0.0) -> tuple[dict[str, Trace], dict[str, dict]]:
    """Run dense and each method on the same prompt. Returns ({method: trace}, {method: figures});
    `on_result(trace)` is called as each method finishes (the figures need dense's second run).
    `should_stop()` is asked at every token of every run (warm-up included): True raises Cancelled.

    Timing: the first pass runs dense, every method (streamed), dense again; each method's run is
    paired with the mean of those two dense runs. `repeats` > 1: repeats - 1 more passes, in which
    every method's run is followed by a dense run, so each is paired with the dense runs just before
    and after it (as in `bench`); `on_pass(i)` is called as pass i (2..repeats) starts. With
    `max_repeats` > repeats, more passes follow, up to `max_repeats`, while the timing passes so far
    plus one more as long as the last fit in `budget_s` seconds (more pairs where they are cheap:
    short clips and answers). Those extra passes time decoding only: each run decodes from the
    state its method's first run kept after its prefill (`engine.Prefilled`: the same first token
    and caches, so the same tokens), where a prefill of a long clip would cost several times its
    decoding (256 frames: ~0.33 s against ~0.04 s). Not on CUDA, whose runs share pooled buffers
    that captured graphs are tied to (`cache.BufferPool`): holding one run's would make the next run
    of its shapes capture anew inside a timed pass; nor beyond KEEP_PREFILL_BYTES of kept caches
    (those methods prefill in every pass). A method's decode speedup is the median of its
    paired ratios (`metrics.decode_speedup`), its other times the medians of its passes (prefill:
    of its `repeats` prefills); dense's times are the medians of all its runs (the tokens are the
    same). Adaptive γ: the first pass's runs (those shown) probe their drafts as a fresh process's
    would; where one finds its draft hopeless, the next timing passes skip the probes
    (`engine.HopelessShapes`), as repeated runs at that shape do anywhere."""
    names = parse_methods(names)
    settings = check_settings(settings)

    def callback(name: str | None):
        def cb(tok: int) -> None:
            if should_stop is not None and should_stop():
                raise Cancelled
            if on_token is not None and name is not None:
                on_token(name, tok)
        return cb

    kept: dict[str, Prefilled | None] = {}  # each name's first run's prefill (None: past the cap)
    keeping = len(names) > 1 and (max_repeats or 0) > repeats and loaded.pool is None

    def run(name: str, on_tok: Callable[[int], None], decode_only: bool = False) -> Trace:
        keep = [] if keeping and name not in kept else None
        t = run_method(loaded, inputs, name, settings, max_new_tokens, sampling, on_tok,
                       prefilled=kept.get(name) if decode_only else None, keep=keep)
        if keep:
            held = sum(k.run.cache.nbytes() for k in kept.values() if k is not None)
            kept[name] = keep[0] if held + keep[0].run.cache.nbytes() <= KEEP_PREFILL_BYTES else None
            if kept[name] is None:
                keep[0].release()
        return t

    if warmup:
        warm_up(loaded, inputs, callback(None), names, settings, max_new_tokens)
    HopelessShapes(loaded).forget()  # the first pass (the runs shown) probes; the timing passes use its verdicts
    try:
        dense_runs = [run("dense", callback("dense"))]
        if on_result is not None:
            on_result(dense_runs[0])
        traces = {"dense": dense_runs[0]}
        for name in names[1:]:
            traces[name] = run(name, callback(name))
            if on_result is not None:
                on_result(traces[name])
        if len(names) > 1:  # dense again after the methods: the first pass's pair is the mean of both runs
            dense_runs.append(run("dense", callback(None)))
        passes = {name: [traces[name]] for name in names[1:]}
        pairs = {name: [dense_pair_s(dense_runs[0], dense_runs[-1])] for name in names[1:]}
        start, last, i = time.perf_counter(), 0.0, 2
        while len(names) > 1 and (i <= repeats or (i <= (max_repeats or 0) and time.perf_counter() - start + last <= budget_s)):
            if on_pass is not None:  # timing only: each method between two dense runs
                on_pass(i)
            t0, decode_only, i = time.perf_counter(), i > repeats, i + 1
            for name in names[1:]:
                passes[name].append(run(name, callback(None), decode_only))
                dense_runs.append(run("dense", callback(None), decode_only))
                pairs[name].append(dense_pair_s(dense_runs[-2], dense_runs[-1]))
            last = time.perf_counter() - t0
    finally:
        for k in kept.values():
            if k is not None:
                k.release()
    traces.update({name: _median_times(p, pairs[name]) for name, p in passes.items()})
    dense = traces["dense"] = _median_times(dense_runs)
    return traces, {name: figures(traces[name], dense, loaded, inputs) for name in names[1:]}


def compare_rows(loaded: Loaded, inputs: list[VideoInputs], names: list[str] | str, settings: dict | None = None,
                 max_new_tokens: int = 96, sampling: Sampling = Sampling(), warmup: bool = True,
                 should_stop: Callable[[], bool] | None = None,
                 width: int | None = None) -> list[tuple[dict[str, Trace], dict[str, dict]]]:
    """`compare` of several prompts decoded together (batched decoding; `eval --batch`, `run VIDEO Q1
    Q2`, the app's /compare with several questions): dense, each method and dense again, each over
    all the rows in one batch; per row ({method: trace}, {method: figures}), each method's row paired
    with the mean of dense's two runs of that row. `should_stop()` is asked at every token: True
    raises Cancelled. `width`: at most that many rows at once (continuous batching, `run_rows`)."""
    names = parse_methods(names)
    settings = check_settings(settings)

    def on_token(row: int, tok: int) -> None:
        if should_stop is not None and should_stop():
            raise Cancelled

    def rows(name: str) -> list[Trace]:
        return run_rows(loaded, inputs, name, settings, max_new_tokens, sampling, on_token, width=width)

    if warmup:
        warm_up(loaded, inputs[0], lambda tok: on_token(0, tok), names, settings, max_new_tokens)
        warm_rows(loaded, inputs[:width or len(inputs)], names, settings, max_new_tokens, on_token)
    HopelessShapes(loaded).forget()  # the runs shown probe (as `compare`'s first pass)
    first = rows("dense")
    traces = {name: rows(name) for name in names[1:]}
    last = rows("dense") if len(names) > 1 else first
    out = []
    for b, x in enumerate(inputs):
        dense = _median_times([first[b], last[b]])
        row = {"dense": dense}
        for name in names[1:]:
            row[name] = _median_times([traces[name][b]], [dense_pair_s(first[b], last[b])])
        out.append((row, {name: figures(row[name], dense, loaded, x) for name in names[1:]}))
    return out


def _methods_json(traces: dict[str, Trace], figs: dict[str, dict]) -> dict:
    return {n: dict(t.to_json(), **figs.get(n, {})) for n, t in traces.items()}


def _header_json(loaded: Loaded, video, state: str, **video_fields) -> dict:
    """model, revision, device, dtype, compile (`state`) and video {file (its name only: no server
    path, and no "path" key, which gradio_client would download as a file), frames, duration,
    timestamps, **video_fields}."""
    return dict(model=loaded.name, revision=loaded.revision, device=str(loaded.device), dtype=str(loaded.dtype)[6:],
                compile=state, video=dict(file=os.path.basename(video.path), frames=len(video.frames),
                                          duration=video.duration, timestamps=video.timestamps, **video_fields))


def comparison_json(loaded: Loaded, video, inputs: VideoInputs, traces: dict[str, Trace], figs: dict[str, dict],
                    state: str) -> dict:
    """`compare`'s results as plain data (`run VIDEO Q --json`, the app's /compare): `_header_json`
    with the video's visual_tokens and prompt_tokens, and methods {name: trace.to_json() + its
    figures}."""
    from .traces import to_plain

    return to_plain(dict(_header_json(loaded, video, state, visual_tokens=inputs.m_v, prompt_tokens=inputs.m),
                         methods=_methods_json(traces, figs)))


def batch_json(loaded: Loaded, video, questions: list[str], inputs: list[VideoInputs],
               results: list[tuple[dict[str, Trace], dict[str, dict]]], state: str) -> dict:
    """`compare_rows`' results as plain data (`run VIDEO Q1 Q2 --json`, the app's /compare with
    several questions): `_header_json` and batch: per question {question, visual_tokens,
    prompt_tokens, methods {name: trace.to_json() + its figures}}."""
    from .traces import to_plain

    return to_plain(dict(_header_json(loaded, video, state),
                         batch=[dict(question=q, visual_tokens=x.m_v, prompt_tokens=x.m, methods=_methods_json(tr, f))
                                for q, x, (tr, f) in zip(questions, inputs, results)]))
