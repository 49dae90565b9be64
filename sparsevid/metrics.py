"""Every figure a face shows, as pure functions of traces (no torch, no model).

- `ratios`: a method's run against dense's on the same prompt: decode speedup (per decoded token,
  none when too few steps were measured) and its range over the timing passes, end-to-end speedup,
  KV ratio, identity with dense, acceptance and tokens per round, the I/O model's prediction (StD paper) and the bound from the
  run's own step costs (MagicDec's form, Chen et al., arXiv:2408.11049);
- `efficiency`: analytic KV bytes and FLOPs of a run from the selections it kept (the HT-Sparse
  paper's figures), so `efficiency_pct` gives them as % of dense.
"""

from __future__ import annotations

import statistics

import numpy as np

from .traces import LayerRecord, ModelShape, PromptInfo, Trace

MIN_DECODE_STEPS = 4  # fewer decoded tokens than this: no decode ratio (one step's time is noise)


def per_token_decode_s(t: Trace) -> float | None:
    """Decode seconds per token after the first (the first comes from the prefill)."""
    return t.decode_s / t.decode_tokens if t.decode_tokens else None


def _pass_speedups(t: Trace, dense: Trace) -> list[float]:
    """Per-token decode speedup of each timing pass of a method's run: dense's decode time per token
    in the runs just before and after that pass (`Trace.dense_pair_s`) over the method's. The same
    pairs in the app, `run`, `eval` and `bench`. Empty when the run carries no pairs."""
    n = len(t.decode_runs_s)
    if not n or len(t.dense_pair_s) != n or not dense.decode_tokens:
        return []
    per_token = t.decode_tokens / dense.decode_tokens
    return [d / r * per_token for d, r in zip(t.dense_pair_s, t.decode_runs_s) if r]


def _measurable(t: Trace, dense: Trace) -> bool:
    """Both decoded at least MIN_DECODE_STEPS tokens: a decode ratio means something."""
    return min(t.decode_tokens, dense.decode_tokens) >= MIN_DECODE_STEPS


def decode_speedup(t: Trace, dense: Trace) -> float | None:
    """dense's decode time per token / the method's: the median of the timing passes' paired ratios
    (`_pass_speedups`; without pairs, of the two traces' times); None when either decoded fewer than
    MIN_DECODE_STEPS tokens."""
    if not _measurable(t, dense):
        return None
    passes = _pass_speedups(t, dense)
    if passes:
        return statistics.median(passes)
    a, b = per_token_decode_s(dense), per_token_decode_s(t)
    return a / b if a and b else None


def decode_speedup_range(t: Trace, dense: Trace) -> tuple[float, float] | None:
    """(lowest, highest) of the passes' paired decode speedups (`_pass_speedups`); None with fewer
    than two passes or too few steps."""
    passes = _pass_speedups(t, dense) if _measurable(t, dense) else []
    return (min(passes), max(passes)) if len(passes) > 1 else None


def acceptance(t: Trace) -> float | None:
    proposed = sum(len(r.proposed) for r in t.rounds)
    return sum(r.accepted for r in t.rounds) / proposed if proposed else None


def position_acceptance(t: Trace) -> float | None:
    """Per-position acceptance α: accepted / positions tested. A round tests its accepted tokens and
    the first rejected one; the tokens drafted after it were never tested (accepted / proposed
    counts them as rejected: at a true 0.8 with γ = 9 it reads about 0.39). Ω(α, γ) takes this α."""
    tested = sum(r.accepted + (r.accepted < len(r.proposed)) for r in t.rounds)
    return sum(r.accepted for r in t.rounds) / tested if tested else None


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    """Ω = (1 - α^(γ+1)) / (1 - α): expected tokens per round at acceptance α (γ + 1 at α = 1)."""
    return gamma + 1.0 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def speculative_bound(alpha: float | list[float], gamma: int, c: float, v: float) -> float:
    """Speedup σ = Ω / (γ·c + v) with draft step cost c and verification cost v in dense steps. A
    list of α: rows decoded together, sharing each round's γ and passes (their mean Ω)."""
    alphas = alpha if isinstance(alpha, list) else [alpha]
    return statistics.mean(expected_tokens_per_round(a, gamma) for a in alphas) / (gamma * c + v)


