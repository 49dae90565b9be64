"""The six panels (the sixth in two figures: this run's step costs, and a what-if), drawn from a `View`: plain data built once from a run's traces, kept in the
session, so changing the method, layer or head redraws without running the model again.

Everything here reads `traces.Trace` records (`layers`, `rounds`, `head_scores`) and the figures
of `runs.compare`; the drawing is `sparsevid.plots`.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .. import plots, whatif
from ..methods import METHODS
from ..methods.htsparse import ROLE_NAMES
from ..traces import PromptInfo, Trace

PANEL_TITLES = ("Selected tokens per head", "Head partition (HT-Sparse)", "Visual-head scores (SparseMM)",
                "Draft tokens, round by round", "Speed and memory relative to dense", "Where the time goes",
                "What if: a 7B model on a data-centre GPU")
PANEL_KEYS = ("tokens", "partition", "scores", "drafts", "speed", "costs", "whatif")
PANEL_HELP = {  # one line under each panel: how to read it
    "tokens": "How to read this: each tile is a sampled frame cut into the model's visual-token cells; bright cells "
              "are the tokens the chosen KV head keeps, dimmed ones it skips; the cyan box is where the asked object "
              "really is (bundled examples).",
    "partition": "How to read this: one row per layer, one cell per query head. **Full** heads read the whole prompt, "
                 "**sparse** heads only the text and the selected visual tokens, **dropped** heads nothing; grey rows "
                 "are layers HT-Sparse does not route (dense). Heads come in **GQA pairs** (thick lines): two query "
                 "heads share one KV head, so HT-Sparse gives a pair one role and the KV memory falls with it.",
    "scores": "How to read this: a **visual head** is one whose attention, while the model names an object, lands on "
              "that object's visual tokens (SparseMM's calibration); left, each head's share of that score (hover "
              "for values); right, the KV entries SparseMM lets each KV head keep: visual heads get more.",
    "drafts": "How to read this: each row is one speculative round, read left to right, top to bottom: green tokens "
              "the draft proposed and dense accepted, blue the token dense's verification added (the bonus), red the "
              "proposals it rejected (just under, from the position the bonus replaced). Hover for the token's full "
              "text and the round's times.",
    "speed": "How to read this: left, speed as a ratio to dense (higher is better; decode speedup is per decoded "
             "token, none under 4 decoded tokens); right, KV memory held at the end as a ratio to dense (lower is "
             "better). Every method run lies between two dense runs and is compared with their mean; the figure is the "
             "median over the timing passes, the card gives their range.",
    "costs": "How to read this: left, the measured time of one step of each kind in this run; right, each speculative "
             "method's measured decode speedup beside the bound σ = Ω / (γ·c + v) from those step costs (MagicDec's "
             "form) at the measured acceptance and at acceptance 1, and the I/O model's prediction.",
    "whatif": "How to read this: the same formula with the step costs of a memory-bound accelerator, "
              "T ≈ (W + B·S·kv) / BW (weights 15.2 GB, 56 KiB of KV per token): the sparse draft reads the weights "
              "and K + text KV entries, verification reads what a dense step reads. Solid: the chosen acceptance; "
              "dotted: acceptance 1.",
}
PARTITION_NAMES = ("dense (not routed)",) + tuple(ROLE_NAMES)  # role code + 1 (-1: layer not routed)
NO_SPEEDUP = "too few decode steps to measure"


@dataclass
class View:
    """Plain data of a finished run: everything the panels are drawn from (kept in gr.State)."""

    frames: np.ndarray  # sampled frames, downscaled for display [T, h, w, 3] uint8
    timestamps: list[float]
    token_grid: np.ndarray  # [m_v, 3]
    grid: tuple[int, int, int]
    boxes: list | None  # per sampled frame, normalised box or None; None when the clip has no ground truth
    num_layers: int
    num_heads: int
    num_kv_heads: int
    labels: dict[str, str]  # method -> label, in run order (dense first)
    kept: dict[str, dict[int, np.ndarray]] = field(default_factory=dict)  # method -> layer -> bool [Hkv, m_v]
    roles: dict[str, dict] = field(default_factory=dict)  # method -> {roles [L, H], saliency [L, H], kv_lengths}
    scores: dict[str, dict] = field(default_factory=dict)  # method -> {scores, budgets, uniform}
    drafts: dict[str, dict] = field(default_factory=dict)  # method -> {first, rounds}
    speed: list[dict] = field(default_factory=list)  # plots.speedups rows
    costs: dict = field(default_factory=dict)  # step_costs(): measured per-step times and bounds (panel 6)

    def selection_methods(self) -> list[str]:
        return [m for m in self.labels if m in self.kept]

    def draft_methods(self) -> list[str]:
        return [m for m in self.labels if m in self.drafts]


def _small(frames: np.ndarray, side: int = 256) -> np.ndarray:
    """Frames with their longer side at most `side` (the session state stays small)."""
    frames = np.asarray(frames)
    big = max(frames.shape[1:3])
    if big <= side:
        return frames
    from PIL import Image

    s = side / big
    size = (max(1, round(frames.shape[2] * s)), max(1, round(frames.shape[1] * s)))
    return np.stack([np.asarray(Image.fromarray(f).resize(size, Image.BILINEAR)) for f in frames])


def _kept_masks(trace: Trace, prompt: PromptInfo) -> dict[int, np.ndarray]:
    """layer -> bool [Hkv, m_v]: the visual tokens each KV head keeps."""
    index = np.full(prompt.m, -1, dtype=np.int64)
    index[prompt.visual_positions] = np.arange(prompt.m_v)
    out = {}
    for layer, rec in trace.layers.items():
        mask = np.zeros((len(rec.kept), prompt.m_v), bool)
        for g, keep in enumerate(rec.kept):
            j = index[np.asarray(keep, dtype=np.int64)]
            mask[g, j[j >= 0]] = True
        out[int(layer)] = mask
    return out


def _roles(trace: Trace, L: int, H: int, Hkv: int, m: int) -> dict | None:
    """HT-Sparse's head roles [L, H] (-1: layer not routed), saliency π [L, H] (NaN there) and the
    prompt KV entries each KV head keeps [L, Hkv], from the layers' records."""
    routed = {l: rec for l, rec in trace.layers.items() if rec.info.get("roles") is not None}
    if not routed:
        return None
    roles, sal, kv = np.full((L, H), -1), np.full((L, H), np.nan), np.full((L, Hkv), m)
    for l, rec in routed.items():
        roles[l] = np.asarray(rec.info["roles"]).astype(int)
        if rec.info.get("saliency") is not None:
            sal[l] = np.asarray(rec.info["saliency"], float)
        kv[l] = rec.lengths
    return dict(roles=roles, saliency=sal, kv_lengths=kv)


