"""The one attention path every method uses, registered in transformers as "sparsevid".

Inside `active(run)`, the language model's attention layers call `sparsevid_attention`, which:

- in dense mode, attends over the dense cache (prefill: causal SDPA; later steps: `grouped_sdpa`);
- at prefill, computes the layer's `LayerStats` (relevance, SnapKV window attention, query norms)
  from the layer's own queries and keys in the same forward, asks the run's policy for the layer's
  `LayerSelection`, and gathers the layer's compact `SparseKV` right away; a selection that routes
  the prefill (HT-Sparse used directly) is applied to the layer's whole prefill attention
  (`routing.routed_attention`), which then runs after the selection instead of dense;
- in sparse mode, attends over the compact cache only;
- given a `fast.StaticKV` in place of key states (every decode step, `fast.static_step`), attends
  over its block (`fast.static_attention`) without reading the active run.

FastV-style pruning (a direct policy with `prune_after`, HT-Sparse's `ht_prune_after`): after that
layer's selection, the visual rows it did not select leave the prompt. `install(model)` (called once
by `models.load_model`) puts a forward pre-hook on every decoder layer that, only while the active
run is pruning its prefill, index-selects the kept rows of `hidden_states` and slices the rotary
`position_embeddings` to the same rows, so later layers run projections, MLP and attention on
m' = m_t + k rows at their original positions. Those layers select in pruned coordinates (a
`Prompt` of m' rows) and always hold a compact cache; `run.rows[layer]` maps back to the prompt.

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

from .cache import KVCache, LayerSelection, Prompt, SparseKV, causal_mask, grouped_sdpa
from .fast import StaticKV, static_attention
from .kernels import threads
from .routing import routed_attention

NAME = "sparsevid"


@dataclass
class LayerStats:
    """Prefill statistics of one layer, from its own queries and keys; each is computed
    only when the run's policy asks for it (`policy.stats`), else None.

    relevance [Hkv, m]: attention the query tokens give each prompt key (softmax over all keys,
        causal), averaged over query tokens, summed over the group's query heads.
    window [Hkv, m]: attention of the last `policy.window` prompt tokens, averaged over those rows
        and the group's query heads (SnapKV).
    query_norm_last [H]: L2 norm of each head's query at the last prompt token.
    query_norm_mean [H]: same, averaged over the query tokens.
    """

    relevance: torch.Tensor | None = None
    window: torch.Tensor | None = None
    query_norm_last: torch.Tensor | None = None
    query_norm_mean: torch.Tensor | None = None


@dataclass
class Run:
    """State of one forward pass sequence, set as the active context by the engine.

    policy: object with `select(layer, stats, prompt) -> LayerSelection | None` (None keeps
        everything), `stats` (the statistics it needs) and `window` (SnapKV rows; 0 for none), or
        `needs(prompt) -> (stats, window)` where they depend on the prompt;
        optional `score_keys(layer, key) -> key` (keys used for scoring and kept in its cache) and
        `route_prefill` (its selection routes the layer's whole prefill when used directly);
        `selects(layer, prompt) -> bool` (False: the layer keeps everything and needs no statistics);
        `prune_after` (an int: used directly, after that layer's selection the visual positions
        outside its `info["tokens"]` are pruned from the prefill's hidden states; None: off).
    keep_stats: also keep every layer's relevance (for evaluation figures).
    copy_all: a layer whose policy keeps everything still gets its own compact copy (a draft that
        keeps its own KV for accepted tokens, `refresh` off); otherwise it reads the dense cache.
    """

    cache: KVCache
    prompt: Prompt
    policy: object | None = None
    keep_stats: bool = False
    copy_all: bool = False
    stats: dict[int, LayerStats] = field(default_factory=dict)
    selections: dict[int, LayerSelection] = field(default_factory=dict)
    on_decode_attention: Callable | None = None  # (layer, query, key, scale) during dense decode
    position_offset: int = 0  # decode position minus cache length (set by the engine's prefill)
    rows: dict[int, torch.Tensor] = field(default_factory=dict)  # pruned layer -> original positions [m']
    prune: torch.Tensor | None = None  # while the prefill is pruning: the kept original positions [m']
    pruned_prompt: Prompt | None = None  # the prompt in pruned coordinates (m' rows)
    fast_steps: int = 0  # decode steps served by a compiled (CPU) or captured (CUDA) graph

    def prompt_of(self, layer: int) -> Prompt:
        """The prompt as layer `layer` sees it: pruned coordinates in a pruned layer."""
        return self.pruned_prompt if layer in self.rows else self.prompt

    def start_pruning(self, keep_visual: torch.Tensor) -> None:
        """Keep the text positions and the visual positions `keep_visual` for the later layers."""
        p = self.prompt
        text = torch.ones(p.m, dtype=torch.bool)
        text[p.visual_positions.cpu()] = False
        kept = text.clone()
        kept[keep_visual.cpu()] = True
        rows = kept.nonzero().squeeze(1)
        vis_rows = (~text)[rows].nonzero().squeeze(1)  # indices of the kept visual rows in `rows`
        self.prune = rows.to(p.visual_positions.device)
        self.pruned_prompt = Prompt(int(rows.numel()), vis_rows.to(p.visual_positions.device),
                                    int((rows < p.query_start).sum()), p.num_layers, p.num_heads, p.num_kv_heads,
                                    pruned=True)


_ACTIVE: contextvars.ContextVar[Run | None] = contextvars.ContextVar("sparsevid_run", default=None)


@contextmanager
def active(run: Run):
    token = _ACTIVE.set(run)
    try:
        yield run
    finally:
        _ACTIVE.reset(token)


def layer_stats(query: torch.Tensor, key: torch.Tensor, scale: float, query_start: int, window: int = 0,
                want=("relevance", "window", "query_norms")) -> LayerStats:
    """query [1, H, m, D], key [1, Hkv, m, D] of a prefill -> LayerStats (float32), only `want`."""
    _, H, m, D = query.shape
    Hkv = key.shape[1]
    G = H // Hkv
    qs = min(query_start, m - 1)
    stats = LayerStats()
    window = min(window, m) if "window" in want else 0  # a prompt shorter than the window: every row
    if "relevance" in want or window:
        start = min(qs, m - window) if window else qs
        r = m - start
        rows = query[0, :, start:].float().reshape(Hkv, G * r, D)
        scores = torch.matmul(rows, key[0].float().transpose(1, 2)).view(Hkv, G, r, m).mul_(scale)
        # causality masks only the keys at the rows' own positions [start, m) (the passes over all m
        # keys are what this costs: in place, and the mask over the last r keys only)
        scores[..., start:].masked_fill_(~causal_mask(r, r, query.device), float("-inf"))
        probs = scores.softmax(-1)  # [Hkv, G, r, m]
        if "relevance" in want:
            stats.relevance = probs[:, :, qs - start:].mean(2).sum(1)
        if window:
            stats.window = probs[:, :, r - window:].mean(2).mean(1)
    if "query_norms" in want:
        norms = query[0, :, qs:].float().norm(dim=-1)  # [H, m - qs]: the query tokens, the last one included
        stats.query_norm_last, stats.query_norm_mean = norms[:, -1], norms.mean(-1)
    return stats


def sparsevid_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: query [1, H, q, D], key/value [1, Hkv, n, D] -> ([1, q, H, D], None)."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if isinstance(key, StaticKV):  # a compiled step (`fast.static_step`): no run to read
        return static_attention(query, key, scale), None
    run = _ACTIVE.get()
    q, n = query.shape[2], key.shape[2]
    if run is None or run.cache.mode == "dense" or run.cache.layers[module.layer_idx].sparse is None:
        if q == n and q > 1:  # prefill
            if run is not None and (run.policy is not None or run.keep_stats):
                return _prefill_hook(run, module.layer_idx, query, key, value, scale), None
            return _causal(query, key, value, scale), None
        if run is not None and run.on_decode_attention is not None:
            run.on_decode_attention(module.layer_idx, query, key, scale)
        return grouped_sdpa(query, key, value, scale), None
    sparse = run.cache.layers[module.layer_idx].sparse
    return sparse.attend(query, scale, run.cache.sparse_len + q - run.cache.prompt_len), None


def _causal(query, key, value, scale):
    """Dense causal prefill: query [1, H, m, D], key/value [1, Hkv, m, D] -> [1, m, H, D]."""
    return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale,
                                          enable_gqa=True).transpose(1, 2)


# A prefill layer's bookkeeping under a policy (statistics, selection, compact-cache copies) runs on
# one CPU thread where its query has fewer than BOOKKEEPING_ONE_THREAD entries (H x m x D): it is
# dozens of small ops, each of which otherwise wakes the other threads (OMP_WAIT_POLICY=PASSIVE).
# Measured on the embedded model at 4,633 prompt tokens (890k entries), HT-Sparse, 2 threads, with
# `routing`'s position-major gathers: its prefill went from 105.9 % to 103.8 % of dense's (medians
# of 12, interleaved), the same selections; what is left is the bookkeeping itself (~18 ms of ~490).
BOOKKEEPING_ONE_THREAD = 4_000_000


def _prefill_hook(run: Run, layer: int, query, key, value, scale):
    """A layer's prefill under a policy: its statistics from the query rows first (only those the
    policy asks for), then its selection, then its attention: routed over the selection
    (`routing.routed_attention`) for a policy used directly that routes its prefill, else dense."""
    small = query.device.type == "cpu" and query.numel() < BOOKKEEPING_ONE_THREAD
    with threads(1 if small else None):
        sel, kept_key = _select_and_store(run, layer, query, key, value, scale)
    if sel is None:
        return _causal(query, key, value, scale)
    m = key.shape[2]
    restricts = (sel.query_mask is not None or sel.head_scale is not None or kept_key is not key
                 or any(n < m for n in sel.lengths))
    if getattr(run.policy, "route_prefill", False) and restricts and not run.cache.store_dense:
        # Direct use only: as a draft, the prefill also fills the dense cache and gives the first
        # token, so it stays dense (the draft routes its decode steps only).
        return routed_attention(query, kept_key, value, scale, sel.keep, sel.query_mask, sel.head_scale)
    return _causal(query, key, value, scale)


def _select_and_store(run: Run, layer: int, query, key, value, scale):
    """`_prefill_hook`'s bookkeeping: the layer's statistics and selection, its compact cache (or,
    for a direct policy keeping the layer whole, its dense entries) stored. Returns (selection or
    None, the keys the selection keeps)."""
    policy = run.policy
    prompt = run.prompt_of(layer)  # m' rows in a pruned layer
    pruned = layer in run.rows
    selects = policy is not None and (not hasattr(policy, "selects") or policy.selects(layer, prompt))
    want, window = needs(policy, prompt) if selects else ((), 0)
    want = set(want) | ({"relevance"} if run.keep_stats else set())
    stats = layer_stats(query, key, scale, prompt.query_start, window, want)
    if run.keep_stats:
        run.stats[layer] = _unpruned(stats, run.rows[layer], run.prompt.m) if pruned else stats
    cache = run.cache
    m = key.shape[2]
    sel = policy.select(layer, stats, prompt) if selects else None
    if sel is None and policy is not None and (run.copy_all or pruned):
        # a pruned layer always keeps a compact cache: the dense buffer is indexed by prompt position
        sel = LayerSelection([torch.arange(m, device=key.device)] * key.shape[1])
    if sel is None:
        if policy is not None and not cache.store_dense:  # a direct policy keeps this layer whole
            cache.layers[layer].store(key, value, 0)
        return None, key
    run.selections[layer] = sel
    if (not pruned and not cache.store_dense and layer == getattr(policy, "prune_after", None)
            and "tokens" in sel.info):
        run.start_pruning(sel.info["tokens"])  # the later layers of this prefill see m_t + k rows
    score_keys = getattr(policy, "score_keys", None)
    kept_key = score_keys(layer, key) if score_keys is not None else key  # the dense cache keeps `key`
    cache.set_sparse(layer, SparseKV(kept_key, value, sel, cache.capacity - run.prompt.m, run.prompt.num_heads,
                                     bufs=cache.buffers, layer=layer, rows=cache.stacked_row))
    return sel, kept_key


def needs(policy, prompt: Prompt) -> tuple[tuple[str, ...], int]:
    """The statistics a selecting policy reads on this prompt and its SnapKV rows: its `needs(prompt)`
    where it has one (what it reads depends on the prompt), else its `stats` and `window`."""
    if hasattr(policy, "needs"):
        return policy.needs(prompt)
    return tuple(getattr(policy, "stats", ())), getattr(policy, "window", 0)


def _unpruned(stats: LayerStats, rows: torch.Tensor, m: int) -> LayerStats:
    """A pruned layer's statistics [Hkv, m'] back at prompt positions [Hkv, m] (0 at pruned ones)."""
    def expand(x):
        if x is None:
            return None
        out = x.new_zeros(x.shape[0], m)
        out[:, rows.to(x.device)] = x
        return out

    return LayerStats(expand(stats.relevance), expand(stats.window), stats.query_norm_last, stats.query_norm_mean)


def _prune_rows(module, args, kwargs):
    """Forward pre-hook of a decoder layer: nothing unless the active run is pruning its prefill;
    then the layer gets the kept rows of `hidden_states` (taken once, where it still has m rows)
    and of the rotary `position_embeddings` (and `position_ids`), and the run records its rows."""
    if torch.compiler.is_compiling():  # a compiled decode step (`fast`): never pruning
        return None
    run = _ACTIVE.get()
    if run is None or run.prune is None:
        return None
    rows, m = run.prune, run.prompt.m
    hidden = args[0] if args else kwargs["hidden_states"]
    if hidden.shape[1] not in (m, rows.numel()):  # not this prefill's hidden states
        return None
    if hidden.shape[1] == m:
        hidden = hidden.index_select(1, rows)
    if args:
        args = (hidden,) + tuple(args[1:])
    else:
        kwargs["hidden_states"] = hidden
    pe = kwargs.get("position_embeddings")
    if pe is not None:
        kwargs["position_embeddings"] = tuple(t.index_select(-2, rows) if t.shape[-2] == m else t for t in pe)
    pos = kwargs.get("position_ids")
    if isinstance(pos, torch.Tensor) and pos.shape[-1] == m:
        kwargs["position_ids"] = pos.index_select(-1, rows)
    run.rows[module.self_attn.layer_idx] = rows
    return args, kwargs


def install(model) -> None:
    """Put the pruning pre-hook on every decoder layer of the language model, once (idempotent);
    it does nothing outside a pruning run's prefill."""
    for layer in model.model.language_model.layers:
        if not getattr(layer, "_sparsevid_prune_hook", False):
            layer.register_forward_pre_hook(_prune_rows, with_kwargs=True)
            layer._sparsevid_prune_hook = True


def no_mask(*args, **kwargs):
    """Batch size 1 without padding: causality is handled inside `sparsevid_attention`."""
    return None


def register() -> str:
    AttentionInterface.register(NAME, sparsevid_attention)
    AttentionMaskInterface.register(NAME, no_mask)
    return NAME


register()
