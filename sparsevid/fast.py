"""The decode step, one path for every method: the same model, the same caches, one graph per step kind.

An eager decode step of the embedded model runs ~900 small ops and ~1,000 Python calls for ~1 ms of
arithmetic; a 7B step on one H200 ran 21-48 ms eager against a 4-11 ms limit. `static_step` is the
step as one function over fixed-shape buffers, run eagerly (`engine.step`, where nothing is
compiled) or as a graph: on CUDA captured by hand as a CUDA graph per step kind (`Captured`: about
one eager step to capture, no compiler, so it fits a ZeroGPU call), on the CPU compiled by
`torch.compile` (inductor with its C++ wrapper):
- it calls the language model's own modules (`embed_tokens`, `rotary_emb`, each decoder layer,
  `norm`, `lm_head`): the weights and the code are transformers', not a second copy;
- the cache it hands the layers is `StaticView`: the run's own preallocated buffers, per layer
  its `Block`s (the dense layer `[1, Hkv, capacity, D]`, or the blocks of its `SparseKV`: a top-K
  draft's one block, HT-Sparse's full and sparse groups with their per-query-head masks,
  SparseMM's per-head budgets) and the write positions as a tensor. `update` `index_copy_`s the
  new KV at those positions and returns a `StaticKV` (the blocks, whole) in place of key states;
  `attention.sparsevid_attention` sees it first, before it reads the active run, and calls
  `static_attention`, so nothing breaks the graph;
- attention is `kernels.attend` (the write positions as a tensor: causality and each buffer's
  unfilled tail; a split-KV kernel of this project: C++ on the CPU (an op, so a compiled graph calls
  it), Triton on CUDA; SDPA with a mask where neither is available);
- on CUDA the layers' RMSNorms, rotary embedding and KV writes run as one Triton kernel each
  (`FUSED`, `kernels.rms_norm`, `kernels.rotary`, `kernels.write_kv`) instead of 8, 10 and 4 small
  ones: in a captured 7B step those are ~730 kernels of a few µs each that read next to nothing.
  transformers' code still decides when they run (its modules and its `apply_rotary_pos_emb` are
  routed to the kernels only inside a step); the prefill runs transformers' ops;
- CPU: the capacity dimension of every buffer is marked dynamic, and so is the row count of a
  verification pass (q > 1): one compiled graph serves every video length and every γ. CUDA: a
  graph per (buffers, rows, layers); the buffers come from the model's `cache.BufferPool`, so the
  next run of the same shapes replays the same graphs, and a verification is padded to γ + 1 rows.
  A step kind is a combination of (one row or several, layers run, the layers' block layout):
  dense step, verification, a draft's step, LayerSkip's draft, a direct policy's step.

Unfilled buffer entries are zero (`cache.py` allocates with zeros), so a masked key never brings a
NaN in.

`--compile auto|on|off`: `on` compiles (during the warm-up, `runs.compile_steps`); `auto` compiles
and keeps the compiled steps only where a dense step then measures faster than eager; `off` is
eager. A failed compilation never fails a run: the step falls back to eager and the reason is kept
in `FastSteps.message`. The compiled code is cached on disk (inductor's cache, under
`~/.cache/sparsevid/inductor/<the CPU op's version>` unless TORCHINDUCTOR_CACHE_DIR is set), so a later process compiles
faster (set in `sparsevid/__init__.py`); tracing is paid once per process.

Measured on the embedded model (2 CPU threads): a compiled dense step is 47-68 % of the eager one
(`bench` prints both); of a compiled step, ~0.2 ms was dynamo's guard check and ~0.05 ms the
runtime wrapper, the rest the graph. Each model compiles its own copy of the step's code, without
the guards on its modules (`FastSteps.compiled_step`): the check fell from 194 to 85 µs a step
(profiled, 256 frames), a dense step at 16 frames 1.10x faster (15 interleaved pairs). Skipping all
guards (`set_stance(skip_guard_eval_unsafe=True)`) was not taken: a step kind not compiled yet
could then run another kind's graph. Only the sizes this module marks dynamic are symbolic (no
automatic dynamism: it made the second step kind's block slots symbolic, 8 more size arguments a
step; HT-Sparse and SparseMM at 288 visual tokens 0.95x of dense with them, 1.01x without).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import types
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import kernels
from .cache import write_at
from .errors import InputError

MODES = ("auto", "on", "off")

try:  # transformers' output-capturing switch (`static_step`); None where this transformers has none
    from transformers.utils.output_capturing import _active_collector as _COLLECTOR
except ImportError:
    _COLLECTOR = None


@dataclass
class Block:
    """One layer's buffers during a step: the dense layer, or its `cache.SparseKV`.

    k, v: [B, Hkv, capacity, D]; bias: optional additive [Hkv, G, capacity] (a per-query-head mask);
    slot, width: its write positions are `start[slot:slot + width]` of the step (`StaticView.start`):
    one for every head (width 1: the dense layer) or one per KV head (width Hkv: a compact cache,
    where head h's entries end at its own K_h).
    """

    k: torch.Tensor
    v: torch.Tensor
    bias: torch.Tensor | None = None
    slot: int = 0
    width: int = 1
    heads: torch.Tensor | None = None  # in a `Split`: its KV heads [h] (else every head)
    qheads: torch.Tensor | None = None  # in a `Split`: its query heads [h G]
    prefix: torch.Tensor | None = None  # a stack's dense layer: rows sharing their first entries [B, 2] (`cache.Stack`)


@dataclass
class Split:
    """A layer whose compact cache is split in groups of heads (`cache.SparseKV.parts`): one `Block`
    per group, each attended by its own call; `order` [H]: query head h's row in the groups' outputs
    concatenated."""

    blocks: list
    order: torch.Tensor


def blocks_of(layer) -> list:
    """A layer's blocks: [block], or a `Split`'s."""
    return layer.blocks if isinstance(layer, Split) else [layer]


@dataclass
class StaticKV:
    """What a decoder layer's `update` returns in a static step, as its 'key states': the layer's
    block (or `Split`), its per-query-head output scale (optional [H], or [B, H] per row) and the
    block's write positions [B or 1, width] (a `Split`: a list, one per block)."""

    block: Block | Split
    head_scale: torch.Tensor | None
    start: torch.Tensor | list


class StaticView:
    """The cache a decoder layer's attention sees during `static_step`.

    layers: per layer, its `Block`; head_scale: per layer, [H] or [B, H] or None; start: LongTensor
    [slots] or, per row of a batch, [B, slots]: where each block writes this step's q tokens (head
    h of block b: entries s .. s + q - 1, s = start[..., b.slot + h] for a block of width Hkv,
    start[..., b.slot] for width 1).
    """

    def __init__(self, layers: list, head_scale: list, start: torch.Tensor, fuse: bool = False):
        self.layers, self.head_scale, self.fuse = layers, head_scale, fuse
        self.start = start if start.dim() == 2 else start[None]

    def update(self, key, value, layer_idx, *args, **kwargs):
        """Write key/value [B, Hkv, q, D] into the layer's block(s) (`fuse`: one Triton kernel a
        block where it takes them, `kernels.write_kv`); return (StaticKV, None)."""
        layer = self.layers[layer_idx]
        starts = []
        for b in blocks_of(layer):
            start = self.start[:, b.slot:b.slot + b.width]  # [B or 1, width]
            if self.fuse and b.heads is None and kernels.write_kv_fusable(b.k, b.v, start, key, value):
                kernels.write_kv(b.k, b.v, start, key, value)
            else:
                pos = start[:, :, None] + torch.arange(key.shape[2], device=key.device)  # [B or 1, width, q]
                write_at(b.k, pos, key if b.heads is None else key.index_select(1, b.heads))
                write_at(b.v, pos, value if b.heads is None else value.index_select(1, b.heads))
            starts.append(start)
        return StaticKV(layer, self.head_scale[layer_idx], starts if isinstance(layer, Split) else starts[0]), None


def static_step(model, input_ids, position_ids, layers: list, head_scale: list, start: torch.Tensor):
    """Logits [B, q, V] of q tokens through the first len(layers) decoder layers (all for a dense
    step) of `model`'s language model, writing their KV into the layers' blocks (see `StaticView`)."""
    lm = getattr(model.model, "language_model", model.model)  # a Video-LLM's text model, or a bare LM
    # A step collects no outputs. Once any call has asked the model for hidden states or attentions,
    # transformers hooks its layers to read a ContextVar, which breaks a compiled graph; its own
    # compile-safe switch (a plain variable while tracing) turns those hooks off for the step.
    token = _COLLECTOR.set(None) if _COLLECTOR is not None else None
    fuse = fused(input_ids.device) and install_fused(lm)
    if fuse:  # (never touched where not fusing: the CPU's compiled step traces this function)
        _FUSING.on = True
    try:
        h = lm.embed_tokens(input_ids)
        pe = lm.rotary_emb(h, position_ids)
        view = StaticView(layers, head_scale, start, fuse)
        for layer in lm.layers[:len(layers)]:
            h = layer(h, attention_mask=None, position_embeddings=pe, past_key_values=view, use_cache=True)
        return model.lm_head(lm.norm(h))
    finally:
        if fuse:
            _FUSING.on = False
        if _COLLECTOR is not None:
            _COLLECTOR.reset(token)


# Fused layer ops (`kernels.rms_norm`, `kernels.rotary`, `kernels.write_kv`: one Triton kernel each
# in place of 8, 10 and 4 small ones). SPARSEVID_FUSED=auto: in every decode step on CUDA where
# Triton imports; on: also on the CPU (through Triton's interpreter: the tests); off: never (the GPU
# check times a step both ways). Prefill and everything outside `static_step` run transformers' ops.
FUSED = os.environ.get("SPARSEVID_FUSED", "auto") if os.environ.get("SPARSEVID_FUSED") in ("auto", "on", "off") \
    else "auto"
NORMS = ("Qwen2RMSNorm", "Qwen2VLRMSNorm", "Qwen2_5_VLRMSNorm")  # weight * x / rms(x), the served LMs' norm
_FUSING = threading.local()  # .on: this thread is inside a fused step


def fused(device: torch.device) -> bool:
    """Whether a decode step on `device` runs the fused layer ops (`FUSED`)."""
    return FUSED != "off" and (device.type == "cuda" or FUSED == "on") and kernels.triton_available()


def install_fused(lm) -> bool:
    """Route `lm`'s RMSNorms and its attention module's `apply_rotary_pos_emb` through the fused
    kernels while this thread is inside `static_step` (`_FUSING.on`), else through transformers'
    own code: each norm gets a forward of its own, the modeling module's function a wrapper (once
    per module; it is looked up at each call). A graph captured inside a step records the fused
    kernels. False where the layers are not the served architectures' (nothing installed)."""
    if getattr(lm, "_sparsevid_fused", None) is not None:
        return lm._sparsevid_fused
    module = sys.modules[type(lm.layers[0].self_attn).__module__]
    plain = getattr(module, "apply_rotary_pos_emb", None)
    norms = [m for layer in lm.layers for m in (layer.input_layernorm, layer.post_attention_layernorm)] + [lm.norm]
    ok = plain is not None and all(type(m).__name__ in NORMS for m in norms)
    if ok:
        if not getattr(plain, "_sparsevid_fused", False):
            def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
                if getattr(_FUSING, "on", False) and unsqueeze_dim == 1 and kernels.rotary_fusable(q, k, cos, sin):
                    return kernels.rotary(q, k, cos, sin)
                return plain(q, k, cos, sin, unsqueeze_dim)

            apply_rotary_pos_emb._sparsevid_fused = True
            module.apply_rotary_pos_emb = apply_rotary_pos_emb
        for m in norms:
            def forward(x, m=m, plain=type(m).forward):
                if getattr(_FUSING, "on", False):
                    return kernels.rms_norm(x, m.weight, m.variance_epsilon)
                return plain(m, x)

            m.forward = forward
    lm._sparsevid_fused = ok
    return ok


def static_attention(query, kv: StaticKV, scale):
    """query [B, H, q, D] over the layer's block [B, Hkv, capacity, D] -> [B, q, H, D], one call:
    row t of head h sees entries 0 .. start_h + t (`kernels.attend`: lengths as tensors, no K/V
    repeat), then the query heads' output scales."""
    b = kv.block
    if isinstance(b, Split):  # one call per group of heads, the rows put back in head order
        out = torch.cat([kernels.attend(query.index_select(1, p.qheads), p.k, p.v, s, scale, p.bias)
                         for p, s in zip(b.blocks, kv.start)], 2).index_select(2, b.order)
    else:
        out = kernels.attend(query, b.k, b.v, kv.start, scale, b.bias, prefix=b.prefix)
    hs = kv.head_scale
    if hs is not None:
        out = out * (hs.view(1, 1, -1, 1) if hs.dim() == 1 else hs[:, None, :, None])
    return out


def buffers(cache, mode: str, num_layers: int | None = None):
    """The step's layers as (block per layer, head_scale per layer, offsets [1, slots], per_head): block
    b's head h writes at `offsets[0, b.slot + h] + cache length` (a compact cache: K_h - prompt length;
    the dense layer: 0), and per_head says whether any layer's heads keep different numbers of
    entries or have masks or output scales (HT-Sparse, SparseMM). Built once per cache, mode and
    layer count (the buffers never move during a run). None when a layer has nothing to read."""
    key = (mode, num_layers)
    if key in cache.static:
        return cache.static[key]
    layers, scales, offsets, per_head = [], [], [], False
    for layer in cache.layers[:num_layers]:
        if mode == "dense" or layer.sparse is None:
            if not layer.is_initialized or (mode == "dense" and not cache.store_dense):
                return None
            layers.append(Block(layer.keys, layer.values, None, len(offsets), 1))
            offsets.append(0)
            scales.append(None)
        else:
            sp = layer.sparse
            if sp.parts is not None:  # heads split in groups: a block each
                blocks = []
                for heads, qheads, p in sp.parts:
                    blocks.append(Block(p.k, p.v, p.bias, len(offsets), len(p.starts), heads, qheads))
                    offsets += [n - cache.prompt_len for n in p.starts]
                layers.append(Split(blocks, sp.order))
            else:
                layers.append(Block(sp.k, sp.v, sp.bias, len(offsets), len(sp.starts)))
                offsets += [n - cache.prompt_len for n in sp.starts]
            scales.append(sp.head_scale)
            per_head |= not sp.uniform or sp.bias is not None or sp.head_scale is not None
    device = blocks_of(layers[0])[0].k.device
    if device.type != "cuda":  # CPU: one inductor graph for every capacity (CUDA: captured graphs, `Captured`)
        for b in (b for layer in layers for b in blocks_of(layer)):
            for t in (b.k, b.v) + (() if b.bias is None else (b.bias,)):
                torch._dynamo.mark_dynamic(t, 2)
    cache.static[key] = out = (layers, scales, torch.tensor([offsets], device=device), per_head)
    return out


def stack_buffers(stack, mode: str, num_layers: int | None = None):
    """`buffers` of the rows of a `cache.Stack` (batched decoding): (block per layer, head_scale per
    layer ([B, H] or None), offsets [B, slots], per_head), built once per mode and layer count;
    None when a layer has nothing to read in `mode`."""
    key = (mode, num_layers)
    if key in stack.blocks:
        return stack.blocks[key]
    B = len(stack.caches)
    layers, scales, offsets, per_head = [], [], [], False
    for dense, sparse in list(zip(stack.dense, stack.sparse))[:num_layers]:
        slot = sum(o.shape[1] for o in offsets)
        if mode == "dense" or sparse is None:
            if dense is None:
                return None
            layers.append(Block(dense[0], dense[1], None, slot, 1, prefix=stack.prefix))
            offsets.append(torch.zeros(B, 1, dtype=torch.long, device=dense[0].device))
            scales.append(None)
        else:
            k, v, bias, scale, width, offs = sparse
            layers.append(Block(k, v, bias, slot, width))
            offsets.append(offs)
            scales.append(scale)
            per_head |= width > 1 or bias is not None or scale is not None
    if layers[0].k.device.type != "cuda":
        for b in layers:
            for t in (b.k, b.v):
                torch._dynamo.mark_dynamic(t, 0)
                torch._dynamo.mark_dynamic(t, 2)
            if b.bias is not None:
                torch._dynamo.mark_dynamic(b.bias, 0)
                torch._dynamo.mark_dynamic(b.bias, 3)
            if b.prefix is not None:
                torch._dynamo.mark_dynamic(b.prefix, 0)
        for sc in scales:
            if sc is not None:
                torch._dynamo.mark_dynamic(sc, 0)
    stack.blocks[key] = out = (layers, scales, torch.cat(offsets, 1), per_head)
    return out


def signature(layers: list, scales: list) -> tuple:
    """Every tensor a captured step reads or writes besides its inputs, by address and shape: two
    steps with the same signature may replay the same CUDA graph (`cache.BufferPool` gives a run
    the buffers of the previous run of the same shapes, so a graph outlives its run)."""
    def sig(t):
        return None if t is None else (t.data_ptr(), tuple(t.shape), t.dtype)

    return (tuple((sig(b.k), sig(b.v), sig(b.bias), b.slot, b.width, sig(b.heads), sig(b.qheads), sig(b.prefix))
                  for layer in layers for b in blocks_of(layer))
            + tuple(sig(layer.order) for layer in layers if isinstance(layer, Split)) + tuple(sig(s) for s in scales))


class Captured:
    """One step kind captured as a CUDA graph: `static_step` over fixed buffers, its inputs (token
    ids, positions, write positions) copied into static tensors before each replay.

    Built at the first step of its kind: that step runs eagerly on a side stream (it computes the
    real logits and KV, and pays Triton's compilation and cuBLAS's first-call costs outside the
    capture), then the same call is captured (capture records, it does not run). A capture takes
    about one eager step. Each graph has its own memory pool (torch 2.11 asserts when a shared
    pool's graphs are all freed and the pool is captured into again)."""

    def __init__(self, model, ids, pos, layers, scales, start):
        self.ids, self.pos, self.start = ids.clone(), pos.clone(), start.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.first = static_step(model, self.ids, self.pos, layers, scales, self.start)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = static_step(model, self.ids, self.pos, layers, scales, self.start)

    def __call__(self, ids, pos, start):
        if self.first is not None:  # the capturing call's own result
            out, self.first = self.first, None
            return out
        self.ids.copy_(ids)
        self.pos.copy_(pos)
        self.start.copy_(start)
        self.graph.replay()
        return self.out.clone()  # the next replay overwrites `out`


class FastSteps:
    """The fast steps of one loaded model and their state: on CUDA each step kind captured as a CUDA
    graph (`Captured`, by hand: seconds, no compiler), on the CPU `static_step` compiled by inductor.

    mode: "on" or "auto"; `enabled` says whether steps go through a graph now
    (after `runs.compile_steps` in auto mode: only if it measured faster). `message` says what happened
    (compiled, kept eager and why, failed and why). On CUDA a verification pass of q rows is padded
    to the run's γ + 1 (`pad_to`), so one graph serves every γ (the padding rows write past the
    committed tokens, where nothing reads before it is overwritten)."""

    def __init__(self, model, device: torch.device, mode: str = "auto"):
        self.model, self.device, self.mode = model, device, mode
        self.enabled = True  # before `runs.compile_steps`: compiled at the first step
        self.message = "compiling at the first steps"
        self.compiled = None
        self.calls = 0  # steps served by the compiled graph
        self.prepared = False  # `runs.compile_steps` ran (compiled every step kind it was asked for)
        # per-head layouts (HT-Sparse, SparseMM: ragged lengths, masks, scales) through the graph too; auto mode
        # turns it off where their compiled step measures slower than eager (on some CPUs it is)
        self.per_head = True
        self.per_head_calls = 0  # steps of a per-head layout served by the graph
        self.warmed: set = set()  # (prompt length, cache size, methods, settings) `runs.warm_up` prepared
        self.graphs: dict = {}  # CUDA: (signature, q, layers) -> Captured, most recently used last
        self.captures = 0
        self.capture_s = 0.0
        # CPU: batches through the graph too (SPARSEVID_CPU_BATCH_COMPILE=0: eager), one graph for every batch
        # size, compiled in the warm-up (`runs.warm_rows`). Eager batches won while a compiled step kept its
        # attention on the step's one thread; with the op's own threads (`kernels.op_threads`) a compiled
        # batch-8 step measured 957 against 816 tok/s at 4,608 visual tokens and 4,028 against 2,511 at 288.
        self.batched = os.environ.get("SPARSEVID_CPU_BATCH_COMPILE", "1") != "0"

    max_graphs = 48

    def captured(self, input_ids, position_ids, layers, scales, start):
        """Logits through the CUDA graph of this step kind, captured at its first call."""
        key = (signature(layers, scales), input_ids.shape[1], len(layers))
        g = self.graphs.pop(key, None)
        if g is None:
            t0 = time.perf_counter()
            g = Captured(self.model, input_ids, position_ids, layers, scales, start)
            self.captures += 1
            self.capture_s += time.perf_counter() - t0
            while len(self.graphs) >= self.max_graphs:  # the least recently used goes
                self.graphs.pop(next(iter(self.graphs)))
        self.graphs[key] = g
        return g(input_ids, position_ids, start)

    def compiled_step(self):
        """`static_step` compiled by inductor for the CPU (built once; graphs are compiled at first calls)."""
        if self.compiled is None:
            import torch._dynamo
            import torch.fx.experimental._config as fx_config

            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            fx_config.use_duck_shape = False  # two buffers of equal capacity in one run must not share a size
            # Only the sizes marked dynamic (`buffers`, `step`) are symbolic: automatic dynamism made the second
            # step kind's block slots and widths symbolic, 8 more size arguments converted and guarded at every
            # call (HT-Sparse and SparseMM at 288 visual tokens 0.955x / 0.950x of dense, 1.006x / 1.009x without)
            torch._dynamo.config.automatic_dynamic_shapes = False
            import torch._inductor.config as inductor_config

            inductor_config.cpp_wrapper = True
            # This model's own copy of the step's code, kept on the model (a later `enable` of the same
            # model reuses its graphs): dynamo keeps graphs and guards per code object, so no other
            # model's graph can ever serve this one's steps. That makes it safe to drop the guards on
            # the model's modules (their parameters and attributes, ~0.1 ms of each step's guard
            # check): a loaded model's weights and modules never change, and every tensor a step
            # reads or writes besides them (buffers, ids, positions, write positions) stays guarded.
            self.compiled = getattr(self.model, "_sparsevid_step", None)
            if self.compiled is None:
                own = types.FunctionType(static_step.__code__.replace(), static_step.__globals__,
                                         static_step.__name__)
                self.compiled = torch.compile(own, options={
                    "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
                self.model._sparsevid_step = self.compiled
        return self.compiled

    def step(self, bufs, start: torch.Tensor, input_ids: torch.Tensor,
             position_ids: torch.Tensor) -> torch.Tensor | None:
        """Logits [B, q, V] through the compiled or captured graph over `bufs` (`buffers` or
        `stack_buffers`) with write positions `start`, or None (the caller runs the eager step): not
        enabled, a per-head layout kept eager, a batch on the CPU with `batched` off, or compilation
        failed (then disabled for good)."""
        if not self.enabled:
            return None
        layers, scales, _, per_head = bufs
        if per_head and not self.per_head:
            return None
        if self.device.type != "cuda" and input_ids.shape[0] > 1 and not self.batched:
            return None
        try:
            if self.device.type == "cuda":
                out = self.captured(input_ids, position_ids, layers, scales, start)
            else:
                if input_ids.shape[1] > 1:  # a verification pass: one graph for every γ
                    torch._dynamo.mark_dynamic(input_ids, 1)
                    torch._dynamo.mark_dynamic(position_ids, position_ids.dim() - 1)
                if input_ids.shape[0] > 1:  # a batch: one graph for every batch size
                    torch._dynamo.mark_dynamic(input_ids, 0)
                    torch._dynamo.mark_dynamic(position_ids, position_ids.dim() - 2)
                    torch._dynamo.mark_dynamic(start, 0)
                out = self.compiled_step()(self.model, input_ids, position_ids, layers, scales, start)
        except Exception as e:  # never fail a run because compilation failed: eager from now on
            root = getattr(e, "inner_exception", None) or e  # a backend's own error, not dynamo's wrapper
            first = (str(root).strip().splitlines() or [""])[0][:200]
            self.enabled = False
            what = "capture" if self.device.type == "cuda" else "compilation"
            self.message = f"eager: {what} failed ({type(root).__name__}: {first})"
            warnings.warn(f"sparsevid: {self.message}", RuntimeWarning)
            return None
        self.calls += 1
        self.per_head_calls += per_head
        return out


def state(loaded) -> str:
    """The loaded model's decode steps in words (for reports): compiled or eager, and why."""
    steps = "eager (compilation off)" if loaded.fast is None else loaded.fast.message
    note = getattr(loaded, "threads_note", "")
    steps = f"{steps}; {note}" if note else steps
    return f"{steps}; attention: {kernels.describe(loaded.device, loaded.dtype)}"


def enable(loaded, mode: str = "auto") -> FastSteps | None:
    """Give `loaded` compiled steps in `mode` (compiled by `runs.compile_steps`, or at the first step);
    "off": none (eager)."""
    if mode not in MODES:
        raise InputError(f"--compile must be one of {', '.join(MODES)}, not {mode!r}.")
    loaded.fast = None if mode == "off" else FastSteps(loaded.model, loaded.device, mode)
    return loaded.fast
