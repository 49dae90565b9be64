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
- narrate:   "Describe the video." / "What happens in the video?" / "Narrate the video."  (issue 22,
             opt-in: not in QTYPES, so the default question sampling is unchanged)
             -> "There are two objects. A red circle moves to the right at the beginning of the
             video. Then a blue square moves to the top in the middle of the video."
             A count sentence, then one sentence per object in order of first appearance, counted in
             frame pairs (the model's temporal patch); objects first seen in the same pair of frames
             left to right (then top to bottom) by their centre in that first frame. The first object
             sentence starts "A" ("An orange ..."), every later one "Then a" ("Then an"); an object visible for the whole clip
             moves "throughout the video". 19-66 tokens (1-4 objects).
             Objects first seen in the same frame pair appear at the same time, so every order of
             them is an order of appearance: `Sample.answers` lists each such narration (the first
             is `answer`, the one training teaches), and evaluation accepts any of them.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

import numpy as np

from .clips import COLOURS, DIRECTIONS, PHASES, SHAPES, Clip, Style, make_clip

QTYPES = ["colour", "shape", "direction", "count", "when", "describe"]
NARRATE = "narrate"  # the narration question type (issue 22): asked only when named
ALL_QTYPES = QTYPES + [NARRATE]
NARRATE_TEMPLATES = ["Describe the video.", "What happens in the video?", "Narrate the video."]
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
    def answers(self) -> list[str]:
        """Every correct answer, `answer` first: for a narration, each order of appearance
        (`narrations`); for the other types the one answer."""
        return narrations(self.clip) if self.qtype == NARRATE else [self.answer]

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
    if qtype == NARRATE:
        return narration(clip)
    raise ValueError(qtype)


def narration_order(clip: Clip) -> list:
    """The clip's objects in order of first appearance: by the frame pair of their first frame,
    then left to right, then top to bottom (their centre in that frame)."""
    def key(o):
        b = o.boxes[o.start]
        return (o.start // 2, (b[0] + b[2]) / 2, (b[1] + b[3]) / 2, o.id)
    return sorted(clip.objects, key=key)


def seen_moving(obj, n_frames: int) -> bool:
    """Whether some frame pair of the model's temporal patch ((0, 1), (2, 3), ...) shows the object
    in both its frames, so that a visual token sees it move. An object visible in two frames that
    straddle pairs (frames 7 and 8) is not: the tower attends within a frame pair (Qwen2-VL), so its
    direction has to be put together from two tokens that each hold one frame of it."""
    vis = obj.boxes[:, 0] >= 0
    return any(vis[t] and vis[t + 1] for t in range(0, n_frames - 1, 2))


def narration_sentence(colour: str, shape: str, direction: str, phase: str | None, first: bool) -> str:
    """One object's sentence of a narration (phase None: visible for the whole clip)."""
    when = "throughout the video" if phase is None else PHASE_PHRASE[phase]
    art = "an" if colour[0] in "aeiou" else "a"
    return f"{art.capitalize() if first else 'Then ' + art} {colour} {shape} moves {DIR_PHRASE[direction]} {when}."


def count_sentence(n: int) -> str:
    return "There is one object." if n == 1 else f"There are {NUMBERS[n]} objects."


def narration_orders(clip: Clip) -> list[list]:
    """Every order of appearance of the clip's objects: `narration_order`'s first, then those that
    reorder objects first seen in the same frame pair (which appear at the same time)."""
    groups = [list(g) for _, g in itertools.groupby(narration_order(clip), key=lambda o: o.start // 2)]
    return [[o for g in perm for o in g] for perm in itertools.product(*(itertools.permutations(g) for g in groups))]


def narrations(clip: Clip) -> list[str]:
    """Every correct narration of the clip (one per order of appearance), the training answer first."""
    return [narration(clip, order) for order in narration_orders(clip)]


def narration(clip: Clip, order: list | None = None) -> str:
    """The narration answer: a count sentence, then one sentence per object in order of appearance
    (`order`, default `narration_order`'s)."""
    objs = narration_order(clip) if order is None else order
    return " ".join([count_sentence(len(objs))] + [
        narration_sentence(o.colour, o.shape, o.direction, None if o.full else o.phase, i == 0)
        for i, o in enumerate(objs)])


def sentences(text: str) -> list:
    """The normalised sentences of a text (split after '.', '!' or '?')."""
    return [n for n in (normalise(x) for x in re.split(r"(?<=[.!?])\s*", text)) if n]


_SENT = re.compile(r"^(?:then )?an? (\w+) (\w+) moves to the (\w+) "
                   r"(at the beginning|in the middle|at the end|throughout)(?: of)? the video$")
_DIR_WORD = {"right": "right", "left": "left", "top": "up", "bottom": "down"}


def parse_sentence(sentence: str):
    """(colour, shape, direction, phase or "throughout") of a narration sentence, None if it is not one."""
    m = _SENT.match(normalise(sentence))
    if not m or m.group(3) not in _DIR_WORD:
        return None
    phase = m.group(4).split()[-1]
    return m.group(1), m.group(2), _DIR_WORD[m.group(3)], phase


def score_narration(pred: str, ref) -> dict:
    """Scores of a narration against the reference (`ref`: one text, or the list of equally correct
    ones, `Sample.answers`, scored against the one it matches best): `whole` (the same text,
    normalised), `sentences` (share of the reference's sentences, the count sentence included,
    matched at their position; `at_place`: that match per reference sentence), `objects` (share of
    the reference's object sentences found anywhere in the prediction, by content: colour, shape,
    direction, time), `count_ok` (the count sentence), the numbers of sentences of each, and
    `whole_strict` (the same text as the first reference: the order training teaches); with a list,
    `ref_index`, the reference scored against."""
    if not isinstance(ref, str):
        scores = [score_narration(pred, r) for r in ref]
        i = max(range(len(scores)), key=lambda j: (scores[j]["whole"], scores[j]["sentences"], -j))
        return dict(scores[i], whole_strict=scores[0]["whole"], ref_index=i)
    p, r = sentences(pred), sentences(ref)
    pos = sum(a == b for a, b in zip(p, r))
    want = [parse_sentence(x) for x in r[1:]]
    got = [parse_sentence(x) for x in p]
    found = 0
    for w in want:
        if w in got:
            got.remove(w)
            found += 1
    return {"whole": normalise(pred) == normalise(ref), "whole_strict": normalise(pred) == normalise(ref),
            "sentences": pos / max(1, len(r)),
            "objects": found / max(1, len(want)), "count_ok": bool(p[:1] == r[:1]),
            "n_pred": len(p), "n_ref": len(r),
            "at_place": [i < len(p) and p[i] == x for i, x in enumerate(r)]}  # per reference sentence


def _words(text: str) -> list:
    """Words (split at spaces, punctuation and lower-to-upper case changes: a model that loops often
    drops the spaces, "yellowThe yellowThe") and punctuation marks, lower case."""
    return [w.lower() for w in re.findall(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])|[^\w\s]", text)]


def repeats_3gram_3x(text: str, consecutive: bool = True) -> bool:
    """Degenerate-answer detector. Default: the answer loops: some span of tokens (words and
    punctuation marks; any length: "triangle triangle triangle", "to the right to the right to the
    right", a sentence said three times) is said three times in a row, or a word is a piece said
    three times ("crosscrosscross"). No correct answer of the toy's questions does either.
    ``consecutive=False``: some 3-token span occurs three times anywhere (stricter: a correct
    narration of three or more objects repeats "of the video")."""
    w = _words(text)
    if not consecutive:
        grams = [tuple(w[i:i + 3]) for i in range(len(w) - 2)]
        return any(grams.count(g) >= 3 for g in set(grams))
    if re.search(r"(\w{2,})\1\1", text.lower()):
        return True
    n = len(w)
    for p in range(1, n // 3 + 1):
        run = 0  # consecutive positions j with w[j] == w[j + p]
        for j in range(n - p):
            run = run + 1 if w[j] == w[j + p] else 0
            if run >= 2 * p:  # the span w[j - 2p + 1 .. j] and its copy: three copies in all
                return True
    return False


def normalise(text: str) -> str:
    """Exact-answer comparison: lower case, punctuation and extra spaces removed."""
    return " ".join(re.sub(r"[^a-z0-9 ]", " ", text.lower()).split())


def is_answer(text: str, answers) -> bool:
    """Whether `text` is one of `answers` (a list of equally correct answers, e.g. `Sample.answers`),
    after `normalise`."""
    return normalise(text) in {normalise(str(a)) for a in answers}


def make_sample(seed: int, n_frames: int = 16, qtype: str | None = None, size: int = 96,
                n_objects: int | None = None, style: Style | None = None, glimpses: bool = False) -> Sample:
    """One clip with one question about it, deterministic in (seed, n_frames, qtype, size, style,
    glimpses). `qtype` None draws one of QTYPES (never "narrate"); `style` renders the clip another
    way; `glimpses` draws the original world (`clips.make_clip`)."""
    rng = np.random.default_rng([int(seed), int(n_frames), 104729])
    if qtype is None:
        qtype = QTYPES[int(rng.integers(0, len(QTYPES)))]
    clip = make_clip(seed, n_frames, size=size, n_objects=n_objects,
                     segment_first=qtype in ("when", "describe"), style=style, glimpses=glimpses)
    sample = ask(clip, qtype, rng)
    if sample is None:  # extremely rare: placement failed; fall back to a fresh seed
        return make_sample(seed + 1_000_003, n_frames, qtype, size, n_objects, style, glimpses)
    return sample


def make_samples(seed: int, n_frames: int, qtypes: list, size: int = 96, n_objects: int | None = None,
                 style: Style | None = None, glimpses: bool = False) -> list:
    """Several questions (one per entry of `qtypes`) about one clip, deterministic in the arguments."""
    rng = np.random.default_rng([int(seed), int(n_frames), 104729, len(qtypes)])
    clip = make_clip(seed, n_frames, size=size, n_objects=n_objects,
                     segment_first=any(q in ("when", "describe") for q in qtypes), style=style,
                     glimpses=glimpses)
    samples = [s for s in (ask(clip, q, rng) for q in qtypes) if s is not None]
    return samples or make_samples(seed + 1_000_003, n_frames, qtypes, size, n_objects, style, glimpses)


def ask(clip: Clip, qtype: str, rng: np.random.Generator) -> Sample | None:
    """A question of type `qtype` about `clip` (its template, object and wording drawn from `rng`);
    None where no object fits ("when" and "describe" ask about an object visible only in part)."""
    if qtype in ("when", "describe"):
        cands = [o for o in clip.objects if not o.full]
    else:
        cands = list(clip.objects)
    if not cands:
        return None
    if qtype == NARRATE:
        tmpl = NARRATE_TEMPLATES[int(rng.integers(0, len(NARRATE_TEMPLATES)))]
        return Sample(clip, qtype, tmpl, narration(clip), None)
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


def corpus(narration: bool = False) -> list[str]:
    """Every question and answer form, for training the tokenizer (`narration`: the narration
    questions and sentences too; off, the corpus, and with it the tokenizer, is the original)."""
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
    if narration:
        lines += NARRATE_TEMPLATES + [count_sentence(n) for n in range(1, 5)]
        for c in COLOURS:
            for s in SHAPES:
                for d in DIRECTIONS:
                    for p in PHASES + [None]:
                        lines += [narration_sentence(c, s, d, p, True), narration_sentence(c, s, d, p, False)]
    return lines
