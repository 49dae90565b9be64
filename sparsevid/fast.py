"""Compiled decode steps: the same model, the same caches, one graph per step kind.

An eager decode step of the embedded model runs ~900 small ops and ~1,000 Python calls for ~1 ms of
arithmetic. `static_step` is the step as one traceable function over fixed-shape buffers, which
`torch.compile` turns into one graph (CPU: inductor with its C++ wrapper; CUDA: CUDA graphs,
`mode="reduce-overhead"`):

- it calls the language model's own modules (`embed_tokens`, `rotary_emb`, each decoder layer,
  `norm`, `lm_head`): the weights and the code are transformers', not a second copy;
- the cache it hands the layers is `StaticView`: the run's own preallocated buffers, per layer
  its `Block`s (the dense layer `[1, Hkv, capacity, D]`, or the blocks of its `SparseKV`: a top-K
  draft's one block, HT-Sparse's full and sparse groups with their per-query-head masks,
  SparseMM's per-head budgets) and the write positions as a tensor. `update` `index_copy_`s the
  new KV at those positions and returns a `StaticKV` (the blocks, whole) in place of key states;
  `attention.sparsevid_attention` sees it first, before it reads the active run, and calls
  `static_attention`, so nothing breaks the graph;
- causality and each buffer's unfilled tail are an additive mask `[q, capacity]` built in the
  graph from the write positions; shapes never depend on the length;
- the capacity dimension of every buffer is marked dynamic, and so is the row count of a
  verification pass (q > 1): one graph serves every video length and every γ. A step kind is a
  combination of (one row or several, layers run, the layers' block layout): dense step,
  verification, a draft's step, LayerSkip's draft, a direct policy's step.

Unfilled buffer entries are zero (`cache.py` allocates with zeros), so a masked key never brings a
NaN in.

`--compile auto|on|off`: `on` compiles (during the warm-up, `runs.compile_steps`); `auto` compiles
and keeps the compiled steps only where a dense step then measures faster than eager; `off` is
eager. A failed compilation never fails a run: the step falls back to eager and the reason is kept
in `FastSteps.message`. The compiled code is cached on disk (inductor's cache, under
`~/.cache/sparsevid/inductor` unless TORCHINDUCTOR_CACHE_DIR is set), so a later process compiles
faster; tracing is paid once per process.

Measured on the embedded model (2 CPU threads): a compiled dense step is 47-68 % of the eager one
(`bench` prints both); of a compiled step, ~0.2 ms is dynamo's guard check and ~0.05 ms the
runtime wrapper, the rest the graph. Skipping the guards (`set_stance(skip_guard_eval_unsafe=True)`)
measured 11 % faster and was not taken: a step kind not compiled yet could then run another kind's
graph.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .errors import InputError

MODES = ("auto", "on", "off")


@dataclass
class Block:
    """KV heads of one layer that share one buffer during a step (the whole dense layer, or one
    `cache.SparseKV` block).

    k, v: [1, h_b, capacity_b, D]; heads: LongTensor [h_b], the layer's KV heads it holds (None: all,
    in order); query_heads: LongTensor [h_b * G], their query heads (None: all); bias: optional
    additive [h_b, G, capacity_b] (a per-query-head mask); slot: its index in the step's write
    positions (`StaticView.start`).
    """

    k: torch.Tensor
    v: torch.Tensor
    heads: torch.Tensor | None
    query_heads: torch.Tensor | None
    bias: torch.Tensor | None
    slot: int


@dataclass
class StaticKV:
    """What a decoder layer's `update` returns in a compiled step, as its 'key states': the layer's
    blocks, its per-query-head output scale (optional [H]) and the step's write positions."""

    blocks: list
    head_scale: torch.Tensor | None
    start: torch.Tensor


class StaticView:
    """The cache a decoder layer's attention sees during `static_step`.

    layers: per layer, its `Block`s; head_scale: per layer, [H] or None; start: LongTensor
    [number of blocks], where block `slot` writes this step's q tokens (entries start .. start + q - 1).
    """

    def __init__(self, layers: list, head_scale: list, start: torch.Tensor):
        self.layers, self.head_scale, self.start = layers, head_scale, start

    def update(self, key, value, layer_idx, *args, **kwargs):
        """Write key/value [1, Hkv, q, D] into the layer's blocks; return (StaticKV, None)."""
        rows = torch.arange(key.shape[2], device=key.device)
        for b in self.layers[layer_idx]:
            pos = self.start[b.slot] + rows
            b.k.index_copy_(2, pos, key if b.heads is None else key.index_select(1, b.heads))
            b.v.index_copy_(2, pos, value if b.heads is None else value.index_select(1, b.heads))
        return StaticKV(self.layers[layer_idx], self.head_scale[layer_idx], self.start), None