def speed_row(label: str, trace: Trace, fig: dict) -> dict:
    """A `plots.speedups` row from a method's trace and its figures."""
    tps = len(trace.token_ids) / trace.total_s if trace.total_s else 0.0
    hover = (f"{tps:.1f} tokens/s, {trace.total_s:.2f} s, KV {fmt_bytes(trace.kv_bytes)}"
             + (f", acceptance {fig['acceptance']:.0%}" if fig.get("acceptance") is not None else "")
             + (f"<br>decode speedup: {NO_SPEEDUP}" if fig.get("speedup") is None else ""))
    return dict(label=label, speedup=fig.get("speedup"), e2e_speedup=fig.get("e2e_speedup"),
                kv_ratio=fig.get("kv_ratio"), predicted_speedup=fig.get("predicted_speedup"), hover=hover)


def build_view(traces: dict[str, Trace], figures: dict[str, dict], prompt: PromptInfo, frames: np.ndarray,
               timestamps: list[float], shape: tuple[int, int, int], token_text: Callable[[int], str],
               boxes: list | None = None) -> View:
    """Plain panel data from a comparison. shape: (layers, query heads, KV heads); token_text: a
    token id as a short readable string (the draft panel's cells)."""
    L, H, Hkv = shape
    v = View(frames=_small(frames), timestamps=list(timestamps), token_grid=np.asarray(prompt.token_grid),
             grid=tuple(int(x) for x in prompt.grid), boxes=boxes, num_layers=L, num_heads=H, num_kv_heads=Hkv,
             labels={n: METHODS[n].label for n in traces})
    for name, t in traces.items():
        if t.layers:
            v.kept[name] = _kept_masks(t, prompt)
        roles = _roles(t, L, H, Hkv, prompt.m)
        if roles is not None:
            v.roles[name] = roles
        hs = t.head_scores
        if hs and (hs.get("score_map") is not None or hs.get("kv_scores") is not None):
            scores = hs["score_map"] if hs.get("score_map") is not None else hs["kv_scores"]
            v.scores[name] = dict(scores=np.asarray(scores, float), uniform=bool(hs.get("uniform")),
                                  budgets=None if hs.get("caps") is None else np.asarray(hs["caps"], float))
        if t.kind == "speculative":
            v.drafts[name] = dict(first=token_text(t.token_ids[0]) if t.token_ids else "", rounds=[
                dict(proposed=[token_text(x) for x in r.proposed], accepted=r.accepted,
                     bonus=None if r.bonus is None else token_text(r.bonus), draft_s=r.draft_s, verify_s=r.verify_s)
                for r in t.rounds])
        if name in figures:
            v.speed.append(speed_row(v.labels[name], t, figures[name]))
    v.costs = step_costs(traces, figures, prompt, L)
    return v


