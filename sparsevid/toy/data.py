"""Turn toy samples into model inputs plus the training-only targets (per-token labels, grounding)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from functools import lru_cache

import numpy as np
import torch

from .clips import COLOURS, DIRECTIONS, PHASES, SHAPES, Clip, phase_of
from .model import MERGE, PATCH, preprocess_frames, prompt_ids
from .questions import NARRATE, Sample, narration_order

MIN_COVER = 20  # pixels of an object (over the 2 frames of a token) for the token to carry its label


@dataclass
class Question:
    """One question of an encoded sequence: its rows are [start, end), its prompt ends at prompt_len
    (the answer, when there is one, fills [prompt_len, end))."""
    start: int
    prompt_len: int
    end: int
    target: np.ndarray  # [n_visual] bool: token's cell touches the asked object's box
    readout: np.ndarray  # [4]: colour+1, shape+1, direction+1, phase of the asked object (-100: none)
    names: list  # rows of the question's words that name the asked object (its colour, its shape)
    # a narration's sentences: (first answer row, end row, target cells) each, so that the rows
    # writing a sentence are grounded on that sentence's object (the count sentence: on all of them);
    # the last one ends with <|im_end|>, at `end`
    parts: list = field(default_factory=list)


@dataclass
class Encoded:
    """A clip's prompt prefix (system, video) followed by one question, or by several (`encode_many`):
    each sees the prefix and itself only, at the positions it would have alone."""
    input_ids: list
    labels: list
    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    vis_start: int
    n_visual: int
    aux: np.ndarray  # [n_visual, 4]: colour, shape, direction (0 = none), phase
    questions: list  # [Question]

    @property
    def prompt_len(self) -> int:  # of the first question
        return self.questions[0].prompt_len


def _pad_time(a: np.ndarray, tp: int = 2) -> np.ndarray:
    if a.shape[0] % tp:
        a = np.concatenate([a, np.repeat(a[-1:], tp - a.shape[0] % tp, 0)], 0)
    return a


def object_cover(clip: Clip, gt: int, mh: int, mw: int) -> dict:
    """Per object id: its pixels in each merged token's cell in each of the token's two frames,
    [gt, 2, mh * mw] (frames the preprocessing resizes: in its pixels)."""
    cell = PATCH * MERGE
    idm = _pad_time(clip.idmap)
    H, W = idm.shape[1:]
    if (H, W) != (mh * cell, mw * cell):  # frames the preprocessing resizes (other sizes, aspect ratios)
        ri = np.minimum(((np.arange(mh * cell) + 0.5) * H / (mh * cell)).astype(int), H - 1)
        ci = np.minimum(((np.arange(mw * cell) + 0.5) * W / (mw * cell)).astype(int), W - 1)
        idm = idm[:, ri][:, :, ci]
    idm = idm[:, : mh * cell, : mw * cell]
    return {o.id: (idm == o.id).reshape(gt, 2, mh, cell, mw, cell).sum(axis=(3, 5)).reshape(gt, 2, mh * mw)
            for o in clip.objects}


def token_labels(clip: Clip, gt: int, mh: int, mw: int) -> np.ndarray:
    """Per merged visual token: colour+1, shape+1, direction+1 of the object under it (0 none), phase."""
    T = clip.n_frames
    n = gt * mh * mw
    out = np.zeros((n, 4), dtype=np.int64)
    best = np.zeros(n, dtype=np.int64)
    cover = object_cover(clip, gt, mh, mw)
    for o in clip.objects:
        c = cover[o.id].sum(1).reshape(-1)
        sel = (c >= MIN_COVER) & (c > best)
        best = np.where(sel, c, best)
        out[sel, 0] = COLOURS.index(o.colour) + 1
        out[sel, 1] = SHAPES.index(o.shape) + 1
        out[sel, 2] = DIRECTIONS.index(o.direction) + 1
    ph = np.array([phase_of(min(2 * t + 1, T - 0.5), T) for t in range(gt)])
    out[:, 3] = np.repeat(ph, mh * mw)
    return out


def target_cells(sample: Sample, gt: int, mh: int, mw: int) -> np.ndarray:
    """Bool per merged token: its cell intersects the asked object's box in one of its frames."""
    cell = PATCH * MERGE
    m = np.zeros((gt, mh, mw), dtype=bool)
    T, H, W = sample.clip.frames.shape[:3]
    sy, sx = mh * cell / H, mw * cell / W  # frames the preprocessing resizes: boxes in its pixels
    for oid in sample.target_ids:
        boxes = sample.clip.obj(oid).boxes
        for f in range(T):
            x0, y0, x1, y1 = boxes[f]
            if x0 < 0:
                continue
            if (sy, sx) != (1.0, 1.0):
                x0, x1 = int(x0 * sx), max(int(x0 * sx) + 1, int(np.ceil(x1 * sx)))
                y0, y1 = int(y0 * sy), max(int(y0 * sy) + 1, int(np.ceil(y1 * sy)))
                x1, y1 = min(x1, mw * cell), min(y1, mh * cell)
            m[f // 2, y0 // cell:(y1 - 1) // cell + 1, x0 // cell:(x1 - 1) // cell + 1] = True
    return m.reshape(-1)


def readout_labels(sample: Sample) -> np.ndarray:
    """What the answer position should know about the asked object, whatever the question:
    colour+1, shape+1, direction+1 and phase (-100 where undefined: count questions, the phase of
    an object visible throughout)."""
    out = np.full(4, -100, dtype=np.int64)
    if sample.obj_id is None:
        return out
    o = sample.clip.obj(sample.obj_id)
    out[:3] = (COLOURS.index(o.colour) + 1, SHAPES.index(o.shape) + 1, DIRECTIONS.index(o.direction) + 1)
    if not o.full:
        out[3] = PHASES.index(o.phase)
    return out


@lru_cache(maxsize=4)  # once per tokenizer, not once per encoded clip
def name_ids(tok) -> frozenset:
    """Token ids of the colour and shape words as they appear in questions (" red", " circle")."""
    return frozenset(tok.encode(" " + w, add_special_tokens=False)[0] for w in COLOURS + SHAPES)


def answer_ids(sample: Sample, tok, gt: int, mh: int, mw: int) -> tuple:
    """The answer's token ids, and for a narration each sentence's token span [a, b) in them with
    the target cells of the object it tells of (the count sentence: every object)."""
    ids = tok.encode(sample.answer, add_special_tokens=False)
    if sample.qtype != NARRATE:
        return ids, []
    sents = re.split(r"(?<=\.) ", sample.answer)
    objs = [None] + [o.id for o in narration_order(sample.clip)]
    pieces = [tok.encode(x if i == 0 else " " + x, add_special_tokens=False) for i, x in enumerate(sents)]
    if len(sents) != len(objs) or sum(pieces, []) != ids:  # not a sentence per object: ground it whole
        return ids, []
    spans, a = [], 0
    for piece, oid in zip(pieces, objs):
        spans.append((a, a + len(piece), target_cells(replace(sample, obj_id=oid), gt, mh, mw)))
        a += len(piece)
    return ids, spans


def encode(sample: Sample, tok, special: dict, with_answer: bool = True) -> Encoded:
    """One question about its clip: the plain chat prompt (and the answer, for training)."""
    return encode_many([sample], tok, special, with_answer)


def encode_many(samples: list, tok, special: dict, with_answer: bool = True) -> Encoded:
    """Questions about one clip (`samples` share it) as one sequence: the prefix once, then each
    question with its answer. One question gives the plain chat prompt."""
    pv, thw = preprocess_frames(samples[0].clip.frames)
    gt, gh, gw = (int(v) for v in thw[0])
    mh, mw = gh // MERGE, gw // MERGE
    nv = gt * mh * mw
    ids, labels, questions = [], [], []
    names = name_ids(tok)
    for s in samples:
        full = prompt_ids(tok, s.question, nv, special)
        vs = full.index(special["<|video_pad|>"])
        if not ids:
            ids, labels = full[:vs + nv + 1], [-100] * (vs + nv + 1)
        start = len(ids)
        ids += full[vs + nv + 1:]
        labels += [-100] * (len(ids) - start)
        plen = len(ids)
        named = [i for i in range(start, plen) if ids[i] in names]
        parts = []
        if with_answer:
            ans, spans = answer_ids(s, tok, gt, mh, mw)
            ans = ans + [special["<|im_end|>"]]
            ids += ans
            labels += ans
            parts = [(plen + a, plen + b if k < len(spans) - 1 else len(ids), tgt)
                     for k, (a, b, tgt) in enumerate(spans)]
        questions.append(Question(start, plen, len(ids), target_cells(s, gt, mh, mw), readout_labels(s),
                                  named, parts))
    return Encoded(ids, labels, pv, thw, vs, nv, token_labels(samples[0].clip, gt, mh, mw), questions)


def collate(encs: list[Encoded], pad_id: int, video_id: int) -> dict:
    L = max(len(e.input_ids) for e in encs)
    B = len(encs)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    lab = torch.full((B, L), -100, dtype=torch.long)
    att = torch.zeros((B, L), dtype=torch.long)
    for b, e in enumerate(encs):
        n = len(e.input_ids)
        ids[b, :n] = torch.tensor(e.input_ids)
        lab[b, :n] = torch.tensor(e.labels)
        att[b, :n] = 1
    mm = (ids == video_id).long() * 2
    out = {
        "input_ids": ids, "labels": lab, "attention_mask": att, "mm_token_type_ids": mm,
        "pixel_values_videos": torch.cat([e.pixel_values for e in encs], 0),
        "video_grid_thw": torch.cat([e.grid_thw for e in encs], 0),
    }
    if any(len(e.questions) > 1 for e in encs):
        # block[b, i]: 0 for the prefix, k for the rows of question k (1, 2, ...), -1 for padding;
        # shift[b, i]: how far question k's rows sit past where they would start alone
        block = torch.full((B, L), -1, dtype=torch.long)
        shift = torch.zeros((B, L), dtype=torch.long)
        for b, e in enumerate(encs):
            block[b, :e.questions[0].start] = 0
            for k, q in enumerate(e.questions):
                block[b, q.start:q.end] = k + 1
                shift[b, q.start:q.end] = q.start - e.questions[0].start
        out.update(question_block=block, position_shift=shift)
    return out
