"""HT-Sparse: query-guided head-token sparsification ("HT-Sparse: Training-Free
Query-Guided Head-Token Sparsification for Long-Video Multi-Modal Inference", anonymous ICLR 2026
submission, no arXiv id; seed 001).

In each routed layer, from the layer's own prefill statistics:

1. head saliency `s [H]`: L2 norm of each query head's query at the last prompt token (or the mean
   over the query tokens), z-scored within the layer, `π = softmax(z / τ)`;
2. head partition by `π`: the top `h_f` heads are full (at least one), the next `h_s` sparse, the
   rest dropped (by default whole GQA groups, ranked by the sum of their heads' π);
3. token selection: `r [m_v]` = relevance summed over heads at the visual positions; keep the top
   `l_v`, or the fewest tokens whose relevance reaches `η` of the total (coverage);
4. joint routing: full heads attend every prompt position, sparse heads the text positions + the
   selected tokens, dropped heads nothing (`drop_mode="zero"`) or the text only (`"text_only"`);
   generated tokens are always attended. A KV head keeps the union of what its query heads read.
5. optional low-rank scoring: prompt keys projected per KV head onto their top-r right singular
   vectors (`low_rank = r`), values untouched.

Used directly (`htsparse`, lossy) the routing applies to a routed layer's whole prefill: the layer
computes its statistics from the query rows first, then every row (visual rows included) of a
sparse head attends only its kept positions <= t, dropped heads compute nothing, and the compact
cache keeps only what decoding reads (`routing.routed_attention`); then to every decode step. As a
draft (`htsparse-draft`, lossless) the prefill stays dense and only the draft's decode steps are
routed. Defaults and the measurements that chose them: README, "HT-Sparse: routed prefill".

Option `prune_after` (`ht_prune_after`, off by default; FastV-style, direct use only): after that
layer's selection, the visual tokens it did not select leave the prefill's hidden states, so every
later layer runs projections, MLP and attention on the text + selected rows only, at their
original positions, and selects among those (`attention.install`); traces stay in prompt positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..attention import LayerStats
from ..cache import LayerSelection, Prompt
from ..options import option
from .base import Method, text_positions

FULL, SPARSE, DROPPED = 0, 1, 2
ROLE_NAMES = ("full", "sparse", "dropped")
LAYER_STRATEGIES = ("early", "mid", "late", "mid+late", "all")
VARIANTS = ("ht", "head", "token")
DROP_MODES = ("zero", "text_only")


def routed_layers(strategy: str, num_layers: int) -> range:
    """Layers a strategy routes: thirds at round(L/3) and round(2L/3) (L = 28: 9 | 10 | 9;
    L = 4: 1 | 2 | 1). "mid+late" = [L/3, L), "all" = every layer."""
    a = round(num_layers / 3)
    b = max(round(2 * num_layers / 3), min(a + 1, num_layers))
    spans = {"early": (0, a), "mid": (a, b), "late": (b, num_layers), "mid+late": (a, num_layers),
             "all": (0, num_layers)}
    return range(*spans[strategy])


def head_count(x: int | float, n: int) -> int:
    """A count given as an int, or as a fraction of n (float), within [0, n]."""
    k = math.floor(x * n + 0.5) if isinstance(x, float) else int(x)
    return max(0, min(k, n))


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
    k = head_count(l_v, n) if l_v is not None else coverage_count(r, 1.0 if eta is None else eta)
    return r.float().topk(k).indices.sort().values


def route(roles: torch.Tensor, num_kv_heads: int, m: int, text: torch.Tensor, selected: torch.Tensor,
          drop_mode: str = "zero") -> tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
    """Joint routing of one layer: roles int8 [H]; text [m_t], selected [k]: prompt positions ->
    keep (per KV head, sorted: the union of its query heads' positions), query_mask bool [H, m]
    (None when every head reads its whole group's keep), head_scale [H] (0 for dropped heads in
    "zero" mode; None when nothing is scaled)."""
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
    keep = [row.nonzero().squeeze(1) for row in group]
    mixed = bool((allowed != group.repeat_interleave(G, 0)).any())
    zeroed = drop_mode == "zero" and bool((roles == DROPPED).any())
    return keep, allowed if mixed else None, (roles != DROPPED).float() if zeroed else None


def low_rank_keys(keys: torch.Tensor, rank: int) -> torch.Tensor:
    """keys [1, Hkv, m, D] -> the keys projected per head onto the top-`rank` right singular
    vectors of that head's keys: k P Pᵀ with P [D, rank], so q·(k P Pᵀ) = (q P)·(k P)."""
    k = keys[0].to(torch.promote_types(keys.dtype, torch.float32))  # [Hkv, m, D]
    rank = min(rank, k.shape[-1])
    _, _, vh = torch.linalg.svd(k, full_matrices=False)  # vh [Hkv, D, D]
    p = vh[:, :rank].transpose(1, 2)  # [Hkv, D, rank]
    return (k @ p @ p.transpose(1, 2)).to(keys.dtype)[None]


@dataclass
class HTSparse:
    """HT-Sparse policy. Per routed layer: head roles [H], a token set, a routed selection."""

    heads_full: int | float = option(0.25, "h_f: full heads per layer, a count or a fraction of the heads (at "
                                     "least one)", "amount", label="h_f: full heads per layer", unit="heads")
    heads_sparse: int | float = option(0.75, "h_s: sparse heads per layer, a count or a fraction of the heads",
                                       "amount", label="h_s: sparse heads per layer", unit="heads")
    tau: float = option(1.0, "τ: saliency softmax temperature (the partition ranks heads, so it only shapes π)",
                        "float", label="τ: saliency temperature", min=0.05, max=5.0)
    # η: 0.8 on the base model, 0.85 from the second fine-tune, 0.95 from the fifth (each chosen on
    # selection clips as the value within one point of dense's accuracy), 0.97 from the seventh (the
    # cheapest within one point on the selection clips and on the reported check; model card)
    eta: float = option(0.97, "η: relevance coverage of the kept visual tokens", "float",
                        label="η: relevance coverage of the kept tokens", min=0.05, max=1.0)
    l_v: int | float | None = option(None, "l_v: a fixed visual-token budget (count or fraction) instead of η "
                                     "coverage; blank: coverage", "amount", label="l_v: fixed visual-token budget",
                                     min=1, unit="tokens")
    layers: str = option("all", "routed layers (the paper: mid+late; every layer measured better here)", "choice", key="ht_layers", label="Routed layers",
                         choices=LAYER_STRATEGIES)
    variant: str = option("ht", "ht: heads + tokens; head: head partition only; token: token selection only",
                          "choice", key="ht_variant", label="Variant", choices=VARIANTS)
    drop_mode: str = option("zero", "dropped heads: zero (output 0) or text_only (attend the text only)",
                            "choice", label="Dropped heads", choices=DROP_MODES)
    summary: str = option("last", "head saliency from the last prompt token's query, or the mean over the "
                          "question's tokens", "choice", key="ht_summary", label="Head saliency from",
                          choices=("last", "mean"))
    by_group: bool = option(True, "partition whole GQA groups (so KV memory falls with them)", "bool",
                            key="ht_by_group", label="Partition whole GQA groups")
    low_rank: int = option(0, "r: score the prompt keys of routed layers in rank r (SVD per KV head); 0: off",
                           "int", label="r: low-rank scoring rank", min=0, max=256)
    prune_after: int | None = option(None, "FastV-style pruning: after this layer's selection, the visual tokens it "
                                     "did not select leave the prompt's hidden states, so every later layer runs "
                                     "projections, MLP and attention on the text + selected rows only (direct use "
                                     "only; the layer must be routed); blank: off", "optional_int",
                                     key="ht_prune_after", label="Prune unselected tokens after layer", min=0)
    stats = ("relevance", "query_norms")
    window = 0
    route_prefill = True

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
            full_groups = math.ceil(n_full / G)
            groups = partition(pi.view(num_kv_heads, G).sum(1), full_groups,
                               min(math.floor(n_sparse / G + 0.5), num_kv_heads - full_groups))
            return groups.repeat_interleave(G)
        return partition(pi, n_full, n_sparse)

    def selects(self, layer: int, prompt: Prompt) -> bool:
        """Only routed layers select (the others keep everything and need no statistics)."""
        return layer in routed_layers(self.layers, prompt.num_layers)

    def select(self, layer: int, stats: LayerStats, prompt: Prompt) -> LayerSelection | None:
        if not self.selects(layer, prompt):
            return None
        Hkv, m = stats.relevance.shape
        norms = stats.query_norm_last if self.summary == "last" else stats.query_norm_mean
        pi = saliency(norms, self.tau)
        roles = self.roles(pi, Hkv)
        dev = stats.relevance.device
        vis = prompt.visual_positions.to(dev)
        text = text_positions(prompt).to(dev)
        if self.variant == "head" or prompt.pruned:  # after pruning, the remaining tokens are the selection
            tokens = vis
        else:
            tokens = vis[select_tokens(stats.relevance.sum(0)[vis], self.l_v, self.eta)]
        keep, query_mask, head_scale = route(roles.to(dev), Hkv, m, text, tokens, self.drop_mode)
        return LayerSelection(keep, query_mask, head_scale, info=dict(roles=roles, saliency=pi, tokens=tokens))

    def score_keys(self, layer: int, key: torch.Tensor) -> torch.Tensor:
        """Keys the routed layers score and keep: rank-r projections with low-rank scoring, else as is."""
        return low_rank_keys(key, self.low_rank) if self.low_rank else key


PAPER = "ICLR 2026 submission (anonymous), no arXiv id"
METHODS = [Method("htsparse", "HT-Sparse (direct)", "direct", HTSparse, paper=PAPER),
           Method("htsparse-draft", "HT-Sparse draft", "speculative", HTSparse, paper=PAPER)]
