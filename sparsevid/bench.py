"""Benchmarks: methods against dense in the same process, interleaved, medians of ratios.

`bench_main` measures whole runs on a model (the embedded one by default). `mechanical` measures
only the cost side at a real model's shape (random weights, random KV): a dense decode step, a
sparse draft step and a γ+1 verification over 4k–32k visual tokens.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from . import kernels
from .cache import SHARED_MIN, common_prefix
from .engine import HopelessShapes, Sampling, step_threads, sync as sync_device
from .errors import InputError
from .fast import enable, state
from .methods import check_settings, parse_methods
from .metrics import batch_bound
from .models import load_model
from .options import count, counts
from .runs import dense_pair_s, figures, run_method, warm_up
from .tables import cell, markdown_table

ROW_FIELDS = ("speedup", "acceptance", "tokens_per_round", "identical_to_dense", "kv_ratio", "predicted_speedup",
              "e2e_speedup", "bound_speedup", "draft_step_cost", "verify_cost", "dense_step_ms", "draft_step_ms",
              "verify_ms", "bound_share", "attention_kv_pct")
# A direct policy's costs (`metrics.efficiency_pct`), each as % of dense in the same run
COST_FIELDS = ("prefill_flops_pct", "prefill_wall_pct", "prefill_kv_pct", "decode_kv_pct", "peak_memory_pct",
               "latency_pct", "decode_flops_pct")


def add_arguments(p) -> None:
    """bench's own flags (the model and method flags come from the CLI)."""
    p.add_argument("--frames", type=counts, default="16,64,256", help="comma list of frame counts")
    p.add_argument("--video", default=None, help="video file (default: a synthetic long clip)")
    p.add_argument("--question", default=None)
    p.add_argument("--repeats", type=count, default=3)
    p.add_argument("--clips", type=int, default=0, help="held-out toy questions per frame count (accuracy and "
                   "medians over them; default: one synthetic narration clip); with --shape --rounds: random clips "
                   "the questions take in turn (8: eight different prompts, the StD paper's batch 8; default one)")
    p.add_argument("--types", default="narrate", help="for --clips: comma list of toy question types (narrate, "
                   "colour, shape, direction, count, when, describe); narrations give the decode phase the most "
                   "tokens")
    p.add_argument("--shape", default=None, help="mechanical benchmark at a real model's shape, e.g. qwen2-vl-7b")
    p.add_argument("--visual-tokens", type=counts, default=None, help="for --shape (default 4096,16384,32768) and "
                   "--verify-kernels (default 4608,9216)")
    p.add_argument("--layers", type=count, default=None, help="for --shape: decoder layers (default: 2 on CPU, all on GPU)")
    p.add_argument("--batch", type=counts, default="1", help="comma list of batch sizes (the StD paper: 8): prompts decoded "
                   "together (held-out toy clips of each --frames; batch 1 runs the same prompts one at a time); "
                   "with --shape: step costs at each")
    p.add_argument("--rounds", action="store_true", help="with --shape: real rounds (prefill, dense and each "
                   "method's decoding) of a whole model at the shape, random weights, on one random clip of --seq "
                   "visual tokens with --batch questions decoded together")
    p.add_argument("--seq", type=counts, default=None, help="for --shape: comma list of prompt lengths (visual tokens + 64 text "
                   "tokens), instead of --visual-tokens")
    p.add_argument("--verify-kernels", action="store_true", help="time the candidate ways to attend a step's or a "
                   "verification's rows over the whole cache (the embedded model's head shape, --visual-tokens) and "
                   "their error against float64")
    p.add_argument("--examples", nargs="?", const="bundled", default=None, metavar="FOLDER",
                   help="the app's check: every example of FOLDER's examples.json (default the bundled ones), at its "
                        "frame count, timed as the app times it (its timing passes, SPARSEVID_TIMING_*) and as bench "
                        "does (--repeats pairs), the two decode speedups side by side")
    p.add_argument("--ignore-eos", action="store_true", help="decode exactly --max-new-tokens tokens")
    p.add_argument("--json", action="store_true")


