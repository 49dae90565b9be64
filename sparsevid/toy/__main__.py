"""CLI: python -m sparsevid.toy train [--out DIR] [--seed S] | eval [...] | examples [...]."""
from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# `toy train --FLAG FOLDER`: fine-tune the model in FOLDER with `train.RECIPE` (issue 22's fine-tunes,
# each from the one before; the shipped weights are --crowded's output)
FINETUNES = {
    "finetune": ("FINETUNE", "issue 22's first fine-tune: fine-tune the model in FOLDER (the default recipe's "
                             "output) on the randomised data (no stage 1, 4100 answer steps)"),
    "refine": ("REFINE", "issue 22's second fine-tune of the model in FOLDER (the --finetune output): the vision "
                         "tower re-trained on random styles, then narration-heavy answer training"),
    "polish": ("POLISH", "fine-tune FOLDER (the --refine output) a third time: narration-heavy answer training on "
                         "multi-object clips, long clips on half of stage 3's steps, low learning rate (with "
                         "--seed 1; measured no better than its parent, not shipped)"),
    "paired": ("PAIRED", "fine-tune FOLDER (the --refine output) as --polish does, on today's clip world, where "
                         "every short-lived object fills a frame pair (with --seed 3)"),
    "long-when": ("LONG_WHEN", "fine-tune FOLDER (the --paired output) on long clips, many without a progress bar "
                               "(with --seed 4)"),
    "deeper": ("DEEPER", "grow FOLDER (the --long-when output) from 4 to 6 layers, the new ones starting as "
                         "identities, and fine-tune it as --long-when does (with --seed 5; measured, not shipped)"),
    "timed": ("TIMED", "fine-tune FOLDER (the --long-when output) as --long-when does, plus a time loss that asks "
                       "each row for the log of the frame pairs up to it (with --seed 6)"),
    "crowded": ("CROWDED", "the shipped weights' recipe: fine-tune FOLDER (the --timed output) as --timed does, "
                           "with more four-object clips and the count words and time phrases weighted (with "
                           "--seed 7)"),
}


