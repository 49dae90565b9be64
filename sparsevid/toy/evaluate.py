"""Held-out evaluation of the toy model: exact-answer accuracy and attention figures.

Clips come from seeds >= 1e9 + 7e8 (training uses seeds < 1e9, its quick validation 1.5e9..;
`seed_base` picks another held-out range, for choosing between recipes without tuning on the
reported clips), question types cycle evenly. Accuracy is reported per method, question type, clip
length and by how the question names its object (`by_ref`: colour / shape / both). Attention
figures come from the dense prefill:

- relevance r[l, g, j]: attention of the query tokens (positions after the last visual token)
  to visual token j, softmax over all keys, averaged over query tokens, summed over the query
  heads of KV group g;
- top10_mass: share of r[l, g, :] held by its top 10 % of visual tokens, averaged over layers
  and KV heads;
- box_hit_rate: for the most relevant heads (the quarter of (layer, KV head) pairs whose query
  tokens give the visual span the most attention), the share of their top-K visual tokens
  whose cell touches the asked object's box (K = the number of such cells, at most 16);
  box_hit_rate_random is what a random choice of K tokens would score.

Issue 22 (opt-in): `style` renders the clips another way, one of STYLE_SETS: "default" (the
training renderer), "random" (`clips.sample_style(train=True)`: random backgrounds, distractors,
sizes, frame shapes, bars, codec), "held-out" (the held-out style family only), "no-bar" and
"other-bar" (the default clips without their progress bar, or with one of another colour at the
top), "glimpses" (the default renderer in the original world, where a short-lived object may be
seen in two frames of two frame pairs only: `clips.make_clip(glimpses=True)`; the other sets draw
today's world, where every object fills some pair). Accuracy is then also reported by background
family, object-size band, bar, codec and number of objects. `qtypes` may include "narrate"
(narrations, scored whole and per sentence, against the narration in whichever order of
appearance fits best: objects that appear in the same frame pair may come in any order;
`whole_strict` keeps the order training teaches). Every answer is checked for loops
(`questions.repeats_3gram_3x`) and for running out of tokens.
"""
from __future__ import annotations

import math
import os
import time
from collections import defaultdict

import numpy as np
import torch

from dataclasses import replace

from .clips import LEGACY, SHORT_MAX, sample_style
from .questions import (NARRATE, QTYPES, is_answer, make_sample, narration_orders, normalise, repeats_3gram_3x,
                        score_narration, seen_moving)
from .tokenizer import SPECIAL_TOKENS

EVAL_SEED_BASE = 1_700_000_000


def load_toy(model_dir: str, attn: str = "eager"):
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir, attn_implementation=attn, dtype=torch.float32)
    model.eval()
    special = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    return tok, model, special


STYLE_SETS = ["default", "random", "held-out", "no-bar", "other-bar", "glimpses"]


def style_for(style_set: str, seed: int):
    """The rendering style of evaluation clip `seed` in a style set (None: the default renderer)."""
    if style_set in ("default", "glimpses"):
        return None
    if style_set == "random":
        return sample_style(seed, train=True)
    if style_set == "held-out":
        return sample_style(seed, held_out=True)
    if style_set == "no-bar":
        return replace(LEGACY, bar="none")
    if style_set == "other-bar":  # the same clips with a coloured bar along the top edge
        rng = np.random.default_rng([int(seed), 31337])
        return replace(LEGACY, bar="top", bar_colours=tuple(tuple(int(c) for c in rng.integers(0, 256, 3))
                                                             for _ in range(2)))
    raise ValueError(f"unknown style set {style_set!r} (one of {', '.join(STYLE_SETS)})")