def step_costs(traces: dict[str, Trace], figures: dict[str, dict], prompt: PromptInfo, num_layers: int) -> dict:
    """Panel 6's data: dense's prefill and median decode step (s), and per speculative method its mean
    draft step and verify pass (s), the costs c and v in dense steps, acceptance, γ, the measured decode
    speedup, the bound at the measured acceptance and at 1, the I/O model's prediction, and c as
    the I/O model expects it (K + m_t entries of m, or LayerSkip's L_e of L layers)."""
    dense = traces.get("dense")
    if dense is None or not dense.step_s:
        return {}
    out = dict(dense_step_s=statistics.median(dense.step_s), prefill_s=dense.prefill_s, methods={})
    for name, t in traces.items():
        f = figures.get(name) or {}
        if t.kind != "speculative" or not t.rounds or f.get("draft_step_cost") is None:
            continue
        drafted = sum(len(r.proposed) for r in t.rounds)
        if t.draft_layers:
            c_io = t.draft_layers / num_layers
        elif t.draft_entries:
            c_io = t.draft_entries / prompt.m
        else:
            c_io = None
        out["methods"][name] = dict(
            draft_step_s=sum(r.draft_s for r in t.rounds) / drafted if drafted else 0.0,
            verify_s=statistics.mean(r.verify_s for r in t.rounds), c=f["draft_step_cost"],
            v=f.get("verify_base", f["verify_cost"]) + t.gamma * f.get("verify_row_cost", 0.0),  # at γ
            acceptance=f.get("acceptance"), gamma=t.gamma, measured=f.get("speedup"), bound=f.get("bound_speedup"),
            bound_full=f.get("bound_speedup_full_acceptance"), predicted=f.get("predicted_speedup"), c_io=c_io)
    return out


def overhead_share(c: float, c_io: float | None) -> float | None:
    """The share of a dense step that does not scale with what a step reads, if a draft step costs c
    dense steps where reading alone would make it c_io: step = F + (1 - F)·reads, so
    F = (c - c_io) / (1 - c_io). None when c_io is unknown or 1 (the draft reads everything)."""
    if c_io is None or c_io >= 0.999:
        return None
    return (c - c_io) / (1 - c_io)


def costs_text(view: "View") -> str:
    """Markdown under panel 6: why the measured speedups differ from the bound and the I/O model."""
    cs = view.costs
    if not cs or not cs.get("methods"):
        return ""
    lines = [f"Here a dense decode step takes **{cs['dense_step_s'] * 1e3:.1f} ms** and the prefill "
             f"**{cs['prefill_s'] * 1e3:.0f} ms**."]
    for name, m in cs["methods"].items():
        label = view.labels.get(name, name)
        measured = NO_SPEEDUP if m["measured"] is None else f"{m['measured']:.2f}×"
        line = (f"**{label}**: a draft step costs c = {m['c']:.2f} dense steps and verifying γ + 1 = {m['gamma'] + 1} "
                f"tokens v = {m['v']:.2f}; at acceptance {m['acceptance'] or 0:.0%} the bound is "
                f"{m['bound']:.2f}× (at acceptance 1: {m['bound_full']:.2f}×), measured {measured}")
        share = overhead_share(m["c"], m["c_io"])
        if share is not None:
            line += (f". Reading alone, a draft step would cost {m['c_io']:.2f} dense steps: the per-step overhead "
                     f"that does not shrink with the draft (Python, dispatch, weights, the draft's own gathers) is "
                     f"about **{min(share, 9.99):.0%} of a dense step here**")
        if m["v"] > 1.05:
            line += (f"; verification costs {m['v']:.2f} dense steps, not 1, because attention over several new "
                     f"rows is compute-bound on a CPU")
        lines.append(line + ".")
    lines.append("On a GPU a decode step is memory-bound and most of that overhead goes, which is the what-if below.")
    return "\n\n".join(lines)


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


