"""HT-Sparse (SPEC §3.2, seed 001): query-guided head–token sparsification.

At prefill, in each routed layer, from the layer's own `LayerStats`:

1. head saliency `s [H]`: L2 norm of each query head's query at the last prompt token (or the
   mean over the query tokens), z-scored within the layer, `π = softmax(z / τ)`;
2. head partition by `π`: the top `h_f` query heads are full (at least one), the next `h_s`
   sparse, the rest dropped;
3. token selection: `r [m_v]` = relevance summed over heads at the visual positions; keep the
   top `l_v`, or the fewest tokens whose relevance reaches `η` of the total (coverage);
4. joint routing: full heads attend every prompt position, sparse heads the text positions + the
   selected tokens, dropped heads nothing (`drop_mode="zero"`: output × 0) or the text positions
   only (`"text_only"`). Generated tokens are always attended. A KV head keeps the union of what
   its query heads attend, so KV memory falls only where a whole GQA group is sparse or dropped.
   The routing applies to the query rows of prefill (`route_prefill`) and to every decode step.

Used directly (`htsparse`, lossy) the routing applies from prefill on; as a draft
(`htsparse-draft`, lossless) the prefill stays dense (it fills the dense cache) and the draft's
decode steps are routed. Optional low-rank scoring (SPEC §3.2 step 5, `low_rank = r`, off by
default): in routed layers the prompt keys are scored in rank r (`cache.low_rank_keys`); values are
untouched. The figures count its score FLOPs at rank r; the keys are still stored at full width.

Defaults (h_f = 25 %, h_s = 75 %, whole GQA groups, η = 0.7, τ = 1, mid + late layers,
last-token saliency), chosen on the embedded toy model's held-out clips (60 clips of 16 and 256
frames, `python -m sparsevid.htsparse_ablation --n 30`). On the current model (dense 96.7 %):
accuracy 90.0 %, 90 % of answers token-identical to dense, decode KV 47.8 % of dense; η = 0.8
98.3 % (98 % identical) at 51.1 %, η = 0.9 dense's accuracy (100 % identical) at 60 %. On 120 clips
(`python -m sparsevid.toy eval --n 60 --methods dense,htsparse`) the default loses less: 93.3 % vs
96.7 %, 95 % identical. Partitioning heads one by one kept a full head in almost every GQA group
(decode KV 58-68 %): with few KV heads per layer — 4 on the toy and on Qwen2-VL-7B — only
whole-group roles shrink the cache. The SPEC's sensible range for η is 0.7-0.9; the default is the
largest η there that keeps decode KV at or under half of dense. τ only shapes π (the partition
ranks heads).

Efficiency figures (`htsparse_figures`, as % of dense on the same inputs) are counted
analytically from the selections actually used; see its docstring for what is counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .attention import LayerStats, Run
from .cache import LayerSelection
from .methods import METHODS, Method, Settings, register
from .policies import text_positions
from .speculative import PolicyDraft

FULL, SPARSE, DROPPED = 0, 1, 2
ROLE_NAMES = ("full", "sparse", "dropped")
LAYER_STRATEGIES = ("early", "mid", "late", "mid+late", "all")
VARIANTS = ("ht", "head", "token")
DROP_MODES = ("zero", "text_only")


@dataclass
class HTSelection(LayerSelection):
    """A `LayerSelection` that also carries, for the trace, the saliency `π [H]` and the selected
    visual positions `tokens [k]` (all visual positions in the Head-only variant)."""

    saliency: torch.Tensor | None = None
    tokens: torch.Tensor | None = None


def routed_layers(strategy: str, num_layers: int) -> range:
    """Layers a strategy routes: thirds at round(L/3) and round(2L/3) (L = 28: 9 | 10 | 9;
    L = 4: 1 | 2 | 1). "mid+late" = [L/3, L), "all" = every layer."""
    a = round(num_layers / 3)
    b = max(round(2 * num_layers / 3), min(a + 1, num_layers))
    spans = {"early": (0, a), "mid": (a, b), "late": (b, num_layers), "mid+late": (a, num_layers),
             "all": (0, num_layers)}
    if strategy not in spans:
        raise ValueError(f"unknown layer strategy {strategy!r}; one of {', '.join(spans)}")
    return range(*spans[strategy])


def head_count(x: int | float, num_heads: int) -> int:
    """A head count given as an int, or as a fraction of the heads (float <= 1), within [0, H]."""
    n = math.floor(x * num_heads + 0.5) if isinstance(x, float) and x <= 1.0 else int(x)
    return max(0, min(n, num_heads))


def saliency(norms: torch.Tensor, tau: float = 1.0) -> torch.Tensor:
    """Query norms [H] -> π [H] = softmax(z / τ), z the z-score of the norms within the layer
    (population std; all-equal norms give z = 0, a uniform π)."""
    s = norms.float()
    std = s.std(unbiased=False) if s.numel() > 1 else s.new_zeros(())
    z = (s - s.mean()) / std if std > 0 else torch.zeros_like(s)
    return torch.softmax(z / tau, dim=0)


def partition(pi: torch.Tensor, n_full: int, n_sparse: int) -> torch.Tensor:
    """π [H] -> roles int8 [H]: the n_full highest π full (0), the next n_sparse sparse (1), the
    rest dropped (2). Ties go to the lower head index."""
    order = pi.sort(descending=True, stable=True).indices
    roles = torch.full(pi.shape, DROPPED, dtype=torch.int8, device=pi.device)
    roles[order[:n_full]] = FULL
    roles[order[n_full:n_full + n_sparse]] = SPARSE
    return roles


def coverage_count(r: torch.Tensor, eta: float) -> int:
    """The fewest tokens whose relevance sum reaches η of the total: r [n] >= 0 -> count in [1, n]."""
    n = r.numel()
    if eta >= 1.0 or n == 0:
        return n
    cum = r.float().sort(descending=True).values.cumsum(0)
    k = int(torch.searchsorted(cum, eta * cum[-1]))  # first index whose prefix sum reaches η·total
    return max(1, min(k + 1, n))


def select_tokens(r: torch.Tensor, l_v: int | float | None = None, eta: float | None = 0.8) -> torch.Tensor:
    """Relevance r [m_v] -> sorted indices [k] of the kept visual tokens: the top `l_v` (a count or
    a fraction of m_v) when given, else the coverage rule with η (None or >= 1: all tokens)."""
    n = r.numel()
    if l_v is not None:
        k = head_count(l_v, n) if isinstance(l_v, float) else max(0, min(int(l_v), n))
    else:
        k = coverage_count(r, 1.0 if eta is None else eta)
    return r.float().topk(k).indices.sort().values


def route(roles: torch.Tensor, num_kv_heads: int, m: int, text: torch.Tensor, selected: torch.Tensor,
          drop_mode: str = "zero") -> tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
    """Joint routing of one layer.

    roles int8 [H]; text [m_t] and selected [k]: prompt positions. Returns
    keep (one sorted LongTensor per KV head: the union of its query heads' positions),
    query_mask bool [H, m] (None when every head sees its whole group's keep) and
    head_scale [H] (0 for dropped heads in "zero" mode; None when nothing is scaled).
    """
    if drop_mode not in DROP_MODES:
        raise ValueError(f"unknown drop_mode {drop_mode!r}; one of {', '.join(DROP_MODES)}")
    H = roles.numel()
    G = H // num_kv_heads
    dev = roles.device
    text_row = torch.zeros(m, dtype=torch.bool, device=dev)
    text_row[text.to(dev)] = True
    sparse_row = text_row.clone()
    sparse_row[selected.to(dev)] = True
    allowed = torch.where((roles == FULL)[:, None], True,
                          torch.where((roles == SPARSE)[:, None], sparse_row, text_row))  # [H, m]
    group = allowed.view(num_kv_heads, G, m).any(1)  # [Hkv, m]
    keep = [row.nonzero().squeeze(1) for row in group]  # Hkv iterations
    mixed = bool((allowed != group.repeat_interleave(G, 0)).any())
    query_mask = allowed if mixed else None
    zeroed = drop_mode == "zero" and bool((roles == DROPPED).any())
    head_scale = (roles != DROPPED).float() if zeroed else None
    return keep, query_mask, head_scale


@dataclass
class HTSparse:
    """HT-Sparse policy (SPEC §3.2). Per routed layer: roles [H], a token set, a routed selection.

    heads_full / heads_sparse: h_f (>= 1) and h_s, counts or fractions of the query heads H.
    tau: softmax temperature of π (the partition ranks heads by π, so τ only shapes π's values).
    eta: coverage target of the token selection; l_v: a fixed top-l_v budget instead (count or
        fraction of m_v). layers: "early" | "mid" | "late" | "mid+late" | "all".
    variant: "ht" (heads and tokens), "head" (head partition only: sparse heads see every token,
        so they are in effect full, and only dropped heads change anything: with the default
        h_f + h_s = 100 % it equals dense), "token" (every head sparse, no full head).
    drop_mode: "zero" (dropped heads output 0) or "text_only" (they attend text positions only).
    summary: "last" (query of the last prompt token) or "mean" (mean over the query tokens).
    by_group: partition whole GQA groups (ranked by the sum of their heads' π; ceil(h_f / G) full
        groups, round(h_s / G) sparse) so that KV memory falls on models with few KV heads, where
        a per-head partition almost always leaves a full head in every group. On by default.
    low_rank: r > 0 scores the prompt keys of routed layers in rank r (SVD of each KV head's
        prefill keys; values untouched). 0 = off (default).
    """

    heads_full: int | float = 0.25
    heads_sparse: int | float = 0.75
    tau: float = 1.0
    eta: float | None = 0.7
    l_v: int | float | None = None
    layers: str = "mid+late"
    variant: str = "ht"
    drop_mode: str = "zero"
    summary: str = "last"
    by_group: bool = True
    low_rank: int = 0
    window: int = 0
    name: str = "htsparse"

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown HT-Sparse variant {self.variant!r}; one of {', '.join(VARIANTS)}")
        if self.drop_mode not in DROP_MODES:
            raise ValueError(f"unknown drop_mode {self.drop_mode!r}; one of {', '.join(DROP_MODES)}")
        if self.summary not in ("last", "mean"):
            raise ValueError(f"unknown query summary {self.summary!r}; 'last' or 'mean'")
        routed_layers(self.layers, 1)  # validates the strategy name

    def roles(self, pi: torch.Tensor, num_kv_heads: int = 1) -> torch.Tensor:
        """π [H] -> roles int8 [H] for this variant."""
        H = pi.numel()
        if self.variant == "token":
            return torch.full((H,), SPARSE, dtype=torch.int8, device=pi.device)
        n_full = max(1, head_count(self.heads_full, H))
        n_sparse = min(head_count(self.heads_sparse, H), H - n_full)
        if self.variant == "head":
            n_full, n_sparse = n_full + n_sparse, 0
        if self.by_group:
            G = H // num_kv_heads
            groups = partition(pi.view(num_kv_heads, G).sum(1), math.ceil(n_full / G),
                               min(math.floor(n_sparse / G + 0.5), num_kv_heads - math.ceil(n_full / G)))
            return groups.repeat_interleave(G)
        return partition(pi, n_full, n_sparse)

    def select(self, layer: int, stats: LayerStats, run: Run) -> LayerSelection | None:
        if layer not in routed_layers(self.layers, len(run.cache.layers)):
            return None
        Hkv, m = stats.relevance.shape
        norms = stats.query_norm_last if self.summary == "last" else stats.query_norm_mean
        pi = saliency(norms, self.tau)
        roles = self.roles(pi, Hkv)
        dev = stats.relevance.device
        vis = run.visual_positions.to(dev)
        text = text_positions(run, m).to(dev)
        if self.variant == "head":
            tokens = vis
        else:
            tokens = vis[select_tokens(stats.relevance.sum(0)[vis], self.l_v, self.eta)]
        keep, query_mask, head_scale = route(roles.to(dev), Hkv, m, text, tokens, self.drop_mode)
        restricted = query_mask is not None or head_scale is not None or any(k.numel() < m for k in keep)
        return HTSelection(keep, query_mask, head_scale, route_prefill=restricted or self.low_rank > 0,
                           roles=roles.cpu(), low_rank=self.low_rank, saliency=pi.cpu(), tokens=tokens.cpu())


def from_settings(s: Settings) -> HTSparse:
    d = HTSparse()
    return HTSparse(heads_full=d.heads_full if s.heads_full is None else s.heads_full,
                    heads_sparse=d.heads_sparse if s.heads_sparse is None else s.heads_sparse,
                    tau=s.tau, eta=s.eta, l_v=s.l_v, layers=s.ht_layers, variant=s.ht_variant,
                    drop_mode=s.drop_mode, summary=s.ht_summary,
                    by_group=s.ht_by_group, low_rank=s.low_rank or 0)


# ---------------------------------------------------------------------------------------------
# Trace and figures


def head_keys(sel: LayerSelection | None, m: int, num_heads: int) -> torch.Tensor:
    """Prompt positions each query head attends at decode: LongTensor [H] (0 for a zeroed head)."""
    if sel is None:
        return torch.full((num_heads,), m, dtype=torch.long)
    if sel.query_mask is not None:
        n = sel.query_mask.sum(1).cpu().long()
    else:
        n = torch.tensor(sel.lengths).repeat_interleave(num_heads // len(sel.keep))
    if sel.head_scale is not None:
        n = n * (sel.head_scale.cpu() != 0)
    return n


def prefill_attended(sel: LayerSelection | None, m: int, num_heads: int, start: int) -> int:
    """(query, key) pairs the prefill attention of one layer computes, summed over query heads.

    Rows before `start` (the visual span and what precedes it) stay dense and causal; with
    `route_prefill`, row t >= start of head h attends only its allowed positions <= t.
    """
    dense = num_heads * m * (m + 1) // 2
    if sel is None or not sel.route_prefill:
        return dense
    allowed = torch.zeros(num_heads, m, dtype=torch.bool)
    G = num_heads // len(sel.keep)
    for g, idx in enumerate(sel.keep):  # Hkv iterations
        allowed[g * G:(g + 1) * G, idx.cpu()] = True
    if sel.query_mask is not None:
        allowed &= sel.query_mask.cpu()
    if sel.head_scale is not None:
        allowed &= (sel.head_scale.cpu() != 0)[:, None]
    routed_rows = int(allowed.long().cumsum(1)[:, start:].sum())
    return num_heads * start * (start + 1) // 2 + routed_rows if start else routed_rows


def model_shapes(loaded) -> dict:
    c = loaded.text_config
    return dict(L=loaded.num_layers, H=loaded.num_heads, Hkv=loaded.num_kv_heads, D=loaded.head_dim,
                d=c.hidden_size, I=c.intermediate_size, V=c.vocab_size,
                bytes=torch.finfo(loaded.dtype).bits // 8)


def htsparse_trace(selections: dict, num_layers: int, num_heads: int, num_kv_heads: int, m: int) -> dict:
    """Per-layer panels: roles int8 [L, H] (0 full / 1 sparse / 2 dropped; unrouted layers are
    dense, so all full), saliency π [L, H] (NaN where not routed), tokens {layer: positions [k]},
    kv_lengths [L, Hkv] (prompt entries each KV head keeps), routed_layers."""
    roles = torch.zeros(num_layers, num_heads, dtype=torch.int8)
    sal = torch.full((num_layers, num_heads), float("nan"))
    kv = torch.full((num_layers, num_kv_heads), m, dtype=torch.long)
    tokens, routed = {}, []
    for layer, sel in sorted(selections.items()):
        kv[layer] = torch.tensor(sel.lengths)
        if isinstance(sel, HTSelection):
            routed.append(layer)
            roles[layer] = sel.roles
            sal[layer] = sel.saliency
            tokens[layer] = sel.tokens
    return dict(roles=roles, saliency=sal, tokens=tokens, kv_lengths=kv, routed_layers=routed)


def _flops(shape: dict, rows: int, attended_pairs: int) -> float:
    """Language-model FLOPs of `rows` new tokens in one layer: the projections and MLP (2·in·out per
    row and matrix) + attention scores and values (2·D each per (query head, key) pair)."""
    d, H, Hkv, D, inter = shape["d"], shape["H"], shape["Hkv"], shape["D"], shape["I"]
    proj = 2 * rows * (d * H * D + 2 * d * Hkv * D + H * D * d + 3 * d * inter)
    return proj + 4 * D * attended_pairs


def efficiency(selections: dict, shape: dict, m: int, query_start: int, n_steps: int) -> dict:
    """Analytic costs of one run whose layers keep `selections` ({} = dense), language model only.

    prefill_kv_bytes: prompt KV held after prefill. decode_kv_bytes: KV entries attended per decode
    step, averaged over steps 1..n_steps (prompt entries kept + generated so far).
    prefill_flops: projections + MLP + attention over the pairs each head attends (visual rows
    dense; routed rows over their allowed keys), + the relevance scores a policy needs (QK of the
    query rows, 2·D per pair), + the LM head of the last position. decode_flops: per step, the same
    per token, each head over its kept prompt entries + generated tokens (a zeroed head: none);
    with low-rank scoring, scores over prompt entries cost 2·r per pair instead of 2·D, and the
    prefill pays the SVD and projection of the prompt keys (routed prefill rows counted at full D).
    peak_act_bytes (the peak estimate is weights + prefill_kv_bytes + this): one layer's prefill
    activations (hidden ×3, q, k, v, attention output, MLP ×3, in both runs: the layer's new K/V
    exist before they are copied into either cache) + for a policy, its float32 relevance scores of
    the query rows. Vision-tower activations are left out (identical for every method).
    """
    L, H, Hkv, D, d, V, nb = (shape[k] for k in ("L", "H", "Hkv", "D", "d", "V", "bytes"))
    entry = 2 * D * nb  # one KV head's K and V for one position
    mean_gen = (n_steps + 1) / 2
    kv_prompt = sum(sum(selections[l].lengths) if l in selections else Hkv * m for l in range(L))
    start = min(query_start, m - 1)
    pre = dec = 2.0 * d * V  # LM head: the last prompt position, then one row per step
    for layer in range(L):
        sel = selections.get(layer)
        pre += _flops(shape, m, prefill_attended(sel, m, H, start))
        if selections:  # a policy computes the relevance of the query rows over all keys
            pre += 2 * D * H * (m - start) * m
        keys = head_keys(sel, m, H)
        active = H if sel is None or sel.head_scale is None else int((sel.head_scale != 0).sum())
        r = min(sel.low_rank, D) if sel is not None and sel.low_rank else D
        if r < D:  # SVD of each KV head's prompt keys (~4·m·D²) + projecting them (4·m·D·r)
            pre += Hkv * (4 * m * D * D + 4 * m * D * r)
        # per (head, key) pair: scores 2·D (2·r on low-rank prompt keys) + values 2·D
        dec += _flops(shape, 1, 0) + (2 * D + 2 * r) * int(keys.sum()) + 4 * D * active * mean_gen
    act = m * (3 * d + 2 * H * D + 2 * Hkv * D + 3 * shape["I"]) * nb
    if selections:
        act += 4 * H * (m - start) * m
    return dict(prefill_kv_bytes=kv_prompt * entry, decode_kv_bytes=(kv_prompt + L * Hkv * mean_gen) * entry,
                prefill_flops=pre, decode_flops=dec, peak_act_bytes=act)


def htsparse_figures(res, dense, inputs, loaded) -> None:
    """Fill `res.trace` (roles, saliency, tokens, kv_lengths) and, for a direct run, `res.extra`
    with each figure as % of dense on the same run: peak_memory_pct (measured with CUDA when the
    engine recorded `peak_memory_bytes`, else the estimate of `efficiency`), prefill_kv_pct,
    decode_kv_pct (per step), latency_pct (end to end), prefill_flops_pct, decode_flops_pct."""
    shape = model_shapes(loaded)
    sels = res.trace.get("selections") or {}
    res.trace.update(htsparse_trace(sels, shape["L"], shape["H"], shape["Hkv"], inputs.m))
    method = METHODS.get(res.method)
    if method is not None and method.kind != "direct":
        return
    n_steps = max(1, len(dense.token_ids) - 1)  # the same steps for both runs
    mine = efficiency(sels, shape, inputs.m, inputs.query_start, n_steps)
    ref = efficiency({}, shape, inputs.m, inputs.query_start, n_steps)
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    e = res.extra
    for k, pct in (("prefill_kv_bytes", "prefill_kv_pct"), ("decode_kv_bytes", "decode_kv_pct"),
                   ("prefill_flops", "prefill_flops_pct"), ("decode_flops", "decode_flops_pct")):
        e[k], e[pct] = mine[k], 100 * mine[k] / ref[k]
    measured = res.extra.get("peak_memory_bytes"), dense.extra.get("peak_memory_bytes")
    if all(measured):
        e["peak_memory_pct"], e["peak_memory_source"] = 100 * measured[0] / measured[1], "cuda"
    else:
        peak = weights + mine["prefill_kv_bytes"] + mine["peak_act_bytes"]
        peak_ref = weights + ref["prefill_kv_bytes"] + ref["peak_act_bytes"]
        e["peak_memory_bytes_est"] = peak
        e["peak_memory_pct"], e["peak_memory_source"] = 100 * peak / peak_ref, "estimate"
    e["latency_pct"] = 100 * res.total_s / dense.total_s if dense.total_s else None


register(Method("htsparse", "HT-Sparse (direct)", "direct", lambda s, l: from_settings(s),
                figures=htsparse_figures))
register(Method("htsparse-draft", "HT-Sparse draft", "speculative",
                lambda s, l: PolicyDraft(from_settings(s), refresh=s.refresh), figures=htsparse_figures))
