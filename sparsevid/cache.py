"""KV caches: a preallocated dense cache and, per layer, a compact sparse cache.

`KVCache` is a transformers `Cache`, so the model's own attention modules write into it. One cache holds
one prompt (batched decoding stacks several caches' buffers: `Stack`). Two logical lengths are tracked:

- the **dense** cache: per layer `[1, Hkv, capacity, D]`, written in place (no `torch.cat` per step);
- the **sparse** cache (`SparseKV`, one per layer whose policy selected): the kept prompt entries
  of every KV head in one buffer (head h's K_h entries first, then its generated tokens), gathered
  once at prefill; attention reads what each head kept, in one call per layer (two on the CPU where
  heads of very different lengths would read much padding: `head_parts`). Its buffer holds
  the largest head's K_max + room for generated tokens per head. A layer whose policy keeps
  everything has no compact copy: it uses the dense one.

On CUDA the buffers come from the model's `BufferPool`, so a run of the same shapes reuses the last
run's buffers (and the CUDA graphs captured over them).

`mode` says which one the current forward reads and writes. Lengths only move when the engine
calls `advance` / `truncate`, so rollback after a rejected draft is a change of one integer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, CacheLayerMixin


class BufferPool:
    """A loaded model's KV buffers on CUDA, kept between runs: a run asks for each buffer by name
    (role, layer, block) and shape, and gets the one the last run of that name and shape gave back,
    so CUDA graphs captured in one run replay in the next (`fast.Captured`). A buffer is handed to
    one cache at a time: one that is out gets a fresh tensor. Buffers come back zeroed. At most
    `shapes` shapes per name are kept (dense and speculative runs size their caches differently,
    and each method its compact blocks)."""

    def __init__(self, shapes: int = 6):
        self.free: dict = {}  # (name, shape, dtype) -> tensor, oldest first
        self.shapes = shapes
        self.low: int | None = None  # the fewest idle bytes since `mark` (None: not marked)

    def mark(self) -> None:
        """Start watching the idle bytes' low-water mark (a run's peak memory: `engine._peak`)."""
        self.low = self.idle_bytes()

    def take(self, name, shape, dtype, device) -> torch.Tensor:
        t = self.free.pop((name, tuple(shape), dtype), None)
        if t is not None and self.low is not None:
            self.low = min(self.low, self.idle_bytes())
        if t is None or t.device != torch.device(device):
            return torch.zeros(shape, dtype=dtype, device=device)
        return t.zero_()

    def give_back(self, taken: dict) -> None:
        for name, t in taken.items():
            key = (name, tuple(t.shape), t.dtype)
            self.free.pop(key, None)
            self.free[key] = t
            same = [k for k in self.free if k[0] == name]
            for k in same[:-self.shapes]:  # the oldest shapes of this name go
                del self.free[k]

    def idle_bytes(self) -> int:
        """Bytes of the buffers waiting in the pool (not any run's)."""
        return sum(t.numel() * t.element_size() for t in self.free.values())


class Buffers:
    """The buffers one cache took from a `BufferPool` (or plain zeros without one)."""

    def __init__(self, pool: BufferPool | None):
        self.pool, self.taken = pool, {}

    def zeros(self, name, shape, dtype, device) -> torch.Tensor:
        if self.pool is None:
            return torch.zeros(shape, dtype=dtype, device=device)
        t = self.taken[name] = self.pool.take(name, shape, dtype, device)
        return t

    def empty(self, name, shape, dtype, device) -> torch.Tensor:
        """`zeros` where the caller writes every entry itself (without a pool: not zeroed first)."""
        if self.pool is None:
            return torch.empty(shape, dtype=dtype, device=device)
        return self.zeros(name, shape, dtype, device)

    def like(self, name, t: torch.Tensor) -> torch.Tensor:
        """A pooled copy of a small tensor the steps read (head indices, scales, masks)."""
        return self.zeros(name, t.shape, t.dtype, t.device).copy_(t)

    def release(self, names=None) -> None:
        """Give back every buffer taken, or those of `names` (no longer used by the cache)."""
        names = list(self.taken) if names is None else [n for n in names if n in self.taken]
        if self.pool is not None:
            self.pool.give_back({n: self.taken[n] for n in names})
        for n in names:
            del self.taken[n]


@dataclass
class Prompt:
    """The prompt a policy selects from (batch size 1).

    m: prompt length; visual_positions: LongTensor [m_v], sorted; query_start: the first position
    after the visual span (the query tokens start here); model sizes L, H (query heads), Hkv.
    pruned: the rows a layer sees after FastV-style pruning (coordinates of the kept rows).
    """

    m: int
    visual_positions: torch.Tensor
    query_start: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    pruned: bool = False

    @property
    def m_v(self) -> int:
        return int(self.visual_positions.numel())

    @property
    def m_t(self) -> int:
        return self.m - self.m_v


@dataclass
class LayerSelection:
    """What one layer's sparse cache keeps, and who may read it.

    keep: one sorted LongTensor per KV head `g` ([n_g] prompt positions), text positions included
        where the method keeps them. Generated tokens are always kept.
    query_mask: optional bool [H, m]: prompt positions query head `h` may attend, when the query
        heads of one group may not all read the whole of the group's `keep`.
    head_scale: optional float [H]: output multiplier per query head (0: the head contributes nothing).
    info: what the policy wants recorded in the run's trace for this layer (tensors or numbers,
        e.g. HT-Sparse's head roles [H], saliency [H] and selected visual positions [k]).
    """

    keep: list[torch.Tensor]
    query_mask: torch.Tensor | None = None
    head_scale: torch.Tensor | None = None
    info: dict = field(default_factory=dict)

    @property
    def lengths(self) -> list[int]:
        return [int(k.numel()) for k in self.keep]


def write_at(buf: torch.Tensor, pos: torch.Tensor, x: torch.Tensor) -> None:
    """buf [B, Hkv, capacity, D][b, h, pos[b, h, t]] = x[b, h, t] for pos [B or 1, Hkv or 1, q] and
    x [B, Hkv, q, D]: one `index_copy_` (over the flattened entries where rows or heads differ).
    (`scatter_` did the same and, compiled by inductor on the CPU, copied the whole buffer: 2.7 ms
    of a 5.4 ms step at 4,608 visual tokens.)"""
    B, Hkv, cap, D = buf.shape
    if pos.shape[0] == 1 and pos.shape[1] == 1:  # every row and head at the same positions
        buf.index_copy_(2, pos[0, 0], x)
        return
    base = torch.arange(B * Hkv, device=buf.device).view(B, Hkv, 1) * cap
    flat = (base + pos).reshape(-1)
    buf.view(B * Hkv * cap, D).index_copy_(0, flat, x.reshape(-1, D))


def causal_mask(rows: int, n: int, device) -> torch.Tensor:
    """bool [rows, n]: row t (the t-th of the last `rows` positions) sees keys j <= n - rows + t."""
    return torch.arange(n, device=device)[None, :] <= torch.arange(n - rows, n, device=device)[:, None]


def grouped_sdpa(query, key, value, scale, bias=None):
    """Attention of a few query rows over a GQA cache without repeating K/V.

    query [1, H, q, D]; key, value [1, Hkv, n, D]; bias optional additive [Hkv, G, q, n].
    The G query heads of a group are folded into the row dimension, so one SDPA call serves all.
    With a single KV head (a `SparseKV` block of one head) the heads stay a dimension instead
    (`enable_gqa`): CPU SDPA over one (batch, head) item with several rows was measured ~10x
    slower (0.65 ms vs 0.06 ms at 2,000 keys, 2 threads). Returns [1, q, H, D].
    """
    _, H, q, D = query.shape
    Hkv, n = key.shape[1], key.shape[2]
    G = H // Hkv
    mask = None
    if q > 1:
        causal = causal_mask(q, n, query.device)
        mask = torch.zeros(q, n, dtype=query.dtype, device=query.device).masked_fill_(~causal, float("-inf"))
        mask = mask.expand(Hkv, G, q, n)
    if bias is not None:
        mask = bias if mask is None else mask + bias
    if Hkv == 1:
        mask = None if mask is None else mask.reshape(1, H, q, n)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=True)
        return out.transpose(1, 2)
    if mask is not None:
        mask = mask.reshape(1, Hkv, G * q, n)
    out = F.scaled_dot_product_attention(query.reshape(1, Hkv, G * q, D), key, value, attn_mask=mask, scale=scale)
    return out.reshape(1, H, q, D).transpose(1, 2)  # SDPA's CUDA output need not be contiguous here