def eval_samples(n: int, frames: int, seed_base: int = EVAL_SEED_BASE, style: str = "default",
                 qtypes=None) -> list:
    """n held-out samples of `frames` frames, question types cycling over `qtypes` (default QTYPES);
    the same seeds (and with "default", "no-bar" and "other-bar" the same clips) in every style set;
    "glimpses" draws them in the original world (`clips.make_clip(glimpses=True)`)."""
    qtypes = list(qtypes or QTYPES)
    out = []
    for i in range(n):
        seed = seed_base + frames * 100_000 + i
        out.append(make_sample(seed, frames, qtypes[i % len(qtypes)], style=style_for(style, seed),
                               glimpses=style == "glimpses"))
    return out


def style_keys(s) -> dict:
    """The style facets of a sample's clip, for the by-style reports."""
    st = s.clip.meta.get("style")
    if st is None:
        return {"family": "original", "band": "original", "bar": "bottom", "codec": "no"}
    return {"family": st["background"], "band": st["size_band"], "bar": st["bar"],
            "codec": "no" if st["crf"] is None else "yes"}


def ref_kind(s) -> str | None:
    """How the question names its object: "colour" (the red object), "shape" (the circle), "both"
    (the red circle); None for count questions."""
    if s.obj_id is None:
        return None
    words = normalise(s.question).split()
    o = s.clip.obj(s.obj_id)
    c, sh = o.colour in words, o.shape in words
    return "both" if c and sh else ("colour" if c else "shape")


MARGIN_BANDS = ((0.03, "< 3 %"), (0.06, "3-6 %"), (math.inf, ">= 6 %"))


def boundary_margin(obj, n_frames: int) -> float:
    """How far an object's visible segment [start, end) lies from the nearest boundary between the
    clip's thirds (frames n/3 and 2n/3, as `clips.phase_of` cuts), as a share of the clip: where
    "when" is decided. A segment always lies inside one third, so a small margin means one edge is
    close to the next third."""
    cuts = (n_frames / 3, 2 * n_frames / 3)
    return min(abs(edge - c) for edge in (obj.start, obj.end) for c in cuts) / n_frames


def margin_band(margin: float) -> str:
    return next(name for hi, name in MARGIN_BANDS if margin < hi)


def attention_figures(r: np.ndarray, target: np.ndarray, head_frac: float = 0.25, kmax: int = 16) -> dict:
    L, G, V = r.shape
    k10 = max(1, math.ceil(0.1 * V))
    srt = -np.sort(-r, axis=-1)
    top10 = srt[..., :k10].sum(-1) / np.maximum(r.sum(-1), 1e-12)  # L, G
    mass = r.sum(-1).reshape(-1)
    n_sel = max(1, int(round(head_frac * L * G)))
    sel = np.argsort(-mass)[:n_sel]
    K = int(min(kmax, max(1, target.sum())))
    hits = []
    for idx in sel:
        l, g = divmod(int(idx), G)
        top = np.argsort(-r[l, g])[:K]
        hits.append(target[top].mean())
    return {"top10_mass": top10, "box_hit_rate": float(np.mean(hits)),
            "box_hit_rate_random": float(target.sum() / V)}


class _Runner:
    """Runs dense (keeping its prefill relevance) and the other methods on one sample, through the
    project's engine (`models.load_model`, the model's adapter, `engine.decode`, `runs.run_method`)."""

    def __init__(self, model_dir: str, methods, max_new_tokens: int):
        from ..methods import parse_methods
        from ..models import load_model

        self.max_new_tokens = max_new_tokens
        self.loaded = load_model(model_dir, device="cpu", dtype="float32")
        self.names = parse_methods(list(methods))

    def __call__(self, s, max_new_tokens: int | None = None):
        """-> ({method: answer text}, r [L, Hkv, m_v], target cells [m_v] bool, dense seconds,
        whether dense decoding ended with an end-of-answer token)."""
        from ..engine import decode
        from ..runs import run_method
        from .data import target_cells

        mnt = max_new_tokens or self.max_new_tokens
        inputs = self.loaded.adapter.build_inputs(s.clip.frames, s.question)
        t0 = time.time()
        runs = []
        dense = decode(self.loaded, inputs, max_new_tokens=mnt, keep_stats=True, run_out=runs)
        dt = time.time() - t0
        ended = bool(dense.token_ids) and dense.token_ids[-1] in set(self.loaded.adapter.eos_token_ids)
        texts = {"dense": dense.text}
        for name in self.names[1:]:
            texts[name] = run_method(self.loaded, inputs, name, {}, mnt).text
        st = runs[0].stats
        r = np.stack([st[l].relevance[:, inputs.visual_positions].float().cpu().numpy() for l in sorted(st)])
        t, rows, cols = inputs.grid
        return texts, r, target_cells(s, t, rows, cols), dt, ended


