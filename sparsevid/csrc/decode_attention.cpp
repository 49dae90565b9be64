// Decode attention on the CPU: a few new query rows per sequence over a preallocated KV buffer, read once.
//
// `sparsevid::decode_attention(q, k, v, start, scale, bias)`, the CPU backend of `kernels.attend` (see
// its docstring for the arguments). Written here because PyTorch's CPU kernels read a decode step's KV
// at 10-15 GB/s at small head dims (SDPA's flash kernel, bmm + softmax, flex_attention, measured on
// the embedded model's head dim 24) against ~25-30 GB/s that the memory gives two cores.
//
// The work is split in items (sequence b, KV head h, split of SPLIT keys); each item reads its keys once
// for all G * q rows of its KV head (the G query heads and the q new tokens), in tiles of TILE keys,
// with an online softmax, and writes a partial output, its running max and sum; a second pass combines
// the splits of a row in order. Splits and tiles start at fixed multiples of the key index, whatever the
// buffer's capacity, the batch or q: so a row's arithmetic depends only on the entries it sees, and a
// row gives the same bits in a one-row step, in a verification pass of γ + 1 rows and in a batch (what
// lossless speculative decoding needs). A masked entry contributes an exact zero.
//
// A step has few rows per KV head and reads its keys once (memory-bound); a verification's γ + 1 tokens
// give 8 or more rows (compute-bound: a tile's scores, softmax and outputs cost ~8x its read). For those
// the tile of K is transposed once (8 x 8 blocks) and scored four rows at a time with 16 keys per
// vector, the softmax's exponentials run 16 lanes at a time (for every row count), and the outputs
// take 16-lane vectors, several rows per V row loaded: per row the same operations in the same order
// as a step's code, so the same bits (a test).
//
// Sequences that share their first entries (questions on one video: bit-identical KV over the common
// prefix, `cache.Stack` checks it) can say so (`prefix` [B, 2]: the sequence whose K and V to read
// for them, how many): an item whose keys all lie below that reads the other sequence's K and V (the
// same values, so the same bits). A call where one does runs its items in the order (KV head, split,
// sequence), so the sequences reading one split of a head's shared keys run one after another and find
// them in cache; any other in the order (sequence, KV head, split), each worker reading one sequence's K
// and V as long contiguous streams: 8 sequences at 4,608 entries, 4 layers' buffers (beyond L3), on a
// 2-core AMD EPYC (Zen 4) 4.1-4.4 -> 3.7-3.9 ms on two threads, 7.2 -> 6.0 on one, against the other.
//
// Parallel over items with ATen's thread pool (torch's intra-op threads, `torch.set_num_threads`), or
// on `threads` OpenMP threads where the caller asks for more than that and the call's work, B x Hkv x
// (entries read) x (rows per KV head + 3), is at least `min_work`: a decode step runs on one thread
// (waking the other between its small kernels costs more than they gain), but a long call pays for a
// second one (`kernels.op_threads`, the same in an eager step and a compiled one). Decided here, from
// the call's sizes, so a compiled graph holds two constants and no guard on its dynamic shapes.
#include <ATen/Parallel.h>
#include <omp.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SPARSEVID_AVX2 1
#if defined(__AVX512F__)
#define SPARSEVID_AVX512 1
#else
#define SPARSEVID_AVX512 0
#endif
#else
#define SPARSEVID_AVX2 0  // and no AVX-512 paths either (a CPU without AVX2, another architecture)
#define SPARSEVID_AVX512 0
#endif