# A compact cache's heads split into two attention calls (`head_parts`) where one padded call would
# read at least this many more K elements (KV head x entry x head dim) per step than two: the CPU's
# SDPA reads a buffer's padding too (masked), and a second call has a fixed cost. Measured on 2 CPU
# threads, HT-Sparse at its defaults on the embedded model (one KV head of four at every entry, the
# others at ~0.8 of them, head dim 24), median decode step, one call vs two, interleaved: at 4,608
# visual tokens (~70,000 elements saved) compiled 2.65 vs 2.50 and 2.25 vs 2.20 ms, eager 3.67 vs
# 3.72 ms; at 9,216 (~140,000) compiled 3.95 vs 3.53 and 3.99 vs 3.63 ms, eager 5.39 vs 4.95 ms.
# One attention call alone, eager, 7B heads (dim 128): two calls lose 14 % at ~48,000 elements saved
# and tie at ~97,000.
SPLIT_MIN_SAVED = 64_000


def head_parts(lens: list[int], head_dim: int, device) -> list[list[int]] | None:
    """KV heads of a compact cache in two groups, the longest first, each attended by its own call over
    its own buffer (the SDPA backend reads every head up to the longest's length): split where the
    elements saved, (Hkv - s) (K_max - K_s) head_dim at the best split s of the heads sorted by
    length, reach `SPLIT_MIN_SAVED`. None: one call (the Triton and the own CPU kernel stop at each
    head's length, so they read no padding)."""
    from .kernels import backend

    if len(lens) < 2 or backend(torch.device(device)) != "sdpa":
        return None
    order = sorted(range(len(lens)), key=lambda h: -lens[h])  # stable: ties keep head order
    saved, s = max(((len(lens) - s) * (lens[order[0]] - lens[order[s]]), s) for s in range(1, len(lens)))
    if saved == 0 or saved * head_dim < SPLIT_MIN_SAVED:
        return None
    return [sorted(order[:s]), sorted(order[s:])]


