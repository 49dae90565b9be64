"""Held-out toy clips as an evaluation set for `python -m sparsevid eval` (mp4 clips + manifest.jsonl)."""

from __future__ import annotations

import json
import os

MANIFEST = "manifest.jsonl"  # the name `sparsevid.evaluation` reads
# First seed of `make_toy_eval_set`. Other toy seed ranges: training < 1e9, its validation 1.5e9..,
# `python -m sparsevid.toy eval` 1.7e9.., the app's examples 2.0e9..
TOY_EVAL_SEED = 2_100_000_000


def make_toy_eval_set(n: int, out: str, frames=(16,), seed: int | None = None) -> str:
    """Write n toy clips (mp4) with questions, reference answers and boxes, and out/manifest.jsonl.

    Item i: seed `seed + i`, question type cycling over all types (narrations first: one item in
    seven), length cycling over `frames`.
    The default seeds (2.1e9..) are disjoint from the other toy seed ranges (training, validation, toy eval, examples).
    """
    from ..video import write_video
    from .questions import NARRATE, QTYPES, make_sample

    seed = TOY_EVAL_SEED if seed is None else seed

    os.makedirs(os.path.join(out, "clips"), exist_ok=True)
    lines = []
    qtypes = [NARRATE] + QTYPES
    for i in range(n):
        F = frames[i % len(frames)]
        s = make_sample(seed + i, F, qtypes[i % len(qtypes)])
        video = f"clips/toy-{i:04d}.mp4"
        write_video(os.path.join(out, video), s.clip.frames)
        lines.append(dict(id=f"toy-{i:04d}", video=video, question=s.question, answer=s.answer,
                          boxes=s.boxes(normalised=True), frames=F, qtype=s.qtype, seed=seed + i,
                          **({"answers": s.answers[1:]} if len(s.answers) > 1 else {})))
    path = os.path.join(out, MANIFEST)
    with open(path, "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    return path