namespace {

constexpr int64_t TILE = 64;    // keys scored at once (one row's scores: 4 AVX-512 vectors)
constexpr int64_t SPLIT = 512;  // keys per item: ~100 KB of K and V at head dim 24
constexpr int64_t DMAX = 256;   // the largest head dim

// e^x for x <= 0 (`exp_neg` and its 8- and 16-lane versions, one method): n = round(x / ln 2),
// r = x - n ln 2 (ln 2 in two parts), e^r by a degree-7 polynomial (Horner over EXP_P, then
// p r^2 + r + 1), times 2^n; exactly 0 below EXP_FLOOR (and for -inf: a masked entry), ~1 ulp elsewhere.
constexpr float EXP_FLOOR = -87.0f, LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f, LN2_LO = 2.12194440e-4f;
constexpr float EXP_P[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// Scalar and branch-free, so the loops around it vectorize (libm's expf does not without -ffast-math).
inline float exp_neg(float x) {
  const bool zero = !(x > EXP_FLOOR);
  x = zero ? 0.0f : x;
  // n = round(x / ln 2) by adding and removing 1.5 * 2^23 (vectorizes; std::nearbyint does not)
  const float n = (x * LOG2E + 12582912.0f) - 12582912.0f;
  const float r = (x - n * LN2_HI) + n * LN2_LO;
  float p = EXP_P[0];
  for (int i = 1; i < 6; ++i) p = p * r + EXP_P[i];
  p = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return zero ? 0.0f : p * scale;
}

struct Args {
  const float *q, *k, *v, *bias;
  const int64_t* start;  // [B, Hkv], contiguous
  const int64_t* prefix;  // [B, 2], contiguous, or null: (sequence whose K and V to read, for how many first entries)
  int64_t B, H, Q, D, Hkv, G, N;
  int64_t qs[3];      // q strides (b, h, t); last stride 1
  int64_t ks[3], vs[3];  // k, v strides (b, h, n)
  int64_t bs[4];      // bias strides (b, h, g, n)
  float scale;
};

#if SPARSEVID_AVX2
// AVX2 (head dims that are multiples of 8): a row's scores of a tile straight from K's rows, 8 keys at a
// time: their D / 8 partial products summed lane-wise, then the 8 horizontal sums done together (three
// hadds and one cross-lane add); no transposed copy of K. s [TILE]: q . k_{j0 + j}; keys past n read
// key n - 1 (masked later). (Two rows sharing each key's loads measured no faster.)
template <int64_t DC, bool FULL>
inline void score_avx2(const float* q, const float* kb, int64_t kstride, int64_t j0, int64_t n, int64_t D, float* s) {
  constexpr int64_t CL = (DC > 0 ? DC : DMAX) / 8;
  const int64_t C = D / 8;
  __m256 qv[CL];
  for (int64_t c = 0; c < C; ++c) qv[c] = _mm256_loadu_ps(q + 8 * c);
  for (int64_t j = 0; j < TILE; j += 8) {
    __m256 t[8];
    const float* k8 = kb + (j0 + j) * kstride;
    for (int64_t u = 0; u < 8; ++u) {
      const float* kj = FULL ? k8 + u * kstride : kb + (j0 + std::min(j + u, n - 1)) * kstride;
      t[u] = _mm256_mul_ps(qv[0], _mm256_loadu_ps(kj));
      for (int64_t c = 1; c < C; ++c) t[u] = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(kj + 8 * c), t[u]);
    }
    const __m256 b0 = _mm256_hadd_ps(_mm256_hadd_ps(t[0], t[1]), _mm256_hadd_ps(t[2], t[3]));
    const __m256 b1 = _mm256_hadd_ps(_mm256_hadd_ps(t[4], t[5]), _mm256_hadd_ps(t[6], t[7]));
    _mm256_storeu_ps(s + j, _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31)));
  }
}

// kt [D, TILE] = the transpose of a whole tile of keys (rows kb + j * kstride, D floats each, D a
// multiple of 8), in 8 x 8 blocks through registers: exact copies.
inline void transpose_avx2(const float* kb, int64_t kstride, int64_t D, float* kt) {
  for (int64_t j = 0; j < TILE; j += 8) {
    for (int64_t c = 0; c < D; c += 8) {
      __m256 r[8], t[8];
      for (int u = 0; u < 8; ++u) r[u] = _mm256_loadu_ps(kb + (j + u) * kstride + c);
      for (int u = 0; u < 8; u += 2) {
        t[u] = _mm256_unpacklo_ps(r[u], r[u + 1]);
        t[u + 1] = _mm256_unpackhi_ps(r[u], r[u + 1]);
      }
      for (int u = 0; u < 8; u += 4) {
        r[u] = _mm256_shuffle_ps(t[u], t[u + 2], 0x44);
        r[u + 1] = _mm256_shuffle_ps(t[u], t[u + 2], 0xEE);
        r[u + 2] = _mm256_shuffle_ps(t[u + 1], t[u + 3], 0x44);
        r[u + 3] = _mm256_shuffle_ps(t[u + 1], t[u + 3], 0xEE);
      }
      for (int u = 0; u < 4; ++u) {
        _mm256_storeu_ps(kt + (c + u) * TILE + j, _mm256_permute2f128_ps(r[u], r[u + 4], 0x20));
        _mm256_storeu_ps(kt + (c + u + 4) * TILE + j, _mm256_permute2f128_ps(r[u], r[u + 4], 0x31));
      }
    }
  }
}

#if SPARSEVID_AVX512
// One row's scores over a transposed tile kt [D, TILE], 16 keys per vector: for many rows (a
// verification) the transposition is shared and a score takes a quarter of `score_avx2`'s vector
// operations. The same operations in the same order per score as `score_avx2` (lane l's chain over
// c of q[8c + l] k[8c + l], then ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))): the same bits.
inline void score_t512(const float* q, const float* kt, int64_t D, float* s) {
  const int64_t C = D / 8;
  for (int64_t j = 0; j < TILE; j += 16) {
    __m512 t[8];
    for (int l = 0; l < 8; ++l) {
      t[l] = _mm512_mul_ps(_mm512_set1_ps(q[l]), _mm512_loadu_ps(kt + l * TILE + j));
      for (int64_t c = 1; c < C; ++c)
        t[l] = _mm512_fmadd_ps(_mm512_set1_ps(q[8 * c + l]), _mm512_loadu_ps(kt + (8 * c + l) * TILE + j), t[l]);
    }
    _mm512_storeu_ps(s + j, _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(t[0], t[1]), _mm512_add_ps(t[2], t[3])),
                                          _mm512_add_ps(_mm512_add_ps(t[4], t[5]), _mm512_add_ps(t[6], t[7]))));
  }
}

