"""Command line: `python -m sparsevid {run,bench,calibrate,eval} ...`.

Errors print one line on stderr and exit non-zero, never a traceback. Progress bars go to stderr;
with --json, stdout holds exactly one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="embedded", help="'embedded' (default), a local folder or a hub id")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: bf16 on cuda, fp32 on cpu)")


def add_method_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--methods", default="dense", help="comma list: dense,std,streaming,layerskip,...")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--k", type=_num, default=None, help="StD visual budget: count, or fraction <= 1 of the visual tokens")
    p.add_argument("--gamma", type=int, default=9, help="draft tokens per round")
    p.add_argument("--no-refresh", action="store_true", help="keep the draft's own KV for accepted tokens")
    p.add_argument("--layerskip-layers", type=int, default=None)
    p.add_argument("--tau", type=float, default=None)
    p.add_argument("--eta", type=float, default=None)
    p.add_argument("--ht-layers", default=None, help="HT-Sparse routed layers: early, mid, late, mid+late or all")
    p.add_argument("--ht-variant", default=None, help="HT-Sparse variant: ht, head or token")
    p.add_argument("--heads-full", type=_num, default=None, help="HT-Sparse h_f: count, or fraction <= 1 of the query heads")
    p.add_argument("--heads-sparse", type=_num, default=None, help="HT-Sparse h_s: count, or fraction <= 1 of the query heads")
    p.add_argument("--l-v", type=_num, default=None, help="HT-Sparse fixed top-l_v token budget instead of coverage eta")
    p.add_argument("--drop-mode", default=None, help="HT-Sparse dropped heads: zero or text_only")
    p.add_argument("--ht-by-group", default=None, choices=("on", "off"), help="HT-Sparse: partition whole GQA groups")
    p.add_argument("--low-rank", type=int, default=None, help="HT-Sparse low-rank scoring rank r (0: off)")
    p.add_argument("--budget", type=_num, default=None,
                   help="SparseMM average KV budget per head: count, or fraction <= 1 of the prompt")
    p.add_argument("--window", type=int, default=None, help="SparseMM local window w")
    p.add_argument("--rho", type=float, default=None, help="SparseMM uniform floor share (paper 0.1; default 0.5)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)


def _num(s: str):
    return float(s) if "." in s else int(s)


def settings_from(args):
    from .methods import Settings

    s = Settings(k=args.k, gamma=args.gamma, refresh=not args.no_refresh, layerskip_layers=args.layerskip_layers)
    by_group = None if args.ht_by_group is None else args.ht_by_group == "on"
    for field, value in (("tau", args.tau), ("eta", args.eta), ("ht_layers", args.ht_layers), ("budget", args.budget),
                         ("window", args.window), ("rho", args.rho), ("ht_variant", args.ht_variant),
                         ("heads_full", args.heads_full), ("heads_sparse", args.heads_sparse), ("l_v", args.l_v),
                         ("drop_mode", args.drop_mode), ("ht_by_group", by_group), ("low_rank", args.low_rank)):
        if value is not None:
            setattr(s, field, value)
    return s


def result_dict(res) -> dict:
    d = dict(text=res.text, token_ids=res.token_ids, prefill_s=res.prefill_s, decode_s=res.decode_s,
             tokens_per_s=res.tokens_per_s, kv_bytes=res.kv_bytes)
    d.update({k: v for k, v in res.extra.items() if isinstance(v, (int, float, str, bool, list, type(None)))})
    return d


def cmd_run(args) -> int:
    from tqdm import tqdm

    from .engine import Sampling
    from .methods import compare, parse_methods
    from .models import load_model
    from .video import load_video

    names = parse_methods(args.methods)
    bar = tqdm(total=3 + len(names), desc="sparsevid", file=sys.stderr, disable=args.quiet)
    bar.set_postfix_str("decoding video")
    video = load_video(args.video, args.frames)
    bar.update()
    bar.set_postfix_str("loading model")
    loaded = load_model(args.model, args.device, args.dtype)
    bar.update()
    inputs = loaded.adapter.build_inputs(video.frames, args.question, video.timestamps).to(loaded.device)
    bar.update()

    def done(res):
        bar.set_postfix_str(res.method)
        bar.update()

    results = compare(loaded, inputs, names, settings_from(args), args.max_new_tokens,
                      Sampling(args.temperature, args.top_p, args.seed), on_result=done)
    bar.close()
    out = dict(model=loaded.name, revision=loaded.revision, device=str(loaded.device), dtype=str(loaded.dtype)[6:],
               video=dict(path=args.video, frames=len(video.frames), visual_tokens=inputs.m_v, prompt_tokens=inputs.m,
                          duration=video.duration, timestamps=video.timestamps),
               methods={n: result_dict(r) for n, r in results.items()})
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{loaded.name}: {len(video.frames)} frames, {inputs.m_v} visual tokens, {inputs.m} prompt tokens")
        for n, r in results.items():
            e = r.extra
            extra = "" if n == "dense" else (
                f"  speedup {e['speedup']:.2f}x  kv {e['kv_ratio']:.0%}"
                + (f"  acceptance {e['acceptance']:.0%}" if e.get("acceptance") is not None else "")
                + ("  identical to dense" if e["identical_to_dense"] else "  differs from dense"))
            print(f"[{n}] {r.text!r}\n    prefill {r.prefill_s * 1e3:.0f} ms  decode {r.decode_s * 1e3:.0f} ms  "
                  f"{r.tokens_per_s:.1f} tok/s  KV {r.kv_bytes / 2**20:.2f} MiB{extra}")
    return 0


def cmd_bench(args) -> int:
    from .bench import bench_main

    return bench_main(args)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sparsevid", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("run", help="one video and question through chosen methods, compared with dense")
    p.add_argument("video")
    p.add_argument("question")
    add_model_args(p)
    add_method_args(p)
    p.add_argument("--frames", type=int, default=16)
    p.add_argument("--json", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("bench", help="speed and memory of methods against dense, same process, interleaved")
    add_model_args(p)
    add_method_args(p)
    p.add_argument("--frames", default="16,64,256", help="comma list of frame counts")
    p.add_argument("--video", default=None, help="video file (default: a synthetic long clip)")
    p.add_argument("--question", default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--shape", default=None, help="mechanical benchmark at a real model's shape, e.g. qwen2-vl-7b")
    p.add_argument("--visual-tokens", default="4096,16384,32768", help="for --shape")
    p.add_argument("--layers", type=int, default=None, help="for --shape: decoder layers (default: 2 on CPU, all on GPU)")
    p.add_argument("--ignore-eos", action="store_true", help="decode exactly --max-new-tokens tokens")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench)

    for extra in ("sparsemm", "evaluation"):  # subcommands that live beside their method
        try:
            __import__(f"sparsevid.{extra}", fromlist=["add_cli"]).add_cli(sub)
        except (ImportError, AttributeError):
            pass

    args = parser.parse_args(argv)
    from .errors import SparsevidError

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