# ------------------------------------------------------------------------------------------------
# Panels from a View


def default_choices(view: View) -> dict:
    """Initial method / layer / head / draft-method choices for a view."""
    sel = view.selection_methods()
    return dict(method=sel[0] if sel else None, layer=view.num_layers // 2, head=0,
                draft=(view.draft_methods() or [None])[0])


def panel_tokens(view: View, method: str | None, layer: int | None, head: int | None):
    title = PANEL_TITLES[0]
    if method not in view.kept:
        t = f"{title}: run a sparse method (StD, Streaming, HT-Sparse, SparseMM) to see the kept tokens"
        return plots.token_mosaic(view.frames, view.token_grid, view.grid, None, view.boxes, view.timestamps, t)
    per = view.kept[method]
    layer = int(layer) if layer is not None else 0
    if layer not in per:  # a layer the method keeps whole: show the nearest one it selected in
        layer = min(per, key=lambda l: abs(l - layer))
    head = min(int(head or 0), per[layer].shape[0] - 1)
    mask = per[layer][head]
    t = (f"{view.labels[method]} · layer {layer} · KV head {head}: keeps {int(mask.sum())} of {mask.size} "
         f"visual tokens ({mask.mean():.0%})")
    if view.boxes:
        share = plots.on_object_share(mask, view.token_grid, view.grid, view.boxes)
        if share is not None:
            t += (f"<br><sub>in frames showing the asked object, {share[0]:.0%} of the kept tokens fall on it "
                  f"(of all tokens: {share[1]:.0%})</sub>")
    return plots.token_mosaic(view.frames, view.token_grid, view.grid, mask, view.boxes, view.timestamps, t)


def _pick(d: dict, preferred: str | None):
    return preferred if preferred in d else next(iter(d), None)


def panel_partition(view: View, method: str | None = None):
    m = _pick(view.roles, method)
    if m is None:
        return plots.placeholder(PANEL_TITLES[1], "Run HT-Sparse to see this panel.")
    r = view.roles[m]
    routed = int((np.asarray(r["roles"]) >= 0).any(1).sum())
    group = view.num_heads // max(1, view.num_kv_heads)
    sub = (f"<br><sub>{routed} of {view.num_layers} layers routed (grey: not routed, dense) · "
           f"{group} query heads per KV head (GQA), partitioned together</sub>")
    return plots.head_partition(r["roles"], r["saliency"], r["kv_lengths"], title=f"{PANEL_TITLES[1]} · "
                                f"{view.labels[m]}{sub}", role_names=PARTITION_NAMES)


def panel_scores(view: View, method: str | None = None):
    m = _pick(view.scores, method)
    if m is None:
        return plots.placeholder(PANEL_TITLES[2], "Run SparseMM to see this panel.")
    d = view.scores[m]
    sub = ("uniform scores: no calibration file for this model" if d["uniform"]
           else "a visual head attends to the named object's visual tokens")
    return plots.visual_head_scores(d["scores"], d["budgets"], title=f"{PANEL_TITLES[2]} · {view.labels[m]}",
                                    subtitle=sub)


def panel_drafts(view: View, method: str | None = None):
    m = _pick(view.drafts, method)
    if m is None:
        return plots.placeholder(PANEL_TITLES[3], "Run a speculative method (StD, Streaming, LayerSkip or a draft) "
                                                  "to see this panel.")
    d = view.drafts[m]
    return plots.draft_rounds(d["first"], d["rounds"], title=f"{PANEL_TITLES[3]} · {view.labels[m]}")


def panel_speed(view: View):
    if not view.speed:
        return plots.placeholder(PANEL_TITLES[4], "Run at least one method besides dense to see this panel.")
    return plots.speedups(view.speed, title=PANEL_TITLES[4])