// Lane l's chain of `score_t512` for four rows at once (q: four rows of D), each K vector loaded once.
__attribute__((always_inline)) inline void chain4(const float* q, const float* kt, int64_t D, int64_t j, int l,
                                                  __m512* t) {
  const __m512 k0 = _mm512_loadu_ps(kt + l * TILE + j);
  for (int i = 0; i < 4; ++i) t[i] = _mm512_mul_ps(_mm512_set1_ps(q[i * D + l]), k0);
  for (int64_t c = 1; c < D / 8; ++c) {
    const __m512 kc = _mm512_loadu_ps(kt + (8 * c + l) * TILE + j);
    for (int i = 0; i < 4; ++i) t[i] = _mm512_fmadd_ps(_mm512_set1_ps(q[i * D + 8 * c + l]), kc, t[i]);
  }
}

// `score_t512` of four rows (s: four rows of TILE): the same operations in the same order, the same bits.
inline void score_t512x4(const float* q, const float* kt, int64_t D, float* s) {
  for (int64_t j = 0; j < TILE; j += 16) {
    __m512 a[4], b[4], lo[4], hi[4];
    chain4(q, kt, D, j, 0, a);
    chain4(q, kt, D, j, 1, b);
    for (int i = 0; i < 4; ++i) lo[i] = _mm512_add_ps(a[i], b[i]);
    chain4(q, kt, D, j, 2, a);
    chain4(q, kt, D, j, 3, b);
    for (int i = 0; i < 4; ++i) lo[i] = _mm512_add_ps(lo[i], _mm512_add_ps(a[i], b[i]));
    chain4(q, kt, D, j, 4, a);
    chain4(q, kt, D, j, 5, b);
    for (int i = 0; i < 4; ++i) hi[i] = _mm512_add_ps(a[i], b[i]);
    chain4(q, kt, D, j, 6, a);
    chain4(q, kt, D, j, 7, b);
    for (int i = 0; i < 4; ++i)
      _mm512_storeu_ps(s + i * TILE + j, _mm512_add_ps(lo[i], _mm512_add_ps(hi[i], _mm512_add_ps(a[i], b[i]))));
  }
}

// `exp_neg` of 16 lanes: the same method, the power of two by `scalef`.
inline __m512 exp_neg512(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_FLOOR), _CMP_GT_OQ);  // not -inf, not NaN
  x = _mm512_maskz_mov_ps(live, x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
  __m512 p = _mm512_set1_ps(EXP_P[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P[i]));
  p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(live, p, n);
}

// One row's tile: s [TILE] its scores (its own up to `seen`), m its running max. Returns the tile's new
// max (-inf: nothing unmasked yet, and then nothing written); p [TILE] = e^(s - max), zero past
// `seen`; *sum their sum, in a fixed order.
inline float softmax512(const float* s, int64_t seen, float m, float* p, float* sum) {
  __m512 v[TILE / 16];
  __m512 mx = _mm512_set1_ps(m);
  for (int c = 0; c < TILE / 16; ++c) {
    const int64_t left = std::max<int64_t>(0, std::min<int64_t>(16, seen - 16 * c));
    const __mmask16 in = static_cast<__mmask16>((1u << left) - 1u);
    v[c] = _mm512_mask_loadu_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), in, s + 16 * c);
    mx = _mm512_max_ps(mx, v[c]);
  }
  const float mt = _mm512_reduce_max_ps(mx);
  if (mt == -std::numeric_limits<float>::infinity()) return mt;
  const __m512 mv = _mm512_set1_ps(mt);
  for (int c = 0; c < TILE / 16; ++c) {
    v[c] = exp_neg512(_mm512_sub_ps(v[c], mv));
    _mm512_storeu_ps(p + 16 * c, v[c]);
  }
  *sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(v[0], v[1]), _mm512_add_ps(v[2], v[3])));
  return mt;
}