def batch_bound(figs: list[dict], adaptive: bool) -> float | None:
    """The bound from step costs of rows decoded together (`ratios` of each row against its dense
    run in the same batch). A batch's rounds are shared: one γ per round, every row's draft steps
    and its verification in the same passes, so a row that drafts less saves nothing. The batch's
    best is then max over γ of the rows' mean Ω(α_b, γ) / (γ·c + v(γ)), with c and v(γ) = v0 + γ·r
    the batch's costs (`step_costs`; the rows' medians: every row is timed by the same rounds), and
    at least 1x with adaptive γ (dense steps). The median of the rows' own bounds would let each row
    pick its γ: more than any shared round can give where rows accept at different rates. None
    without costs."""
    rows = [f for f in figs if f.get("draft_step_cost") is not None and f.get("gamma")]
    if not rows:
        return None
    return bound_over_gamma([f["position_acceptance"] for f in rows], max(f["gamma"] for f in rows),
                            *(statistics.median(f[k] for f in rows) for k in ("draft_step_cost", "verify_base",
                                                                              "verify_row_cost")), adaptive)


def bound_over_gamma(alpha: float | list[float], gamma: int, c: float, v0: float, r: float, adaptive: bool) -> float:
    """σ from step costs, a verification of γ + 1 tokens costing v0 + γ·r (`step_costs`): at `gamma`,
    or with adaptive γ the best γ up to it and at least 1x (it can always run dense steps)."""
    best = max(speculative_bound(alpha, g, c, v0 + g * r) for g in (range(1, gamma + 1) if adaptive else [gamma]))
    return max(1.0, best) if adaptive else best


def best_gamma(alpha: float | list[float], gamma_max: int, t_draft: float, t_dense: float, t_row: float,
               margin: float = 0.05, padded: int | None = None) -> int:
    """The γ in [0, gamma_max] with the most expected tokens per second: Ω(α, γ) tokens per round of
    γ draft steps (t_draft each) and one verification of γ + 1 tokens (t_dense + γ·t_row); γ = 0 is a
    plain dense step (one token per t_dense). A list of α: rows decoded together (`speculative_bound`).
    `padded`: every verification computes that many rows whatever γ (captured CUDA graphs: one graph
    serves every γ), so it costs t_dense + (padded - 1)·t_row. Speculation must beat dense by
    `margin` (the costs are measured, and a step's time varies by a few % between steps), else 0."""
    def rate(g: int) -> float:
        rows = g if not padded or g == 0 else padded - 1
        return speculative_bound(alpha, g, t_draft, t_dense + rows * t_row)

    best = max(range(gamma_max + 1), key=lambda g: (rate(g), -g))
    return best if rate(best) >= (1 + margin) * rate(0) else 0


def step_costs(t: Trace, dense: Trace) -> tuple[float, float, float, float] | None:
    """(c, v, v0, r) of a speculative run, in dense steps (dense's median decode step of the same
    prompt): its mean draft step c and mean verification pass v, and a verification of γ + 1 tokens
    as v0 + γ·r. Where the run verified at two γ or more (adaptive γ: probes, then its choices), v0
    and r are the least-squares line through each γ's median pass (weighted by its rounds); at one
    γ, v0 = 1 (a dense step) and r the rest per drafted token, `GammaPlan`'s model. A verification
    is not the same cost at every γ: on 2 cores at batch 8, 4,608 visual tokens, passes of 2, 4, 7
    and 10 tokens cost 1.30, 1.65, 2.13 and 2.57 dense steps, so a bound over γ that took one γ's
    pass for all of them was up to 1.3x too high."""
    spec = [r for r in t.rounds if r.proposed]  # rounds with γ = 0 are plain dense steps
    if not spec or not dense.step_s:
        return None
    step = statistics.median(dense.step_s)
    c = sum(r.draft_s for r in spec) / sum(len(r.proposed) for r in spec) / step
    v = statistics.mean(r.verify_s for r in spec) / step
    by_gamma: dict[int, list[float]] = {}
    for r in spec:
        by_gamma.setdefault(len(r.proposed), []).append(r.verify_s / step)
    if len(by_gamma) > 1:
        w = np.array([len(ys) for ys in by_gamma.values()], dtype=float)
        x = np.array(list(by_gamma), dtype=float)
        y = np.array([statistics.median(ys) for ys in by_gamma.values()])
        xm, ym = np.average(x, weights=w), np.average(y, weights=w)
        slope = max(0.0, float(np.average((x - xm) * (y - ym), weights=w) / np.average((x - xm) ** 2, weights=w)))
        return c, v, float(ym - slope * xm), slope
    (g, ys), = by_gamma.items()
    v1 = statistics.median(ys)
    return c, v, min(1.0, v1), (v1 - min(1.0, v1)) / g


