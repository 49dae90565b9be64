"""Question templates with deterministic answers for toy clips.

Question forms the toy model understands ({ref} is "the {colour} object", "the {shape}" or
"the {colour} {shape}"):

- colour:    "What colour is the {shape}?" / "What color is the {shape}?"            -> "red"
- shape:     "What shape is the {colour} object?"                                      -> "circle"
- direction: "Which way does {ref} move?" / "In which direction does {ref} move?"      -> "left"
- count:     "How many objects are there?" / "How many shapes are in the video?"       -> "three"
- when:      "When does {ref} appear?" / "When is {ref} visible?"                      -> "beginning"
- describe:  "Describe {ref}." / "What does {ref} do?"
             -> "The red circle moves to the right at the beginning of the video."
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from .clips import COLOURS, DIRECTIONS, PHASES, SHAPES, Clip, make_clip

QTYPES = ["colour", "shape", "direction", "count", "when", "describe"]
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six"]
# One content word per direction: with "from left to right" the model retrieved the direction
# twice and its two halves disagreed ("from left to bottom").
DIR_PHRASE = {"right": "to the right", "left": "to the left", "down": "to the bottom", "up": "to the top"}
PHASE_PHRASE = {
    "beginning": "at the beginning of the video", "middle": "in the middle of the video",
    "end": "at the end of the video",
}
TEMPLATES = {
    "colour": ["What colour is {ref}?", "What color is {ref}?"],
    "shape": ["What shape is {ref}?"],
    "direction": ["Which way does {ref} move?", "In which direction does {ref} move?"],
    "count": ["How many objects are there?", "How many shapes are in the video?"],
    "when": ["When does {ref} appear?", "When is {ref} visible?"],
    "describe": ["Describe {ref}.", "What does {ref} do?"],
}


@dataclass
class Sample:
    clip: Clip
    qtype: str
    question: str
    answer: str
    obj_id: int | None  # the asked object (None for count: all objects)

    @property
    def target_ids(self) -> list[int]:
        return [o.id for o in self.clip.objects] if self.obj_id is None else [self.obj_id]

    def boxes(self, normalised: bool = False) -> list:
        """Per-frame box of the asked object (None where invisible); count: union of objects."""
        T, H, W = self.clip.frames.shape[:3]
        out = []
        for t in range(T):
            bs = [self.clip.obj(i).boxes[t] for i in self.target_ids]
            bs = [b for b in bs if b[0] >= 0]
            if not bs:
                out.append(None)
                continue
            b = [min(x[0] for x in bs), min(x[1] for x in bs), max(x[2] for x in bs), max(x[3] for x in bs)]
            out.append([b[0] / W, b[1] / H, b[2] / W, b[3] / H] if normalised else [int(v) for v in b])
        return out


def describe_sentence(colour: str, shape: str, direction: str, phase: str) -> str:
    return f"The {colour} {shape} moves {DIR_PHRASE[direction]} {PHASE_PHRASE[phase]}."


def answer_for(clip: Clip, qtype: str, obj_id: int | None) -> str:
    if qtype == "count":
        return NUMBERS[len(clip.objects)]
    o = clip.obj(obj_id)
    if qtype == "colour":
        return o.colour
    if qtype == "shape":
        return o.shape
    if qtype == "direction":
        return o.direction
    if qtype == "when":
        return o.phase
    if qtype == "describe":
        return describe_sentence(o.colour, o.shape, o.direction, o.phase)
    raise ValueError(qtype)


def normalise(text: str) -> str:
    """Exact-answer comparison: lower case, punctuation and extra spaces removed."""
    return " ".join(re.sub(r"[^a-z0-9 ]", " ", text.lower()).split())


def make_sample(seed: int, n_frames: int = 16, qtype: str | None = None, size: int = 96,
                n_objects: int | None = None) -> Sample:
    """One clip with one question about it, deterministic in (seed, n_frames, qtype, size)."""
    rng = np.random.default_rng([int(seed), int(n_frames), 104729])
    if qtype is None:
        qtype = QTYPES[int(rng.integers(0, len(QTYPES)))]
    clip = make_clip(seed, n_frames, size=size, n_objects=n_objects,
                     segment_first=qtype in ("when", "describe"))
    sample = ask(clip, qtype, rng)
    if sample is None:  # extremely rare: placement failed; fall back to a fresh seed
        return make_sample(seed + 1_000_003, n_frames, qtype, size, n_objects)
    return sample


def make_samples(seed: int, n_frames: int, qtypes: list, size: int = 96, n_objects: int | None = None) -> list:
    """Several questions (one per entry of `qtypes`) about one clip, deterministic in the arguments."""
    rng = np.random.default_rng([int(seed), int(n_frames), 104729, len(qtypes)])
    clip = make_clip(seed, n_frames, size=size, n_objects=n_objects,
                     segment_first=any(q in ("when", "describe") for q in qtypes))
    samples = [s for s in (ask(clip, q, rng) for q in qtypes) if s is not None]
    return samples or make_samples(seed + 1_000_003, n_frames, qtypes, size, n_objects)


def ask(clip: Clip, qtype: str, rng: np.random.Generator) -> Sample | None:
    """A question of type `qtype` about `clip` (its template, object and wording drawn from `rng`);
    None where no object fits ("when" and "describe" ask about an object visible only in part)."""
    if qtype in ("when", "describe"):
        cands = [o for o in clip.objects if not o.full]
    else:
        cands = list(clip.objects)
    if not cands:
        return None
    tmpl = TEMPLATES[qtype][int(rng.integers(0, len(TEMPLATES[qtype])))]
    if qtype == "count":
        return Sample(clip, qtype, tmpl, answer_for(clip, qtype, None), None)
    o = cands[int(rng.integers(0, len(cands)))]
    if qtype == "colour":
        ref = f"the {o.shape}"
    elif qtype == "shape":
        ref = f"the {o.colour} object"
    else:
        ref = [f"the {o.colour} object", f"the {o.shape}", f"the {o.colour} {o.shape}"][int(rng.integers(0, 3))]
    return Sample(clip, qtype, tmpl.format(ref=ref), answer_for(clip, qtype, o.id), o.id)


def corpus() -> list[str]:
    """Every question and answer form, for training the tokenizer."""
    lines = ["You are a helpful assistant."]
    refs = [f"the {c} object" for c in COLOURS] + [f"the {s}" for s in SHAPES]
    refs += [f"the {c} {s}" for c in COLOURS for s in SHAPES]
    for q, ts in TEMPLATES.items():
        for t in ts:
            for r in refs:
                lines.append(t.format(ref=r))
    for c in COLOURS:
        for s in SHAPES:
            for d in DIRECTIONS:
                for p in PHASES:
                    lines.append(describe_sentence(c, s, d, p))
    lines += COLOURS + SHAPES + DIRECTIONS + PHASES + NUMBERS
    lines += [w.capitalize() for w in COLOURS + SHAPES + DIRECTIONS + PHASES + NUMBERS]
    return lines