// `accumulate_avx2` with a row's head dims in 16-lane vectors (and one 8-lane vector for a remainder
// of 8): D = 24 takes two FMAs per key and row instead of three. Each output element gets the same
// operations in the same order: the same bits. NB rows share each V row's loads.
template <int64_t DC, int NB>
inline void accumulate512(float* o, const float* alpha, const float* p, const float* v, int64_t vstride,
                          int64_t seen) {
  constexpr int Z = DC / 16, Y = (DC % 16) / 8;  // 16-lane and 8-lane vectors per row
  __m512 a0[NB][Z > 0 ? Z : 1], a1[NB][Z > 0 ? Z : 1];
  __m256 b0[NB], b1[NB];
  for (int i = 0; i < NB; ++i) {
    const __m512 al = _mm512_set1_ps(alpha[i]);
    for (int z = 0; z < Z; ++z) {
      a0[i][z] = _mm512_mul_ps(_mm512_loadu_ps(o + i * DC + 16 * z), al);
      a1[i][z] = _mm512_setzero_ps();
    }
    if (Y) {
      b0[i] = _mm256_mul_ps(_mm256_loadu_ps(o + i * DC + 16 * Z), _mm512_castps512_ps256(al));
      b1[i] = _mm256_setzero_ps();
    }
  }
  int64_t j = 0;
  for (; j + 1 < seen; j += 2, v += 2 * vstride) {
    for (int z = 0; z < Z; ++z) {
      const __m512 v0 = _mm512_loadu_ps(v + 16 * z), v1 = _mm512_loadu_ps(v + vstride + 16 * z);
      for (int i = 0; i < NB; ++i) {
        a0[i][z] = _mm512_fmadd_ps(_mm512_set1_ps(p[i * TILE + j]), v0, a0[i][z]);
        a1[i][z] = _mm512_fmadd_ps(_mm512_set1_ps(p[i * TILE + j + 1]), v1, a1[i][z]);
      }
    }
    if (Y) {  // the same weights, their low halves (one broadcast per key and row)
      const __m256 v0 = _mm256_loadu_ps(v + 16 * Z), v1 = _mm256_loadu_ps(v + vstride + 16 * Z);
      for (int i = 0; i < NB; ++i) {
        b0[i] = _mm256_fmadd_ps(_mm512_castps512_ps256(_mm512_set1_ps(p[i * TILE + j])), v0, b0[i]);
        b1[i] = _mm256_fmadd_ps(_mm512_castps512_ps256(_mm512_set1_ps(p[i * TILE + j + 1])), v1, b1[i]);
      }
    }
  }
  if (j < seen) {
    for (int z = 0; z < Z; ++z) {
      const __m512 v0 = _mm512_loadu_ps(v + 16 * z);
      for (int i = 0; i < NB; ++i) a0[i][z] = _mm512_fmadd_ps(_mm512_set1_ps(p[i * TILE + j]), v0, a0[i][z]);
    }
    if (Y) {
      const __m256 v0 = _mm256_loadu_ps(v + 16 * Z);
      for (int i = 0; i < NB; ++i) b0[i] = _mm256_fmadd_ps(_mm256_set1_ps(p[i * TILE + j]), v0, b0[i]);
    }
  }
  for (int i = 0; i < NB; ++i) {
    for (int z = 0; z < Z; ++z) _mm512_storeu_ps(o + i * DC + 16 * z, _mm512_add_ps(a0[i][z], a1[i][z]));
    if (Y) _mm256_storeu_ps(o + i * DC + 16 * Z, _mm256_add_ps(b0[i], b1[i]));
  }
}
#endif