def ratios(t: Trace, dense: Trace, prompt: PromptInfo) -> dict:
    """A method's figures against dense on the same prompt (dense's own ratios are 1)."""
    d = dict(speedup=decode_speedup(t, dense), e2e_speedup=dense.total_s / t.total_s if t.total_s else None,
             kv_ratio=t.kv_bytes / dense.kv_bytes if dense.kv_bytes else None,
             identical_to_dense=t.token_ids == dense.token_ids, lossless=t.kind != "direct",
             speedup_range=decode_speedup_range(t, dense),
             decode_tokens=t.decode_tokens, prefill_ratio=t.prefill_s / dense.prefill_s if dense.prefill_s else None)
    if t.kind == "speculative":
        a = acceptance(t)
        d.update(acceptance=a, rounds=len(t.rounds), gamma=t.gamma,
                 tokens_per_round=t.decode_tokens / len(t.rounds) if t.rounds else None,
                 proposed=sum(len(r.proposed) for r in t.rounds), accepted=sum(r.accepted for r in t.rounds),
                 draft_entries=t.draft_entries, predicted_speedup=None, bound_speedup=None,
                 dense_steps=sum(1 for r in t.rounds if not r.proposed))
        if a and t.gamma:  # I/O model: c = (K + m_t) / m, v = 1
            d["predicted_speedup"] = prompt.m / ((t.gamma * t.draft_entries + prompt.m) / (a * t.gamma))
        costs = step_costs(t, dense)
        if costs is not None and t.gamma:
            c, v, v0, r = costs
            step_ms = 1e3 * statistics.median(dense.step_s)
            pa = position_acceptance(t) or 0.0  # Ω's α
            d.update(dense_step_ms=step_ms, draft_step_ms=c * step_ms, verify_ms=v * step_ms,
                     draft_step_cost=c, verify_cost=v, verify_base=v0, verify_row_cost=r, position_acceptance=pa)
            adaptive = any(rd.why != "fixed" for rd in t.rounds)
            for key, alpha in (("bound_speedup", pa), ("bound_speedup_full_acceptance", 1.0)):
                d[key] = bound_over_gamma(alpha, t.gamma, c, v0, r, adaptive)
            if d["speedup"] and d["bound_speedup"]:  # how much of what its own step costs allow it reached
                d["bound_share"] = d["speedup"] / d["bound_speedup"]
    return d


# ---------------------------------------------------------------------------------------------
# Analytic costs of a run from its selections (language model only)


def _allowed(rec: LayerRecord, H: int, m: int) -> np.ndarray:
    """bool [H, m]: prompt positions each query head reads (a dropped head: none)."""
    G = H // len(rec.kept)
    allowed = np.zeros((H, m), dtype=bool)
    for g, idx in enumerate(rec.kept):
        allowed[g * G:(g + 1) * G, idx] = True
    if rec.query_mask is not None:
        allowed &= rec.query_mask
    if rec.head_scale is not None:
        allowed &= (rec.head_scale != 0)[:, None]
    return allowed


def head_keys(rec: LayerRecord | None, m: int, H: int) -> np.ndarray:
    """Prompt positions each query head attends at decode: int [H] (0 for a dropped head)."""
    return np.full(H, m) if rec is None else _allowed(rec, H, m).sum(1)


def prefill_attended(rec: LayerRecord | None, m: int, H: int, routed: bool) -> int:
    """(query, key) pairs one layer's prefill attention computes, summed over query heads.

    Dense (or a prefill that is not routed): every row t attends keys 0..t. Routed: every row t of
    head h attends only its allowed positions <= t (a dropped head: none), as
    `routing.routed_attention` computes them. A pruned layer (`rec.rows`) computes only its
    processed rows, over processed keys.
    """
    rows = None if rec is None else rec.rows
    if rec is None or not routed:
        n = m if rows is None else len(rows)
        return H * n * (n + 1) // 2
    counts = np.cumsum(_allowed(rec, H, m), axis=1)  # [H, m]: allowed positions <= t
    return int(counts.sum() if rows is None else counts[:, rows].sum())


def _flops(s: ModelShape, rows: int, attended_pairs: int) -> float:
    """FLOPs of `rows` new tokens in one layer: projections and MLP (2·in·out per row and matrix) +
    attention scores and values (2·D each per (query head, key) pair)."""
    proj = 2 * rows * (s.d * s.H * s.D + 2 * s.d * s.Hkv * s.D + s.H * s.D * s.d + 3 * s.d * s.I)
    return proj + 4 * s.D * attended_pairs