NARRATE_MAX_NEW_TOKENS = 96  # narrations are 17-68 tokens with a narration-trained tokenizer


def evaluate(model_dir: str, n: int = 60, frames=(16, 256), methods=("dense",), threads: int = 2,
             progress: bool = True, max_new_tokens: int = 24,
             seed_base: int = EVAL_SEED_BASE, style: str = "default", qtypes=None, runner=None) -> dict:
    """Held-out evaluation on one style set (`style`, one of STYLE_SETS) and question types
    `qtypes` (default QTYPES; "narrate" decodes up to NARRATE_MAX_NEW_TOKENS tokens)."""
    from tqdm import tqdm

    torch.set_num_threads(threads)
    runner = runner or _Runner(model_dir, methods, max_new_tokens)
    names = runner.names
    qtypes = list(qtypes or QTYPES)
    acc = {m: defaultdict(list) for m in names}
    top10_all, hit_all, rnd_all, top10_layers = [], [], [], []
    records = []
    narr = defaultdict(list)
    degenerate, no_eos = [], []
    t_total = 0.0
    jobs = [(f, s) for f in frames for s in eval_samples(n, f, seed_base, style, qtypes)]
    for f, s in tqdm(jobs, desc=f"toy eval ({style})", disable=not progress, mininterval=2.0):
        long_answer = s.qtype == NARRATE
        texts, r, target, dt, ended = runner(s, max(max_new_tokens, NARRATE_MAX_NEW_TOKENS) if long_answer else None)
        t_total += dt
        length = "short" if f <= SHORT_MAX else "long"
        ref = ref_kind(s)
        facets = style_keys(s)
        band = margin_band(boundary_margin(s.clip.obj(s.obj_id), f)) if s.qtype == "when" else None
        answers = s.answers  # a narration: one per order of appearance, computed once per item
        for m, pred in texts.items():
            ok = is_answer(pred, answers)
            acc[m]["all"].append(ok)
            if not long_answer:
                acc[m]["short_answers"].append(ok)
            acc[m][f"type:{s.qtype}"].append(ok)
            acc[m][f"len:{length}"].append(ok)
            acc[m][f"frames:{f}"].append(ok)
            acc[m][f"{length}:{s.qtype}"].append(ok)
            acc[m][f"objects:{len(s.clip.objects)}"].append(ok)
            for k, v in facets.items():
                acc[m][f"{k}:{v}"].append(ok)
            if ref:
                acc[m][f"ref:{ref}"].append(ok)
            if band:
                acc[m][f"when_margin:{band}"].append(ok)
            if m != "dense":
                acc[m]["same_as_dense"].append(normalise(pred) == normalise(texts["dense"]))
            if m == "dense":
                deg = repeats_3gram_3x(pred)
                degenerate.append(deg)
                no_eos.append(not ended)
                if long_answer:
                    sc = score_narration(pred, answers)
                    for k in ("whole", "whole_strict", "sentences", "objects", "count_ok"):
                        narr[k].append(float(sc[k]))
                    narr[f"len:{length}:sentences"].append(sc["sentences"])
                    narr[f"len:{length}:whole"].append(float(sc["whole"]))
                    # object sentences by whether a token of the model sees the object move
                    moving = [seen_moving(o, f) for o in narration_orders(s.clip)[sc["ref_index"]]]
                    for mv, hit in zip(moving, sc["at_place"][1:]):
                        narr["moving_sentences" if mv else "glimpsed_sentences"].append(float(hit))
                    narr["whole_all_moving" if all(moving) else "whole_with_glimpsed"].append(float(sc["whole"]))
                records.append({"frames": f, "qtype": s.qtype, "question": s.question, "answer": s.answer,
                                "pred": pred, "ok": bool(ok), "degenerate": deg, "ended": ended,
                                "n_objects": len(s.clip.objects), **facets})
        fig = attention_figures(r, target)
        top10_all.append(fig["top10_mass"].mean()); top10_layers.append(fig["top10_mass"].mean(1))
        hit_all.append(fig["box_hit_rate"]); rnd_all.append(fig["box_hit_rate_random"])

    def summarise(d):
        mean = lambda xs: float(np.mean(xs)) if xs else None
        return {
            "overall": mean(d["all"]),
            "overall_without_narration": mean(d["short_answers"]),
            "by_type": {q: mean(d[f"type:{q}"]) for q in QTYPES if d[f"type:{q}"]},
            "by_length": {k.split(":", 1)[1]: mean(v) for k, v in d.items() if k.startswith("len:")},
            "by_frames": {k.split(":", 1)[1]: mean(v) for k, v in d.items() if k.startswith("frames:")},
            "by_length_type": {k: mean(v) for k, v in d.items() if k.split(":")[0] in ("short", "long")},
            "by_ref": {k.split(":", 1)[1]: mean(v) for k, v in d.items() if k.startswith("ref:")},
            "by_objects": {k.split(":", 1)[1]: mean(v) for k, v in sorted(d.items()) if k.startswith("objects:")},
            # "when" by how close the object's segment comes to the next third (accuracy, questions)
            "when_by_margin": {name: (mean(v), len(v)) for _, name in MARGIN_BANDS
                               if (v := d.get(f"when_margin:{name}"))},
            **{f"by_{facet}": {k.split(":", 1)[1]: mean(v) for k, v in sorted(d.items()) if k.startswith(facet + ":")}
               for facet in ("family", "band", "bar", "codec")},
            "n": len(d["all"]),
            **({"same_answer_as_dense": mean(d["same_as_dense"])} if d["same_as_dense"] else {}),
        }

    return {
        "accuracy": {m: summarise(acc[m]) for m in names},
        "attention": {
            "top10_mass": float(np.mean(top10_all)),
            "top10_mass_by_layer": [float(x) for x in np.mean(top10_layers, 0)],
            "box_hit_rate": float(np.mean(hit_all)),
            "box_hit_rate_random": float(np.mean(rnd_all)),
        },
        "narration": {k: float(np.mean(v)) for k, v in narr.items()}
        | {"n": len(narr["whole"]), "n_moving": len(narr["moving_sentences"]),
           "n_glimpsed": len(narr["glimpsed_sentences"]), "n_with_glimpsed": len(narr["whole_with_glimpsed"])}
        if narr else None,
        "degenerate": {"loops": int(sum(degenerate)), "no_end": int(sum(no_eos)), "n": len(degenerate)},
        "settings": {"model": os.path.abspath(model_dir), "n": n, "frames": list(frames),
                     "seed_base": seed_base, "style": style, "qtypes": qtypes,
                     "mean_dense_s": t_total / max(1, len(jobs))},
        "errors": [r for r in records if not r["ok"]][:20],
        "loops": [r for r in records if r["degenerate"]][:10],
    }