def cpu_stolen_s() -> float | None:
    """CPU seconds the hypervisor has given other guests so far, all CPUs (Linux `/proc/stat`'s steal
    column), or None where it cannot be read."""
    try:
        with open("/proc/stat") as f:
            return int(f.readline().split()[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def stolen_pct(since: tuple[float | None, float]) -> float | None:
    """The share of this machine's CPU time stolen by other guests since `since` = (`cpu_stolen_s()`,
    `time.perf_counter()`), in %: on a shared VM, where a benchmark's single runs move by 15 % or more,
    this says how much of that was the host's, not the method's."""
    stolen0, t0 = since
    stolen = cpu_stolen_s()
    if stolen0 is None or stolen is None:
        return None
    return 100 * (stolen - stolen0) / ((time.perf_counter() - t0) * (os.cpu_count() or 1))


def print_stolen(pct: float | None) -> None:
    if pct is not None:
        print(f"CPU time stolen by other guests of this machine's host during the bench: {pct:.1f} %"
              f"{' (its figures are noisier than usual)' if pct >= 2 else ''}")


def bench_clip(frames: int, video: str | None, question: str | None):
    """(frames [T, H, W, 3], question, correct answers or None): a video file, or a synthetic toy
    clip (its narration; a question of the caller's has no known answer)."""
    if video:
        from .video import load_video

        return load_video(video, frames).frames, question or "Describe the video.", None
    from .toy.questions import NARRATE, make_sample

    s = make_sample(seed=10_000 + frames, n_frames=frames, qtype=NARRATE)
    return s.clip.frames, question or s.question, None if question else s.answers


def toy_clips(n: int, frames: int, types: str = "narrate") -> list:
    """n held-out toy questions with `frames` frames (as `toy eval` draws them), their types cycling
    over the comma list `types`: (frames, question, correct answers)."""
    from .toy.evaluate import eval_samples
    from .toy.questions import ALL_QTYPES

    qtypes = [t.strip() for t in types.split(",") if t.strip()]
    unknown = [t for t in qtypes if t not in ALL_QTYPES]
    if unknown or not qtypes:
        raise InputError(f"Unknown question type(s) {unknown or types!r}; known: {', '.join(ALL_QTYPES)}.")
    return [(s.clip.frames, s.question, s.answers) for s in eval_samples(n, frames, qtypes=qtypes)]


def _correct(trace, answers) -> bool | None:
    """The answer is one of the clip's correct ones (toy clips; None without known answers)."""
    if answers is None:
        return None
    from .toy.questions import is_answer

    return is_answer(trace.text, answers)


def _pct(flags: list) -> float | None:
    flags = [f for f in flags if f is not None]
    return 100 * sum(flags) / len(flags) if flags else None


def pairs(speedups: list) -> dict:
    """A row's pairs: every (method, dense) pair's decode speedup (`speedups`), and where there are
    several, their range as shown beside the median ("its pairs": on a shared machine single pairs
    move by 15 % or more)."""
    xs = [x for x in speedups if x is not None]
    return dict(speedups=xs, **({"speedup_pairs": f"{min(xs):.2f}-{max(xs):.2f}x"} if len(xs) > 1 else {}))


def _median(values):
    values = [v for v in values if v is not None]
    if not values:
        return None
    if isinstance(values[0], bool):
        return all(values)
    return statistics.median(values)


def _eager_vs_compiled(loaded, inputs, settings, args, decoding, compiled, frames: int) -> tuple:
    """A dense run with the compiled steps switched off, against the compiled dense run just before:
    (frames, eager step median, compiled step median, same tokens)."""
    loaded.fast.enabled = False
    try:
        eager = run_method(loaded, inputs, "dense", settings, args.max_new_tokens, decoding)
    finally:
        loaded.fast.enabled = True
    med = lambda t: statistics.median(t.step_s) if t.step_s else None  # noqa: E731
    return frames, med(eager), med(compiled), eager.token_ids == compiled.token_ids


def compiled_rows(pairs: list[tuple]) -> list[dict]:
    """Per frame count: median eager and compiled dense step (ms), their ratio, tokens identical."""
    out = []
    for F in dict.fromkeys(p[0] for p in pairs):
        ps = [p for p in pairs if p[0] == F and p[1] and p[2]]
        if ps:
            e, c = statistics.median(p[1] for p in ps), statistics.median(p[2] for p in ps)
            out.append(dict(frames=F, eager_step_ms=e * 1e3, compiled_step_ms=c * 1e3, ratio=c / e,
                            identical=all(p[3] for p in ps)))
    return out


def bench_main(args) -> int:
    """Each method interleaved with dense on the same clip(s), after a warm-up: every method's run
    between two dense runs and its decode speedup against their mean (as `runs.compare` pairs them);
    medians over clips and repeats."""
    if args.verify_kernels:
        return verify_kernels(args)
    if args.shape:
        return shape_rounds(args) if args.rounds else mechanical(args)
    loaded = load_model(args.model, args.device, args.dtype)
    settings = check_settings(args.settings)
    names = [n for n in parse_methods(args.methods) if n != "dense"] or ["std"]
    enable(loaded, args.compile)  # compiled in the first warm-up (`runs.warm_up`)
    if args.examples:
        return examples_check(args, loaded, names, settings)
    if str(args.batch) != "1":
        return batch_bench(args, loaded, names, settings)
    compiled = []  # (eager dense step, compiled dense step, same tokens) per clip and repeat
    since = cpu_stolen_s(), time.perf_counter()
    frame_counts = [int(f) for f in str(args.frames).split(",")]
    decoding = Sampling(ignore_eos=args.ignore_eos)
    rows = []
    bar = tqdm(total=len(frame_counts) * len(names) * args.repeats * max(1, args.clips), desc="bench",
               file=sys.stderr)
    try:
        for F in frame_counts:
            clips = toy_clips(args.clips, F, args.types) if args.clips else [bench_clip(F, args.video, args.question)]
            per = {name: [] for name in names}
            correct = {name: [] for name in ["dense"] + names}
            for frames, question, answers in clips:
                inputs = loaded.adapter.build_inputs(frames, question).to(loaded.device)
                warm_up(loaded, inputs, names=names, settings=settings, max_new_tokens=args.max_new_tokens)
                for name in names:
                    check = None  # the compiled steps against eager, beside the first method's dense runs
                    if loaded.fast is not None and loaded.fast.enabled and name == names[0]:
                        check = lambda d: compiled.append(  # noqa: E731
                            _eager_vs_compiled(loaded, inputs, settings, args, decoding, d, F))
                    figs, res, dense = paired_runs(loaded, inputs, name, settings, args, decoding, check)
                    if res.kind == "direct" and dense.step_s:
                        kv_s = attention_kv_s(loaded, inputs, args.max_new_tokens)
                        for f in figs:
                            f.update(kv_bound(f, statistics.median(dense.step_s), kv_s))
                    per[name] += figs
                    bar.update(args.repeats)
                    correct[name].append(_correct(res, answers))
                correct["dense"].append(_correct(dense, answers))
            for name in names:
                row = dict(frames=F, visual_tokens=inputs.m_v, method=name, clips=len(clips),
                           tokens=_median([p["tokens"] for p in per[name]]))
                row.update({f: _median([p.get(f) for p in per[name]]) for f in ROW_FIELDS + COST_FIELDS})
                row.update(pairs([p.get("speedup") for p in per[name]]))
                row.update(accuracy=_pct(correct[name]), dense_accuracy=_pct(correct["dense"]))
                if row.get("verify_ms") is not None:
                    row["step_costs"] = f"{row['dense_step_ms']:.2f} / {row['draft_step_ms']:.2f} / {row['verify_ms']:.2f}"
                rows.append(row)
    finally:
        bar.close()
    steps = compiled_rows(compiled)
    compile_state = state(loaded)
    stolen = stolen_pct(since)
    if args.json:
        print(json.dumps(dict(model=loaded.name, device=str(loaded.device), settings=settings, repeats=args.repeats,
                              ignore_eos=args.ignore_eos, threads=torch.get_num_threads(), compile=compile_state,
                              compiled_steps=steps, rows=rows, cpu_stolen_pct=stolen)))
        return 0
    print(f"decode steps: {compile_state}")
    print_stolen(stolen)
    print(format_table(rows))
    if steps:
        print()
        print(markdown_table(["frames", "dense step, eager (ms)", "dense step, compiled (ms)", "compiled / eager",
                              "same tokens"],
                             [[str(s["frames"]), f"{s['eager_step_ms']:.2f}", f"{s['compiled_step_ms']:.2f}",
                               f"{s['ratio']:.0%}", str(s["identical"])] for s in steps]))
    costs = [r for r in rows if r.get("prefill_flops_pct") is not None]
    if costs:
        print()
        print(format_cost_table(costs))
    return 0


def batch_bench(args, loaded, names: list, settings: dict) -> int:
    """Batched decoding (`--batch 1,8`): at each frame count, the largest batch's worth of held-out toy
    clips (`--types`), decoded in batches of each size (`batch_rows`)."""
    batches = batch_sizes(args)
    frame_counts = [int(f) for f in str(args.frames).split(",")]
    rows = []
    since = cpu_stolen_s(), time.perf_counter()
    bar = tqdm(total=len(frame_counts) * len(batches) * batch_passes(names, args), desc="bench", file=sys.stderr)
    try:
        for n_frames in frame_counts:
            clips = toy_clips(max(batches), n_frames, args.types)
            inputs = [loaded.adapter.build_inputs(f, q).to(loaded.device) for f, q, _ in clips]
            rows += batch_rows(args, loaded, names, settings, inputs, batches, dict(frames=n_frames), bar)
    finally:
        bar.close()
    return print_batch_rows(args, loaded, settings, rows, cpu_stolen_pct=stolen_pct(since))


def batch_sizes(args) -> list[int]:
    """--batch's sizes, ascending (each >= 1: `options.counts` parsed it)."""
    return sorted({int(b) for b in str(args.batch).split(",")})


def batch_passes(names: list, args) -> int:
    """Runs `batch_rows` makes per batch size: each method once (outside the timing), dense, each pair."""
    return len(names) + 1 + 2 * len(names) * args.repeats


def batch_rows(args, loaded, names: list, settings: dict, inputs: list, batches: list[int], label: dict,
               bar) -> list[dict]:
    """The prompts `inputs` decoded in batches of each size (batch 1: one at a time), dense and each
    method, every method's pass between two dense passes (paired, medians over --repeats; the batch
    sizes take turns within each repeat, so dense's ratio between them is interleaved too). A pass's
    tokens/s is every row's tokens over the summed decode time of its batches (a batch's decode
    time ends with its last row); each method's figures against dense per row (acceptance, the
    bound from the run's own step costs) are medians over rows. `label`: fields every row starts with."""
    from .runs import run_rows

    decoding = Sampling(ignore_eos=args.ignore_eos)
    warm_up(loaded, inputs[0], names=names, settings=settings, max_new_tokens=args.max_new_tokens)
    rows = []

    def run(B: int, name: str):
        traces, decode_s = [], 0.0
        for i in range(0, len(inputs), B):
            part = run_rows(loaded, inputs[i:i + B], name, settings, args.max_new_tokens, decoding)
            traces += part
            decode_s += part[0].batch_decode_s
        bar.update()
        return traces, sum(len(t.token_ids) - 1 for t in traces) / decode_s

    for B in batches:  # first calls at each batch size (CUDA: graph captures) outside the timing
        for name in names:
            run(B, name)
    HopelessShapes(loaded).forget()  # each method's first timed pass probes (as `paired_runs`)
    after = {B: run(B, "dense") for B in batches}
    per = {B: {name: [] for name in names} for B in batches}
    dense_tok_s = {B: [after[B][1]] for B in batches}
    settled = {B: [settled_step_s(after[B][0])] for B in batches}
    # The batch sizes take turns within each repeat, so a slow stretch of a shared machine (the same
    # batch-8 attention on the same buffers moved 2.3-5.0 ms over 15 s on a 2-core VM) falls on both
    # sides of "dense vs batch 1" rather than on one batch size's passes.
    for _ in range(args.repeats):
        for B in batches:
            for name in names:
                dense = after[B]
                res = run(B, name)
                after[B] = run(B, "dense")
                dense_tok_s[B].append(after[B][1])
                settled[B].append(settled_step_s(after[B][0]))
                figs = [figures(r, d, loaded, x) for r, d, x in zip(res[0], dense[0], inputs)]
                adaptive = any(rd.why != "fixed" for r in res[0] for rd in r.rounds)
                bounds = [batch_bound(figs[i:i + B], adaptive) for i in range(0, len(figs), B)]  # batch 1: each row's own
                per[B][name].append(dict(
                    speedup=res[1] / ((dense[1] + after[B][1]) / 2),
                    identical=all(r.token_ids == d.token_ids for r, d in zip(res[0], dense[0])),
                    acceptance=_median([f.get("acceptance") for f in figs]),
                    tokens_per_round=_median([f.get("tokens_per_round") for f in figs]),
                    bound=_median(bounds),
                    fast_steps=sum(r.fast_steps or 0 for r in res[0]),
                    tok_s=res[1]))
    dense1 = statistics.median(dense_tok_s[batches[0]])
    step1 = _median(settled[batches[0]])
    for B in batches:
        dense_rate = statistics.median(dense_tok_s[B])
        bound = dense_batch_bound(loaded, inputs[:B], args.max_new_tokens, B, dense1) if B > 1 else {}
        step = _median(settled[B])
        if step and step1:
            bound.update(settled_step_ms=step * 1e3, settled_vs_batch1=B * step1 / (batches[0] * step))
        for name in names:
            p = per[B][name]
            row = dict(label, visual_tokens=inputs[0].m_v, batch=B, method=name, rows=len(inputs),
                       dense_tok_s=dense_rate, dense_vs_batch1=dense_rate / dense1,
                       tok_s=_median([x["tok_s"] for x in p]), speedup=_median([x["speedup"] for x in p]),
                       identical_to_dense=all(x["identical"] for x in p),
                       acceptance=_median([x["acceptance"] for x in p]),
                       tokens_per_round=_median([x["tokens_per_round"] for x in p]),
                       bound_speedup=_median([x["bound"] for x in p]), fast_steps=p[-1]["fast_steps"] if p else 0,
                       **bound)
            row.update(pairs([x["speedup"] for x in p]))
            if row["speedup"] and row["bound_speedup"]:
                row["bound_share"] = row["speedup"] / row["bound_speedup"]
            rows.append(row)
    return rows


SETTLED_AFTER = 10  # steps of a pass before its "settled" steps


def settled_step_s(traces: list, skip: int = SETTLED_AFTER) -> float | None:
    """The median decode step of a pass's traces after each one's first `skip` steps (in a batch,
    each row's steps are the batch's): what a step costs once its KV is back in the caches. After
    its prefills (or a second idle), a batch-8 step at 4,608 visual tokens (122 MB) ran 5.7-8 ms for
    5 to 30+ steps before settling at ~3.3 on a 2-core VM whose 300 MiB L3 the host shares, while a
    one-row step (21.6 MB) lost one or two steps: the tokens/s of whole passes carry that, this
    does not. None where no trace has more steps than that."""
    xs = [s for t in traces for s in t.step_s[skip:]]
    return statistics.median(xs) if xs else None


def kv_entry_bytes(loaded) -> int:
    """Bytes of KV one token holds (K and V, every layer and KV head)."""
    return 2 * loaded.num_layers * loaded.num_kv_heads * loaded.head_dim * torch.finfo(loaded.dtype).bits // 8


def step_bytes(loaded, inputs: list, max_new_tokens: int) -> tuple[int, list[int]]:
    """Bytes a dense decode step of these rows reads at mid-answer: (the language model's weights,
    read once: its layers, final norm and LM head, one embedding row being nothing; each row's KV)."""
    lm = getattr(loaded.model.model, "language_model", loaded.model.model)
    params = {id(p): p for mod in (lm.layers, lm.norm, loaded.model.lm_head) for p in mod.parameters()}
    weights = sum(p.numel() * p.element_size() for p in params.values())
    return weights, [(x.m + max_new_tokens // 2) * kv_entry_bytes(loaded) for x in inputs]


def read_seconds(nbytes: int, dev: torch.device, most: int = 1 << 30) -> float:
    """Seconds to read `nbytes` once at this machine's memory speed: a plain sum over a buffer that
    size (torch's threads; beyond `most` bytes, that much, scaled), timed by `time_calls`."""
    x = torch.ones(max(1, min(nbytes, most) // 4), device=dev)
    return time_calls(x.sum, dev, calls=1, repeats=9) * max(1.0, nbytes / most)


def dense_batch_bound(loaded, inputs: list, max_new_tokens: int, B: int, dense1_tok_s: float) -> dict:
    """How much faster dense can decode B rows together than one at a time, if only bytes counted:
    `bytes_bound`, B x a one-row step's bytes / a B-row step's (weights read once, KV B times;
    both at the same speed), and `read_bound`, batch B's tokens/s were its step only a read of its
    bytes (timed now, `read_seconds`) against batch 1's measured tokens/s. Where one row's bytes
    fit in a cache and B rows' do not, the second is the lower."""
    weights, kv = step_bytes(loaded, inputs, max_new_tokens)
    shared = shared_bytes(loaded, inputs)
    total = weights + sum(kv) - shared
    read_s = read_seconds(total, loaded.device)
    return dict(step_mb=total / 1e6, read_ms=read_s * 1e3, shared_mb=shared / 1e6,
                bytes_bound=B * (weights + statistics.median(kv)) / total, read_bound=B / read_s / dense1_tok_s)


def shared_bytes(loaded, inputs: list) -> int:
    """KV bytes a step of these rows reads once instead of once per row: questions on one video
    (`Adapter.build_questions`) share their common prefix (`cache.Stack.prefix`, where the attention
    kernel reads it: the CPU op, Triton), each row after the first of its video reading it from that
    one; 0 where the kernel reads every row's own (SDPA)."""
    if kernels.backend(loaded.device) == "sdpa":
        return 0
    total = 0
    for i, x in enumerate(inputs):
        first = next((y for y in inputs[:i] if y.vision is x.vision), None)  # its video's first row
        if first is not None:
            m = common_prefix(x.model_kwargs["input_ids"][0], first.model_kwargs["input_ids"][0])
            total += m * kv_entry_bytes(loaded) if m >= SHARED_MIN else 0
    return total


def print_batch_rows(args, loaded, settings: dict, rows: list[dict], **extra) -> int:
    if args.json:
        print(json.dumps(dict(model=loaded.name, device=str(loaded.device), settings=settings, repeats=args.repeats,
                              ignore_eos=args.ignore_eos, threads=torch.get_num_threads(), compile=state(loaded),
                              rows=rows, **extra)))
        return 0
    fast = loaded.fast
    batches = ("compiled too" if fast is not None and fast.enabled and fast.batched
               else "eager" if loaded.device.type == "cpu" else "as batch 1")
    print(f"decode steps: {state(loaded)} (batches of more than one row: {batches})")
    print_stolen(extra.get("cpu_stolen_pct"))
    first = [("frames", "frames", "g")] if "frames" in rows[0] else [("prompt", "seq", "g")]
    cols = first + [
        ("visual tokens", "visual_tokens", "g"), ("batch", "batch", "g"),
        ("method", "method", ""), ("dense tok/s", "dense_tok_s", ""), ("dense vs batch 1", "dense_vs_batch1", "x"),
        ("method tok/s", "tok_s", ""), ("decode speedup", "speedup", "x"), ("its pairs", "speedup_pairs", ""),
        ("identical", "identical_to_dense", ""),
        ("acceptance", "acceptance", "pct"), ("tokens/round", "tokens_per_round", ""),
        ("bound from step costs", "bound_speedup", "x"), ("share of bound", "bound_share", "pct")]
    print(markdown_table([c[0] for c in cols], [[cell(r.get(k), kind) for _, k, kind in cols] for r in rows]))
    for r in {r["batch"]: r for r in rows if r.get("bytes_bound")}.values():  # one line per batch size
        print(f"dense at batch {r['batch']} vs batch 1 ({r.get('visual_tokens')} visual tokens): "
              f"{r['dense_vs_batch1']:.2f}x measured; bound if only bytes counted {r['bytes_bound']:.2f}x "
              f"(a step reads {r['step_mb']:.1f} MB: weights once, KV {r['batch']} times"
              + (f", less {r['shared_mb']:.1f} MB of prefixes shared by questions on one video" if r.get("shared_mb") else "")
              + "); "
              f"{r['read_bound']:.2f}x were a batch step only a read of its bytes at this machine's speed "
              f"({r['read_ms']:.2f} ms, {r['step_mb'] / r['read_ms']:.1f} GB/s) against batch 1 as measured"
              + (f"; settled steps (after each pass's first {SETTLED_AFTER}) {r['settled_step_ms']:.2f} ms, "
                 f"{r['settled_vs_batch1']:.2f}x batch 1's tokens/s" if r.get("settled_vs_batch1") else ""))
    return 0


def shape_loaded(name: str, dev: torch.device, dtype: torch.dtype, layers: int | None = None):
    """A whole Qwen2-VL model whose language model has a real checkpoint's shape (`SHAPES`; random
    weights, built on `dev` directly), with a tiny vision tower (its cost is not what is measured)
    and a word-level tokenizer as large as the vocabulary: a `Loaded` the engine runs like any model.
    Its folder (config, tokenizer, preprocessor; no weights) is a temporary one; frames of 448 x 448
    give 128 visual tokens each."""
    import tempfile

    import transformers

    from . import attention
    from .adapters import adapter_for
    from .cache import BufferPool
    from .models import Loaded
    from .tiny import make_tokenizer, tiny_config, token_ids

    shape = shape_fields(name, dev, layers)
    tok = make_tokenizer(vocab_size=shape.pop("vocab_size"))
    ids = token_ids(tok)
    config = tiny_config("qwen2_vl", len(tok), token_ids=ids, initializer_range=0.02, **shape)
    folder = tempfile.mkdtemp(prefix="sparsevid-shape-")
    tok.save_pretrained(folder)
    with open(f"{folder}/preprocessor_config.json", "w") as f:
        json.dump(dict(patch_size=14, temporal_patch_size=2, merge_size=2, min_pixels=448 * 448,
                       max_pixels=448 * 448), f)
    model = random_model(transformers.Qwen2VLForConditionalGeneration, config, dev, dtype)
    model.generation_config.update(**ids)
    model.set_attn_implementation({"text_config": attention.NAME})
    attention.install(model)
    return Loaded(model, tok, adapter_for(folder, config, tok), f"{name} (random weights)", "random", dev, dtype,
                  pool=BufferPool() if dev.type == "cuda" else None)


SHAPE_QUESTIONS = ("describe the video .", "what happens in the video ?", "what colour is the object ?",
                   "which direction does the object move ?", "how many objects are there ?",
                   "when does the red circle appear ?", "what shape is the blue object ?",
                   "describe the green square .")


@torch.inference_mode()
def shape_rounds(args) -> int:
    """Real rounds at a real shape (`--shape NAME --rounds`): `shape_loaded`'s model on random clips
    of about --seq visual tokens (default 16384) with up to 8 questions, decoded in batches of each
    --batch size (`batch_rows`: dense and each method, paired, tokens/s of the batch, acceptance,
    tokens per round, the bound from the run's own step costs, steps served by graphs). --clips N:
    the questions take N clips in turn (8: eight different prompts, the StD paper's batch 8, whose
    rows share nothing); default one clip, questions on one video (the demo's batch, whose rows
    read their shared prefix once where the kernel can: `cache.Stack.prefix`). Random weights: the
    acceptance is the random model's, not a checkpoint's; the costs are the shape's."""
    import numpy as np

    from .models import pick_device

    if args.shape not in SHAPES:
        raise InputError(f"Unknown shape '{args.shape}'; known: {', '.join(SHAPES)}.")
    dev, dtype = pick_device(args.device, args.dtype)
    batches = batch_sizes(args)
    seqs = [int(s) for s in str(args.seq or args.visual_tokens or "16384").split(",")]
    names = [n for n in parse_methods(args.methods) if n != "dense"] or ["std"]
    settings = check_settings(args.settings)
    loaded = shape_loaded(args.shape, dev, dtype, args.layers or (None if dev.type == "cuda" else 2))
    enable(loaded, args.compile)
    rows = []
    bar = tqdm(total=len(seqs) * len(batches) * batch_passes(names, args), desc="bench", file=sys.stderr)
    try:
        for seq in seqs:
            questions = (SHAPE_QUESTIONS * 8)[:max(batches)]
            clips = max(1, min(args.clips, len(questions)))
            per_clip = [loaded.adapter.build_questions(
                np.random.default_rng([seq, c]).integers(0, 256, (2 * -(-seq // 256), 448, 448, 3), dtype=np.uint8),
                questions[c::clips], device=dev) for c in range(clips)]
            inputs = [per_clip[i % clips][i // clips] for i in range(len(questions))]  # row i: clip i mod N
            rows += batch_rows(args, loaded, names, settings, inputs, batches, dict(seq=inputs[0].m, clips=clips), bar)
    finally:
        bar.close()
    return print_batch_rows(args, loaded, settings, rows, shape=args.shape, layers=loaded.num_layers,
                            random_weights=True)


@torch.inference_mode()
def attention_kv_s(loaded, inputs, max_new_tokens: int) -> float:
    """Seconds of a dense decode step that scale with the KV it reads, measured: every layer's decode
    attention (`kernels.attend`, as a step calls it, on the step's thread count; the CPU op on the
    threads it takes inside a step, `kernels.op_threads`, eager or compiled alike) over the prompt's
    entries + half the answer, minus the same over 64 entries (the part that does not scale).
    Measured on the step's one thread where the compiled step's op took two (a machine whose
    WIDE_GRAPH_WORK is 48,000), it read 85 % of a 1.27-ms dense step at 9,216 visual tokens where the
    step's attention took about half of it, and overstated the bounds."""
    dev, dtype = loaded.device, loaded.dtype
    H, Hkv, D, L = loaded.num_heads, loaded.num_kv_heads, loaded.head_dim, loaded.num_layers

    def calls(n):
        q = torch.randn(1, H, 1, D, device=dev, dtype=dtype)
        k, v = (torch.randn(1, Hkv, n + max_new_tokens, D, device=dev, dtype=dtype) for _ in range(2))
        start = torch.tensor([[n]], device=dev)
        return lambda: kernels.attend(q, k, v, start, D ** -0.5)

    with step_threads(loaded):
        n = inputs.m + max_new_tokens // 2
        return max(0.0, L * (time_calls(calls(n), dev) - time_calls(calls(64), dev)))


def kv_bound(figs: dict, dense_step_s: float, kv_s: float) -> dict:
    """A direct method's decode bound from the KV it reads: a dense step costs `dense_step_s`, of which
    `kv_s` scales with the KV read (`attention_kv_s`); reading decode_kv_pct % of dense's KV, a step
    at best costs dense_step_s - (1 - kv) kv_s. Returns the bound and the measured share of it."""
    if figs.get("decode_kv_pct") is None or not dense_step_s:
        return {}
    kv_s = min(kv_s, dense_step_s)
    bound = dense_step_s / (dense_step_s - (1 - figs["decode_kv_pct"] / 100) * kv_s)
    return dict(bound_speedup=bound, attention_kv_pct=100 * kv_s / dense_step_s,
                bound_share=None if figs.get("speedup") is None else figs["speedup"] / bound)


def paired_runs(loaded, inputs, name: str, settings, args, decoding, on_dense=None) -> tuple[list, object, object]:
    """--repeats runs of `name` on one prompt, each between two dense runs and paired with their mean
    (as `runs.compare` pairs them) -> (each run's figures, the last run, the last dense run).
    `on_dense(dense)` is called with the dense run before each of them."""
    after = run_method(loaded, inputs, "dense", settings, args.max_new_tokens, decoding)
    HopelessShapes(loaded).forget()  # the first run probes (as `runs.compare`'s first pass); the next may not
    out = []
    for _ in range(args.repeats):
        dense = after
        if on_dense is not None:
            on_dense(dense)
        res = run_method(loaded, inputs, name, settings, args.max_new_tokens, decoding)
        after = run_method(loaded, inputs, "dense", settings, args.max_new_tokens, decoding)
        res.decode_runs_s, res.dense_pair_s = [res.decode_s], [dense_pair_s(dense, after)]
        out.append(dict(figures(res, dense, loaded, inputs), tokens=len(res.token_ids)))
    return out, res, after


def examples_check(args, loaded, names: list, settings: dict) -> int:
    """Issue 23's check: on every bundled example, the decode speedup the app shows (`runs.compare`
    with the app's timing passes, `demo.config.TIMING_*`; its median and range) beside bench's (the median of --repeats pairs on the
    same input, timed right after), and whether they agree within 15 %."""
    from .demo.config import EXAMPLES_DIR, TIMING_BUDGET_S, TIMING_MAX_REPEATS, TIMING_REPEATS, load_examples
    from .runs import compare
    from .video import load_video

    folder = EXAMPLES_DIR if args.examples == "bundled" else args.examples
    examples = load_examples(folder)
    if not examples:
        raise InputError(f"No examples with their clips in {folder}/examples.json.")
    decoding = Sampling(ignore_eos=args.ignore_eos)
    rows = []
    for e in tqdm(examples, desc="examples", file=sys.stderr):
        vid = load_video(e["path"], int(e["frames"]))
        inputs = loaded.adapter.build_inputs(vid.frames, e["question"], vid.timestamps).to(loaded.device)
        traces, figs = compare(loaded, inputs, names, settings, args.max_new_tokens, decoding, repeats=TIMING_REPEATS,
                               max_repeats=TIMING_MAX_REPEATS, budget_s=TIMING_BUDGET_S)  # as the app times it
        for name in names:
            app, rng = figs[name]["speedup"], figs[name]["speedup_range"]
            bench = (_median([f["speedup"] for f in paired_runs(loaded, inputs, name, settings, args, decoding)[0]])
                     if app is not None else None)
            rows.append(dict(example=e["file"], frames=len(vid.frames), tokens=len(traces[name].token_ids),
                             method=name, app=app, app_range=rng, app_passes=len(traces[name].decode_runs_s), bench=bench,
                             ratio=app / bench if app and bench else None))
    if args.json:
        print(json.dumps(dict(model=loaded.name, compile=state(loaded), repeats=args.repeats, rows=rows)))
        return 0
    print(f"decode steps: {state(loaded)}")
    print(markdown_table(
        ["example", "frames", "tokens", "method", "app", "app's range (passes)", "bench", "app / bench", "within 15 %",
         "bench inside the app's range"],
        [[r["example"], str(r["frames"]), str(r["tokens"]), r["method"], cell(r["app"], "x"),
          "{:.2f}-{:.2f}x ({})".format(*r["app_range"], r["app_passes"]) if r["app_range"] else "-",
          cell(r["bench"], "x"),
          f"{r['ratio']:.2f}" if r["ratio"] else "-",
          "-" if not r["ratio"] else ("yes" if 1 / 1.15 <= r["ratio"] <= 1.15 else "no"),
          "-" if not (r["app_range"] and r["bench"]) else
          ("yes" if r["app_range"][0] <= r["bench"] <= r["app_range"][1] else "no")] for r in rows]))
    return 0


COLUMNS = [("frames", "frames", "g"), ("visual tokens", "visual_tokens", "g"), ("method", "method", ""),
           ("tokens", "tokens", "g"), ("decode speedup", "speedup", "x"), ("its pairs", "speedup_pairs", ""),
           ("end-to-end", "e2e_speedup", "x"),
           ("acceptance", "acceptance", "pct"), ("tokens/round", "tokens_per_round", ""),
           ("identical", "identical_to_dense", ""), ("KV vs dense", "kv_ratio", "pct"),
           ("I/O-model speedup", "predicted_speedup", "x"), ("bound", "bound_speedup", "x"),
           ("share of bound", "bound_share", "pct"), ("dense / draft step / verify (ms)", "step_costs", "")]


def format_table(rows: list[dict]) -> str:
    return markdown_table([c[0] for c in COLUMNS], [[cell(r.get(k), kind) for _, k, kind in COLUMNS] for r in rows])


def format_cost_table(rows: list[dict]) -> str:
    """A direct policy's costs as % of dense (medians over clips and repeats) and accuracy."""
    head = ["frames", "visual tokens", "method", "clips", "prefill FLOPs %", "prefill wall %", "prefill KV %",
            "decode KV %", "peak mem %", "e2e latency %", "decode FLOPs %", "accuracy % (dense)",
            "attention scaling with KV, % of a dense step"]
    body = []
    for r in rows:
        acc = "-" if r.get("accuracy") is None else f"{r['accuracy']:.1f} ({r['dense_accuracy']:.1f})"
        body.append([str(r["frames"]), str(r["visual_tokens"]), r["method"], str(r.get("clips", 1))]
                    + ["-" if r.get(k) is None else f"{r[k]:.0f}" for k in COST_FIELDS] + [acc]
                    + ["-" if r.get("attention_kv_pct") is None else f"{r['attention_kv_pct']:.0f}"])
    return markdown_table(head, body)


# Language-model shapes of the supported 7B-class checkpoints (from their published config.json).
SHAPES = {
    "qwen2-vl-2b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                        num_key_value_heads=2, vocab_size=151936),
    "qwen2-vl-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                        num_key_value_heads=4, vocab_size=152064),
    "qwen2.5-vl-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                          num_key_value_heads=4, vocab_size=152064),
    "llava-video-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                           num_key_value_heads=4, vocab_size=152064),
}


def copy_bandwidth(dev: torch.device, nbytes: int = 2 << 30) -> float:
    """The device's measured copy bandwidth in bytes/s (bytes read + written by a large copy, median
    of 5): the `BW` of every limit (SPEC §7). One H200: about 4.3 TB/s."""
    if dev.type != "cuda":
        nbytes = min(nbytes, 256 << 20)
    a = torch.empty(nbytes // 2, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    times = []
    for _ in range(6):
        sync_device(dev)
        t = time.perf_counter()
        b.copy_(a)
        sync_device(dev)
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times[1:])


def time_calls(fn, dev: torch.device, calls: int = 20, repeats: int = 5) -> float:
    """Seconds per call: `calls` calls back to back between two syncs, median over `repeats` (after
    two warm-up calls)."""
    fn(), fn()
    out = []
    for _ in range(repeats):
        sync_device(dev)
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        sync_device(dev)
        out.append((time.perf_counter() - t) / calls)
    return statistics.median(out)


TRITON_VARIANTS = ((32, 8, 2), (64, 4, 3), (64, 8, 2), (128, 8, 2), (128, 8, 3))

# Kernel families of a captured step, by name (cuBLAS / CUTLASS matmuls; this project's Triton kernels)
KERNEL_FAMILIES = (("matmul", ("gemm", "gemv", "cutlass", "xmma", "splitk", "cublas")),
                   ("attention", ("split_kv", "combine")), ("fused ops", ("rms_norm", "rotary", "write_kv")))


def kernel_breakdown(kernels_us: list[tuple[str, float, float]], steps: int) -> dict:
    """Per step, from the GPU kernels of `steps` replays of one captured step [(name, start µs,
    duration µs)]: per family (`KERNEL_FAMILIES`, the rest "other") how many kernels and how many
    µs they ran; the busy time (the sum) against the span from the first kernel's start to the last
    one's end (the difference: the GPU idle between kernels); the other family's five largest names."""
    fam = {name: dict(kernels=0, us=0.0) for name, _ in KERNEL_FAMILIES + (("other", ()),)}
    other: dict = {}
    for name, _, us in kernels_us:
        low = name.lower()
        f = next((f for f, keys in KERNEL_FAMILIES if any(k in low for k in keys)), "other")
        fam[f]["kernels"] += 1
        fam[f]["us"] += us
        if f == "other":
            other[name[:60]] = other.get(name[:60], 0.0) + us
    for f in fam.values():
        f["kernels"], f["us"] = f["kernels"] / steps, f["us"] / steps
    span = (max(t + us for _, t, us in kernels_us) - min(t for _, t, _ in kernels_us)) / steps if kernels_us else 0.0
    busy = sum(f["us"] for f in fam.values())
    return dict(families=fam, busy_us=busy, span_us=span, idle_us=span - busy,
                other_top=sorted(((n, us / steps) for n, us in other.items()), key=lambda x: -x[1])[:5])


def profile_replays(graph, steps: int = 5) -> dict:
    """`kernel_breakdown` of `steps` replays of a captured CUDA graph (torch.profiler, CUDA
    activity: CUPTI reports a graph's kernels one by one)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            graph.replay()
        torch.cuda.synchronize()
    ks = [(e.name, e.time_range.start, e.time_range.elapsed_us()) for e in prof.events()
          if e.device_type == DeviceType.CUDA]
    return kernel_breakdown(ks, steps)


@torch.inference_mode()
def verify_kernels(args) -> int:
    """Time each decode-attention backend (`kernels.BACKENDS`) for one layer: q = 1 (a step) and
    γ + 1 (a verification) rows per query head over a buffer of m entries, per batch size; its
    achieved GB/s of K and V and its error against a float64 reference (checked on a slice of
    the heads). Head shape: --shape's (default the embedded model's: Hkv 4, G 2, D 24).
    On CUDA also SDPA's flash kernel without any mask over exactly the entries read: the
    bandwidth a mask-free kernel reaches (not usable in a captured step: it takes no lengths); on
    the CPU a plain sum over the same K and V (the memory bound of a step) and, for a verification,
    the same two matmuls by the BLAS without the softmax (its arithmetic alone: a verification's γ + 1
    rows make it compute-bound)."""

    from .models import pick_device

    dev, dtype = pick_device(args.device, args.dtype)
    if args.shape:
        if args.shape not in SHAPES:
            raise InputError(f"Unknown shape '{args.shape}'; known: {', '.join(SHAPES)}.")
        c = SHAPES[args.shape]
        Hkv, G, D = c["num_key_value_heads"], c["num_attention_heads"] // c["num_key_value_heads"], \
            c["hidden_size"] // c["num_attention_heads"]
    else:
        Hkv, G, D = 4, 2, 24
    gamma = int(args.settings.get("gamma", 9))
    seqs = [int(x) for x in (args.seq or args.visual_tokens or "4608,9216").split(",")]
    if dev.type == "cuda":  # Triton runs on CUDA (the tests run it interpreted on the CPU)
        backends = ["sdpa"] + (["triton"] if kernels.triton_available() else [])
    else:  # the own CPU kernel where it builds (float32)
        backends = ["sdpa"] + (["cpu"] if kernels.cpu_available() and dtype == torch.float32 else [])
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for B in [int(b) for b in str(args.batch).split(",")]:
        for n in seqs:
            k = torch.randn(B, Hkv, n + gamma + 8, D, generator=gen, device=dev, dtype=dtype)
            v = torch.randn(B, Hkv, n + gamma + 8, D, generator=gen, device=dev, dtype=dtype)
            for q_rows in (1, gamma + 1):
                q = torch.randn(B, Hkv * G, q_rows, D, generator=gen, device=dev, dtype=dtype)
                start = torch.full((B,), n - q_rows, device=dev)
                ref = kernels.reference(q[:1, :G].cpu(), k[:1, :1, :n].cpu(), v[:1, :1, :n].cpu(),
                                        start[:1].cpu(), D ** -0.5)
                nbytes = 2 * B * Hkv * n * D * k.element_size()
                flops = 4 * B * Hkv * G * q_rows * n * D  # scores and outputs, a multiply and an add each
                cands = {b: (lambda b=b: kernels.attend(q, k, v, start, D ** -0.5, which=b)) for b in backends}
                kk, vv = k[:, :, :n], v[:, :, :n]
                if dev.type != "cuda" and q_rows == 1:  # the memory bound: the same bytes read by a plain sum
                    cands["read K and V once (bound)"] = lambda: (kk.sum(), vv.sum())
                if dev.type != "cuda" and q_rows > 1:  # the arithmetic alone: the same two matmuls by the BLAS
                    qg = q.view(B, Hkv, G * q_rows, D)
                    cands["the same matmuls, no softmax (BLAS)"] = lambda: torch.matmul(
                        torch.matmul(qg, kk.transpose(-1, -2)), vv)
                if dev.type == "cuda" and q_rows == 1:
                    cands["sdpa, no mask (ceiling)"] = lambda: F.scaled_dot_product_attention(
                        q, kk, vv, scale=D ** -0.5, enable_gqa=True)
                if "triton" in backends:  # tile variants (key block, warps, stages), timed for the record
                    for bn, w, st in TRITON_VARIANTS:
                        cands[f"triton n{bn} w{w} s{st}"] = (lambda bn=bn, w=w, st=st: kernels.attend_triton(
                            q, k, v, start, D ** -0.5, block_n=bn, num_warps=w, num_stages=st))
                for name, fn in cands.items():
                    t = time_calls(fn, dev)
                    out = fn()
                    err = None
                    if not name.startswith(("sdpa, no mask", "read K and V", "the same matmuls")):
                        err = (out[:1, :, :G].double().cpu() - ref).abs().max().item()
                    rows.append(dict(batch=B, entries=n, rows=q_rows, kernel=name, ms=t * 1e3,
                                     gb_s=nbytes / t / 1e9, gflop_s=flops / t / 1e9, max_error=err))
    where = f"{dev}, {str(dtype)[6:]}, {torch.get_num_threads()} threads" if dev.type != "cuda" else \
        f"{torch.cuda.get_device_name(dev)}, {str(dtype)[6:]}"
    fastest = fastest_exact(rows, EXACT_TOLERANCE.get(dtype, 1e-4))
    # where a compiled one-thread step's call takes a second thread on this machine (measured once)
    wide = kernels.measure_graph_work() if "cpu" in backends and torch.get_num_threads() > 1 else None
    if args.json:
        print(json.dumps(dict(device=where, heads=dict(Hkv=Hkv, G=G, D=D), rows=rows, fastest_exact=fastest,
                              graph_work=wide)))
        return 0
    print(f"one layer, {Hkv} KV heads x {G} query heads, D = {D}, {where}")
    print(markdown_table(["batch", "entries", "rows per query head", "kernel", "ms", "GB/s of K and V", "GFLOP/s",
                          "max error vs float64"],
                         [[str(r["batch"]), str(r["entries"]), str(r["rows"]), r["kernel"], f"{r['ms']:.3f}",
                           f"{r['gb_s']:.1f}", "-" if r["kernel"].startswith("read") else f"{r['gflop_s']:.1f}",
                           "-" if r["max_error"] is None else f"{r['max_error']:.1e}"]
                          for r in rows]))
    print("fastest within the dtype's tolerance: " + "; ".join(
        f"batch {r['batch']}, {r['entries']} entries, {r['rows']} row(s): {r['kernel']} ({r['ms']:.3f} ms)" for r in fastest))
    if wide:
        print(f"inside a compiled step on one thread, the own kernel takes {torch.get_num_threads()} threads from "
              f"{wide:,} (KV pairs x entries x (rows per KV head + 3); measured once on this machine)")
    return 0


# Largest error against float64 that still counts as exact for a dtype: float32's kernels agree to
# ~1e-7 here; bf16 and fp16 round their inputs and outputs (a unit in the last place of an output
# of order 1 is 8e-3 in bf16).
EXACT_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def fastest_exact(rows: list[dict], tolerance: float) -> list[dict]:
    """Per (batch, entries, rows): the fastest kernel whose error against float64 is within
    `tolerance` (bounds and ceilings, which compute something else, have no error and never win),
    as the GPU check records it: the one to choose on that machine."""
    best: dict = {}
    for r in rows:
        if r["max_error"] is None or r["max_error"] > tolerance:
            continue
        key = (r["batch"], r["entries"], r["rows"])
        if key not in best or r["ms"] < best[key]["ms"]:
            best[key] = r
    return [dict(batch=b, entries=n, rows=q, kernel=r["kernel"], ms=r["ms"], max_error=r["max_error"])
            for (b, n, q), r in best.items()]


def prefill_attention(m: int, m_v: int, K: int, n_full: int, H: int, Hkv: int, D: int, dev, dtype) -> dict:
    """One layer's prefill attention over m prompt rows (32 text tokens, m_v visual, the rest text):
    dense causal SDPA, and HT-Sparse's routed attention (`routing.routed_attention`) where n_full KV
    groups read everything and the others the text and K random visual positions (ms)."""
    from .routing import routed_attention

    g = torch.Generator(device=dev).manual_seed(1)
    q, k, v = (torch.randn(1, h, m, D, generator=g, device=dev, dtype=dtype) for h in (H, Hkv, Hkv))
    text = torch.cat([torch.arange(32), torch.arange(32 + m_v, m)])
    visual = 32 + torch.randperm(m_v, generator=torch.Generator().manual_seed(2))[:K]
    sparse = torch.cat([text, visual]).sort().values.to(dev)
    keep = [torch.arange(m, device=dev)] * n_full + [sparse] * (Hkv - n_full)
    dense = time_calls(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), dev,
                       calls=1, repeats=3)
    routed = time_calls(lambda: routed_attention(q, k, v, D ** -0.5, keep), dev, calls=1, repeats=3)
    return dict(prefill_attention_ms=dense * 1e3, routed_attention_ms=routed * 1e3, routed_attention_vs_dense=routed / dense)


def shape_model(name: str, dev: torch.device, dtype: torch.dtype, layers: int | None = None):
    """A Qwen2 language model at a real checkpoint's shape (`SHAPES`), random weights, built on `dev`
    directly (initialising 7.6 B parameters on the CPU first takes minutes)."""
    import transformers

    config = transformers.Qwen2Config(**shape_fields(name, dev, layers))
    config._attn_implementation = "sparsevid"
    return random_model(transformers.Qwen2ForCausalLM, config, dev, dtype), config


def shape_fields(name: str, dev: torch.device, layers: int | None = None) -> dict:
    """The text config fields of shape `name` with `layers` decoder layers (default all) and room for
    128k positions; on a CPU a 4,096-word vocabulary (the LM head's cost does not depend on the
    cache; keep CPU runs short)."""
    shape = dict(SHAPES[name], max_position_embeddings=131072)
    shape["num_hidden_layers"] = layers or shape["num_hidden_layers"]
    if dev.type != "cuda":
        shape["vocab_size"] = 4096
    return shape


def random_model(cls, config, dev: torch.device, dtype: torch.dtype):
    """`cls(config)` with random weights (seed 0) in `dtype`, built on `dev` directly (initialising
    7.6 B parameters on the CPU first takes minutes)."""
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            return cls(config).eval()
    finally:
        torch.set_default_dtype(old)


@torch.inference_mode()
def mechanical(args) -> int:
    """Cost of one dense step, one sparse draft step and one γ+1 verification at a real shape, for
    each batch size and prompt length, against each step's limit.

    The language model is built from the shape with random weights (Qwen2 decoder, as in all
    three architectures); its buffers are filled with random KV instead of running a prefill, since
    only the cost is measured (acceptance is meaningless here and not reported). The steps are
    `fast.static_step` over B sequences of the same length: the dense buffers [B, Hkv, m + γ + 8, D]
    and a top-K draft's compact buffers [B, Hkv, K + m_t + γ + 8, D]; eager, and on CUDA each also
    captured as a CUDA graph (`fast.Captured`, as the engine runs them) unless --compile off.

    Limit of a step = (weights + the KV entries it reads) / the copy bandwidth measured here. StD's
    round bound (every draft accepted) is (γ + 1) t_dense / (γ t_draft + t_verify) from the measured
    step costs; its ideal is the same from the limits. Also HT-Sparse's and SparseMM's decode steps
    over their per-head layouts (`cache.SparseKV`): HT-Sparse's default partition by GQA group (a
    quarter of the KV heads keep everything, the rest K + m_t entries, StD's budget: an assumption,
    its real token count follows the relevance), SparseMM's budgets (0.7 of the prompt per head on
    average) over random head scores; and on CUDA, at batch 1, a dense prefill, and at the first
    prompt length the captured dense and draft steps' kernels by family (`profile_replays`).
    """
    from .fast import Block, Captured, static_step
    from .methods.base import visual_budget
    from .methods.sparsemm import DEFAULT_BUDGET, budgets
    from .models import pick_device

    if args.shape not in SHAPES:
        raise InputError(f"Unknown shape '{args.shape}'; known: {', '.join(SHAPES)}.")
    dev, dtype = pick_device(args.device, args.dtype)
    bw = copy_bandwidth(dev)
    layers = args.layers or (SHAPES[args.shape]["num_hidden_layers"] if dev.type == "cuda" else 2)
    model, config = shape_model(args.shape, dev, dtype, layers)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    H, Hkv = config.num_attention_heads, config.num_key_value_heads
    D = config.hidden_size // H
    gamma = int(args.settings.get("gamma", 9))
    k = check_settings({"k": args.settings["k"]})["k"] if args.settings.get("k") else None
    graphs = dev.type == "cuda" and args.compile != "off"
    m_t = 64
    if args.seq:
        visual = [int(v) - m_t for v in args.seq.split(",")]
    else:
        visual = [int(v) for v in (args.visual_tokens or "4096,16384,32768").split(",")]
    batches = [int(b) for b in str(args.batch).split(",")]
    rows = []
    elem = torch.finfo(dtype).bits // 8
    for B in batches:
        for m_v in visual:
            m = m_v + m_t
            K = visual_budget(k, m_v, m_t)
            n_draft = K + m_t
            new = lambda n: torch.randn(B, Hkv, n + gamma + 8, D, device=dev, dtype=dtype)  # noqa: E731
            dense = [Block(new(m), new(m)) for _ in range(layers)]
            draft = [Block(new(n_draft), new(n_draft)) for _ in range(layers)]

            def per_head(lens_by_layer):
                """Compact blocks where KV head h of a layer keeps lens[h] entries (one buffer of the
                layer's largest, written at each head's own length: `cache.SparseKV`'s layout) and
                the step's write positions."""
                blocks, starts = [], []
                for lens in lens_by_layer:
                    blocks.append(Block(new(max(lens)), new(max(lens)), None, len(starts), len(lens)))
                    starts += list(lens)
                return blocks, torch.tensor(starts, device=dev)

            profiles = {}

            def timed(blocks, n, q, start=None, profile_as=None):
                """(eager s, graph s or None) of a step of q rows at position n, written at entry n of
                `blocks` (or at `start`, per head); `profile_as`: also its captured kernels, at the
                first prompt length (`profile_replays`, into `profiles`)."""
                ids = torch.randint(0, 100, (B, q), device=dev)
                pos = torch.arange(n, n + q, device=dev).expand(B, q)
                start = torch.full((1,), n, device=dev) if start is None else start
                step = lambda: static_step(model, ids, pos, blocks, [None] * layers, start)  # noqa: E731
                eager = time_calls(step, dev, calls=3, repeats=3)
                if not graphs:
                    return eager, None
                g = Captured(model, ids, pos, blocks, [None] * layers, start)
                g(ids, pos, start)  # the capturing call's own result
                t = time_calls(g.graph.replay, dev, calls=10, repeats=5)
                if profile_as and m_v == visual[0]:
                    try:
                        profiles[profile_as] = profile_replays(g.graph)
                    except Exception as e:  # noqa: BLE001 - a profiler that fails costs only its figures
                        profiles[profile_as] = dict(error=f"{type(e).__name__}: {e}"[:300])
                del g
                return eager, t

            kv = lambda n: B * layers * 2 * Hkv * n * D * elem  # noqa: E731  KV bytes a step reads
            limits = dict(dense=(weights + kv(m + 1)) / bw, draft=(weights + kv(n_draft + 1)) / bw,
                          verify=(weights + kv(m + gamma + 1)) / bw)
            t = dict(dense=timed(dense, m, 1, profile_as="dense"), draft=timed(draft, n_draft, 1, profile_as="draft"),
                     verify=timed(dense, m, gamma + 1))
            del dense, draft
            # the per-head layouts at the methods' default proportions (random KV, as above)
            n_full = max(1, round(0.25 * Hkv))  # HT-Sparse: h_f = 0.25 of the heads keep all, by GQA group;
            ht = [[m] * n_full + [n_draft] * (Hkv - n_full)] * layers  # the sparse ones K + m_t (as StD's)
            caps = budgets(torch.rand(layers, Hkv, generator=torch.Generator().manual_seed(0)),
                           round(DEFAULT_BUDGET * m), available=m).tolist()  # SparseMM: random head scores
            layouts = dict(htsparse=ht, sparsemm=caps)
            for name, lens in layouts.items():
                blocks, starts = per_head(lens)
                entries = sum(n + 1 for ls in lens for n in ls)
                limits[name] = (weights + B * 2 * D * elem * entries) / bw
                t[name] = timed(blocks, m, 1, starts)
                del blocks
            best = {s: (g if g is not None else e) for s, (e, g) in t.items()}
            row = dict(shape=args.shape, layers=layers, batch=B, visual_tokens=m_v, prompt=m, k=K,
                       steps="graph" if graphs else "eager",
                       **{f"{n}_kv_pct": 100 * sum(map(sum, ls)) / (layers * Hkv * m) for n, ls in layouts.items()})
            if B == 1:  # one layer's prefill attention: dense causal against HT-Sparse's routed (its partition above)
                row.update(prefill_attention(m, m_v, K, n_full, H, Hkv, D, dev, dtype))
            if B == 1 and dev.type == "cuda":  # a dense prefill of the prompt (the first token's logits only;
                ids = torch.randint(0, 100, (1, m), device=dev)  # on a CPU, 7B-wide layers take seconds)
                row["prefill_ms"] = 1e3 * time_calls(lambda: model(input_ids=ids, logits_to_keep=1, use_cache=False),
                                                     dev, calls=1, repeats=3)
                # HT-Sparse's routed prefill, estimated: dense's, less every layer's attention saving
                row["routed_prefill_est_ms"] = row["prefill_ms"] - layers * (row["prefill_attention_ms"]
                                                                              - row["routed_attention_ms"])
            for s in ("dense", "draft", "verify", "htsparse", "sparsemm"):
                row[f"{s}_eager_ms"] = t[s][0] * 1e3
                row[f"{s}_ms"] = best[s] * 1e3
                row[f"{s}_limit_ms"] = limits[s] * 1e3
                row[f"{s}_vs_limit"] = best[s] / limits[s]
                row[f"{s}_gb_s"] = limits[s] * bw / best[s] / 1e9
            row["verify_vs_dense"] = best["verify"] / best["dense"]
            row["round_bound"] = (gamma + 1) * best["dense"] / (gamma * best["draft"] + best["verify"])
            row["ideal_round_bound"] = (gamma + 1) * limits["dense"] / (gamma * limits["draft"] + limits["verify"])
            row["bound_share"] = row["round_bound"] / row["ideal_round_bound"]
            if profiles:
                row["kernels"] = profiles
            rows.append(row)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    head = dict(device=str(dev) if dev.type != "cuda" else torch.cuda.get_device_name(dev), dtype=str(dtype)[6:],
                gamma=gamma, weights_gb=weights / 1e9, bandwidth_tb_s=bw / 1e12, rows=rows)
    if args.json:
        print(json.dumps(head))
        return 0
    print(f"{args.shape} ({layers} layers, {head['device']}, {head['dtype']}, weights {weights / 1e9:.1f} GB, "
          f"copy bandwidth {bw / 1e12:.2f} TB/s), gamma={gamma}; ms (x its limit)")
    print(markdown_table(
        ["batch", "prompt", "K", "dense step", "draft step", f"verify ({gamma + 1} rows)", "verify/dense",
         "StD round bound", "ideal", "share", "HT-Sparse step (KV %)", "SparseMM step (KV %)",
         "prefill attention: routed / dense (one layer)", "prefill ms: dense / routed (est.)",
         "eager dense / draft / verify"],
        [[str(r["batch"]), str(r["prompt"]), str(r["k"])]
         + [f"{r[s + '_ms']:.2f} ({r[s + '_vs_limit']:.2f}x)" for s in ("dense", "draft", "verify")]
         + [f"{r['verify_vs_dense']:.2f}", f"{r['round_bound']:.2f}x", f"{r['ideal_round_bound']:.2f}x",
            f"{r['bound_share']:.0%}"]
         + [f"{r[s + '_ms']:.2f} ({r[s + '_vs_limit']:.2f}x, {r[s + '_kv_pct']:.0f} %)" for s in ("htsparse", "sparsemm")]
         + [f"{r['routed_attention_ms']:.2f} / {r['prefill_attention_ms']:.2f} ms ({r['routed_attention_vs_dense']:.0%})"
            if "routed_attention_ms" in r else "-",
            f"{r['prefill_ms']:.0f} / {r['routed_prefill_est_ms']:.0f}" if "prefill_ms" in r else "-",
            " / ".join(f"{r[s + '_eager_ms']:.1f}" for s in ("dense", "draft", "verify"))] for r in rows]))
    for r in rows:  # where a captured step's time goes (CUDA, the first prompt length)
        for kind, p in r.get("kernels", {}).items():
            if "error" in p:
                print(f"batch {r['batch']}, {kind} step: no kernel profile ({p['error']})")
                continue
            fams = ", ".join(f"{f} {v['kernels']:.0f} kernels {v['us']:.0f} us" for f, v in p["families"].items())
            print(f"batch {r['batch']}, prompt {r['prompt']}, {kind} step: {fams}; busy {p['busy_us']:.0f} us "
                  f"of a {p['span_us']:.0f}-us span (idle {p['idle_us']:.0f} us)")
    return 0