class SparseKV:
    """One layer's compact cache: the kept prompt entries of every KV head + generated tokens, in one
    buffer, so a step attends the whole layer in one call whatever the selection.

    k, v [1, Hkv, K_max + gen_capacity, D]: KV head h's K_h kept prompt entries at [0, K_h), its
    generated tokens right after them (K_h + i); `starts` = [K_h per head], or [K] where every head
    keeps K (`uniform`: one write position for all heads), and `lens` the same as a tensor. A
    step's row t of head h sees entries 0 .. K_h + n_gen + t (`kernels.attend` with per-head write
    positions), so the attention reads what each head kept, never the padding up to K_max. `bias` [Hkv, G, K_max + gen_capacity]:
    -inf where a query head may not read a kept entry (HT-Sparse's query masks), else None;
    `head_scale` [H]: a query head's output multiplier (0: dropped). StD's top-K, Streaming and a
    selection that keeps everything have equal K_h and no mask: dense's arithmetic on fewer entries.
    Memory held: Hkv (K_max + gen_capacity) entries; `nbytes` counts the entries kept.

    `parts`: where the SDPA backend would read much padding (one HT-Sparse full head among short
    sparse ones: every head read up to the full one's length), the heads are split in two groups
    (`head_parts`), each a `SparseKV` of its own over its KV heads `heads` [h_j] (query heads
    `qheads` [h_j G]), and a step makes one call per group (`fast.Split`); k, v, bias, lens are then None.
    The same entries, the same arithmetic per head. `merge()` puts them back in one buffer (a batch's
    `Stack` holds one buffer per layer).

    `rows`: a batch's row (`KVCache.stacked_row`): k, v are then the row's place in the buffers the
    batch will be stacked in (`StackRows`), wider than K_max + gen_capacity where the rows differ in
    length, so stacking copies nothing.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, sel: LayerSelection, gen_capacity: int,
                 num_heads: int, bufs: Buffers | None = None, layer=0, split: bool = True, rows=None):
        _, Hkv, m, D = keys.shape
        G = num_heads // Hkv
        dev = keys.device
        bufs = bufs or Buffers(None)
        self.selection, self.bufs, self.layer, self.gen_capacity = sel, bufs, layer, gen_capacity
        self.num_heads, self.head_dim, self.dtype = num_heads, D, keys.dtype
        lens = sel.lengths
        K = max(lens)
        self.uniform = min(lens) == K  # every KV head keeps the same number of prompt entries (no padding)
        self.starts = lens[:1] if self.uniform else lens
        self.head_scale = None
        if sel.head_scale is not None:
            self.head_scale = bufs.like(("sparse", layer, "scale"), sel.head_scale.to(dev, keys.dtype))
        self.parts: list[tuple[torch.Tensor, torch.Tensor, SparseKV]] | None = None
        groups = head_parts(lens, D, dev) if split else None
        if groups is not None:  # (KV heads [h_j], query heads [h_j G], the group's own compact cache)
            self.k = self.v = self.bias = self.lens = None
            self.parts = []
            for j, heads in enumerate(groups):
                qmask = None if sel.query_mask is None else sel.query_mask.view(Hkv, G, m)[heads].reshape(-1, m)
                part = LayerSelection([sel.keep[h] for h in heads], qmask)
                idx = torch.tensor(heads, device=dev)
                qheads = (idx[:, None] * G + torch.arange(G, device=dev)).reshape(-1)
                self.parts.append((idx, qheads, SparseKV(keys.index_select(1, idx), values.index_select(1, idx), part,
                                                         gen_capacity, len(heads) * G, bufs, (layer, j), False)))
            cat = torch.cat([q for _, q, _ in self.parts])
            self.order = torch.empty_like(cat).scatter_(0, cat, torch.arange(num_heads, device=dev))  # head -> its row
            return
        self.lens = bufs.like(("sparse", layer, "lens"), torch.tensor(self.starts, device=dev))
        shape = (1, Hkv, K + gen_capacity, D)  # zeros: see `fast` (the unfilled tail is never read)
        # a batch's row: its place in the buffer the rows will be stacked in (`StackRows`), else its own
        self.k = None if rows is None else rows(("stack", layer, "sk"), keys, K + gen_capacity)
        if self.k is not None:
            self.v = rows(("stack", layer, "sv"), values, K + gen_capacity)
        else:
            self.k = bufs.zeros(("sparse", layer, "k"), shape, keys.dtype, dev)
            self.v = bufs.zeros(("sparse", layer, "v"), shape, values.dtype, dev)
        for h, idx in enumerate(sel.keep):  # gathered straight into the buffer (contiguous rows)
            idx = idx.to(dev)
            torch.index_select(keys[0, h], 0, idx, out=self.k[0, h, :len(idx)])
            torch.index_select(values[0, h], 0, idx, out=self.v[0, h, :len(idx)])
        self.bias = None
        if sel.query_mask is not None:  # built once; generated entries 0
            qmask = sel.query_mask.to(dev).view(Hkv, G, m)
            self.bias = bufs.zeros(("sparse", layer, "bias"), (Hkv, G, K + gen_capacity), keys.dtype, dev)
            for h, idx in enumerate(sel.keep):
                self.bias[h, :, :len(idx)].masked_fill_(~qmask[h][:, idx.to(dev)], float("-inf"))

    def merge(self) -> "SparseKV":
        """Put the heads of a split cache (`parts`) back in one buffer, generated entries included
        (a batch stacks one buffer per layer); the parts' buffers are given back. Returns self."""
        if self.parts is None:
            return self
        Hkv, K = len(self.selection.keep), max(self.selection.lengths)
        dev = self.parts[0][0].device
        shape = (1, Hkv, K + self.gen_capacity, self.head_dim)
        k = self.bufs.zeros(("sparse", self.layer, "k"), shape, self.dtype, dev)
        v = self.bufs.zeros(("sparse", self.layer, "v"), shape, self.dtype, dev)
        bias = None
        if any(p.bias is not None for _, _, p in self.parts):
            G = self.num_heads // Hkv
            bias = self.bufs.zeros(("sparse", self.layer, "bias"), (Hkv, G, K + self.gen_capacity), self.dtype, dev)
        for idx, _, p in self.parts:
            n = p.k.shape[2]
            k[:, idx, :n], v[:, idx, :n] = p.k, p.v
            if p.bias is not None:
                bias[idx, :, :n] = p.bias
            p.release()
        self.k, self.v, self.bias, self.parts = k, v, bias, None
        self.lens = self.bufs.like(("sparse", self.layer, "lens"), torch.tensor(self.starts, device=dev))
        return self

    def release(self) -> None:
        """Give this cache's buffers back (a part, once merged)."""
        self.bufs.release([n for n in self.bufs.taken if n[1] == self.layer])

    def positions(self, gen_pos, q: int) -> torch.Tensor:
        """[1, Hkv, q] (or [1, 1, q] where every head keeps as many entries): where each head stores q
        new tokens from generated-token index `gen_pos` (an int or a tensor)."""
        return (self.lens[:, None] + gen_pos + torch.arange(q, device=self.lens.device))[None]

    def write(self, key: torch.Tensor, value: torch.Tensor, gen_pos: int) -> None:
        """Store new tokens' KV [1, Hkv, q, D] at generated-token index `gen_pos`."""
        if self.parts is not None:
            for idx, _, p in self.parts:
                p.write(key.index_select(1, idx), value.index_select(1, idx), gen_pos)
            return
        pos = self.positions(gen_pos, key.shape[2])
        write_at(self.k, pos, key)
        write_at(self.v, pos, value)

    def attend(self, query: torch.Tensor, scale: float, n_gen: int) -> torch.Tensor:
        """query [1, H, q, D] (the newest q tokens; n_gen generated tokens stored, them included)
        -> [1, q, H, D]."""
        from .kernels import attend

        if self.parts is not None:
            out = torch.cat([p.attend(query.index_select(1, qh), scale, n_gen) for _, qh, p in self.parts], 2)
            out = out.index_select(2, self.order)
        else:
            out = attend(query, self.k, self.v, (self.lens + n_gen - query.shape[2])[None], scale, self.bias)
        if self.head_scale is not None:
            out = out * self.head_scale.view(1, 1, -1, 1)
        return out

    def copy_generated(self, keys: torch.Tensor, values: torch.Tensor, gen_pos: int) -> None:
        """Replace generated entries from gen_pos with dense KV [1, Hkv, n, D] (draft refresh)."""
        self.write(keys, values, gen_pos)

    def nbytes(self, n_gen: int) -> int:
        """KV bytes of the entries kept: sum over heads of K_h + n_gen."""
        per_entry = self.head_dim * torch.finfo(self.dtype).bits // 8 * 2
        return per_entry * (sum(self.selection.lengths) + len(self.selection.keep) * n_gen)


