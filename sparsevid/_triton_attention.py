"""The Triton kernels of `kernels.attend_triton` (imported only where Triton is installed).

`split_kv`: program (b * Hkv + h, s) reads keys [s * per, min((s + 1) * per, start_bh + q)) of KV
head h of sequence b (or of the sequence whose first entries b shares, where the split lies wholly
within them: `Prefix`, `kernels.attend`'s prefix; the programs of one split run side by side, so the
shared keys are read from memory about once) once, for the G * q rows of its query heads (row r = g * q + t: query head
h * G + g, new token t); online softmax in float32; writes the split's normalised output
o_part [B, Hkv, S, BLOCK_M, D] and its log-sum-exp l_part [B, Hkv, S, BLOCK_M] (-inf: nothing seen).
`combine`: program (b * Hkv + h, r) weighs the splits by their log-sum-exp and writes out [B, q, H, D].
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["ss_b", "ss_h"], do_not_specialize_on_alignment=["Start"])  # Start: a view
def split_kv(Q, K, V, Start, Bias, Prefix, O_part, L_part,
             sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d, sb_b, sb_h, sb_g, sb_n, ss_b, ss_h,
             scale, Hkv, q_len, per, D,
             G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
             HAS_BIAS: tl.constexpr, HAS_PREFIX: tl.constexpr, IEEE: tl.constexpr):
    bh = tl.program_id(0)
    s = tl.program_id(1)
    b = (bh // Hkv).to(tl.int64)  # offsets past 2^31 elements (a batch of long buffers) stay exact
    h = bh % Hkv
    start = tl.load(Start + b * ss_b + h * ss_h)  # Start [B, Hkv] (a stride 0 where rows or heads share one)
    end = start + q_len  # entries 0 .. end - 1 exist for some row
    lo = s * per
    hi = tl.minimum(lo + per, end)
    kvb = b  # the sequence whose K and V this split reads
    if HAS_PREFIX:  # Prefix [B, 2]: (sequence whose first entries b shares, how many)
        kvb = tl.where(hi <= tl.load(Prefix + 2 * b + 1), tl.load(Prefix + 2 * b), b).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    g = rows // q_len
    t = rows % q_len
    row_ok = rows < G * q_len
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    qv = tl.load(Q + b * sq_b + (h * G + g)[:, None] * sq_h + t[:, None] * sq_t + d[None, :] * sq_d,
                 mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    last = start + t  # the last entry row t sees
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        c_ok = cols < hi
        kt = tl.load(K + kvb * sk_b + h * sk_h + cols[None, :] * sk_n + d[:, None] * sk_d,
                     mask=c_ok[None, :] & d_ok[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        if IEEE:
            sc = tl.dot(qv, kt, input_precision="ieee")
        else:
            sc = tl.dot(qv, kt)
        sc = sc * scale
        if HAS_BIAS:
            sc += tl.load(Bias + b * sb_b + h * sb_h + g[:, None] * sb_g + cols[None, :] * sb_n,
                          mask=row_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        sc = tl.where(c_ok[None, :] & (cols[None, :] <= last[:, None]), sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(sc - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        vv = tl.load(V + kvb * sv_b + h * sv_h + cols[:, None] * sv_n + d[None, :] * sv_d,
                     mask=c_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, vv, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv)
        m_i = m_new
    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    S = tl.num_programs(1)
    base = (bh * S + s) * BLOCK_M
    tl.store(O_part + (base + rows)[:, None] * D + d[None, :], o, mask=d_ok[None, :])
    tl.store(L_part + base + rows, lse)


@triton.jit
def combine(O_part, L_part, Out, so_b, so_h, so_s, so_m, so_d, sl_b, sl_h, sl_s, sl_m, st_b, st_t, st_h, st_d,
            Hkv, q_len, D, splits, G: tl.constexpr, SPLITS: tl.constexpr, BLOCK_D: tl.constexpr):
    bh = tl.program_id(0)
    r = tl.program_id(1)
    b = (bh // Hkv).to(tl.int64)
    h = bh % Hkv
    sp = tl.arange(0, SPLITS)
    s_ok = sp < splits
    lse = tl.load(L_part + b * sl_b + h * sl_h + sp * sl_s + r * sl_m, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - m))
    w = w / tl.sum(w, 0)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    o = tl.load(O_part + b * so_b + h * so_h + sp[:, None] * so_s + r * so_m + d[None, :] * so_d,
                mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    o = tl.sum(o * w[:, None], 0)
    g = r // q_len
    t = r % q_len
    tl.store(Out + b * st_b + t * st_t + (h * G + g) * st_h + d * st_d, o.to(Out.dtype.element_ty), mask=d_ok)


def sm90_usage(G: int, cfg: dict, dtype: str, bias: bool = True, prefix: bool = True) -> dict:
    """`split_kv` launched as `cfg` (`kernels.triton_config`) with `dtype` ("bf16", "fp16" or "fp32")
    compiled for sm_90 (H100 / H200): `sm90_resources`."""
    const = dict(G=G, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_D=cfg["BLOCK_D"], HAS_BIAS=bias,
                 HAS_PREFIX=prefix, IEEE=dtype == "fp32")
    types = dict(Q=f"*{dtype}", K=f"*{dtype}", V=f"*{dtype}", Bias=f"*{dtype}", Start="*i64", Prefix="*i64",
                 O_part="*fp32", L_part="*fp32", scale="fp32")
    return sm90_resources(split_kv, types, const, cfg["num_warps"], cfg["num_stages"])


def sm90_resources(fn, types: dict, const: dict, num_warps: int, num_stages: int = 2, **options) -> dict:
    """The Triton kernel `fn` with its pointer and float arguments typed as `types` (the rest i32)
    and `const` for its constexprs (and other compile `options`), compiled for sm_90 (H100 / H200) with Triton's own ptxas, which
    needs no GPU: {"shared": bytes of shared memory a block needs, "local": bytes of local memory per
    thread (spilled registers), "registers": per thread}, read from the cubin with Triton's
    cuobjdump. Not under TRITON_INTERPRET=1 (the interpreter replaces the compiler)."""
    import os
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: "constexpr" if name in const else types.get(name, "i32") for name in fn.arg_names}
    kernel = triton.compile(ASTSource(fn, signature, const), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages, **options))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        usage = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True, check=True).stdout
    field = {name: int(re.search(rf"{name}:(\d+)", usage).group(1)) for name in ("REG", "STACK")}
    return dict(shared=kernel.metadata.shared, local=field["STACK"], registers=field["REG"])