def efficiency(layers: dict[int, LayerRecord], s: ModelShape, m: int, query_start: int, n_steps: int,
               routed_prefill: bool = False, low_rank: int = 0) -> dict:
    """Analytic costs of one run whose layers keep `layers` ({} = dense).

    prefill_kv_bytes: prompt KV held after prefill. decode_kv_bytes: KV entries attended per decode
    step, averaged over steps 1..n_steps. prefill_flops: projections + MLP + attention over the
    pairs each head attends (+ for a policy, the relevance scores of the query rows, + the LM head of
    the last position). decode_flops: per step, the same per token, each head over its kept prompt
    entries + generated tokens; low-rank scoring costs 2·r per prompt pair instead of 2·D, and the
    prefill pays the SVD and projection of the prompt keys. A pruned layer (`LayerRecord.rows`)
    counts its m' processed rows for projections, MLP, scores and SVD. peak_act_bytes: one layer's prefill
    activations (+ a policy's float32 relevance scores); the peak estimate is weights + prefill KV +
    this. Vision-tower costs are left out (the same for every method).
    """
    entry = 2 * s.D * s.bytes
    mean_gen = (n_steps + 1) / 2
    kv_prompt = sum(sum(layers[l].lengths) if l in layers else s.Hkv * m for l in range(s.L))
    start = min(query_start, m - 1)
    pre = dec = 2.0 * s.d * s.V
    for layer in range(s.L):
        rec = layers.get(layer)
        n = m if rec is None or rec.rows is None else len(rec.rows)  # rows this layer's prefill processed
        pre += _flops(s, n, prefill_attended(rec, m, s.H, routed_prefill))
        if layers:  # the query rows (text, never pruned) score the layer's n keys
            pre += 2 * s.D * s.H * (m - start) * n
        keys = head_keys(rec, m, s.H)
        active = s.H if rec is None or rec.head_scale is None else int((rec.head_scale != 0).sum())
        r = min(low_rank, s.D) if rec is not None and low_rank else s.D
        if r < s.D:
            pre += s.Hkv * (4 * n * s.D * s.D + 4 * n * s.D * r)
        dec += _flops(s, 1, 0) + (2 * s.D + 2 * r) * int(keys.sum()) + 4 * s.D * active * mean_gen
    act = m * (3 * s.d + 2 * s.H * s.D + 2 * s.Hkv * s.D + 3 * s.I) * s.bytes
    if layers:
        act += 4 * s.H * (m - start) * m
    return dict(prefill_kv_bytes=kv_prompt * entry, decode_kv_bytes=(kv_prompt + s.L * s.Hkv * mean_gen) * entry,
                prefill_flops=pre, decode_flops=dec, peak_act_bytes=act)


def efficiency_pct(t: Trace, dense: Trace, s: ModelShape, prompt: PromptInfo) -> dict:
    """A direct run's costs as % of dense on the same prompt (the HT-Sparse paper's figures): prefill and
    decode KV, prefill and decode FLOPs (counted over the same number of decode steps for both),
    peak memory (CUDA: peak allocated; CPU: weights + the run's peak resident growth; else the
    analytic estimate), prefill wall time and end-to-end latency (measured)."""
    n_steps = max(1, dense.decode_tokens)
    routed = bool(t.config.get("route_prefill")) and t.kind == "direct"
    low_rank = int(t.config.get("low_rank") or 0)
    mine = efficiency(t.layers, s, prompt.m, prompt.query_start, n_steps, routed, low_rank)
    ref = efficiency({}, s, prompt.m, prompt.query_start, n_steps)
    out = {f"{k}_pct": 100 * mine[k] / ref[k]
           for k in ("prefill_kv_bytes", "decode_kv_bytes", "prefill_flops", "decode_flops")}
    out = {k.replace("_bytes_pct", "_pct"): v for k, v in out.items()}
    if t.peak_memory_bytes is not None and dense.peak_memory_bytes is not None:
        if t.peak_memory_source == "rss":  # CPU: weights + each run's peak resident growth
            pct = 100 * (s.weight_bytes + t.peak_memory_bytes) / (s.weight_bytes + dense.peak_memory_bytes)
        else:
            pct = 100 * t.peak_memory_bytes / dense.peak_memory_bytes
        out.update(peak_memory_pct=pct, peak_memory_source=t.peak_memory_source)
    else:
        peak = s.weight_bytes + mine["prefill_kv_bytes"] + mine["peak_act_bytes"]
        peak_ref = s.weight_bytes + ref["prefill_kv_bytes"] + ref["peak_act_bytes"]
        out.update(peak_memory_pct=100 * peak / peak_ref, peak_memory_source="estimate")
    out["latency_pct"] = 100 * t.total_s / dense.total_s if dense.total_s else None
    out["prefill_wall_pct"] = 100 * t.prefill_s / dense.prefill_s if dense.prefill_s else None
    return out


def top_share(scores: np.ndarray, frac: float = 0.05) -> float:
    """Share of the score mass held by the top `frac` of the entries (at least one)."""
    s = np.sort(np.asarray(scores, dtype=float).ravel())[::-1]
    n = max(1, int(np.ceil(frac * s.size)))
    return float(s[:n].sum() / s.sum()) if s.sum() > 0 else 0.0