class LayerKV(CacheLayerMixin):
    """One layer of `KVCache`.

    It holds a dense buffer `keys, values [1, Hkv, capacity, D]` when the run stores dense KV
    (dense decoding, and the verifier of speculative decoding) or when its policy keeps every
    entry of this layer (`sparse` is None); and a compact `SparseKV` when its policy selected.
    In sparse mode a layer without `SparseKV` reads and writes its dense buffer: a draft layer
    that keeps everything holds no copy.
    """

    is_sliding = False

    def __init__(self, owner: "KVCache", idx: int):
        super().__init__()
        self.owner, self.idx = owner, idx
        self.sparse: SparseKV | None = None

    def lazy_initialization(self, key_states, value_states):
        _, Hkv, _, D = key_states.shape
        shape = (1, Hkv, self.owner.capacity, D)
        bufs = self.owner.buffers  # zeros: the steps (`fast`) mask, never read, the tail
        self.keys = self.owner.stacked_row(("stack", self.idx, "k"), key_states)
        if self.keys is not None:  # its row of the buffers the rows will be stacked in
            self.values = self.owner.stacked_row(("stack", self.idx, "v"), value_states)
        else:
            self.keys = bufs.zeros(("dense", self.idx, "k"), shape, key_states.dtype, key_states.device)
            self.values = bufs.zeros(("dense", self.idx, "v"), shape, value_states.dtype, value_states.device)
        self.is_initialized = True

    def store(self, key_states, value_states, start: int):
        """Write [1, Hkv, q, D] at positions [start, start + q) of the dense buffer; return the
        buffer's first start + q entries."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[2]
        if start + q > self.owner.capacity:
            raise RuntimeError(f"KV cache capacity {self.owner.capacity} exceeded")
        self.keys[:, :, start:start + q] = key_states
        self.values[:, :, start:start + q] = value_states
        return self.keys[:, :, :start + q], self.values[:, :, :start + q]

    def update(self, key_states, value_states, *args, **kwargs):
        o = self.owner
        if o.mode == "sparse":
            if self.sparse is None:
                return self.store(key_states, value_states, o.sparse_len)
            self.sparse.write(key_states, value_states, o.sparse_len - o.prompt_len)
            return key_states, value_states
        if not o.store_dense:  # a direct policy's prefill: the attention keeps what the policy selects
            return key_states, value_states
        return self.store(key_states, value_states, o.dense_len)

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.length + query_length, 0

    def get_max_length(self) -> int:
        return self.owner.capacity

    def nbytes(self) -> int:
        """KV bytes this layer holds: its dense buffer's filled entries and its compact cache."""
        o = self.owner
        n = 0
        if self.is_initialized:
            filled = o.dense_len if o.store_dense else o.sparse_len
            n += 2 * self.keys[:, :, :filled].numel() * self.keys.element_size()
        if self.sparse is not None:
            n += self.sparse.nbytes(o.sparse_len - o.prompt_len)
        return n