def main(argv=None) -> int:
    from ..options import count, counts
    from . import DEFAULT_MODEL_DIR

    ap = argparse.ArgumentParser(prog="python -m sparsevid.toy")
    sub = ap.add_subparsers(dest="cmd", required=True)
    tr = sub.add_parser("train", help="train the toy model from scratch (about 80 min on 2 CPU cores)")
    tr.add_argument("--out", default=DEFAULT_MODEL_DIR)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--threads", type=int, default=2)
    tr.add_argument("--tiny", action="store_true", help="a few steps on tiny settings (smoke test)")
    tr.add_argument("--two-pass", action="store_true",
                    help="train the vision tower with a first language model, then a fresh one (experimental)")
    tr.add_argument("--scale", type=float, default=1.0, help="multiply the number of steps")
    tr.add_argument("--questions-per-clip", type=int, default=1, choices=range(1, 7), metavar="K",
                    help="answer training: K (1-6) questions of distinct types per clip, in one sequence")
    tr.add_argument("--randomise", action="store_true",
                    help="issue 22: random clip styles (never the held-out family), frame counts of every "
                         "size and narration questions (train.RANDOMISED; --style-prob/--narration-prob override)")
    for flag, (recipe, help_) in FINETUNES.items():
        tr.add_argument(f"--{flag}", default=None, metavar="FOLDER", help=f"{help_} (train.{recipe})")
    tr.add_argument("--attr-weight", type=float, default=None,
                    help="cross-entropy weight of the answer tokens naming a colour, shape, direction or time")
    tr.add_argument("--style-prob", type=float, default=None,
                    help="share of training clips in a random style (default 0; --randomise: 0.8)")
    tr.add_argument("--narration-prob", type=float, default=None,
                    help="share of answer questions asking for a narration (default 0; --randomise: 0.15)")
    ev = sub.add_parser("eval", help="held-out accuracy and attention figures")
    ev.add_argument("--model", default=DEFAULT_MODEL_DIR)
    ev.add_argument("--n", type=count, default=60, help="questions per clip length")
    ev.add_argument("--frames", type=counts, default="16,256", help="comma-separated clip lengths (frames)")
    ev.add_argument("--methods", default="dense")
    ev.add_argument("--json", action="store_true")
    ev.add_argument("--threads", type=count, default=2)
    ev.add_argument("--seed-base", type=int, default=None,
                    help="first clip seed (default 1.7e9; training uses < 1e9): pick another range, e.g. "
                         "1.6e9, to choose between recipes without tuning on the reported clips")
    ev.add_argument("--styles", default="default",
                    help="comma list of style sets, each reported on its own: default (the training renderer), "
                         "random (random styles), held-out (the held-out style family), no-bar, other-bar, "
                         "glimpses (the default renderer in the original clip world)")
    ev.add_argument("--types", default=None,
                    help="comma list of question types (default the six short ones; add 'narrate' for narrations)")
    ev.add_argument("--narration", action="store_true", help="ask for narrations too (adds 'narrate' to the types)")
    ev.add_argument("--max-new-tokens", type=count, default=24, help="answer tokens (narrations: at least 96)")
    ex = sub.add_parser("examples", help="write the bundled example clips and examples.json")
    ex.add_argument("--out", default=os.path.join(os.path.dirname(DEFAULT_MODEL_DIR), "examples"))
    ex.add_argument("--model", default=DEFAULT_MODEL_DIR)
    me = sub.add_parser("make-eval", help="held-out clips + manifest.jsonl for `python -m sparsevid eval`")
    me.add_argument("--n", type=count, default=40)
    me.add_argument("--out", required=True)
    me.add_argument("--frames", type=counts, default="16,32,64,128", help="comma list of clip lengths, cycled")
    me.add_argument("--seed", type=int, default=None, help="first clip seed (default 2.1e9: disjoint from training)")
    pr = sub.add_parser("probe", help="linear probes of motion direction in the vision tower's output (what a "
                                      "visual token can tell of its object's direction)")
    pr.add_argument("--model", default=DEFAULT_MODEL_DIR)
    pr.add_argument("--n", type=int, default=None,
                    help="clips (a fifth of them held out for scoring; default 1500, with --time 150)")
    pr.add_argument("--frames", default=None,
                    help="comma list of clip lengths, cycled (default 8,16; with --time 64,96,128,192,256)")
    pr.add_argument("--json", action="store_true")
    pr.add_argument("--time", action="store_true",
                    help="instead: how well each layer's rows tell a visual token's frame pair and, after the "
                         "video, the clip's length, in clips without a progress bar (ridge regressions)")
    a = ap.parse_args(argv)

    if a.cmd == "make-eval":
        from .evalset import make_toy_eval_set

        print(make_toy_eval_set(a.n, a.out, [int(f) for f in a.frames.split(",")], a.seed))
        return 0

    if a.cmd == "train":
        from dataclasses import replace

        from . import train as train_mod
        from .train import RANDOMISED, TINY, TWO_PASS, TrainConfig, train

        cfg = TrainConfig(seed=a.seed, threads=a.threads, questions_per_clip=a.questions_per_clip)
        if a.two_pass:
            cfg = replace(cfg, **TWO_PASS)
        if a.randomise:
            cfg = replace(cfg, **RANDOMISED)
        for flag, (recipe, _) in FINETUNES.items():
            folder = getattr(a, flag.replace("-", "_"))
            if folder:
                cfg = replace(cfg, **getattr(train_mod, recipe), init_from=folder)
        if a.style_prob is not None:
            cfg = replace(cfg, style_prob=a.style_prob)
        if a.narration_prob is not None:
            cfg = replace(cfg, narration_prob=a.narration_prob)
        if a.attr_weight is not None:
            cfg = replace(cfg, attr_weight=a.attr_weight)
        if a.tiny:
            cfg = replace(cfg, **TINY)
        elif a.scale != 1.0:
            def scale(n: int) -> int:
                return int(n * a.scale)

            cfg = replace(cfg, stage1_steps=scale(cfg.stage1_steps), tower_steps=tuple(map(scale, cfg.tower_steps)),
                          stage2_steps=scale(cfg.stage2_steps), stage3_steps=scale(cfg.stage3_steps),
                          stage4_steps=scale(cfg.stage4_steps))
        info = train(cfg, a.out)
        print(json.dumps(info))
        return 0
    if a.cmd == "eval":
        from .evaluate import EVAL_SEED_BASE, STYLE_SETS, evaluate, evaluate_styles, format_report
        from .questions import ALL_QTYPES, NARRATE, QTYPES

        styles = [x for x in a.styles.split(",") if x]
        qtypes = [x for x in a.types.split(",") if x] if a.types else list(QTYPES)
        if a.narration and NARRATE not in qtypes:
            qtypes.append(NARRATE)
        bad = [x for x in styles if x not in STYLE_SETS] + [x for x in qtypes if x not in ALL_QTYPES]
        if bad:
            ap.error(f"unknown style set or question type: {', '.join(bad)} (style sets: {', '.join(STYLE_SETS)}; "
                     f"types: {', '.join(ALL_QTYPES)})")
        kw = dict(n=a.n, frames=[int(f) for f in a.frames.split(",") if f],
                  methods=[m for m in a.methods.split(",") if m], threads=a.threads, progress=not a.json,
                  seed_base=EVAL_SEED_BASE if a.seed_base is None else a.seed_base, max_new_tokens=a.max_new_tokens,
                  qtypes=qtypes)
        if styles == ["default"]:
            res = evaluate(a.model, **kw)
        else:
            res = evaluate_styles(a.model, styles=styles, **kw)
        if a.json:
            print(json.dumps(res))
        else:
            print(format_report(res))
        return 0
    if a.cmd == "probe" and a.time:
        from .probe import time_probes

        res = time_probes(a.model, n=a.n or 150, frames=[int(f) for f in (a.frames or "64,96,128,192,256").split(",")],
                          progress=not a.json)
        if a.json:
            print(json.dumps(res))
        else:
            print("R^2 (mean abs. error, log units) of a ridge regression from each hidden state; no progress bar")
            for k, r in res.items():
                what = "visual token's frame pair" if k == "visual_pair" else "clip length, rows after the video"
                print(f"{what:34s} " + "  ".join(f"{name} {v['r2']:.2f} ({v['mae']:.2f})" for name, v in
                                                  zip(["emb", *(f"L{j}" for j in range(1, len(r)))], r)))
        return 0
    if a.cmd == "probe":
        from .probe import direction_probes

        n = a.n or 1500
        res = direction_probes(a.model, n_train=n - n // 5, n_test=n // 5,
                               frames=[int(f) for f in (a.frames or "8,16").split(",") if f], progress=not a.json)
        if a.json:
            print(json.dumps(res))
        else:
            for k, r in res.items():
                print(f"{k:18s} direction read by a linear probe: {r['accuracy']:.2f} (n={r['n_test']}, chance 0.25)")
        return 0
    if a.cmd == "examples":
        from .examples import write_examples

        write_examples(a.out, a.model)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
