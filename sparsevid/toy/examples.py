"""Bundled example clips (assets/examples/*.mp4 + examples.json) with their questions and boxes."""
from __future__ import annotations

import json
import os

import numpy as np

from ..video import write_video
from .clips import SHORT_MAX
from .questions import make_sample

EXAMPLE_SEED_BASE = 2_000_000_000
# (name, frames, question type, fps); narrations first: the app's first example shows several
# speculative rounds, each with accepted and rejected draft tokens
EXAMPLES = [
    ("toy_narrate", 64, "narrate", 8),
    ("toy_long_narrate", 256, "narrate", 16),
    ("toy_colour", 16, "colour", 8),
    ("toy_direction", 16, "direction", 8),
    ("toy_count", 16, "count", 8),
    ("toy_describe", 32, "describe", 8),
    ("toy_when", 32, "when", 8),
    ("toy_long_describe", 256, "describe", 16),
]


def read_video(path: str) -> np.ndarray:
    import av

    with av.open(path) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])


def example_sample(name: str, frames: int, qtype: str, offset: int = 0):
    idx = [e[0] for e in EXAMPLES].index(name)
    return make_sample(EXAMPLE_SEED_BASE + idx * 1000 + offset, frames, qtype)


def write_examples(out_dir: str, model_dir: str | None = None, max_tries: int = 20) -> list[dict]:
    """Write the clips. With a model, pick for each slot the first seed the model answers
    correctly from the decoded mp4 (the examples are demos; accuracy is measured by `eval`)."""
    os.makedirs(out_dir, exist_ok=True)
    answerer = _Answerer(model_dir) if model_dir and os.path.isdir(model_dir) else None
    entries = []
    for name, frames, qtype, fps in EXAMPLES:
        for off in range(max_tries):
            s = example_sample(name, frames, qtype, off)
            path = os.path.join(out_dir, f"{name}.mp4")
            write_video(path, s.clip.frames, fps)
            if answerer is None:
                pred = None
                break
            pred = answerer(read_video(path), s.question)
            if pred.strip().lower().rstrip(".") == s.answer.lower().rstrip("."):
                break
        o = s.clip.obj(s.obj_id) if s.obj_id is not None else None
        entries.append({
            "file": f"{name}.mp4", "question": s.question, "answer": s.answer, "qtype": s.qtype,
            "frames": frames, "fps": fps, "long": frames > SHORT_MAX,
            "seed": s.clip.seed, "object_id": s.obj_id,
            "object": o.to_dict() if o else None,
            "objects": [x.to_dict() for x in s.clip.objects],
            "boxes": s.boxes(normalised=True),
            "model_answer": pred,
        })
    with open(os.path.join(out_dir, "examples.json"), "w") as f:
        json.dump(entries, f, indent=1)
    return entries


class _Answerer:
    def __init__(self, model_dir: str):
        from .evaluate import load_toy

        self.tok, self.model, self.special = load_toy(model_dir, attn="sdpa")

    def __call__(self, frames: np.ndarray, question: str, max_new_tokens: int = 128) -> str:
        return answer(self.model, self.tok, self.special, frames, question, max_new_tokens)


def answer(model, tok, special, frames: np.ndarray, question: str, max_new_tokens: int = 128) -> str:
    import torch

    from .model import preprocess_frames, prompt_ids

    pv, thw = preprocess_frames(frames)
    nv = int(thw[0].prod()) // 4
    ids = torch.tensor([prompt_ids(tok, question, nv, special)])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             mm_token_type_ids=(ids == special["<|video_pad|>"]).long() * 2,
                             pixel_values_videos=pv, video_grid_thw=thw, max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=special["<|im_end|>"],
                             pad_token_id=special["<|endoftext|>"])
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