// `exp_neg` of 8 lanes (AVX2 without AVX-512): the same method, the power of two built from its bits.
inline __m256 exp_neg256(__m256 x) {
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_FLOOR), _CMP_GT_OQ);  // not -inf, not NaN
  x = _mm256_and_ps(live, x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
  __m256 p = _mm256_set1_ps(EXP_P[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P[i]));
  p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(live, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// `softmax512` in 8-lane vectors (AVX2 without AVX-512): the same contract.
inline float softmax256(const float* s, int64_t seen, float m, float* p, float* sum) {
  constexpr int C = TILE / 8;
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 v[C];
  __m256 mx = _mm256_set1_ps(m);
  for (int c = 0; c < C; ++c) {
    const __m256 in = _mm256_cmp_ps(lane, _mm256_set1_ps(static_cast<float>(seen - 8 * c)), _CMP_LT_OQ);
    v[c] = _mm256_blendv_ps(ninf, _mm256_loadu_ps(s + 8 * c), in);
    mx = _mm256_max_ps(mx, v[c]);
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float mt = _mm_cvtss_f32(h);
  if (mt == -std::numeric_limits<float>::infinity()) return mt;
  const __m256 mv = _mm256_set1_ps(mt);
  for (int c = 0; c < C; ++c) {
    v[c] = exp_neg256(_mm256_sub_ps(v[c], mv));
    _mm256_storeu_ps(p + 8 * c, v[c]);
  }
  for (int c = C / 2; c > 0; c /= 2)
    for (int i = 0; i < c; ++i) v[i] = _mm256_add_ps(v[i], v[i + c]);
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(v[0]), _mm256_extractf128_ps(v[0], 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  t = _mm_add_ss(t, _mm_movehdup_ps(t));
  *sum = _mm_cvtss_f32(t);
  return mt;
}

// Rows o_i = o_i * alpha_i + sum_{j < seen} p_ij v_{j0 + j} for NB rows at once (each V row loaded once
// for all of them), two chains per row (even and odd keys) in registers. A row's arithmetic is the same
// whatever NB and the other rows (their p past a row's own entries are exact zeros).
template <int64_t DC, int NB>
inline void accumulate_avx2(float* o, const float* alpha, const float* p, const float* v, int64_t vstride,
                            int64_t seen, int64_t D) {
  constexpr int64_t CL = (DC > 0 ? DC : DMAX) / 8;
  const int64_t C = D / 8;
  __m256 o0[NB][CL], o1[NB][CL];
  for (int i = 0; i < NB; ++i) {
    const __m256 al = _mm256_set1_ps(alpha[i]);
    for (int64_t c = 0; c < C; ++c) {
      o0[i][c] = _mm256_mul_ps(_mm256_loadu_ps(o + i * D + 8 * c), al);
      o1[i][c] = _mm256_setzero_ps();
    }
  }
  int64_t j = 0;
  for (; j + 1 < seen; j += 2, v += 2 * vstride) {
    for (int64_t c = 0; c < C; ++c) {
      const __m256 v0 = _mm256_loadu_ps(v + 8 * c), v1 = _mm256_loadu_ps(v + vstride + 8 * c);
      for (int i = 0; i < NB; ++i) {
        o0[i][c] = _mm256_fmadd_ps(_mm256_set1_ps(p[i * TILE + j]), v0, o0[i][c]);
        o1[i][c] = _mm256_fmadd_ps(_mm256_set1_ps(p[i * TILE + j + 1]), v1, o1[i][c]);
      }
    }
  }
  if (j < seen) {
    for (int64_t c = 0; c < C; ++c) {
      const __m256 v0 = _mm256_loadu_ps(v + 8 * c);
      for (int i = 0; i < NB; ++i) o0[i][c] = _mm256_fmadd_ps(_mm256_set1_ps(p[i * TILE + j]), v0, o0[i][c]);
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int64_t c = 0; c < C; ++c) _mm256_storeu_ps(o + i * D + 8 * c, _mm256_add_ps(o0[i][c], o1[i][c]));
}
#endif

// One item: rows r = g * Q + t of KV head h of sequence b over keys [lo, hi) of sequence kvb's K and V
// (b's own, or one sharing them: `Args::prefix`); m, l [R], acc [R, D].
// DC: the head dim as a constant (0: any, up to DMAX), so that the loops over it unroll and a row's
// output stays in registers.

template <int64_t DC>
void item(const Args& a, int64_t b, int64_t kvb, int64_t h, int64_t lo, int64_t hi, float* m, float* l, float* acc,
          float* qrow, float* kt, float* p, float* al, int64_t* sn) {
  constexpr int64_t DL = DC > 0 ? DC : DMAX;
  const int64_t D = DC > 0 ? DC : a.D, R = a.G * a.Q;
  const float NEG = -std::numeric_limits<float>::infinity();
  const int64_t st = a.start[b * a.Hkv + h];
  for (int64_t r = 0; r < R; ++r) {
    const int64_t g = r / a.Q, t = r % a.Q;
    const float* src = a.q + b * a.qs[0] + (h * a.G + g) * a.qs[1] + t * a.qs[2];
    for (int64_t d = 0; d < D; ++d) qrow[r * D + d] = src[d] * a.scale;
    m[r] = NEG;
    l[r] = 0.0f;
    for (int64_t d = 0; d < D; ++d) acc[r * D + d] = 0.0f;
  }
  const float* kb = a.k + kvb * a.ks[0] + h * a.ks[1];
  const float* vb = a.v + kvb * a.vs[0] + h * a.vs[1];
  const bool avx = SPARSEVID_AVX2 && D % 8 == 0;
  const bool shared = SPARSEVID_AVX512 && avx && R >= 8;  // many rows: score over one transposed tile
  for (int64_t j0 = lo; j0 < hi; j0 += TILE) {
    const int64_t n = std::min(TILE, hi - j0);
#if SPARSEVID_AVX2
    if (shared && n == TILE) transpose_avx2(kb + j0 * a.ks[2], a.ks[2], D, kt);
    else
#endif
    for (int64_t j = 0; j < TILE && (!avx || shared); ++j) {  // K tile transposed, kt [D, TILE] (zero past the keys)
      const float* kj = kb + (j0 + std::min(j, n - 1)) * a.ks[2];
      const float keep = j < n ? 1.0f : 0.0f;
      for (int64_t d = 0; d < D; ++d) kt[d * TILE + j] = kj[d] * keep;
    }
    // scores into p [R, TILE]
    int64_t r0 = 0;
#if SPARSEVID_AVX512
    for (; shared && r0 + 3 < R; r0 += 4) score_t512x4(qrow + r0 * D, kt, D, p + r0 * TILE);
    for (; shared && r0 < R; ++r0) score_t512(qrow + r0 * D, kt, D, p + r0 * TILE);
#endif
#if SPARSEVID_AVX2
    for (; avx && n == TILE && r0 < R; ++r0) score_avx2<DC, true>(qrow + r0 * D, kb, a.ks[2], j0, n, D, p + r0 * TILE);
    for (; avx && r0 < R; ++r0) score_avx2<DC, false>(qrow + r0 * D, kb, a.ks[2], j0, n, D, p + r0 * TILE);
#endif
    for (; r0 < R; ++r0) {  // without AVX2: over the transposed tile
      float s[TILE] = {};
      for (int64_t d = 0; d < D; ++d) {
        const float qd = qrow[r0 * D + d];
        const float* kd = kt + d * TILE;
#pragma omp simd
        for (int64_t j = 0; j < TILE; ++j) s[j] += qd * kd[j];
      }
      for (int64_t j = 0; j < TILE; ++j) p[r0 * TILE + j] = s[j];
    }
    // the online softmax of each row; p becomes its weights
    for (int64_t r = 0; r < R; ++r) {
      const int64_t g = r / a.Q, end = st + r % a.Q;  // the last entry row r sees
      const int64_t seen = std::min(n, end - j0 + 1);
      float* pr = p + r * TILE;
      al[r] = 1.0f;  // a row with nothing (unmasked) in this tile keeps its output: weights all zero
      sn[r] = 0;
      if (seen <= 0) {
        std::fill(pr, pr + TILE, 0.0f);
        continue;
      }
      float s[TILE];  // the scores in a local array (kept in registers: measured faster than in place)
      for (int64_t j = 0; j < TILE; ++j) s[j] = pr[j];
      if (a.bias != nullptr) {
        const float* br = a.bias + b * a.bs[0] + h * a.bs[1] + g * a.bs[2] + j0 * a.bs[3];
        for (int64_t j = 0; j < seen; ++j) s[j] += br[j * a.bs[3]];
      }
      float sum = 0.0f;
#if SPARSEVID_AVX512
      const float mt = softmax512(s, seen, m[r], pr, &sum);
#elif SPARSEVID_AVX2
      const float mt = softmax256(s, seen, m[r], pr, &sum);
#else
      float mt = m[r];
#pragma omp simd reduction(max : mt)
      for (int64_t j = 0; j < TILE; ++j) {
        s[j] = j < seen ? s[j] : NEG;
        mt = std::max(mt, s[j]);
      }
#endif
      if (mt == NEG) {  // everything seen so far is masked (a bias)
        std::fill(pr, pr + TILE, 0.0f);
        continue;
      }
      const float alpha = exp_neg(m[r] - mt);
#if !SPARSEVID_AVX2
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < TILE; ++j) {
        pr[j] = exp_neg(s[j] - mt);
        sum += pr[j];
      }
#endif
      m[r] = mt;
      l[r] = l[r] * alpha + sum;
      al[r] = alpha;
      sn[r] = seen;
    }
    // the output rows, several at a time where their accumulators fit in registers
    const float* vt = vb + j0 * a.vs[2];
    int64_t r = 0;
#if SPARSEVID_AVX512
    if constexpr (DC == 24 || DC == 64 || DC == 128) {  // 16-lane outputs, NB rows per V row loaded
      constexpr int NB = DC == 24 ? 4 : DC == 64 ? 2 : 1;  // their accumulators fill 16 registers
      for (; r + NB - 1 < R; r += NB)
        accumulate512<DC, NB>(acc + r * D, al + r, p + r * TILE, vt, a.vs[2], *std::max_element(sn + r, sn + r + NB));
      if constexpr (NB > 2)  // two rows (a step's two query heads per KV head): their chains interleave
        for (; r + 1 < R; r += 2)
          accumulate512<DC, 2>(acc + r * D, al + r, p + r * TILE, vt, a.vs[2], std::max(sn[r], sn[r + 1]));
      for (; r < R; ++r) accumulate512<DC, 1>(acc + r * D, al + r, p + r * TILE, vt, a.vs[2], sn[r]);
    }
#endif
#if SPARSEVID_AVX2
    for (; avx && D <= 32 && r + 1 < R; r += 2)
      accumulate_avx2<DC, 2>(acc + r * D, al + r, p + r * TILE, vt, a.vs[2], std::max(sn[r], sn[r + 1]), D);
    for (; avx && r < R; ++r) accumulate_avx2<DC, 1>(acc + r * D, al + r, p + r * TILE, vt, a.vs[2], sn[r], D);
#endif
    for (; r < R; ++r) {  // the same without AVX2: two chains (even and odd keys)
      float o0[DL], o1[DL];
      float* ar = acc + r * D;
      for (int64_t d = 0; d < D; ++d) {
        o0[d] = ar[d] * al[r];
        o1[d] = 0.0f;
      }
      int64_t j = 0;
      for (; j + 1 < sn[r]; j += 2) {
        const float p0 = p[r * TILE + j], p1 = p[r * TILE + j + 1];
        const float* v0 = vt + j * a.vs[2];
        const float* v1 = v0 + a.vs[2];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) {
          o0[d] += p0 * v0[d];
          o1[d] += p1 * v1[d];
        }
      }
      if (j < sn[r]) {
        const float p0 = p[r * TILE + j];
        const float* v0 = vt + j * a.vs[2];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o0[d] += p0 * v0[d];
      }
      for (int64_t d = 0; d < D; ++d) ar[d] = o0[d] + o1[d];
    }
  }
}

// f(i0, i1) over the n = work.size() items, one contiguous range per worker, the ranges cut where the
// items' work (`work[i]`: entries read) is shared evenly: a compact cache's KV heads keep different
// numbers of entries, and in ranges of equal item counts one worker got the long heads (a SparseMM
// layer keeping 9,241 / 9,241 / 6,897 / 3,707 entries took as long as a dense one on two threads,
// 151 us, where its entries spread evenly took 119-124; interleaving the items instead balanced it
// but made a dense layer 151 -> 191 us). On `threads` OpenMP threads where that is more than ATen's
// count, else ATen's. Items are independent, so the cut changes no result.
template <class F>
void parallel(const std::vector<int64_t>& work, int64_t threads, const F& f) {
  const int64_t n = static_cast<int64_t>(work.size());
  const bool omp = threads > at::get_num_threads() && n > 1;
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(n, omp ? threads : at::get_num_threads()));
  std::vector<int64_t> cut(nt + 1, n);  // worker t: items cut[t] .. cut[t + 1] - 1
  int64_t total = 0;
  for (int64_t w : work) total += w;
  cut[0] = 0;
  for (int64_t i = 0, t = 1, seen = 0; i < n && t < nt; ++i) {
    seen += work[i];
    while (t < nt && seen * nt >= total * t) cut[t++] = i + 1;
  }
  const auto worker = [&](int64_t t) {
    if (cut[t] < cut[t + 1]) f(cut[t], cut[t + 1]);
  };
  if (!omp) {
    at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) worker(t);
    });
    return;
  }