class KVCache(Cache):
    """Dense preallocated cache + optional per-layer compact caches, batch size 1.

    capacity: prompt length + the most tokens that will ever be written (max_new_tokens + γ + 1).
    store_dense: False for sparse methods used directly: only what the policy keeps is held.
    Two lengths: `dense_len` (the dense buffers, dense mode) and `sparse_len` (what a draft or
    direct policy has fed, sparse mode); rollback is a change of one of them.
    """

    def __init__(self, num_layers: int, capacity: int, store_dense: bool = True, pool: BufferPool | None = None):
        self.capacity, self.store_dense = capacity, store_dense
        self.buffers = Buffers(pool)  # `release()` gives them back to the pool
        self.mode = "dense"
        self.dense_len = self.sparse_len = self.prompt_len = 0
        self.static: dict = {}  # the compiled steps' views of these buffers (`fast.buffers`)
        self.stack: "Stack | None" = None  # batched decoding: the stack this cache's buffers are a row of
        self.prompt_ids: torch.Tensor | None = None  # the prompt's token ids [m] (`engine.prefill`; `Stack.prefix`)
        self.reserved: "tuple[StackRows, int] | None" = None  # (the rows' buffers, its row) before the stack
        super().__init__(layers=[LayerKV(self, i) for i in range(num_layers)])

    @property
    def length(self) -> int:
        return self.dense_len if self.mode == "dense" else self.sparse_len

    def advance(self, n: int) -> None:
        if self.mode == "dense":
            self.dense_len += n
        else:
            self.sparse_len += n

    def stacked_row(self, name, like: torch.Tensor, need: int | None = None) -> torch.Tensor | None:
        """This cache's row of buffer `name` of the batch it will be stacked with (`StackRows`), or
        None (not reserved, or a compact buffer needing `need` entries where the row has fewer)."""
        if self.reserved is None:
            return None
        rows, b = self.reserved
        return rows.row(name, b, like, need)

    def finish_prefill(self, m: int) -> None:
        self.prompt_len = self.dense_len = self.sparse_len = m
        if not self.store_dense:
            self.mode = "sparse"

    def rewind(self) -> None:
        """Back to the state right after the prefill (`engine.Prefilled`): decoding writes only past
        the prompt, so forgetting what it wrote is a change of lengths."""
        assert self.stack is None and self.reserved is None, "a batch row's cache is not rewound"
        self.dense_len = self.sparse_len = self.prompt_len
        self.mode = "dense" if self.store_dense else "sparse"

    def set_sparse(self, layer: int, sparse: SparseKV) -> None:
        self.layers[layer].sparse = sparse

    def refresh_sparse(self, start: int, end: int) -> None:
        """Overwrite the compact caches' entries for positions [start, end) with the dense KV."""
        for layer in self.layers:
            if layer.sparse is not None:
                layer.sparse.copy_generated(layer.keys[:, :, start:end], layer.values[:, :, start:end],
                                            start - self.prompt_len)

    def release(self) -> None:
        """The run is over: its buffers go back to the pool (this cache must not be used again)."""
        self.static.clear()
        self.buffers.release()
        if self.stack is not None:  # the stack goes back once no row of it is left
            stack, self.stack = self.stack, None
            stack.release_if_unused()
        if self.reserved is not None:  # the reserved rows go back once no cache uses them
            rows, self.reserved = self.reserved[0], None
            rows.release_if_unused()

    def nbytes(self) -> int:
        """KV bytes held now, every layer, dense buffers and compact caches."""
        return sum(layer.nbytes() for layer in self.layers)

    def sparse_nbytes(self) -> int:
        """KV bytes of the compact caches only."""
        n_gen = self.sparse_len - self.prompt_len
        return sum(l.sparse.nbytes(n_gen) for l in self.layers if l.sparse is not None)


