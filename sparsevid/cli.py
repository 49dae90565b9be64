"""Command line: `python -m sparsevid {run,bench,calibrate,eval} ...`.

Every method setting is a flag generated from its declaration (`sparsevid.options`), parsed by the
same parser the app uses. Errors print one line on stderr (after any progress bar is closed) and
exit non-zero, never a traceback. Progress bars go to stderr; with --json, stdout holds exactly one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from . import bench, evaluation  # noqa: E402
from .errors import SparsevidError  # noqa: E402
from .methods import METHODS, all_options  # noqa: E402
from .options import add_arguments, count, values_from_args  # noqa: E402


def add_model_args(p: argparse.ArgumentParser, compile_default: str | None = "auto") -> None:
    """--model, --device, --dtype, and --compile unless `compile_default` is None (a command that
    runs no decode steps worth compiling)."""
    p.add_argument("--model", default="embedded", help="'embedded' (default), a local folder or a hub id")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: bf16 on cuda, fp32 on cpu)")
    if compile_default is not None:
        p.add_argument("--compile", choices=("auto", "on", "off"), default=compile_default,
                       help="compiled decode steps (torch.compile, one graph per step kind; compiled during the "
                       "warm-up, ~1 min the first time, cached on disk): on, off, or auto (kept only if a dense "
                       f"step measures faster than eager); default {compile_default}")


def add_method_args(p: argparse.ArgumentParser, methods_default: str = "dense") -> None:
    p.add_argument("--methods", default=methods_default, help=f"comma list of: {', '.join(METHODS)}")
    p.add_argument("--max-new-tokens", type=count, default=96, help="answer tokens at most (a narration of the "
                   "embedded model: up to ~70)")
    add_arguments(p.add_argument_group("method settings (blank/absent: each method's default)"), all_options())
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)


def settings_from(args) -> dict:
    """{key: text} of the method-setting flags given on the command line."""
    return values_from_args(args, all_options())


def cmd_run(args) -> int:
    from tqdm import tqdm

    from .adapters import check_question
    from .engine import Sampling
    from .methods import check_settings, parse_methods
    from .models import load_model
    from .fast import enable as enable_steps, state as fast_state
    from .runs import batch_json, compare, compare_rows, comparison_json
    from .video import load_video

    names = parse_methods(args.methods)
    settings = check_settings(settings_from(args))
    for q in args.question:  # before the video and the model: a bad question is refused at once
        check_question(q)
    if args.quiet or args.json:  # no progress bar at all, transformers' weight loading included
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    bar = tqdm(total=3 + len(names), desc="sparsevid", file=sys.stderr, disable=args.quiet)
    try:
        bar.set_postfix_str("decoding video")
        video = load_video(args.video, args.frames)
        bar.update()
        bar.set_postfix_str("loading model")
        loaded = load_model(args.model, args.device, args.dtype)
        bar.update()
        batch = loaded.adapter.build_questions(video.frames, args.question, video.timestamps, loaded.device)
        inputs = batch[0]
        bar.update()
        if enable_steps(loaded, args.compile) is not None:  # compiled in `compare`'s warm-up
            bar.set_postfix_str("warm-up: compiling decode steps")

        def done(trace):
            bar.set_postfix_str(trace.method)
            bar.update()

        sampling = Sampling(args.temperature, args.top_p, args.seed)
        if len(batch) == 1:
            results = [compare(loaded, inputs, names, settings, args.max_new_tokens, sampling, on_result=done,
                               repeats=args.repeats)]
        else:  # several questions: every method decodes them together, one pass
            results = compare_rows(loaded, batch, names, settings, args.max_new_tokens, sampling)
            bar.update(len(names))
    finally:
        bar.close()
    if len(results) > 1:
        if args.json:
            print(json.dumps(batch_json(loaded, video, args.question, batch, results, fast_state(loaded))))
            return 0
        print(f"{loaded.name}: {len(video.frames)} frames, {inputs.m_v} visual tokens, {len(batch)} questions "
              "decoded together")
        for q, (tr, f) in zip(args.question, results):
            print(f"Q: {q}")
            for n, t in tr.items():
                sp = f.get(n, {}).get("speedup")
                extra = "" if n == "dense" else (f"  decode speedup {sp:.2f}x" if sp else "  decode speedup -") + (
                    "  identical to dense" if f[n]["identical_to_dense"] else "  differs from dense")
                print(f"  [{n}] {t.text!r}{extra}")
        dense = [tr["dense"] for tr, _ in results]
        tokens = sum(len(t.token_ids) - 1 for t in dense)
        print(f"dense batch: {tokens} tokens in {dense[0].batch_decode_s * 1e3:.0f} ms "
              f"({tokens / max(dense[0].batch_decode_s, 1e-9):.1f} tok/s)")
        return 0
    traces, figs = results[0]
    if args.json:
        print(json.dumps(comparison_json(loaded, video, inputs, traces, figs, fast_state(loaded))))
        return 0
    print(f"{loaded.name}: {len(video.frames)} frames, {inputs.m_v} visual tokens, {inputs.m} prompt tokens")
    for n, t in traces.items():
        f = figs.get(n)
        extra = ""
        if f is not None:
            sp = "too few decode steps" if f["speedup"] is None else f"{f['speedup']:.2f}x"
            if f.get("speedup_range"):
                sp += " ({:.2f}-{:.2f}x over the passes)".format(*f["speedup_range"])
            extra = (f"  decode speedup {sp}  kv {f['kv_ratio']:.0%}"
                     + (f"  acceptance {f['acceptance']:.0%}" if f.get("acceptance") is not None else "")
                     + ("  identical to dense" if f["identical_to_dense"] else "  differs from dense"))
        tps = t.decode_tokens / t.decode_s if t.decode_s else 0.0
        print(f"[{n}] {t.text!r}\n    prefill {t.prefill_s * 1e3:.0f} ms  decode {t.decode_s * 1e3:.0f} ms  "
              f"{tps:.1f} tok/s  KV {t.kv_bytes / 2**20:.2f} MiB{extra}")
    return 0


def cmd_calibrate(args) -> int:
    import warnings

    from . import calibration
    from .models import load_model

    loaded = load_model(args.model, args.device, args.dtype)
    from .toy.calibration import ToyClips, default_source

    source = {"toy": ToyClips(), "text": calibration.TextImages()}.get(args.source) or default_source(loaded)
    if args.ship and not args.out:
        args.out = os.path.join(calibration.SHIPPED_DIR, calibration.model_key(loaded) + ".json")
    with warnings.catch_warnings():  # the summary below says it, without a source line
        warnings.simplefilter("ignore", RuntimeWarning)
        hs = calibration.calibrate(loaded, samples=args.samples, progress=not (args.quiet or args.json), out=args.out,
                                   source=source, max_new_tokens=args.max_new_tokens, force=args.force)
    d = dict(hs.to_json(), file=hs.meta.get("file") or args.out)
    if args.json:
        print(json.dumps(d))
        return 0
    print(f"{loaded.name}: {d.get('source')}, {d.get('samples')} samples, {d.get('named_tokens')} of "
          f"{d.get('generated_tokens')} generated tokens named an item -> {d['file']}")
    if hs.meta.get("uniform"):
        print("warning: no head looked at an item the model named: the scores are uniform; try more --samples")
    print(f"top 5 % of heads hold {d['top5_mass']:.0%} of the score mass (KV heads: {d['top5_mass_kv']:.0%})")
    print(calibration.format_map(hs))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sparsevid", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("run", help="one video and question through chosen methods, compared with dense")
    p.add_argument("video")
    p.add_argument("question", nargs="+", help="one question, or several: decoded together (batched decoding)")
    add_model_args(p, compile_default="off")
    add_method_args(p)
    p.add_argument("--frames", type=count, default=16)
    p.add_argument("--repeats", type=count, default=3, help="passes of dense and every method; times are medians "
                   "over them, the decode speedup the median of the passes' paired ratios (as the app's "
                   "SPARSEVID_TIMING_REPEATS)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("bench", help="speed and memory of methods against dense, same process, interleaved")
    add_model_args(p)
    add_method_args(p, methods_default="std")
    bench.add_arguments(p)
    p.set_defaults(func=bench.bench_main)

    p = sub.add_parser("calibrate", help="SparseMM visual-head calibration (once per model; cached)")
    add_model_args(p, compile_default=None)
    p.add_argument("--samples", type=count, default=32)
    p.add_argument("--max-new-tokens", type=count, default=48)
    p.add_argument("--source", choices=("auto", "text", "toy"), default="auto",
                   help="rendered text images, the embedded model's clips, or auto (toy for the embedded model)")
    p.add_argument("--out", default=None, help="output file (default: the cache file keyed by model and revision)")
    p.add_argument("--ship", action="store_true",
                   help="write to assets/visual_heads/ (shipped with the project) instead of the user cache")
    p.add_argument("--force", action="store_true", help="recalibrate even if the file exists")
    p.add_argument("--json", action="store_true")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("eval", help="dense and methods over a manifest of clips (accelerate launch: several processes)",
                       description=evaluation.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="manifest.jsonl, or a folder holding one")
    add_model_args(p, compile_default="off")
    add_method_args(p)
    evaluation.add_arguments(p)
    p.set_defaults(func=evaluation.eval_main)
    return parser


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2), already printed by argparse: its exit code
        return e.code if isinstance(e.code, int) else 2
    args.settings = settings_from(args)
    try:
        return args.func(args)
    except SparsevidError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # never a traceback for the user; SPARSEVID_DEBUG=1 shows it
        if os.environ.get("SPARSEVID_DEBUG"):
            raise
        print(f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", file=sys.stderr)
        return 1
