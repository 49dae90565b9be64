"""HT-Sparse ablation on the embedded toy model's held-out clips (the paper's figures, as % of dense).

    python -m sparsevid.htsparse_ablation --n 20 --frames 16,256 \
        --configs "variant=ht,head,token;layers=early,mid,late,mid+late"
    python -m sparsevid.htsparse_ablation --method sparsemm --configs "budget=0.3,0.4,0.5"

`--method` sweeps another method's settings the same way (default htsparse; any lossy method of
`methods.METHODS`, e.g. sparsemm's budget, window, rho).

Each `--configs` axis is `key=v1,v2,...`: an HT-Sparse setting (`methods.all_options`), without
its `ht_` prefix where it has one (variant, layers, eta, l_v, tau, heads_full, heads_sparse,
drop_mode, summary, by_group, prune_after); axes are joined by `;` into a cartesian product, products by `|`. Every
combination runs as the method beside dense on each clip (same process, same inputs).
A row: accuracy (exact answer, as `python -m sparsevid.toy eval`), the share of clips answered
token for token as dense did, and medians over clips of decode KV %, prefill KV %, end-to-end
latency % (all clips, and long clips only), prefill wall time % (long clips), prefill / decode
FLOPs % and peak memory % against dense (`metrics.efficiency_pct`). Latency and prefill wall
time are against the mean of a dense run before and one after the configs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

FIGS = ("decode_kv_pct", "kv_ratio", "latency_pct", "prefill_flops_pct", "decode_flops_pct", "peak_memory_pct",
        "prefill_kv_pct", "prefill_wall_pct")
ALIASES = {"variant": "ht_variant", "layers": "ht_layers", "summary": "ht_summary", "by_group": "ht_by_group",
           "prune_after": "ht_prune_after"}


def parse_configs(spec: str) -> list[dict]:
    """'variant=ht,head;eta=0.7,0.8' -> the cartesian product as a list of Settings overrides;
    several products joined by '|' run one after the other."""
    if "|" in spec:
        return [c for part in spec.split("|") for c in parse_configs(part)]
    axes = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        key, values = part.split("=", 1)
        key = ALIASES.get(key.strip(), key.strip())
        axes.append([(key, "" if v.strip().lower() == "none" else v.strip()) for v in values.split(",")])
    return [dict(combo) for combo in itertools.product(*axes)] if axes else [{}]


def ablation(model: str | None, n: int, frames: list[int], configs: list[dict], max_new_tokens: int = 24,
             progress: bool = True, seed_base: int | None = None, method: str = "htsparse") -> list[dict]:
    from tqdm import tqdm

    from .methods import check_settings, parse_methods
    from .models import load_model
    from .runs import figures, run_method
    from .toy.clips import SHORT_MAX
    from .toy.evaluate import EVAL_SEED_BASE, eval_samples
    from .toy.questions import is_answer

    parse_methods([method])  # a clear error for an unknown name or setting before the model loads
    settings = [check_settings(c) for c in configs]
    loaded = load_model(model, device="cpu", dtype="float32")
    base: dict = {}
    rows = [dict(config=c, ok=[], same=[], figs={k: [] for k in FIGS}) for c in configs]
    dense_ok, lengths = [], []
    jobs = [(f, s) for f in frames for s in eval_samples(n, f, EVAL_SEED_BASE if seed_base is None else seed_base)]
    for f, s in tqdm(jobs, desc=f"{method} ablation", disable=not progress, file=sys.stderr):
        inputs = loaded.adapter.build_inputs(s.clip.frames, s.question)
        dense = run_method(loaded, inputs, "dense", base, max_new_tokens)
        answers = s.answers  # the one scorer of `toy eval` (a narration: any order of appearance)
        dense_ok.append(is_answer(dense.text, answers))
        lengths.append("short" if f <= SHORT_MAX else "long")
        results = [run_method(loaded, inputs, method, st, max_new_tokens) for st in settings]
        # dense again after the configs: the first run on a clip tends to be the fastest, so the
        # latency reference is the mean of a dense run before and one after
        again = run_method(loaded, inputs, "dense", base, max_new_tokens)
        dense_s, dense_prefill_s = (dense.total_s + again.total_s) / 2, (dense.prefill_s + again.prefill_s) / 2
        for row, res in zip(rows, results):
            figs = figures(res, dense, loaded, inputs)
            figs["latency_pct"] = 100 * res.total_s / dense_s
            figs["prefill_wall_pct"] = 100 * res.prefill_s / dense_prefill_s
            row["ok"].append(is_answer(res.text, answers))
            row["same"].append(res.token_ids == dense.token_ids)
            for k in FIGS:
                v = figs.get(k)
                row["figs"][k].append(100 * v if k == "kv_ratio" else v)

    def acc(ok, length=None):
        sel = [o for o, ln in zip(ok, lengths) if length in (None, ln)]
        return round(100 * sum(sel) / len(sel), 1) if sel else None

    out = [dict(config="dense", accuracy=acc(dense_ok), short=acc(dense_ok, "short"), long=acc(dense_ok, "long"))]
    for row in rows:
        r = dict(config=row["config"], accuracy=acc(row["ok"]), short=acc(row["ok"], "short"),
                 long=acc(row["ok"], "long"), same_as_dense=acc(row["same"]))
        r.update({k: round(statistics.median(v), 1) for k, v in row["figs"].items() if v})
        for length in ("short", "long"):  # fixed per-layer costs weigh more on short clips
            for k in ("latency_pct", "prefill_wall_pct"):
                v = [x for x, ln in zip(row["figs"][k], lengths) if ln == length]
                r[f"{k}_{length}"] = round(statistics.median(v), 1) if v else None
        out.append(r)
    return out


def format_table(rows: list[dict]) -> str:
    from .tables import cell, markdown_table

    head = ["config", "acc %", "short", "long", "same as dense %", "decode KV %", "prefill KV %", "latency %",
            "latency % long clips", "prefill wall % long clips", "prefill FLOPs %", "decode FLOPs %", "peak mem %"]
    keys = ("accuracy", "short", "long", "same_as_dense", "decode_kv_pct", "prefill_kv_pct", "latency_pct",
            "latency_pct_long", "prefill_wall_pct_long", "prefill_flops_pct", "decode_flops_pct", "peak_memory_pct")
    body = []
    for r in rows:
        cfg = r["config"] if isinstance(r["config"], str) else " ".join(f"{k}={v}" for k, v in r["config"].items())
        body.append([cfg or "defaults"] + ["" if r.get(k) is None else cell(r[k], "g") for k in keys])
    return markdown_table(head, body)


def main(argv=None) -> int:
    from .options import count, counts

    ap = argparse.ArgumentParser(prog="python -m sparsevid.htsparse_ablation", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the embedded toy model)")
    ap.add_argument("--method", default="htsparse", help="the method whose settings --configs sweeps")
    ap.add_argument("--n", type=count, default=20, help="questions per clip length")
    ap.add_argument("--frames", type=counts, default="16,256")
    ap.add_argument("--configs", default="variant=ht,head,token;layers=early,mid,late,mid+late")
    ap.add_argument("--max-new-tokens", type=count, default=24)
    ap.add_argument("--threads", type=count, default=1)
    ap.add_argument("--seed-base", type=int, default=None,
                    help="first clip seed (default: toy eval's held-out 1.7e9); choose settings on another "
                    "range, e.g. 1.6e9, then report them on the default one")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    from .errors import SparsevidError

    try:
        rows = ablation(a.model, a.n, [int(f) for f in a.frames.split(",") if f], parse_configs(a.configs),
                        a.max_new_tokens, progress=not a.json, seed_base=a.seed_base, method=a.method)
    except SparsevidError as e:  # an unknown method or setting, a bad value: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(rows) if a.json else format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