def panel_costs(view: View):
    """Panel 6 (left): measured step times and each speculative method's bound from them."""
    cs = view.costs
    if not cs:
        return plots.placeholder(PANEL_TITLES[5], "Run with at least 2 decoded tokens to see this panel.")
    steps = [dict(label="dense", kind="prefill", ms=cs["prefill_s"] * 1e3, hover="dense prefill (median of 2 runs)"),
             dict(label="dense", kind="dense", ms=cs["dense_step_s"] * 1e3, hover="dense decode step (median)")]
    bounds = []
    for name, m in cs.get("methods", {}).items():
        label = view.labels.get(name, name)
        steps += [dict(label=label, kind="draft", ms=m["draft_step_s"] * 1e3,
                       hover=f"{label}: mean draft step, c = {m['c']:.2f} dense steps"),
                  dict(label=label, kind="verify", ms=m["verify_s"] * 1e3,
                       hover=f"{label}: mean verification of up to γ + 1 = {m['gamma'] + 1} tokens, "
                             f"v = {m['v']:.2f} dense steps")]
        bounds.append(dict(label=label, measured=m["measured"], bound=m["bound"], bound_full=m["bound_full"],
                           predicted=m["predicted"], hover=f"acceptance {m['acceptance'] or 0:.0%}, γ = {m['gamma']}"))
    sub = "" if bounds else "<br><sub>run a speculative method (StD, Streaming, LayerSkip, a draft) for its bound</sub>"
    return plots.step_costs(steps, bounds, title=PANEL_TITLES[5] + " · this run" + sub)


def panel_whatif(ref: whatif.Reference | None = None, visual_tokens: tuple[int, ...] = (16384, 24576, 32768, 49152,
                                                                                         65536)):
    """Panel 6 (right): the predicted speedup at a reference setting, batch 1 and 8, 16k-64k visual tokens."""
    ref = ref or whatif.Reference()
    rows = whatif.sweep(ref, list(visual_tokens))
    at = {(r["batch"], r["visual_tokens"]): r["speedup"] for r in rows}
    title = (f"{PANEL_TITLES[6]}<br><sub>{whatif.REFERENCE_MODEL} on {ref.gpu} "
             f"({whatif.BANDWIDTH[ref.gpu] / 1e12:.2f} TB/s), K = {ref.k}, γ = {ref.gamma}, acceptance "
             f"{ref.acceptance:.0%}: {at[(1, visual_tokens[0])]:.2f}-{at[(1, visual_tokens[-1])]:.2f}× at batch 1, "
             f"{at[(8, visual_tokens[0])]:.2f}-{at[(8, visual_tokens[-1])]:.2f}× at batch 8</sub>")
    return plots.whatif(rows, title=title)


def whatif_reference(view: View | None, gpu: str | None = None, gamma: int | None = None,
                     acceptance: float | None = None, k: int | None = None) -> whatif.Reference:
    """The what-if's setting: given values, else the run's first speculative method's γ and acceptance,
    else `whatif.Reference`'s defaults."""
    base = whatif.Reference()
    m = next(iter((view.costs.get("methods") or {}).values()), None) if view is not None and view.costs else None
    return whatif.Reference(gpu=gpu or base.gpu, batch=1, visual_tokens=base.visual_tokens, text_tokens=base.text_tokens,
                            k=int(k) if k else base.k,
                            gamma=int(gamma) if gamma else (m["gamma"] if m and m.get("gamma") else base.gamma),
                            acceptance=float(acceptance) if acceptance is not None else
                            (m["acceptance"] if m and m.get("acceptance") is not None else base.acceptance))


def all_panels(view: View) -> dict:
    """Every panel at the view's default choices: {key: figure} for `PANEL_KEYS`."""
    c = default_choices(view)
    return dict(tokens=panel_tokens(view, c["method"], c["layer"], c["head"]),
                partition=panel_partition(view, c["method"]), scores=panel_scores(view, c["method"]),
                drafts=panel_drafts(view, c["draft"]), speed=panel_speed(view), costs=panel_costs(view),
                whatif=panel_whatif(whatif_reference(view)))


def empty_panels() -> dict:
    msg = "Upload a video, ask a question and press Run."
    out = {k: plots.placeholder(t, msg) for k, t in zip(PANEL_KEYS, PANEL_TITLES)}
    out["whatif"] = panel_whatif()  # needs no run
    return out
