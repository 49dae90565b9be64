"""The one attention path every method uses, registered in transformers as "sparsevid".

Inside `active(run)`, the language model's attention layers call `sparsevid_attention`, which:

- in dense mode, attends over the dense cache (prefill: causal SDPA; later steps: `grouped_sdpa`);
- at prefill, computes the layer's `LayerStats` (relevance, SnapKV window attention, query norms)
  from the layer's own queries and keys in the same forward, asks the run's policy for the layer's
  `LayerSelection`, and gathers the layer's compact `SparseKV` right away;
- in sparse mode, attends over the compact cache only.

Outside `active(...)` it behaves as plain causal attention, so the model still works normally.
Batch size 1, no padding: causality is applied here, so the mask function returns None.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from .cache import KVCache, LayerSelection, SparseKV, grouped_sdpa, keep_all, low_rank_keys

NAME = "sparsevid"


@dataclass
class LayerStats:
    """Prefill statistics of one layer, from its own queries and keys (SPEC §1).

    relevance [Hkv, m]: attention the query tokens give each prompt key (softmax over all keys,
        causal), averaged over query tokens, summed over the group's query heads.
    window [Hkv, m] or None: attention of the last `window` prompt tokens, averaged over those rows
        and the group's query heads (SnapKV).
    query_norm_last [H]: L2 norm of each head's query at the last prompt token.
    query_norm_mean [H]: same, averaged over the query tokens.
    """

    relevance: torch.Tensor
    window: torch.Tensor | None
    query_norm_last: torch.Tensor
    query_norm_mean: torch.Tensor


@dataclass
class Run:
    """State of one forward pass sequence, set as the active context by the engine.

    policy: object with `select(layer, stats, run) -> LayerSelection | None` (None keeps everything),
        and an int attribute `window` (rows of SnapKV statistics it needs; 0 for none).
    visual_positions: LongTensor [m_v]; query_start: first position after the visual span.
    """

    cache: KVCache
    num_heads: int
    visual_positions: torch.Tensor
    query_start: int
    policy: object | None = None
    keep_stats: bool = False
    stats: dict[int, LayerStats] = field(default_factory=dict)
    selections: dict[int, LayerSelection] = field(default_factory=dict)
    on_decode_attention: Callable | None = None  # (layer, probs [H, q, n]) during dense decode


_ACTIVE: contextvars.ContextVar[Run | None] = contextvars.ContextVar("sparsevid_run", default=None)


@contextmanager
def active(run: Run):
    token = _ACTIVE.set(run)
    try:
        yield run
    finally:
        _ACTIVE.reset(token)


def layer_stats(query: torch.Tensor, key: torch.Tensor, scale: float, query_start: int, window: int) -> LayerStats:
    """query [1, H, m, D], key [1, Hkv, m, D] of a prefill -> LayerStats (computed in float32)."""
    _, H, m, D = query.shape
    Hkv = key.shape[1]
    G = H // Hkv
    qs = min(query_start, m - 1)
    window = min(window, m)  # a prompt shorter than the window: every row is in it
    start = min(qs, m - window) if window else qs
    r = m - start
    rows = query[0, :, start:].float().reshape(Hkv, G * r, D)
    scores = torch.matmul(rows, key[0].float().transpose(1, 2)).view(Hkv, G, r, m) * scale
    causal = torch.arange(m, device=query.device)[None, :] <= torch.arange(start, m, device=query.device)[:, None]
    probs = scores.masked_fill_(~causal, float("-inf")).softmax(-1)  # [Hkv, G, r, m]
    relevance = probs[:, :, qs - start:].mean(2).sum(1)
    win = probs[:, :, r - window:].mean(2).mean(1) if window else None
    norms = query[0, :, qs:].float().norm(dim=-1)  # [H, m - qs]: the query tokens, the last one included
    return LayerStats(relevance, win, norms[:, -1], norms.mean(-1))


def _route_prefill_rows(out, query, key, value, scale, sel: LayerSelection, start: int):
    """Recompute the prefill output rows [start, m) under the selection (HT-Sparse routing)."""
    _, H, m, D = query.shape
    Hkv = key.shape[1]
    G = H // Hkv
    allowed = torch.zeros(Hkv, m, dtype=torch.bool, device=query.device)
    for g, idx in enumerate(sel.keep):  # Hkv iterations, once per layer at prefill
        allowed[g, idx.to(query.device)] = True
    allowed = allowed.repeat_interleave(G, 0)  # [H, m]
    if sel.query_mask is not None:
        allowed &= sel.query_mask.to(query.device)
    causal = torch.arange(m, device=query.device)[None, :] <= torch.arange(start, m, device=query.device)[:, None]
    r = m - start
    mask = (allowed[:, None, :] & causal[None]).view(1, Hkv, G * r, m)  # a group's heads folded into rows
    rows = F.scaled_dot_product_attention(query[:, :, start:].reshape(1, Hkv, G * r, D), key, value,
                                          attn_mask=mask, scale=scale)
    rows = torch.nan_to_num(rows).view(1, H, r, D)  # a head allowed no key at all contributes nothing
    if sel.head_scale is not None:
        rows = rows * sel.head_scale.to(rows.device, rows.dtype).view(1, H, 1, 1)
    out[:, start:] = rows.transpose(1, 2)
    return out


def sparsevid_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: query [1, H, q, D], key/value [1, Hkv, n, D] -> ([1, q, H, D], None)."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    run = _ACTIVE.get()
    q, n = query.shape[2], key.shape[2]
    if run is None or run.cache.mode == "dense":
        if q == n and q > 1:  # prefill
            out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale,
                                                 enable_gqa=True).transpose(1, 2)
            if run is not None and (run.policy is not None or run.keep_stats):
                out = _prefill_hook(run, module.layer_idx, out, query, key, value, scale)
            return out, None
        if run is not None and run.on_decode_attention is not None:
            run.on_decode_attention(module.layer_idx, query, key, scale)
        return grouped_sdpa(query, key, value, scale), None
    sparse = run.cache.layers[module.layer_idx].sparse
    return sparse.attend(query, scale, run.cache.sparse_len + q - run.cache.prompt_len), None


def _prefill_hook(run: Run, layer: int, out, query, key, value, scale):
    window = getattr(run.policy, "window", 0) if run.policy is not None else 0
    stats = layer_stats(query, key, scale, run.query_start, window)
    if run.keep_stats:
        run.stats[layer] = stats
    if run.policy is None:
        return out
    sel = run.policy.select(layer, stats, run) or keep_all(key.shape[2], key.shape[1])
    run.selections[layer] = sel
    gen_capacity = run.cache.capacity - key.shape[2]
    score_key = low_rank_keys(key, sel.low_rank) if sel.low_rank else key  # the dense cache keeps `key`
    run.cache.set_sparse(layer, SparseKV(score_key, value, sel, gen_capacity, run.num_heads))
    if sel.route_prefill and not run.cache.store_dense:
        # Direct use only: as a draft, the prefill also fills the dense cache and gives the first
        # token, so it must stay dense (the draft then routes its decode steps only).
        out = _route_prefill_rows(out, query, score_key, value, scale, sel, min(run.query_start, key.shape[2] - 1))
    return out


def _no_mask(*args, **kwargs):
    """Batch size 1 without padding: causality is handled inside `sparsevid_attention`."""
    return None


def register() -> str:
    AttentionInterface.register(NAME, sparsevid_attention)
    AttentionMaskInterface.register(NAME, _no_mask)
    return NAME


register()
