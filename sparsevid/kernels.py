"""Decode attention: a few new query rows per sequence over a preallocated KV buffer.

Every decode step (dense, draft, verification of γ + 1 rows) attends q new rows over a buffer whose
capacity is fixed for the run, of which only the first `start + q` entries are written. `attend`
takes the write position `start` as a tensor, so one captured CUDA graph or one compiled graph
serves every step of a run. Row t of sequence b sees entries 0 .. start[b] + t (causality and the
unfilled tail), and optionally an additive per-query-head bias (HT-Sparse's query masks).

Three backends compute the same thing:

- `sdpa`: PyTorch's `scaled_dot_product_attention` with an additive mask [q, capacity] built from
  `start`, the G query heads of a KV head folded into rows (no K/V repeat). It reads the whole
  buffer. On the CPU it is the fast one (one fused call); on CUDA a mask rules out the flash kernel
  and it was measured at 91 GB/s on one H200 (issue 39);
- `cpu`: the same split-KV scheme in C++ for the CPU (`csrc/decode_attention.cpp`, the op
  `sparsevid::decode_attention`, built once per machine by `torch.utils.cpp_extension` into
  ~/.cache/sparsevid/ext, so it runs inside compiled graphs too): SDPA's flash kernel and every other
  PyTorch path tried read a decode step's KV at 10-15 GB/s at the embedded model's head dim 24 (bmm +
  softmax, flex_attention: issue 41), a third to a half of what two cores can stream. float32 only;
  where it cannot be built (no C++ compiler), `sdpa`, and `describe()` says why;
- `triton`: a split-KV ("flash-decoding") kernel written here, because none of the libraries at
  hand does this with lengths as tensors and GQA without repeating K/V (SDPA's flash kernel takes
  no lengths; FlashInfer and flash-attn are not installed on the GPU image): the grid is
  (sequence x KV head, split of the keys); each program reads its split of one KV head once for
  all G * q rows of that head (one `tl.dot`), stops at the sequence's length, and writes a partial
  output and log-sum-exp; a second small kernel combines the splits. The number of splits depends
  on the capacity only, never on q, so a row's arithmetic is the same in a one-row step and in a
  verification pass.

Beside attention, three small ops of a decoder layer as Triton kernels for the CUDA steps
(`rms_norm`, `rotary`, `write_kv`; `fast.FUSED`): in a captured step every kernel costs a few µs
whatever it reads, and transformers spends 8 on an RMSNorm and 10 on the rotary embedding of a
layer's q and k, the cache's writes 4 on a layer's new K and V.

`backend()` picks `triton` on CUDA where Triton imports, `cpu` on the CPU where it builds, else `sdpa`;
SPARSEVID_ATTENTION=sdpa|cpu|triton overrides it (`bench --verify-kernels` and the GPU check time each). The tests check each against a float64 reference on the
CPU (Triton's interpreter, TRITON_INTERPRET=1).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading

import torch
import torch.nn.functional as F

BACKENDS = ("sdpa", "cpu", "triton")


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


# SPARSEVID_ATTENTION=sdpa|triton forces a backend (read once; `gpu_check` sets FORCED to time each)
FORCED: str | None = os.environ.get("SPARSEVID_ATTENTION") if os.environ.get("SPARSEVID_ATTENTION") in BACKENDS else None


def backend(device: torch.device) -> str:
    """The decode-attention backend for `device`: FORCED if set, else triton on CUDA (where it
    imports), cpu on the CPU (where it builds), sdpa elsewhere."""
    if FORCED is not None:
        return FORCED
    if device.type == "cuda":
        return "triton" if triton_available() else "sdpa"
    return "cpu" if device.type == "cpu" and cpu_available() else "sdpa"


_CPU_OP: str | None = None  # "" once the CPU op is loaded, else why it is not (None: not tried yet)
BUILD_DIR: str | None = None  # where it was built (per machine)
_CPU_LOCK = threading.Lock()
SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "decode_attention.cpp")
CFLAGS = ["-O3", "-march=native", "-fopenmp"]  # -fopenmp: ATen's parallel_for on torch's own OpenMP pool


def cpu_available() -> bool:
    """Whether the CPU op `sparsevid::decode_attention` is loaded: built (or found built) on the first
    call, outside a compiled graph (inside one, only what is already known is read)."""
    if _CPU_OP is None and not torch.compiler.is_compiling():
        with _CPU_LOCK:
            if _CPU_OP is None:
                load_cpu_op()
    return _CPU_OP == ""


def describe(device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    """The decode attention a step on `device` runs, in words (the steps line of a report)."""
    which = backend(device)
    if which == "cpu" and dtype == torch.float32:
        return "own C++ kernel"
    if which == "triton":
        return "split-KV Triton kernel"
    why = f"; own kernel: {_CPU_OP}" if device.type == "cpu" and _CPU_OP else ""
    return f"SDPA with a mask{why}"


def load_cpu_op() -> None:
    """Build `csrc/decode_attention.cpp` into ~/.cache/sparsevid/ext/<key> (key: the source, flags,
    torch version and this CPU's flags; -march=native) and load it; on failure keep the reason.
    A build takes ~12 s once per machine (a process-safe lock: torch's); a later process loads it."""
    global _CPU_OP
    import hashlib
    import platform
    import warnings

    try:
        from torch.utils import cpp_extension

        with open(SOURCE, "rb") as f:
            key = hashlib.sha256(f.read())
        key.update(" ".join(CFLAGS + [torch.__version__, platform.machine()]).encode())
        try:
            with open("/proc/cpuinfo") as f:
                key.update(next((line for line in f if line.startswith(("flags", "Features"))), "").encode())
        except OSError:
            pass
        build = os.path.join(os.path.expanduser("~"), ".cache", "sparsevid", "ext", key.hexdigest()[:16])
        os.makedirs(build, exist_ok=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cpp_extension.load("sparsevid_decode_attention", [SOURCE], extra_cflags=CFLAGS,
                               extra_ldflags=["-fopenmp"], build_directory=build, is_python_module=False)
        _register_fake()
        global BUILD_DIR
        BUILD_DIR = build
        _CPU_OP = ""
    except Exception as e:  # no compiler, no ninja, an unusual platform: SDPA serves
        lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [""]
        why = next((line for line in lines if "error:" in line.lower()), lines[-1])
        _CPU_OP = f"{type(e).__name__}: {why}"[:300]  # the compiler's first error, not ninja's last line


def _register_fake() -> None:
    """The op's output shape for torch.compile's tracing: [B, q, H, D]."""
    if getattr(_register_fake, "done", False):
        return

    @torch.library.register_fake("sparsevid::decode_attention")
    def _(q, k, v, start, scale, bias, prefix, threads=0, min_work=0):
        return q.new_empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3])

    _register_fake.done = True


def attend(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, scale: float,
           bias: torch.Tensor | None = None, which: str | None = None,
           prefix: torch.Tensor | None = None) -> torch.Tensor:
    """query [B, H, q, D] over k, v [B, Hkv, N, D] -> [B, q, H, D].

    start: LongTensor broadcastable to [B, Hkv]: where this step's q rows were written, per sequence
    and KV head (row t of head h sees entries 0 .. start[b, h] + t: a compact cache's heads keep
    different numbers of entries); bias: optional additive [Hkv, G, N] shared by the batch, or
    [B, Hkv, G, N] per sequence (-inf: query head g of KV head h may not read that entry). H = Hkv * G.
    prefix: optional LongTensor [B, 2]: sequence b's first prefix[b, 1] entries are bit-identical to
    sequence prefix[b, 0]'s (questions on one video, `cache.Stack.prefix`), so the `cpu` op and the
    `triton` kernel read those instead (each shared split about once for all the sequences); SDPA
    reads b's own, the same values."""
    which = which or backend(query.device)
    if which == "triton":
        return attend_triton(query, k, v, start, scale, bias, prefix=prefix)
    if which == "cpu" and query.device.type == "cpu" and query.dtype == torch.float32 and cpu_available():
        return attend_cpu(query, k, v, start, scale, bias, prefix)
    return attend_sdpa(query, k, v, start, scale, bias)


def attend_cpu(query, k, v, start, scale, bias=None, prefix=None):
    """`attend` through the C++ CPU op (see the module docstring), on the threads `op_threads` gives
    it: the same in an eager step and in a compiled one (the op splits the keys itself)."""
    B, H, q, D = query.shape
    Hkv = k.shape[1]
    start = per_sequence_and_head(start, B, Hkv).expand(B, Hkv).contiguous()
    if bias is not None:
        bias = bias[None] if bias.dim() == 3 else bias
    return torch.ops.sparsevid.decode_attention(query, k, v, start, scale, bias, prefix, *op_threads())


# CPU: the thread count of the process while a decode step runs on fewer (`engine.step_threads`), or
# None. An eager SDPA call reading at least WIDE_MIN (row, KV head, entry) triples runs on it:
# a batch of 8 rows at 4,650 entries, 4 KV heads of dim 24 took 2.6 ms per layer on one thread and
# 2.1 ms on two, switching included; switching costs ~0.15 ms, more than one row gains below that.
WIDE_THREADS: int | None = None
WIDE_MIN = 100_000


# Inside a decode step on fewer threads, eager or compiled (a graph cannot switch threads), the CPU op
# runs its own items on WIDE_THREADS where the call is long enough to pay for waking them:
# (sequence, KV head) pairs x entries read x (rows per KV head + 3) at least WIDE_GRAPH_WORK. Where
# that lies depends on the CPU, so it is measured once per machine (`measure_graph_work`, ~0.3 s, kept
# beside the op's build). One layer of the embedded model's shape (4 KV heads x 2 query heads, head
# dim 24), one thread against two (the op's own, under OMP_WAIT_POLICY=PASSIVE: ~0.1 ms to wake the second):
# - 2-core Xeon (AVX-512): 4,608 entries, 4 tokens 0.34 vs 0.39 ms, 10 tokens 0.73 vs 0.58; 9,216
#   entries, 1 token 0.37 vs 0.42, 2 tokens 0.48 vs 0.41, 4 tokens 0.68 vs 0.51; 18,432 entries,
#   1 token 0.61 vs 0.50: two threads pay from ~240,000;
# - 2-core AMD EPYC (AVX2 only: a row's scores and softmax cost more per entry read): 4,700 entries,
#   1 token 0.19 vs 0.22 ms, 2 tokens 0.34 vs 0.28, 4 tokens 0.66 vs 0.48; 2,300 entries, 4 tokens
#   0.32 vs 0.38, 7 tokens 0.56 vs 0.49: measured 182,400-211,200 (`bench --verify-kernels` prints
#   this machine's).
WIDE_GRAPH_WORK: int | None = None  # None: not measured yet in this process
GRAPH_WORK_DEFAULT = 240_000  # where it cannot be measured


def measure_graph_work(reps: int = 15) -> int:
    """WIDE_GRAPH_WORK for this machine: one layer of the embedded model's shape at a few lengths
    and row counts, on one thread and on torch's count, interleaved, medians; the threshold that
    makes the calls measured take the least time in all (one noisy call moves it little). Kept in
    the op's build folder (per machine), so measured once."""
    import json
    import statistics
    import time

    n_threads = torch.get_num_threads()
    if n_threads < 2 or not cpu_available():  # (loads the op: BUILD_DIR, where the measurement is kept)
        return GRAPH_WORK_DEFAULT
    path = os.path.join(BUILD_DIR, "graph_work.json")
    try:
        with open(path) as f:
            saved = json.load(f)
        if saved.get("threads") == n_threads:
            return int(saved["work"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    op, Hkv, G, D = torch.ops.sparsevid.decode_attention, 4, 2, 24
    gen = torch.Generator().manual_seed(0)
    cells = []  # (work, one thread s, n_threads s)
    with torch.inference_mode():
        for n in (1_200, 2_400, 4_800, 9_600):
            k, v = (torch.randn(1, Hkv, n, D, generator=gen) for _ in range(2))
            for q in (1, 2, 4, 8):
                query = torch.randn(1, Hkv * G, q, D, generator=gen)
                start = torch.full((1, Hkv), n - q, dtype=torch.long)
                times = {1: [], n_threads: []}
                with threads(1):
                    for _ in range(reps + 1):
                        for t in times:
                            t0 = time.perf_counter()
                            op(query, k, v, start, 0.2, None, None, t, 0)
                            times[t].append(time.perf_counter() - t0)
                one, many = (statistics.median(times[t][1:]) for t in times)
                work = Hkv * n * (G * q + 3)
                cells.append((work, one, many))
    work = min((w for w, _, _ in cells), key=lambda w: sum(many if c >= w else one for c, one, many in cells))
    try:
        with open(path, "w") as f:
            json.dump(dict(threads=n_threads, work=work, cells=cells), f)
    except OSError:
        pass
    return work


def op_threads() -> tuple[int, int]:
    """The CPU op's (threads, min_work) inside a decode step on fewer threads: WIDE_THREADS and
    WIDE_GRAPH_WORK (in a compiled graph read at tracing: constants of the graph), and the op
    compares a call's work with min_work itself: a comparison here, over the graph's dynamic sizes
    (capacity, rows), would become a guard, and a verification or a video length on its other side
    would recompile inside a timed run. An eager step's call gets the same (so eager steps, which
    `runs.choose_step_threads` times, spend their attention as compiled ones do). (0, 0) elsewhere:
    the step's own threads."""
    if not WIDE_THREADS:
        return 0, 0
    return WIDE_THREADS, WIDE_GRAPH_WORK or GRAPH_WORK_DEFAULT


@torch.compiler.assume_constant_result
def traced_threads() -> int:
    """torch's thread count, read at tracing inside a compiled graph (a constant there, as it is in
    inductor's code; a plain torch.get_num_threads() call breaks the graph)."""
    return torch.get_num_threads()


def call_threads(device: torch.device, items: int, n: int) -> int | None:
    """The thread count an eager SDPA call over `items` (sequence, KV head) pairs of `n` entries
    runs on, or None (the step's own):
    - one item: one thread. The CPU flash kernel parallelises over (sequence, KV head, block of 32
      query rows); with a single one it runs it in the calling thread, outside a parallel region, so
      every small GEMM inside then wakes the other threads, once per block of keys: under
      OMP_WAIT_POLICY=PASSIVE, 2 threads, 2 query rows over 9,400 entries of head dim 24 took
      2,380 us against 102 us on one thread (one HT-Sparse full head in a group of its own: a
      decode step 3x dense's). In a compiled graph (no switch), `attend_sdpa` makes the G query
      heads G items instead;
    - at least WIDE_MIN (item, entry) pairs inside a step on fewer threads: `WIDE_THREADS`."""
    if device.type != "cpu" or torch.compiler.is_compiling():
        return None
    if items == 1:
        return 1
    return WIDE_THREADS if WIDE_THREADS is not None and items * n >= WIDE_MIN else None


@contextlib.contextmanager
def threads(n: int | None):
    """torch's intra-op thread count set to n (None or the current count: unchanged), restored after.
    None reads nothing, so a compiled graph can trace it (torch.get_num_threads() is a graph break)."""
    if not n:
        yield
        return
    old = torch.get_num_threads()
    if n == old:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def attend_sdpa(query, k, v, start, scale, bias=None):
    """`attend` through SDPA with an additive mask (see the module docstring); an eager CPU call on
    the threads `call_threads` gives it."""
    B, H, q, D = query.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = H // Hkv
    rows = torch.arange(q, device=query.device)
    cols = torch.arange(N, device=query.device)
    start = per_sequence_and_head(start, B, Hkv)
    ends = start[..., None, None] + rows[:, None]  # [B or 1, Hkv or 1, q, 1]: the last entry row t sees
    mask = torch.zeros(ends.shape[:3] + (N,), dtype=query.dtype, device=query.device)
    mask = mask.masked_fill(cols > ends, float("-inf"))[:, :, None]  # [B or 1, Hkv or 1, 1, q, N]
    if bias is not None:  # [Hkv, G, N] or per sequence [B, Hkv, G, N]
        mask = mask + (bias[None] if bias.dim() == 3 else bias)[:, :, :, None, :].to(query.dtype)
    mask = mask.expand(-1, -1, G, q, N).reshape(mask.shape[0], mask.shape[1], G * q, N)  # rows g * q + t
    query = query.reshape(B, Hkv, G * q, D)
    if (B * Hkv == 1 < G and query.device.type == "cpu" and torch.compiler.is_compiling()
            and traced_threads() > 1):
        # one (sequence, KV head) in a graph compiled for several threads (the count is fixed at
        # tracing; no switch inside a graph): its G query heads as G sequences over the same K/V
        # (expanded, not copied), so the flash kernel splits them across threads (`call_threads`)
        query, k, v, mask = query.view(G, 1, q, D), k.expand(G, -1, -1, -1), v.expand(G, -1, -1, -1), mask.view(G, 1, q, N)
    with threads(call_threads(query.device, B * Hkv, N)):
        out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale)
    # SDPA's CUDA output need not be contiguous in this layout: reshape, not view
    return out.reshape(B, H, q, D).transpose(1, 2)


def splits_for(capacity: int, rows: int, device: torch.device, unit: int) -> tuple[int, int]:
    """(number of splits, keys per split, a multiple of `unit`) of a buffer of `capacity` for `rows`
    (sequences x KV heads): about four programs per multiprocessor. Depends on the capacity, never
    on the step's q."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    want = max(1, (4 * sms) // max(1, rows))
    per = max(unit, math.ceil(capacity / want / unit) * unit)
    return math.ceil(capacity / per), per


# The largest shared memory a block may have on an H100 / H200 (sm_90): 227 KB.
SM90_SHARED = 232_448


def triton_config(G: int, q: int, D: int, dtype: torch.dtype) -> dict:
    """`split_kv`'s launch for G query heads per KV head, q new tokens and head dim D: its tile sizes
    (BLOCK_M rows, BLOCK_N keys, BLOCK_D dims), warps and stages. The key tile depends on D and the
    dtype only, never on q: a row's online softmax runs over the same tiles in a one-row step and in
    a verification (the same bits, as the splits). bf16 / float16, as measured on one H200 (7B heads,
    batch 8, 16k-64k entries): 64-key tiles; one row block of up to 32 rows: 4 warps, 2 stages (a
    step: 4.3 TB/s at 64k, the mask-free flash kernel's 4.3); more rows (a verification, G (γ + 1) =
    70): 8 warps, 3 stages (0.48 ms at 64k against 0.66 ms with 2 stages). float32 (exact products:
    `tl.dot` in IEEE mode, on the CUDA cores, its tiles in registers): 2 stages and at most 2,048
    (key, dim) pairs a tile. Compiled for sm_90 on a CPU with Triton 3.6 (the GPU image's) and 3.9,
    resource usage read from the cubin (`_triton_attention.sm90_usage`): with 64-key tiles at the 7B
    heads a verification of 64-128 rows spilled 10.6-17.6 KB of local memory per thread; with 16-key
    tiles 0-168 bytes; 3 stages of 128 rows x 128 dims with a bias needed 295 KB of shared memory, more
    than a block may have (`SM90_SHARED`). `tests/test_kernels.py` compiles every launch this gives
    at the models' heads and checks both. Unmeasured on a GPU: float32 is the exactness path there."""
    block_m, block_d = max(16, triton_next_pow2(G * q)), max(16, triton_next_pow2(D))
    warps = 4 if block_m <= 32 else 8
    if dtype == torch.float32:
        return dict(BLOCK_M=block_m, BLOCK_N=max(16, min(64, 2048 // block_d)), BLOCK_D=block_d, num_warps=warps,
                    num_stages=2)
    return dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_D=block_d, num_warps=warps, num_stages=2 if block_m <= 32 else 3)


def attend_triton(query, k, v, start, scale, bias=None, block_n: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None, prefix=None):
    """`attend` through the split-KV Triton kernel (see the module docstring), launched as
    `triton_config` says; the tile size, warps and stages can be set (`bench --verify-kernels`
    times variants on CUDA)."""
    from ._triton_attention import combine, split_kv

    B, H, q, D = query.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = H // Hkv
    cfg = triton_config(G, q, D, query.dtype)
    cfg.update({name: x for name, x in dict(BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages).items() if x})
    block_m, block_d = cfg["BLOCK_M"], cfg["BLOCK_D"]
    splits, per = splits_for(N, B * Hkv, query.device, 256)  # the split never depends on q or the tile
    start = per_sequence_and_head(start, B, Hkv).expand(B, Hkv)  # read through its strides: no copy a layer
    o_part = torch.empty(B, Hkv, splits, block_m, D, dtype=torch.float32, device=query.device)
    l_part = torch.empty(B, Hkv, splits, block_m, dtype=torch.float32, device=query.device)
    bias_t = bias if bias is not None else k  # any tensor: not read without HAS_BIAS
    bs = ((0,) + bias.stride() if bias.dim() == 3 else bias.stride()) if bias is not None else (0, 0, 0, 0)
    split_kv[(B * Hkv, splits)](
        query, k, v, start, bias_t, prefix if prefix is not None else start, o_part, l_part,
        *query.stride(), *k.stride(), *v.stride(), *bs, *start.stride(),
        scale, Hkv, q, per, D,
        G=G, HAS_BIAS=bias is not None, HAS_PREFIX=prefix is not None, IEEE=query.dtype == torch.float32, **cfg)
    out = torch.empty(B, q, H, D, dtype=query.dtype, device=query.device)
    combine[(B * Hkv, G * q)](o_part, l_part, out, *o_part.stride(), *l_part.stride(), *out.stride(),
                              Hkv, q, D, splits, G=G, SPLITS=max(2, triton_next_pow2(splits)), BLOCK_D=block_d)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm (Qwen2 / Qwen2-VL / Qwen2.5-VL) of x [..., N] with weight [N] as one
    Triton kernel (`_triton_layer.rms_norm`, a program a row): weight * (x * rsqrt(mean(x²) + eps))
    rounded as transformers rounds it, in x's and weight's promoted dtype."""
    from ._triton_layer import layer_launch, rms_norm as kernel

    N = x.shape[-1]
    rows = x.reshape(-1, N)
    rows = rows if rows.stride(1) == 1 else rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0), N, eps, **layer_launch("rms_norm", N))
    return out.view(x.shape)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """transformers' `apply_rotary_pos_emb(q, k, cos, sin)` (unsqueeze_dim 1) as one Triton kernel
    (`_triton_layer.rotary`, a program per (token, head)): q [B, H, T, D], k [B, Hkv, T, D] (any
    strides but a unit last one), cos and sin [B or 1, T, D] -> (q_embed, k_embed), laid out as q and
    k, with PyTorch's roundings (bf16 and float16: transformers' bits)."""
    from ._triton_layer import layer_launch, rotary as kernel

    B, H, T, D = q.shape
    ty = torch.promote_types(q.dtype, cos.dtype)
    qo = torch.empty_like(q, dtype=ty)
    ko = torch.empty_like(k, dtype=ty)
    cos, sin = cos.expand(B, T, D), sin.expand(B, T, D)  # a stride of 0 where one row serves all
    kernel[(B * T, H + k.shape[1])](q, k, cos, sin, qo, ko, *q.stride()[:3], *k.stride()[:3], *qo.stride()[:3],
                                    *ko.stride()[:3], *cos.stride()[:2], T, H, D // 2, **layer_launch("rotary", D))
    return qo, ko


def write_kv(kbuf: torch.Tensor, vbuf: torch.Tensor, start: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor) -> None:
    """kbuf[b, h, start[b, h] + t] = key[b, h, t], the same for vbuf and value, as one Triton kernel
    (`_triton_layer.write_kv`): buffers [B, Hkv, capacity, D], key and value [B, Hkv, q, D], start
    [B or 1, Hkv or 1] (`fast.StaticView`'s write positions); what `cache.write_at` does in four."""
    from ._triton_layer import layer_launch, write_kv as kernel

    B, Hkv, q, D = key.shape
    st = start.expand(B, Hkv)  # a stride of 0 where one position serves all rows or heads
    kernel[(B * Hkv, q)](key, value, kbuf, vbuf, st, *key.stride()[:3], *kbuf.stride()[:3], *st.stride(), Hkv, D,
                         **layer_launch("write_kv", D))


def write_kv_fusable(kbuf, vbuf, start, key, value) -> bool:
    """Whether `write_kv` takes these: K and V (new, and buffers) laid out alike, unit last strides,
    the same dtype and heads, the buffers' rows those of the new entries, int64 positions [B or 1,
    Hkv or 1]."""
    return (key.stride() == value.stride() and kbuf.stride() == vbuf.stride() and key.stride(3) == kbuf.stride(3) == 1
            and key.dtype == value.dtype == kbuf.dtype == vbuf.dtype and key.shape[:2] == kbuf.shape[:2] == vbuf.shape[:2]
            and start.dim() == 2 and start.dtype == torch.long and start.shape[0] in (1, key.shape[0])
            and start.shape[1] in (1, key.shape[1]) and key.shape[3] == kbuf.shape[3])


def rotary_fusable(q, k, cos, sin) -> bool:
    """Whether `rotary` takes these (else transformers' own ops run): 4-D q and k over the same
    tokens, [B or 1, T, D] cos and sin like each other, unit last strides, an even head dim."""
    return (q.dim() == k.dim() == 4 and cos.dim() == 3 and cos.shape == sin.shape and cos.stride() == sin.stride()
            and q.shape[0] == k.shape[0] and q.shape[2:] == k.shape[2:] and cos.shape[0] in (1, q.shape[0])
            and tuple(cos.shape[1:]) == tuple(q.shape[2:]) and q.shape[3] % 2 == 0
            and q.stride(3) == k.stride(3) == cos.stride(2) == 1 and k.dtype == q.dtype and sin.dtype == cos.dtype)


def per_sequence_and_head(start: torch.Tensor, B: int, Hkv: int) -> torch.Tensor:
    """`start` ([] / [B] / [B, 1] / [1, Hkv] / [B, Hkv]; a 1-D [Hkv] only where B == 1) as 2-D
    [B or 1, Hkv or 1], not expanded (the SDPA path builds one mask for heads that share it)."""
    if start.dim() > 1:
        return start.reshape(start.shape[-2:])
    if start.numel() == 1:
        return start.reshape(1, 1)
    return start.reshape(-1, 1) if start.numel() == B and (B > 1 or Hkv == 1) else start.reshape(1, -1)


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def reference(query, k, v, start, scale, bias=None) -> torch.Tensor:
    """`attend` in float64, one row at a time over exactly the entries it sees: the tests' reference."""
    B, H, q, D = query.shape
    Hkv = k.shape[1]
    G = H // Hkv
    out = torch.empty(B, q, H, D, dtype=torch.float64)
    starts = per_sequence_and_head(start, B, Hkv).expand(B, Hkv)
    for b in range(B):
        for t in range(q):
            for h in range(H):
                n = int(starts[b, h // G]) + t + 1
                s = query[b, h, t].double() @ k[b, h // G, :n].double().T * scale
                if bias is not None:
                    s = s + (bias if bias.dim() == 3 else bias[b])[h // G, h % G, :n].double()
                out[b, t, h] = torch.softmax(s, -1) @ v[b, h // G, :n].double()
    return out
