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
"""
from __future__ import annotations

import math
import os
import time
from collections import defaultdict

import numpy as np
import torch

from .clips import SHORT_MAX
from .questions import QTYPES, make_sample, normalise
from .tokenizer import SPECIAL_TOKENS

EVAL_SEED_BASE = 1_700_000_000


def load_toy(model_dir: str, attn: str = "eager"):
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir, attn_implementation=attn, dtype=torch.float32)
    model.eval()
    special = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    return tok, model, special


def eval_samples(n: int, frames: int, seed_base: int = EVAL_SEED_BASE) -> list:
    return [make_sample(seed_base + frames * 100_000 + i, frames, QTYPES[i % len(QTYPES)]) for i in range(n)]


def ref_kind(s) -> str | None:
    """How the question names its object: "colour" (the red object), "shape" (the circle), "both"
    (the red circle); None for count questions."""
    if s.obj_id is None:
        return None
    words = normalise(s.question).split()
    o = s.clip.obj(s.obj_id)
    c, sh = o.colour in words, o.shape in words
    return "both" if c and sh else ("colour" if c else "shape")


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

    def __call__(self, s):
        """-> ({method: answer text}, r [L, Hkv, m_v], target cells [m_v] bool, dense seconds)."""
        from ..engine import decode
        from ..runs import run_method
        from .data import target_cells

        inputs = self.loaded.adapter.build_inputs(s.clip.frames, s.question)
        t0 = time.time()
        runs = []
        dense = decode(self.loaded, inputs, max_new_tokens=self.max_new_tokens, keep_stats=True, run_out=runs)
        dt = time.time() - t0
        texts = {"dense": dense.text}
        for name in self.names[1:]:
            texts[name] = run_method(self.loaded, inputs, name, {}, self.max_new_tokens).text
        st = runs[0].stats
        r = np.stack([st[l].relevance[:, inputs.visual_positions].float().cpu().numpy() for l in sorted(st)])
        t, rows, cols = inputs.grid
        return texts, r, target_cells(s, t, rows, cols), dt


def evaluate(model_dir: str, n: int = 60, frames=(16, 256), methods=("dense",), threads: int = 2,
             progress: bool = True, max_new_tokens: int = 24,
             seed_base: int = EVAL_SEED_BASE) -> dict:
    from tqdm import tqdm

    torch.set_num_threads(threads)
    runner = _Runner(model_dir, methods, max_new_tokens)
    names = runner.names
    acc = {m: defaultdict(list) for m in names}
    top10_all, hit_all, rnd_all, top10_layers = [], [], [], []
    records = []
    t_total = 0.0
    jobs = [(f, s) for f in frames for s in eval_samples(n, f, seed_base)]
    for f, s in tqdm(jobs, desc="toy eval", disable=not progress, mininterval=2.0):
        texts, r, target, dt = runner(s)
        t_total += dt
        length = "short" if f <= SHORT_MAX else "long"
        ref = ref_kind(s)
        for m, pred in texts.items():
            ok = normalise(pred) == normalise(s.answer)
            acc[m]["all"].append(ok)
            acc[m][f"type:{s.qtype}"].append(ok)
            acc[m][f"len:{length}"].append(ok)
            acc[m][f"frames:{f}"].append(ok)
            acc[m][f"{length}:{s.qtype}"].append(ok)
            if ref:
                acc[m][f"ref:{ref}"].append(ok)
            if m != "dense":
                acc[m]["same_as_dense"].append(normalise(pred) == normalise(texts["dense"]))
            if m == "dense":
                records.append({"frames": f, "qtype": s.qtype, "question": s.question, "answer": s.answer,
                                "pred": pred, "ok": bool(ok)})
        fig = attention_figures(r, target)
        top10_all.append(fig["top10_mass"].mean()); top10_layers.append(fig["top10_mass"].mean(1))
        hit_all.append(fig["box_hit_rate"]); rnd_all.append(fig["box_hit_rate_random"])

    def summarise(d):
        mean = lambda xs: float(np.mean(xs)) if xs else None
        return {
            "overall": mean(d["all"]),
            "by_type": {q: mean(d[f"type:{q}"]) for q in QTYPES if d[f"type:{q}"]},
            "by_length": {k.split(":", 1)[1]: mean(v) for k, v in d.items() if k.startswith("len:")},
            "by_frames": {k.split(":", 1)[1]: mean(v) for k, v in d.items() if k.startswith("frames:")},
            "by_length_type": {k: mean(v) for k, v in d.items() if k.split(":")[0] in ("short", "long")},
            "by_ref": {k.split(":", 1)[1]: mean(v) for k, v in d.items() if k.startswith("ref:")},
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
        "settings": {"model": os.path.abspath(model_dir), "n": n, "frames": list(frames),
                     "seed_base": seed_base,
                     "mean_dense_s": t_total / max(1, len(jobs))},
        "errors": [r for r in records if not r["ok"]][:20],
    }


def format_report(res: dict) -> str:
    lines = []
    for m, a in res["accuracy"].items():
        lines.append(f"{m}: overall {a['overall']:.3f} (n={a['n']})")
        lines.append("  by type:   " + "  ".join(f"{k} {v:.2f}" for k, v in a["by_type"].items()))
        lines.append("  by length: " + "  ".join(f"{k} {v:.2f}" for k, v in a["by_length"].items()))
        lines.append("  by how the question names the object: "
                     + "  ".join(f"{k} {v:.2f}" for k, v in sorted(a["by_ref"].items())))
        lines.append("  by length and type: " + "  ".join(f"{k} {v:.2f}" for k, v in sorted(a["by_length_type"].items())))
    at = res["attention"]
    lines.append(f"attention: top10_mass {at['top10_mass']:.3f} (by layer "
                 + ", ".join(f"{x:.2f}" for x in at["top10_mass_by_layer"])
                 + f"), box_hit_rate {at['box_hit_rate']:.3f} (random {at['box_hit_rate_random']:.3f})")
    for e in res.get("errors", [])[:8]:
        lines.append(f"  miss [{e['frames']}f {e['qtype']}] {e['question']} -> {e['pred']!r} (want {e['answer']!r})")
    return "\n".join(lines)
