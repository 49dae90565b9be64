"""Three small ops of a decoder layer's CUDA decode step, each one Triton kernel in place of a chain
of PyTorch ops (`kernels.rms_norm`, `kernels.rotary`, `kernels.write_kv`; `fast.FUSED`; imported
only where Triton is installed).

In a captured 7B decode step on one H200 the work outside attention and the weights' reads took
~3 ms, about 3 µs for each of the ~35 small kernels a layer ran (issue 39): transformers' RMSNorm
is 8 kernels in bf16 (cast, square, mean, add, rsqrt, multiply, cast, scale), its rotary embedding
10 (per q and k: multiply, negate, concatenate, multiply, add), and writing the new K and V at
their positions 4 (arange, add, two index_copy_). Here they are 2 + 1 + 1 a layer. Each program
does one row.

`rms_norm`: program r normalises row r of X [rows, N] (stride sx) into Y: float32 sum of squares,
x * rsqrt(mean + eps) rounded to X's dtype, times the weight, rounded to Y's dtype (transformers'
order of roundings; the mean's summation order is the kernel's own).
`rotary`: program (b * T + t, j) rotates head j of token t of sequence b (j < H: a query head of Q,
else key head j - H of K): out = x * cos + rotate_half(x) * sin, each product and the sum rounded
to the output dtype as PyTorch's elementwise ops round them (launched without contracting a multiply
and an add into one), so the bits are transformers' own.
`write_kv`: program (b * Hkv + h, t) copies the new key and value of head h, token t of sequence
b into the layer's buffers at entry start[b, h] + t (`cache.write_at`).
"""

import triton
import triton.language as tl


@triton.jit
def rms_norm(X, W, Y, sx, sy, N, eps, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    ok = c < N
    x = tl.load(X + r * sx + c, mask=ok, other=0.0).to(tl.float32)
    var = tl.sum(x * x, 0) / N
    y = (x * tl.math.rsqrt(var + eps)).to(X.dtype.element_ty)
    w = tl.load(W + c, mask=ok, other=0.0)
    tl.store(Y + r * sy + c, (w.to(tl.float32) * y.to(tl.float32)).to(Y.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["sq_b", "sk_b", "sqo_b", "sko_b", "sc_b", "T"])  # one compile for any B and T
def rotary(Q, K, Cos, Sin, Qo, Ko, sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sqo_b, sqo_h, sqo_t, sko_b, sko_h, sko_t,
           sc_b, sc_t, T, H, HALF, BLOCK: tl.constexpr):
    bt = tl.program_id(0)
    j = tl.program_id(1)
    b = (bt // T).to(tl.int64)
    t = bt % T
    c = tl.arange(0, BLOCK)
    ok = c < HALF
    if j < H:
        src = Q + b * sq_b + j * sq_h + t * sq_t
        dst = Qo + b * sqo_b + j * sqo_h + t * sqo_t
    else:
        src = K + b * sk_b + (j - H) * sk_h + t * sk_t
        dst = Ko + b * sko_b + (j - H) * sko_h + t * sko_t
    cs = Cos + b * sc_b + t * sc_t
    sn = Sin + b * sc_b + t * sc_t
    ty = dst.dtype.element_ty
    x1 = tl.load(src + c, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + c, mask=ok, other=0.0).to(tl.float32)
    c1 = tl.load(cs + c, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(cs + HALF + c, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(sn + c, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(sn + HALF + c, mask=ok, other=0.0).to(tl.float32)
    lo = (x1 * c1).to(ty).to(tl.float32) + (-x2 * s1).to(ty).to(tl.float32)  # rotate_half(x) = (-x2, x1)
    hi = (x2 * c2).to(ty).to(tl.float32) + (x1 * s2).to(ty).to(tl.float32)
    tl.store(dst + c, lo.to(ty), mask=ok)
    tl.store(dst + HALF + c, hi.to(ty), mask=ok)


@triton.jit(do_not_specialize=["sn_b", "sb_b", "ss_b"], do_not_specialize_on_alignment=["Start"])  # Start: a view
def write_kv(Kn, Vn, Kb, Vb, Start, sn_b, sn_h, sn_t, sb_b, sb_h, sb_n, ss_b, ss_h, Hkv, D, BLOCK: tl.constexpr):
    bh = tl.program_id(0)
    t = tl.program_id(1)
    b = (bh // Hkv).to(tl.int64)
    h = bh % Hkv
    pos = tl.load(Start + b * ss_b + h * ss_h) + t
    c = tl.arange(0, BLOCK)
    ok = c < D
    src = b * sn_b + h * sn_h + t * sn_t + c
    dst = b * sb_b + h * sb_h + pos * sb_n + c
    tl.store(Kb + dst, tl.load(Kn + src, mask=ok), mask=ok)
    tl.store(Vb + dst, tl.load(Vn + src, mask=ok), mask=ok)


def layer_launch(name: str, n: int) -> dict:
    """How kernel `name` is launched over rows of n elements (rms_norm: the hidden size; rotary and
    write_kv: the head dim): its BLOCK, warps and compile options. One place for the launchers
    (`kernels.rms_norm`, `kernels.rotary`, `kernels.write_kv`) and the sm_90 compile check."""
    if name == "rms_norm":
        block = triton.next_power_of_2(n)
        return dict(BLOCK=block, num_warps=4 if block <= 1024 else 8, enable_fp_fusion=False)
    if name == "rotary":  # no multiply-add contraction: PyTorch's roundings
        return dict(BLOCK=max(16, triton.next_power_of_2(n // 2)), num_warps=1, enable_fp_fusion=False)
    return dict(BLOCK=max(16, triton.next_power_of_2(n)), num_warps=1)


def sm90_usage(dtype: str, hidden: int, head_dim: int) -> dict:
    """The kernels for `dtype` ("bf16", "fp16", "fp32") at a model's hidden size and head dim,
    launched as `layer_launch` says, compiled for sm_90: {name: resources}
    (`_triton_attention.sm90_resources`)."""
    from ._triton_attention import sm90_resources

    ptr = f"*{dtype}"
    kernels = dict(rms_norm=(rms_norm, hidden, dict(X=ptr, W=ptr, Y=ptr, eps="fp32")),
                   rotary=(rotary, head_dim, dict(Q=ptr, K=ptr, Cos=ptr, Sin=ptr, Qo=ptr, Ko=ptr)),
                   write_kv=(write_kv, head_dim, dict(Kn=ptr, Vn=ptr, Kb=ptr, Vb=ptr, Start="*i64")))
    out = {}
    for name, (fn, n, types) in kernels.items():
        launch = layer_launch(name, n)
        out[name] = sm90_resources(fn, types, dict(BLOCK=launch.pop("BLOCK")), **launch)
    return out