def evaluate_styles(model_dir: str, styles=("default",), methods=("dense",), max_new_tokens: int = 24,
                    **kwargs) -> dict:
    """`evaluate` on each style set of `styles` (the model loaded once) -> {style set: result}."""
    runner = _Runner(model_dir, methods, max_new_tokens)
    return {st: evaluate(model_dir, methods=methods, max_new_tokens=max_new_tokens, style=st, runner=runner,
                         **kwargs) for st in styles}


def format_report(res: dict) -> str:
    lines = []
    if "accuracy" not in res:  # evaluate_styles: one report per style set
        rows = []
        for st, r in res.items():
            a = r["accuracy"]["dense"]
            nar = r.get("narration") or {}
            short = a["overall_without_narration"]  # None: narrations only
            rows.append(f"  {st:10s} overall {a['overall']:.3f} (n={a['n']}"
                        + (f"; without narrations {short:.3f})" if short is not None else ")")
                        + (f"  narration whole {nar['whole']:.2f} sentences {nar['sentences']:.2f} "
                           f"objects {nar['objects']:.2f}" if nar else "")
                        + f"  loops {r['degenerate']['loops']} no-end {r['degenerate']['no_end']}")
        for st, r in res.items():
            lines += [f"== style set {st}", format_report(r)]
        return "\n".join(lines + ["== summary (dense)"] + rows)
    for m, a in res["accuracy"].items():
        lines.append(f"{m}: overall {a['overall']:.3f} (n={a['n']})")
        lines.append("  by type:   " + "  ".join(f"{k} {v:.2f}" for k, v in a["by_type"].items()))
        lines.append("  by length: " + "  ".join(f"{k} {v:.2f}" for k, v in a["by_length"].items()))
        lines.append("  by how the question names the object: "
                     + "  ".join(f"{k} {v:.2f}" for k, v in sorted(a["by_ref"].items())))
        lines.append("  by length and type: " + "  ".join(f"{k} {v:.2f}" for k, v in sorted(a["by_length_type"].items())))
        lines.append("  by number of objects: " + "  ".join(f"{k} {v:.2f}" for k, v in a.get("by_objects", {}).items()))
        if a.get("when_by_margin"):
            lines.append("  'when' by the segment's distance to the next third (share of the clip): "
                         + "  ".join(f"{k} {v:.2f} (n={c})" for k, (v, c) in a["when_by_margin"].items()))
        for facet in ("family", "band", "bar", "codec"):
            d = a.get(f"by_{facet}", {})
            if len(d) > 1 or (d and "original" not in d):
                lines.append(f"  by {facet}: " + "  ".join(f"{k} {v:.2f}" for k, v in d.items()))
    nar = res.get("narration")
    if nar:
        lines.append(f"narration (n={nar['n']}): whole {nar['whole']:.3f} (in the taught order of objects that "
                     f"appear together {nar['whole_strict']:.3f}), sentences at their place "
                     f"{nar['sentences']:.3f}, object sentences anywhere {nar['objects']:.3f}, "
                     f"count sentence {nar['count_ok']:.3f}")
        if nar.get("n_moving") and nar.get("n_glimpsed"):
            lines.append(f"  object sentences at their place: objects some frame pair shows moving "
                         f"{nar['moving_sentences']:.3f} (n={nar['n_moving']}), objects seen only across frame "
                         f"pairs {nar['glimpsed_sentences']:.3f} (n={nar['n_glimpsed']}); whole narrations "
                         f"without such an object {nar.get('whole_all_moving', float('nan')):.3f} (n={nar['n'] - nar['n_with_glimpsed']}), "
                         f"with one {nar.get('whole_with_glimpsed', float('nan')):.3f} (n={nar['n_with_glimpsed']})")
    if "degenerate" in res:
        d = res["degenerate"]
        lines.append(f"degenerate answers: {d['loops']} looping, {d['no_end']} without an end (of {d['n']})")
    at = res["attention"]
    lines.append(f"attention: top10_mass {at['top10_mass']:.3f} (by layer "
                 + ", ".join(f"{x:.2f}" for x in at["top10_mass_by_layer"])
                 + f"), box_hit_rate {at['box_hit_rate']:.3f} (random {at['box_hit_rate_random']:.3f})")
    for e in res.get("errors", [])[:8]:
        lines.append(f"  miss [{e['frames']}f {e['qtype']}] {e['question']} -> {e['pred']!r} (want {e['answer']!r})")
    for e in res.get("loops", [])[:3]:
        lines.append(f"  loop [{e['frames']}f {e['qtype']}] {e['question']} -> {e['pred']!r}")
    return "\n".join(lines)