class StackRows:
    """The buffers of caches that will be decoded together, allocated before their prefills in the
    stack's layout (`Stack`'s names and shapes: per layer [B, Hkv, width, D], K and V, dense and
    compact), so each prefill writes its KV into its own row and stacking them copies nothing: the
    copy cost 25-27 ms of a 500-ms batch decode (8 rows of 4,650 tokens, 115 MB, on 2 CPU cores), and
    StD's compact draft caches another 9-12 ms at the batch's first round. A dense buffer is as wide
    as the longest row's capacity; a compact one is sized at its first row's selection, K_max +
    room for generated tokens, plus the difference between the longest row's capacity and that
    row's (a top-K keeps K entries in every row, a policy keeping a share of the prompt keeps more
    in a longer row); a row whose selection needs more keeps its own buffer, and that layer is
    stacked by copying. A row is zeroed as its cache first writes (the tail is masked, never
    uninitialised memory), so each prefill pays for its own row. The stack adopts the buffers where
    it stacks exactly these caches in this order (`Stack.__init__`), each buffer whose every row is
    in place; otherwise (a row ended at its first token) it copies as before, and the buffers go
    back once no cache uses them."""

    def __init__(self, caches: list[KVCache], pool: BufferPool | None = None):
        self.caches, self.buffers = list(caches), Buffers(pool)
        self.tensors: dict = {}  # name -> [B, Hkv, width, D]
        self.width = max(c.capacity for c in caches)
        for b, c in enumerate(caches):
            c.reserved = (self, b)

    def row(self, name, b: int, like: torch.Tensor, need: int | None = None) -> torch.Tensor | None:
        """Row b [1, Hkv, width, D] (zeroed) of buffer `name`, allocated at its first row: a dense
        buffer (`need` None) as wide as the widest cache, a compact one needing `need` entries as
        described above; None where row b needs more entries than the buffer has."""
        t = self.tensors.get(name)
        if t is None:
            width = self.width if need is None else need + self.width - self.caches[b].capacity
            shape = (len(self.caches), like.shape[1], width, like.shape[3])
            t = self.tensors[name] = self.buffers.empty(name, shape, like.dtype, like.device)
        if need is not None and need > t.shape[2]:
            return None
        return t[b:b + 1].zero_()

    def adopt(self, caches: list[KVCache]) -> Buffers | None:
        """Where `caches` are exactly these rows in order: the buffers {name: [B, Hkv, width, D]},
        handed over (the stack takes each one whose rows are all in place and gives back the
        others); else None."""
        if len(caches) != len(self.caches) or any(a is not b or a.reserved != (self, i) for i, (a, b) in
                                                  enumerate(zip(caches, self.caches))):
            return None
        out = Buffers(self.buffers.pool)
        out.taken, self.tensors, self.buffers.taken = self.tensors, {}, {}  # (with a pool: the same tensors)
        for c in caches:
            c.reserved = None
        return out

    def release_if_unused(self) -> None:
        if all(c.reserved is None or c.reserved[0] is not self for c in self.caches):
            self.buffers.release()
            self.tensors.clear()