#pragma omp parallel num_threads(static_cast<int>(nt))
  worker(omp_get_thread_num());
}

template <int64_t DC>
void run(const Args& a, float* out, int64_t threads, int64_t min_work) {
  const int64_t D = a.D, R = a.G * a.Q;
  int64_t last = 0;  // the largest entry any row sees, + 1
  for (int64_t i = 0; i < a.B * a.Hkv; ++i) last = std::max(last, a.start[i] + a.Q);
  last = std::min(last, a.N);
  if (a.B * a.Hkv * last * (R + 3) < min_work) threads = 0;
  const int64_t splits = std::max<int64_t>(1, (last + SPLIT - 1) / SPLIT), items = a.B * a.Hkv * splits;
  std::vector<float> m(items * R), l(items * R), acc(items * R * D);
  // item i: split i % splits of (sequence, KV head) i / splits, its keys [lo, hi) (empty past what its rows see)
  const auto end = [&](int64_t i) { return std::min({(i % splits + 1) * SPLIT, a.N, a.start[i / splits] + a.Q}); };
  // the item at place x of the order: (sequence, KV head, split), each worker's keys one stream after
  // another, or, where a sequence reads another's prefix, (KV head, split, sequence) (see the header)
  const auto at = [&](int64_t x) {
    if (a.prefix == nullptr) return x;
    const int64_t b = x % a.B, hs = x / a.B;
    return (b * a.Hkv + hs / splits) * splits + hs % splits;
  };
  std::vector<int64_t> work(items);  // entries each item reads, in that order
  for (int64_t x = 0; x < items; ++x) {
    const int64_t i = at(x);
    work[x] = std::max<int64_t>(0, end(i) - (i % splits) * SPLIT);
  }
  parallel(work, threads, [&](int64_t x0, int64_t x1) {
    std::vector<float> qrow(R * D), kt(D * TILE), p(R * TILE), al(R);
    std::vector<int64_t> sn(R);
    for (int64_t x = x0; x < x1; ++x) {
      const int64_t i = at(x), bh = i / splits, b = bh / a.Hkv, h = bh % a.Hkv, lo = (i % splits) * SPLIT, hi = end(i);
      if (lo >= hi) {
        for (int64_t r = 0; r < R; ++r) {
          m[i * R + r] = -std::numeric_limits<float>::infinity();
          l[i * R + r] = 0.0f;
        }
        continue;
      }
      const int64_t kvb = a.prefix != nullptr && hi <= a.prefix[2 * b + 1] ? a.prefix[2 * b] : b;
      item<DC>(a, b, kvb, h, lo, hi, &m[i * R], &l[i * R], &acc[i * R * D], qrow.data(), kt.data(), p.data(), al.data(),
               sn.data());
    }
  });
  // combine the splits of each row, in order: out [B, Q, H, D]. A decode step's combine is a few
  // thousand multiply-adds, run in the calling thread: a second parallel region woke the other thread
  // again for it (one layer at 4,700 entries on two threads 77 -> 65 us; a batch of 8 rows 607 -> 561
  // us, with NB = 2 in `item`); a long one (a 7B verification over 64k entries) on the threads.
  const auto combine = [&](int64_t i0, int64_t i1) {
    for (int64_t bh = i0; bh < i1; ++bh) {
      const int64_t b = bh / a.Hkv, h = bh % a.Hkv;
      for (int64_t r = 0; r < R; ++r) {
        const int64_t g = r / a.Q, t = r % a.Q;
        float mx = -std::numeric_limits<float>::infinity(), den = 0.0f;
        for (int64_t sp = 0; sp < splits; ++sp) mx = std::max(mx, m[(bh * splits + sp) * R + r]);
        float* o = out + ((b * a.Q + t) * a.H + h * a.G + g) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
        for (int64_t sp = 0; sp < splits; ++sp) {
          const int64_t i = bh * splits + sp;
          if (l[i * R + r] == 0.0f) continue;
          const float w = exp_neg(m[i * R + r] - mx);
          den += w * l[i * R + r];
          for (int64_t d = 0; d < D; ++d) o[d] += w * acc[(i * R + r) * D + d];
        }
        const float inv = 1.0f / den;
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
      }
    }
  };
  if (a.B * a.Hkv * R * splits * D < (int64_t{1} << 20)) combine(0, a.B * a.Hkv);
  else parallel(std::vector<int64_t>(a.B * a.Hkv, 1), threads, combine);
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& start,
                            double scale, const std::optional<at::Tensor>& bias,
                            const std::optional<at::Tensor>& prefix, int64_t threads, int64_t min_work) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "decode_attention: q, k, v must be 4-D");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "decode_attention: float32 only");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "decode_attention: last dim must be contiguous");
  TORCH_CHECK(start.scalar_type() == at::kLong && start.is_contiguous() && start.dim() == 2, "decode_attention: start [B, Hkv] int64");
  Args a{};
  a.q = q.data_ptr<float>();
  a.k = k.data_ptr<float>();
  a.v = v.data_ptr<float>();
  a.start = start.data_ptr<int64_t>();
  a.B = q.size(0), a.H = q.size(1), a.Q = q.size(2), a.D = q.size(3), a.Hkv = k.size(1), a.N = k.size(2);
  a.G = a.H / a.Hkv;
  TORCH_CHECK(a.D <= DMAX, "decode_attention: head dim above 256");
  TORCH_CHECK(a.G * a.Hkv == a.H && k.size(3) == a.D && v.size(2) == a.N && start.size(0) == a.B && start.size(1) == a.Hkv,
              "decode_attention: shapes do not match");
  TORCH_CHECK(k.size(0) == a.B || k.size(0) == 1, "decode_attention: k, v batch must be B or 1");
  for (int i = 0; i < 3; ++i) {
    a.qs[i] = q.stride(i);
    a.ks[i] = k.size(0) == 1 && i == 0 ? 0 : k.stride(i);
    a.vs[i] = v.size(0) == 1 && i == 0 ? 0 : v.stride(i);
  }
  a.bias = nullptr;
  if (bias.has_value() && bias->defined()) {
    const at::Tensor& bt = *bias;
    TORCH_CHECK(bt.scalar_type() == at::kFloat && bt.dim() == 4 && bt.size(1) == a.Hkv && bt.size(2) == a.G && bt.size(3) == a.N,
                "decode_attention: bias [B or 1, Hkv, G, N] float32");
    a.bias = bt.data_ptr<float>();
    for (int i = 0; i < 4; ++i) a.bs[i] = bt.size(0) == 1 && i == 0 ? 0 : bt.stride(i);
  }
  a.prefix = nullptr;
  if (prefix.has_value() && prefix->defined()) {
    const at::Tensor& pt = *prefix;
    TORCH_CHECK(pt.scalar_type() == at::kLong && pt.is_contiguous() && pt.dim() == 2 && pt.size(0) == a.B && pt.size(1) == 2,
                "decode_attention: prefix [B, 2] int64");
    a.prefix = pt.data_ptr<int64_t>();
    bool shared = false;  // a row reads another's first entries (else, as a stack's rows sharing nothing, none)
    for (int64_t b = 0; b < a.B; ++b) {
      TORCH_CHECK((a.prefix[2 * b] >= 0 && a.prefix[2 * b] < k.size(0)) || a.prefix[2 * b + 1] == 0,
                  "decode_attention: prefix names a sequence k and v do not have");
      shared |= a.prefix[2 * b] != b && a.prefix[2 * b + 1] > 0;
    }
    if (!shared) a.prefix = nullptr;
  }
  a.scale = static_cast<float>(scale);
  at::Tensor out = at::empty({a.B, a.Q, a.H, a.D}, q.options());
  float* o = out.data_ptr<float>();
  switch (a.D) {  // the head dims of the models at hand, unrolled; any other through the generic loop
    case 24: run<24>(a, o, threads, min_work); break;
    case 64: run<64>(a, o, threads, min_work); break;
    case 128: run<128>(a, o, threads, min_work); break;
    default: run<0>(a, o, threads, min_work);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(sparsevid, m) {
  // `prefix` comes before the defaulted ints, without a default of its own: as a trailing `Tensor? prefix=None`,
  // compiled steps that inductor (C++ wrapper) loaded from its disk cache crashed the process in the op's call.
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor start, float scale, Tensor? bias, Tensor? prefix, "
        "int threads=0, int min_work=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(sparsevid, CPU, m) { m.impl("decode_attention", &decode_attention); }