def static_step(model, input_ids, position_ids, layers: list, head_scale: list, start: torch.Tensor):
    """Logits [1, q, V] of q tokens through the first len(layers) decoder layers (all for a dense
    step) of `model`'s language model, writing their KV into the layers' blocks (see `StaticView`)."""
    lm = getattr(model.model, "language_model", model.model)  # a Video-LLM's text model, or a bare LM
    h = lm.embed_tokens(input_ids)
    pe = lm.rotary_emb(h, position_ids)
    view = StaticView(layers, head_scale, start)
    for layer in lm.layers[:len(layers)]:
        h = layer(h, attention_mask=None, position_embeddings=pe, past_key_values=view, use_cache=True)
    return model.lm_head(lm.norm(h))


def static_attention(query, kv: StaticKV, scale):
    """query [B, H, q, D] over each block's whole buffer [B, h_b, capacity_b, D] -> [B, q, H, D]
    (the engine: B = 1; `bench --shape --batch`: B sequences of one length). Row t of block b sees
    its entries 0 .. start_b + t (causality and the unfilled tail are one additive mask
    [q, capacity_b]); the G query heads of a KV head are folded into rows (no K/V repeat)."""
    B, H, q, D = query.shape
    rows = torch.arange(q, device=query.device)
    outs = []
    for b in kv.blocks:
        h_b = b.k.shape[1]
        G = H // h_b if b.query_heads is None else b.query_heads.shape[0] // h_b
        cols = torch.arange(b.k.shape[2], device=query.device)
        mask = torch.zeros(q, cols.shape[0], dtype=query.dtype, device=query.device)
        mask = mask.masked_fill(cols[None, :] > (kv.start[b.slot] + rows)[:, None], float("-inf"))
        if b.bias is None:
            mask = mask.repeat(G, 1)[None, None]  # [1, 1, G*q, n]: row g*q + t is query head g's row t
        else:
            mask = (mask[None, None] + b.bias[:, :, None, :]).reshape(1, h_b, G * q, -1)
        qb = query if b.query_heads is None else query.index_select(1, b.query_heads)
        out = F.scaled_dot_product_attention(qb.reshape(B, h_b, G * q, D), b.k, b.v, attn_mask=mask, scale=scale)
        outs.append(out.view(B, h_b * G, q, D))
    if len(outs) == 1 and kv.blocks[0].query_heads is None:
        out = outs[0]
    else:  # blocks hold disjoint query heads, together all of them
        out = query.new_empty(query.shape)
        for b, o in zip(kv.blocks, outs):
            out = out.index_copy(1, b.query_heads, o)
    out = out.transpose(1, 2)
    if kv.head_scale is not None:
        out = out * kv.head_scale.view(1, 1, -1, 1)
    return out


def buffers(cache, mode: str, num_layers: int | None = None):
    """The step's layers as (blocks per layer, head_scale per layer, offsets [blocks], per_head) where
    block `slot` writes at `offsets[slot] + cache length` and per_head says whether any layer has a
    per-head layout (HT-Sparse, SparseMM); built once per cache, mode and layer count (the buffers
    never move during a run). None when a layer has nothing to read."""
    key = (mode, num_layers)
    if key in cache.static:
        return cache.static[key]
    layers, scales, offsets = [], [], []
    for layer in cache.layers[:num_layers]:
        blocks = []
        if mode == "dense" or layer.sparse is None:
            if not layer.is_initialized or (mode == "dense" and not cache.store_dense):
                return None
            blocks.append(Block(layer.keys, layer.values, None, None, None, len(offsets)))
            offsets.append(0)
            scales.append(None)
        else:
            sp = layer.sparse
            for b in sp.blocks:
                blocks.append(Block(b.k, b.v, None if b.all_heads else b.kv, None if b.all_heads else b.q, b.bias,
                                    len(offsets)))
                offsets.append(b.n_prompt - cache.prompt_len)
            scales.append(sp.head_scale)
        layers.append(blocks)
    device = layers[0][0].k.device
    for blocks in layers:
        for b in blocks:  # one graph for every capacity (prompt length); fixed addresses for CUDA graphs
            for t, dim in ((b.k, 2), (b.v, 2)) + (() if b.bias is None else ((b.bias, 2),)):
                torch._dynamo.mark_dynamic(t, dim)
                if device.type == "cuda":
                    torch._dynamo.mark_static_address(t)
    per_head = any(b.query_heads is not None or b.bias is not None for blocks in layers for b in blocks)
    cache.static[key] = out = (layers, scales, torch.tensor(offsets, device=device), per_head)
    return out