SHARED_MIN = 512  # shortest common prefix worth checking (the CPU op's keys per item: `SPLIT`)


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many first token ids [m] two prompts have in common."""
    n = min(len(a), len(b))
    differ = torch.nonzero(a[:n].cpu() != b[:n].cpu())  # (a CPU tensor's .cpu() is itself)
    return int(differ[0, 0]) if len(differ) else n


def shared_prefixes(caches: list, dense: list) -> list[list[int]]:
    """`Stack.prefix` of these rows over their stacked dense K and V (`dense`: per layer (k, v) or None)."""
    B = len(caches)
    out = [[b, 0] for b in range(B)]
    layers = [kv for kv in dense if kv is not None]
    for b in range(1, B):
        for a in range(b):
            ia, ib = caches[a].prompt_ids, caches[b].prompt_ids
            if out[a][1] or ia is None or ib is None or not layers:
                continue  # only a group's first row is read for others
            m = min(common_prefix(ia, ib), caches[a].prompt_len, caches[b].prompt_len)
            if m < SHARED_MIN:
                continue
            # two videos of one length have the same token ids (placeholders): one entry of the first
            # layer tells them apart before the whole prefix is compared (8 rows of 8 videos: 28 pairs)
            k0 = layers[0][0]
            if not torch.equal(k0[a, :, m // 2], k0[b, :, m // 2]):
                continue
            if all(torch.equal(k[a, :, :m], k[b, :, :m]) and torch.equal(v[a, :, :m], v[b, :, :m]) for k, v in layers):
                out[b] = [a, m]
                break
    return out


class Stack:
    """The KV buffers of B runs' caches stacked along the batch dimension, so one decode step serves
    every row (batched decoding): per layer the dense buffers [B, Hkv, max capacity, D] and the
    compact ones [B, Hkv, max(K_max + gen_capacity), D], with per-row biases [B, Hkv, G, N] and
    head scales [B, H] where any row has them. Each run's cache is re-pointed at its row (views),
    so rollback, refresh and byte counts stay per row and unchanged; rows keep their own lengths.

    A layer where some rows hold a compact cache and others read their dense one (their policy kept
    everything there) gets, for those rows, a compact copy of every entry (the same entries: the
    same attention), so every layer is one block. Stacking copies each row's KV once, except the
    KV (dense and compact) of rows prefilled into their places (`StackRows`); after rows end,
    `Stack(remaining caches)` drops theirs (each row's cache keeps working on its own views).

    offsets(mode, layers): per row, where each block's heads write relative to the row's length
    ([B, slots]: dense 0; a compact cache K_h - prompt length).

    prefix: LongTensor [B, 2], per row (the row whose dense K and V to read for its first entries,
    how many): rows whose prompts begin alike (questions on one video) and whose dense KV over that
    common prefix is bit-identical in every layer (checked here, once per stack: ~2 x 15 MB read
    per row at 4,600 tokens of the embedded model) read the first such row's, in cache for all of
    them (`kernels.attend`'s prefix): one layer of eight such rows at 4,716 entries 528-630 -> 338-445
    us on two threads, the same bits; others (b, 0)."""

    def __init__(self, caches: list[KVCache], num_heads: int, pool: BufferPool | None = None):
        self.caches, self.num_heads = list(caches), num_heads
        self.buffers = Buffers(pool)
        B = len(caches)
        reserved = caches[0].reserved[0] if caches[0].reserved is not None else None
        adopted = (reserved.adopt(caches) if reserved is not None else None) or Buffers(pool)  # KV in place
        self.dense: list[tuple | None] = []
        # per layer: (k, v, bias, scale, width, offsets [B, width]) of the stacked compact caches, or None
        self.sparse: list[tuple | None] = []
        for i in range(len(caches[0].layers)):
            rows = [c.layers[i] for c in caches]
            if any(r.sparse is not None for r in rows):
                sps = [self._compact(c, r) for c, r in zip(caches, rows)]
                k, v = self._kv(adopted, i, "s", [s.k for s in sps], [s.v for s in sps])
                Hkv, G = k.shape[1], num_heads // k.shape[1]
                bias = scale = None
                if any(s.bias is not None for s in sps):
                    bias = self.buffers.zeros(("stack", i, "bias"), (B, Hkv, G, k.shape[2]), k.dtype, k.device)
                if any(s.head_scale is not None for s in sps):
                    scale = self.buffers.zeros(("stack", i, "scale"), (B, num_heads), k.dtype, k.device)
                width = 1 if all(s.uniform for s in sps) else Hkv
                offsets = torch.zeros(B, width, dtype=torch.long, device=k.device)
                self.sparse.append((k, v, bias, scale, width, offsets))
            else:
                self.sparse.append(None)
            if all(r.is_initialized for r in rows):
                self.dense.append(self._kv(adopted, i, "", [r.keys for r in rows], [r.values for r in rows]))
            else:
                self.dense.append(None)
        for b, c in enumerate(caches):
            self._put(b, c)
        device = next(t[0].device for t in self.dense + self.sparse if t is not None)
        self.prefix = self.buffers.like(("stack", "prefix"), torch.tensor(shared_prefixes(caches, self.dense),
                                                                          dtype=torch.long, device=device))
        adopted.release()  # the reserved buffers not taken (their rows are copied now)
        for c in caches:  # stacked by copying: the reserved rows are no longer read
            if c.reserved is not None:
                rows, c.reserved = c.reserved[0], None
                rows.release_if_unused()
        self.blocks: dict = {}

    MOVED = ("dense", "k"), ("dense", "v"), ("sparse", "k"), ("sparse", "v"), ("sparse", "bias"), ("sparse", "scale")

    def _kv(self, adopted: Buffers, i: int, kind: str, ks: list, vs: list) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's stacked K and V [B, Hkv, N, D] (`kind` "" dense, "s" compact) for rows [1, Hkv, n_b, D]:
        the reserved buffers, taken over from `adopted`, where every row of both is its own row of
        them (prefilled in place, `StackRows`), else new ones that `_put` fills."""
        names = ("stack", i, kind + "k"), ("stack", i, kind + "v")
        ts = [adopted.taken.get(n) for n in names]
        if all(t is not None and all(r.data_ptr() == t[b].data_ptr() and r.shape[2] == t.shape[2]
                                     for b, r in enumerate(rows)) for t, rows in zip(ts, (ks, vs))):
            for n in names:
                self.buffers.taken[n] = adopted.taken.pop(n)
            return ts[0], ts[1]
        return self._buffer(names[0], ks), self._buffer(names[1], vs)

    def _buffer(self, name, rows: list[torch.Tensor]) -> torch.Tensor:
        """[B, Hkv, max n_b, D] for rows [1, Hkv, n_b, D] (filled by `_put`)."""
        n = max(r.shape[2] for r in rows)
        return self.buffers.empty(name, (len(rows),) + rows[0].shape[1:2] + (n,) + rows[0].shape[3:],
                                  rows[0].dtype, rows[0].device)

    def _compact(self, c: KVCache, r) -> "SparseKV":
        """Row r's compact cache; for a row that reads its dense cache in a layer where others hold a
        compact one, a compact copy of every entry it has (the same entries: the same attention)."""
        if r.sparse is None:
            n = c.prompt_len
            sel = LayerSelection([torch.arange(n, device=r.keys.device)] * r.keys.shape[1])
            r.sparse = SparseKV(r.keys[:, :, :n], r.values[:, :, :n], sel, c.capacity - n, self.num_heads)
            r.sparse.copy_generated(r.keys[:, :, n:c.sparse_len], r.values[:, :, n:c.sparse_len], 0)
        return r.sparse.merge()

    @staticmethod
    def _copy(out: torch.Tensor, b: int, row: torch.Tensor) -> torch.Tensor:
        """Row b of `out` <- row [1, Hkv, n, D], zeros past it (masked, but never uninitialised memory:
        0 x NaN is NaN); the row's view of `out`."""
        n = row.shape[2]
        out[b, :, :n] = row[0]
        out[b, :, n:] = 0
        return out[b:b + 1]

    def _fits(self, c: KVCache) -> bool:
        """Cache `c` can take a row of these buffers: the same layers stacked, no longer rows, and
        no bias, head scale or per-head width the stacked layer lacks."""
        for i, r in enumerate(c.layers):
            d, sp = self.dense[i], self.sparse[i]
            if (d is not None) != r.is_initialized or (d is not None and r.keys.shape[2] > d[0].shape[2]):
                return False
            if sp is None:
                if r.sparse is not None:
                    return False
                continue
            k, _, bias, scale, width, _ = sp
            s = None if r.sparse is None else r.sparse.merge()  # a row holds one buffer per layer
            n = s.k.shape[2] if s is not None else c.capacity
            if n > k.shape[2] or (s is not None and ((s.bias is not None and bias is None) or (
                    s.head_scale is not None and scale is None) or (width == 1 and not s.uniform))):
                return False
        return True

    def _put(self, b: int, c: KVCache) -> None:
        """Copy cache `c`'s KV (and its compact caches' biases, head scales and write offsets) into
        row b and re-point `c` at its row (views); its own buffers are given back."""
        for i, r in enumerate(c.layers):
            if self.sparse[i] is not None:
                k, v, bias, scale, width, offsets = self.sparse[i]
                s = self._compact(c, r)
                if s.k.data_ptr() != k[b].data_ptr():  # else already in place (`StackRows`)
                    s.k, s.v = self._copy(k, b, s.k), self._copy(v, b, s.v)
                if bias is not None:
                    bias[b] = 0
                    if s.bias is not None:
                        bias[b, :, :, :s.bias.shape[-1]] = s.bias
                    s.bias = bias[b]
                if scale is not None:
                    scale[b] = 1 if s.head_scale is None else s.head_scale
                    s.head_scale = scale[b]
                offsets[b] = torch.tensor([n - c.prompt_len for n in s.starts] * (width // len(s.starts)))
            if self.dense[i] is not None:
                k, v = self.dense[i]
                if r.keys.data_ptr() != k[b].data_ptr():  # else already in place (`StackRows`)
                    r.keys, r.values = self._copy(k, b, r.keys), self._copy(v, b, r.values)
        c.static.clear()
        old, c.stack = c.stack, self
        if old is not None and old is not self:
            old.release_if_unused()  # the previous stack (rows have ended since), once every row has left it
        c.buffers.release([(kind, i, t) for i in range(len(c.layers)) for kind, t in self.MOVED])

    def replace(self, b: int, c: KVCache) -> bool:
        """Cache `c` (a prompt that joins as row b's ended: continuous batching) takes row b in place,
        the buffers, their addresses (CUDA graphs) and the other rows untouched; False where it does
        not fit (`_fits`: then the rows are stacked again)."""
        if c.stack is not None or not self._fits(c):
            return False
        self.caches[b].stack = None
        self.caches[b] = c
        self._put(b, c)
        # row b's first entries are another prompt's now: it and the rows that read them read their own
        rows = torch.nonzero((self.prefix[:, 0] == b) | (torch.arange(len(self.caches), device=self.prefix.device) == b))[:, 0]
        self.prefix[rows, 0] = rows
        self.prefix[rows, 1] = 0
        self.blocks.clear()  # their offsets are rebuilt from the rows'
        return True

    def release_if_unused(self) -> None:
        """Give the buffers back once no cache is a row of this stack any more."""
        if all(c.stack is not self for c in self.caches):
            self.release()

    def release(self) -> None:
        self.buffers.release()