class FastSteps:
    """The compiled step of one loaded model and its state.

    mode: "on" or "auto"; `enabled` says whether steps go through the compiled graph now
    (after `runs.compile_steps` in auto mode: only if it measured faster). `message` says what happened
    (compiled, kept eager and why, failed and why)."""

    def __init__(self, model, device: torch.device, mode: str = "auto"):
        self.model, self.device, self.mode = model, device, mode
        self.enabled = True  # before `runs.compile_steps`: compiled at the first step
        self.message = "compiling at the first steps"
        self.compiled = None
        self.calls = 0  # steps served by the compiled graph
        self.prepared = False  # `runs.compile_steps` ran (compiled every step kind it was asked for)
        # per-head layouts (HT-Sparse, SparseMM: a block per KV head) through the graph too; auto mode
        # turns it off where their compiled step measures slower than eager (on some CPUs it is)
        self.per_head = True
        self.per_head_calls = 0  # steps of a per-head layout served by the graph

    def compiled_step(self):
        """`static_step` compiled for this device (built once; graphs are compiled at first calls)."""
        if self.compiled is None:
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                                  os.path.join(os.path.expanduser("~"), ".cache", "sparsevid", "inductor"))
            import torch._dynamo
            import torch.fx.experimental._config as fx_config

            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            fx_config.use_duck_shape = False  # two buffers of equal capacity in one run must not share a size
            if self.device.type == "cuda":
                self.compiled = torch.compile(static_step, mode="reduce-overhead")
            else:
                import torch._inductor.config as inductor_config

                inductor_config.cpp_wrapper = True
                self.compiled = torch.compile(static_step)
        return self.compiled

    def step(self, cache, mode: str, input_ids: torch.Tensor, position_ids: torch.Tensor,
             num_layers: int | None = None) -> torch.Tensor | None:
        """Logits [1, q, V] through the compiled graph, or None (the caller runs the eager step): not
        enabled, a layer with no buffer to read, or compilation failed (then disabled for good)."""
        if not self.enabled:
            return None
        bufs = buffers(cache, mode, num_layers)
        if bufs is None:
            return None
        layers, scales, offsets, per_head = bufs
        if per_head and not self.per_head:
            return None
        if input_ids.shape[1] > 1:  # a verification pass: one graph for every γ
            torch._dynamo.mark_dynamic(input_ids, 1)
            torch._dynamo.mark_dynamic(position_ids, position_ids.dim() - 1)
        try:
            out = self.compiled_step()(self.model, input_ids, position_ids, layers, scales, offsets + cache.length)
        except Exception as e:  # never fail a run because compilation failed: eager from now on
            root = getattr(e, "inner_exception", None) or e  # a backend's own error, not dynamo's wrapper
            first = (str(root).strip().splitlines() or [""])[0][:200]
            self.enabled = False
            self.message = f"eager: compilation failed ({type(root).__name__}: {first})"
            warnings.warn(f"sparsevid: {self.message}", RuntimeWarning)
            return None
        self.calls += 1
        self.per_head_calls += per_head
        return out


def state(loaded) -> str:
    """The loaded model's decode steps in words (for reports): compiled or eager, and why."""
    return "eager (compilation off)" if loaded.fast is None else loaded.fast.message


def enable(loaded, mode: str = "auto") -> FastSteps | None:
    """Give `loaded` compiled steps in `mode` (compiled by `runs.compile_steps`, or at the first step);
    "off": none (eager)."""
    if mode not in MODES:
        raise InputError(f"--compile must be one of {', '.join(MODES)}, not {mode!r}.")
    loaded.fast = None if mode == "off" else FastSteps(loaded.model, loaded.device, mode)
    return loaded.fast
