// Paged attention on the CPU over a packed batch of prefill chunks and decodes.
//
// Layouts follow schedkit/runners/paged/attention.py: q and out are [T, H, D] float32
// (row t of sequence s is query_start_loc[s] + j, at position seq_len - q_len + j); the
// caches are [num_blocks, block_size, KVH, D] in float32, bfloat16 or float16 and are
// read in place through each sequence's block table. Query head h uses KV head
// h / (H / KVH).
//
// One work item is (sequence, tile of query rows), every head: its query vectors share
// each key block the item loads, a contiguous [block_size, KVH, D] piece of the cache
// (float32 read in place, bfloat16 / float16 widened to float32 once per item; the next
// block is prefetched into L2). Softmax is online, one rescale per block and query. Items are spread over the threads of the OpenMP runtime torch
// itself uses (the library is loaded after torch, so libgomp.so.1 resolves to torch's).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include <omp.h>

#include <atomic>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#define SCHEDKIT_AVX512 1  // 16-wide item path (run_item_avx512)
#if defined(__AVX512BF16__)
#define SCHEDKIT_AVX512_BF16 1  // bfloat16 keys read in place by vdpbf16ps
#endif
#endif

namespace {

constexpr float kNegBig = -1e30f;  // finite: the kernel is built with -ffast-math

#if defined(__FLT16_MAX__)
#define SCHEDKIT_HAVE_FLOAT16 1  // _Float16: GCC >= 12 / clang >= 15 on x86
#endif

struct Item {
  int32_t seq, row_begin, row_end;
  int64_t layout = -1;  // float32 tiles: the index of the sequence's laid-out keys and values
};

struct Problem {
  float* q;          // [T, H, D] float32 queries (the fused call writes them after RoPE)
  void* out;         // [T, H, D] in out_dtype (0 float32, 1 bfloat16)
  const int32_t* query_start_loc;
  const int32_t* seq_lens;
  const int32_t* block_table;
  int64_t block_table_stride, num_heads, num_kv_heads, head_dim, block_size;
  float scale;
  int64_t num_cache_blocks;
  int out_dtype;
};

typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));

inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof v); }
inline float hsum(v8f v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// n values widened to float32
inline void widen(const uint16_t* src, int64_t n, float* dst) {  // bfloat16
  int64_t c = 0;
#if defined(__AVX512F__)
  for (; c + 16 <= n; c += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + c));
    _mm512_storeu_si512(dst + c, _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
#endif
  for (; c + 8 <= n; c += 8) {
    v8u16 h;
    std::memcpy(&h, src + c, sizeof h);
    v8u32 w = __builtin_convertvector(h, v8u32) << 16;
    std::memcpy(dst + c, &w, sizeof w);
  }
  for (; c < n; ++c) {
    const uint32_t w = static_cast<uint32_t>(src[c]) << 16;
    std::memcpy(dst + c, &w, sizeof w);
  }
}
#ifdef SCHEDKIT_HAVE_FLOAT16
inline void widen(const _Float16* src, int64_t n, float* dst) {
  for (int64_t c = 0; c < n; ++c) dst[c] = static_cast<float>(src[c]);
}
#endif

inline uint16_t to_bf16(float f) {  // round to nearest even, as torch's .to(bfloat16)
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline void store_as(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store_as(uint16_t* dst, const float* src, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512BF16__)
  for (; i + 16 <= n; i += 16)  // the same rounding (nearest even, NaN kept quiet)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
#endif
  for (; i < n; ++i) dst[i] = to_bf16(src[i]);
}
#ifdef SCHEDKIT_HAVE_FLOAT16
inline void store_as(_Float16* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<_Float16>(src[i]);
}
#endif

// n float32 values written to dst in dtype (0 float32, 1 bfloat16)
inline void store_row(void* dst, int dtype, int64_t offset, const float* src, int64_t n) {
  if (dtype == 0)
    store_as(static_cast<float*>(dst) + offset, src, n);
  else
    store_as(static_cast<uint16_t*>(dst) + offset, src, n);
}

// One query against `valid` keys of one block (rows `stride` floats apart): the scores,
// the online-softmax update of (m, l) and the accumulator a[8 * DVC].
template <int DVC>
inline void attend_block(const float* qi, const float* krows, const float* vrows, int64_t stride,
                         int64_t valid, float* s, float* a, float& m, float& l) {
  v8f q[DVC];
  for (int c = 0; c < DVC; ++c) q[c] = load8(qi + 8 * c);
  int64_t t = 0;
  for (; t + 4 <= valid; t += 4) {  // four keys at a time: four independent FMA chains
    const float* k0 = krows + t * stride;
    v8f a0 = q[0] * load8(k0), a1 = q[0] * load8(k0 + stride), a2 = q[0] * load8(k0 + 2 * stride),
        a3 = q[0] * load8(k0 + 3 * stride);
    for (int c = 1; c < DVC; ++c) {
      a0 += q[c] * load8(k0 + 8 * c);
      a1 += q[c] * load8(k0 + stride + 8 * c);
      a2 += q[c] * load8(k0 + 2 * stride + 8 * c);
      a3 += q[c] * load8(k0 + 3 * stride + 8 * c);
    }
    s[t] = hsum(a0), s[t + 1] = hsum(a1), s[t + 2] = hsum(a2), s[t + 3] = hsum(a3);
  }
  for (; t < valid; ++t) {
    const float* kr = krows + t * stride;
    v8f x = q[0] * load8(kr);
    for (int c = 1; c < DVC; ++c) x += q[c] * load8(kr + 8 * c);
    s[t] = hsum(x);
  }
  float block_max = kNegBig;
  for (t = 0; t < valid; ++t) block_max = std::max(block_max, s[t]);
  const float m_new = std::max(m, block_max);
  const float alpha = std::exp(m - m_new);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t u = 0; u < valid; ++u) {
    s[u] = std::exp(s[u] - m_new);
    sum += s[u];
  }
  v8f x[DVC];
  for (int c = 0; c < DVC; ++c) x[c] = load8(a + 8 * c) * alpha;
  for (int64_t u = 0; u < valid; ++u) {  // DVC independent chains
    const float w = s[u];
    const float* vr = vrows + u * stride;
    for (int c = 0; c < DVC; ++c) x[c] += w * load8(vr + 8 * c);
  }
  for (int c = 0; c < DVC; ++c) store8(a + 8 * c, x[c]);
  l = l * alpha + sum;
  m = m_new;
}

// The same for any width (head_dim / 8 not 2, 4, 8 or 16).
inline void attend_block_any(int64_t DV, const float* qi, const float* krows, const float* vrows,
                             int64_t stride, int64_t valid, float* s, float* a, float& m, float& l) {
  float block_max = kNegBig;
  for (int64_t t = 0; t < valid; ++t) {
    const float* kr = krows + t * stride;
    v8f x = {};
    for (int64_t c = 0; c < 8 * DV; c += 8) x += load8(qi + c) * load8(kr + c);
    s[t] = hsum(x);
    block_max = std::max(block_max, s[t]);
  }
  const float m_new = std::max(m, block_max);
  const float alpha = std::exp(m - m_new);
  float sum = 0.0f;
  for (int64_t u = 0; u < valid; ++u) {
    s[u] = std::exp(s[u] - m_new);
    sum += s[u];
  }
  for (int64_t c = 0; c < 8 * DV; c += 8) {
    v8f x = load8(a + c) * alpha;
    for (int64_t u = 0; u < valid; ++u) x += s[u] * load8(vrows + u * stride + c);
    store8(a + c, x);
  }
  l = l * alpha + sum;
  m = m_new;
}

// acc / l of nq query vectors, written to out from element `offset` on.
inline void finish_item(const Problem& p, float* acc, const float* l, int64_t offset, int64_t nq) {
  const int64_t D = p.head_dim;
  for (int64_t i = 0; i < nq; ++i) {
    const float inv = 1.0f / l[i];
    for (int64_t d = 0; d < D; ++d) acc[i * D + d] *= inv;
  }
  store_row(p.out, p.out_dtype, offset, acc, nq * D);
}

// One item: rows [row_begin, row_end) of one sequence, every head. Requires D % 8 == 0
// (checked by the entry point).
template <typename KT>
void run_item(const Problem& p, const KT* k_cache, const KT* v_cache, const Item& it,
              float* qbuf, float* acc, float* m, float* l, float* kb, float* vb, float* s) {
  const int64_t D = p.head_dim, BS = p.block_size, H = p.num_heads, KVH = p.num_kv_heads;
  const int64_t G = H / KVH, DV = D / 8;
  const int64_t q0 = p.query_start_loc[it.seq];
  const int64_t q_len = p.query_start_loc[it.seq + 1] - q0;
  const int64_t context = p.seq_lens[it.seq] - q_len;
  const int64_t rows = it.row_end - it.row_begin;
  const int64_t nq = rows * H;  // query vector i = (row i / H, head i % H), as q is laid out
  const float* qsrc = p.q + (q0 + it.row_begin) * H * D;
  for (int64_t x = 0; x < nq * D; ++x) qbuf[x] = qsrc[x] * p.scale;
  std::fill(acc, acc + nq * D, 0.0f);
  std::fill(m, m + nq, kNegBig);
  std::fill(l, l + nq, 0.0f);
  const int64_t num_keys = context + it.row_end;  // the last row sees keys 0 .. num_keys-1
  const int32_t* blocks = p.block_table + it.seq * p.block_table_stride;
  const int64_t token_stride = KVH * D;
  for (int64_t base = 0; base < num_keys; base += BS) {
    const int64_t n = std::min(BS, num_keys - base);
    const int64_t slot0 = static_cast<int64_t>(blocks[base / BS]) * BS;
    const KT* kp = k_cache + slot0 * token_stride;
    const KT* vp = v_cache + slot0 * token_stride;
    const float* kblock;
    const float* vblock;
    if constexpr (std::is_same_v<KT, float>) {
      kblock = kp, vblock = vp;
    } else {
      widen(kp, n * token_stride, kb);
      widen(vp, n * token_stride, vb);
      kblock = kb, vblock = vb;
    }
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t r = i / H, h = i - r * H;
      const int64_t valid = std::min(n, context + it.row_begin + r - base + 1);
      if (valid <= 0) {  // this block lies wholly after this row: skip its other heads
        i = (r + 1) * H - 1;
        continue;
      }
      const int64_t head_off = (h / G) * D;
      const float* krows = kblock + head_off;
      const float* vrows = vblock + head_off;
      const float* qi = qbuf + i * D;
      float* a = acc + i * D;
      switch (DV) {  // compile-time widths keep q and the accumulators in registers
        case 2: attend_block<2>(qi, krows, vrows, token_stride, valid, s, a, m[i], l[i]); break;
        case 4: attend_block<4>(qi, krows, vrows, token_stride, valid, s, a, m[i], l[i]); break;
        case 8: attend_block<8>(qi, krows, vrows, token_stride, valid, s, a, m[i], l[i]); break;
        case 16: attend_block<16>(qi, krows, vrows, token_stride, valid, s, a, m[i], l[i]); break;
        default: attend_block_any(DV, qi, krows, vrows, token_stride, valid, s, a, m[i], l[i]);
      }
    }
  }
  finish_item(p, acc, l, (q0 + it.row_begin) * H * D, nq);
}

#ifdef SCHEDKIT_AVX512
// exp of 16 floats as 2^n * p(r): r = x - n ln2 in [-ln2/2, ln2/2] (ln2 in two parts),
// p the Taylor polynomial of exp of degree kDegree (7: relative error below 2e-7, as
// std::exp's float result to about an ulp; 4: below 5e-5, about a fortieth of bfloat16's
// rounding step, for values rounded to bfloat16 next: the tiles' P).
template <int kDegree>
inline __m512 exp16_deg(__m512 x) {
  static_assert(kDegree >= 2 && kDegree <= 7);
  constexpr float kInvFactorial[8] = {1.0f, 1.0f, 0.5f, 1.0f / 6, 1.0f / 24, 1.0f / 120, 1.0f / 720, 1.0f / 5040};
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 y = _mm512_set1_ps(kInvFactorial[kDegree]);
  for (int k = kDegree - 1; k >= 0; --k) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kInvFactorial[k]));
  return _mm512_scalef_ps(y, n);
}
inline __m512 exp16(__m512 x) { return exp16_deg<7>(x); }
inline __m512 exp16_bf16(__m512 x) { return exp16_deg<4>(x); }

inline __m512 load16(const uint16_t* p) {  // 16 bfloat16 widened
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
#ifdef SCHEDKIT_AVX512_BF16
inline __m256i to_bf16x16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
#else
inline __m256i to_bf16x16(__m512 v) {  // round to nearest even (finite values)
  __m512i u = _mm512_castps_si512(v);
  u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                           _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
}
#endif
inline __m512 round16(__m512 v) {  // to bfloat16 and back
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16x16(v)), 16));
}
inline void store16(uint16_t* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16x16(v)); }
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

// Lane t of the result is the sum of the 16 lanes of v[t]: a transposing tree of
// 45 shuffles and adds instead of 16 horizontal sums.
inline __m512 sum_each16(const __m512* v) {
  __m512 w[8], x[4];
  for (int k = 0; k < 8; ++k)
    w[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k) {  // 128-bit group g of x[k]: keys 4k..4k+3 over group g's lanes
    const __m512d a = _mm512_castps_pd(w[2 * k]), b = _mm512_castps_pd(w[2 * k + 1]);
    x[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 z01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
  const __m512 z23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88), _mm512_shuffle_f32x4(x[2], x[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z01, z23, 0x88), _mm512_shuffle_f32x4(z01, z23, 0xDD));
}

// Scores of one query against `cn` (1..16) key rows `stride` elements apart; lanes from cn
// on repeat the last row (the caller masks them). DC = head_dim / 16.
template <int DC>
inline __m512 scores16(const float* qi, const float* krows, int64_t stride, int cn) {
  __m512 q[DC], a[16];
  for (int c = 0; c < DC; ++c) q[c] = _mm512_loadu_ps(qi + 16 * c);
#pragma GCC unroll 16
  for (int t = 0; t < 16; ++t) {
    const float* kr = krows + std::min(t, cn - 1) * stride;
    a[t] = _mm512_mul_ps(q[0], _mm512_loadu_ps(kr));
    for (int c = 1; c < DC; ++c) a[t] = _mm512_fmadd_ps(q[c], _mm512_loadu_ps(kr + 16 * c), a[t]);
  }
  return sum_each16(a);
}

#ifdef SCHEDKIT_AVX512_BF16
// The same with bfloat16 keys read in place and the query rounded to bfloat16 pairs
// (qi: head_dim bfloat16 values), products summed in float32 by vdpbf16ps.
template <int DC>
inline __m512 scores16(const uint16_t* qi, const uint16_t* krows, int64_t stride, int cn) {
  __m512bh q[DC / 2];
  for (int c = 0; c < DC / 2; ++c) q[c] = (__m512bh)_mm512_loadu_si512(qi + 32 * c);
  __m512 a[16];
#pragma GCC unroll 16
  for (int t = 0; t < 16; ++t) {
    const uint16_t* kr = krows + std::min(t, cn - 1) * stride;
    a[t] = _mm512_setzero_ps();
    for (int c = 0; c < DC / 2; ++c)
      a[t] = _mm512_dpbf16_ps(a[t], q[c], (__m512bh)_mm512_loadu_si512(kr + 32 * c));
  }
  return sum_each16(a);
}
#endif

// One item as run_item does it, 16 keys at a time: one online-softmax rescale per 16
// keys, scores for 16 keys from one transposing sum, exp vectorised. head_dim = 16 * DC.
template <typename KT, int DC>
void run_item_avx512(const Problem& p, const KT* k_cache, const KT* v_cache, const Item& it,
                     float* qbuf, float* acc, float* m, float* l, float* kb, float* vb, float* s,
                     uint16_t* qbh) {
  constexpr int64_t D = 16 * DC;
  const int64_t BS = p.block_size, H = p.num_heads, KVH = p.num_kv_heads, G = H / KVH;
  const int64_t q0 = p.query_start_loc[it.seq];
  const int64_t q_len = p.query_start_loc[it.seq + 1] - q0;
  const int64_t context = p.seq_lens[it.seq] - q_len;
  const int64_t nq = (it.row_end - it.row_begin) * H;
  const float* qsrc = p.q + (q0 + it.row_begin) * H * D;
  for (int64_t x = 0; x < nq * D; ++x) qbuf[x] = qsrc[x] * p.scale;
#ifdef SCHEDKIT_AVX512_BF16
  constexpr bool kDotBf16 = std::is_same_v<KT, uint16_t> && DC % 2 == 0;
  if constexpr (kDotBf16)
    for (int64_t i = 0; i < nq * DC / 2; ++i)
      _mm512_storeu_si512(qbh + 32 * i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(qbuf + 32 * i + 16),
                                                                    _mm512_loadu_ps(qbuf + 32 * i)));
#else
  constexpr bool kDotBf16 = false;
#endif
  std::fill(acc, acc + nq * D, 0.0f);
  std::fill(m, m + nq, kNegBig);
  std::fill(l, l + nq, 0.0f);
  const int64_t num_keys = context + it.row_end;
  const int32_t* blocks = p.block_table + it.seq * p.block_table_stride;
  const int64_t token_stride = KVH * D;
  constexpr int64_t kAhead = 1;
  for (int64_t base = 0; base < num_keys; base += BS) {
    const int64_t n = std::min(BS, num_keys - base);
    const int64_t slot0 = static_cast<int64_t>(blocks[base / BS]) * BS;
    const KT* kp = k_cache + slot0 * token_stride;
    const KT* vp = v_cache + slot0 * token_stride;
    if (base == 0)  // the first blocks, before the loop's prefetches reach them
      for (int64_t b = 0; b < kAhead && b * BS < num_keys; ++b) {
        const int64_t at = static_cast<int64_t>(blocks[b]) * BS * token_stride;
        const int64_t bytes = std::min(BS, num_keys - b * BS) * token_stride * static_cast<int64_t>(sizeof(KT));
        for (int64_t o = 0; o < bytes; o += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(k_cache + at) + o, 0, 2);
          __builtin_prefetch(reinterpret_cast<const char*>(v_cache + at) + o, 0, 2);
        }
      }
    if (base + kAhead * BS < num_keys) {  // a block ahead: its address comes from the table,
      // which the hardware prefetcher cannot follow. Into L2, not L1: with the block being
      // read and the widened values, a 12 KB block prefetched into L1 evicts what is in use
      // (decode attention of SmolLM2-135M, 64 x 350 keys, 2 cores on Zen 4: 1.5 ms a layer
      // against 2.2 ms prefetching into L1)
      const int64_t next = static_cast<int64_t>(blocks[base / BS + kAhead]) * BS * token_stride;
      const char* kn = reinterpret_cast<const char*>(k_cache + next);
      const char* vn = reinterpret_cast<const char*>(v_cache + next);
      const int64_t bytes = std::min(BS, num_keys - base - kAhead * BS) * token_stride * static_cast<int64_t>(sizeof(KT));
      for (int64_t o = 0; o < bytes; o += 64) {
        __builtin_prefetch(kn + o, 0, 2);
        __builtin_prefetch(vn + o, 0, 2);
      }
    }
    const float* kblock = nullptr;
    const float* vblock;
    if constexpr (std::is_same_v<KT, float>) {
      kblock = kp, vblock = vp;
    } else {
      if constexpr (!kDotBf16) {
        widen(kp, n * token_stride, kb);
        kblock = kb;
      }
      widen(vp, n * token_stride, vb);
      vblock = vb;
    }
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t r = i / H, h = i - r * H;
      const int64_t valid = std::min(n, context + it.row_begin + r - base + 1);
      if (valid <= 0) {
        i = (r + 1) * H - 1;
        continue;
      }
      const int64_t head_off = (h / G) * D;
      float* a = acc + i * D;
      for (int64_t c0 = 0; c0 < valid; c0 += 16) {
        const int cn = static_cast<int>(std::min<int64_t>(16, valid - c0));
        const __mmask16 live = static_cast<__mmask16>((1u << cn) - 1u);
        __m512 sv;
#ifdef SCHEDKIT_AVX512_BF16
        if constexpr (kDotBf16)
          sv = scores16<DC>(qbh + i * D, kp + c0 * token_stride + head_off, token_stride, cn);
        else
#endif
          sv = scores16<DC>(qbuf + i * D, kblock + c0 * token_stride + head_off, token_stride, cn);
        const float m_new = std::max(m[i], _mm512_mask_reduce_max_ps(live, sv));
        const float alpha = m_new == m[i] ? 1.0f : std::exp(m[i] - m_new);
        const __m512 pv = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(sv, _mm512_set1_ps(m_new))));
        _mm512_storeu_ps(s, pv);
        __m512 x[DC], y[DC];  // even and odd keys: two independent FMA chains per column
        const __m512 va = _mm512_set1_ps(alpha);
        for (int c = 0; c < DC; ++c) x[c] = _mm512_mul_ps(_mm512_loadu_ps(a + 16 * c), va), y[c] = _mm512_setzero_ps();
        const float* vr = vblock + c0 * token_stride + head_off;
        int t = 0;
        for (; t + 2 <= cn; t += 2, vr += 2 * token_stride) {
          const __m512 w0 = _mm512_set1_ps(s[t]), w1 = _mm512_set1_ps(s[t + 1]);
          for (int c = 0; c < DC; ++c) {
            x[c] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(vr + 16 * c), x[c]);
            y[c] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(vr + token_stride + 16 * c), y[c]);
          }
        }
        if (t < cn) {
          const __m512 w0 = _mm512_set1_ps(s[t]);
          for (int c = 0; c < DC; ++c) x[c] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(vr + 16 * c), x[c]);
        }
        for (int c = 0; c < DC; ++c) _mm512_storeu_ps(a + 16 * c, _mm512_add_ps(x[c], y[c]));
        l[i] = l[i] * alpha + _mm512_reduce_add_ps(pv);
        m[i] = m_new;
      }
    }
  }
  finish_item(p, acc, l, (q0 + it.row_begin) * H * D, nq);
}
#endif

// Prefill tiles in float32, for every cache dtype where no bfloat16 tile engine runs
// (float32 caches everywhere; bfloat16 / float16 caches on CPUs without AVX512-BF16).
// Before the items run, each such sequence's keys are laid out once per KV head as
// chunks of 16 transposed (Kt: [D][16] float32) and its values as float32 rows, so that
// no item transposes or widens a key again. An item is up to kFloatTileRows query rows
// of one sequence; per KV head, its rows x G query vectors go through the keys a span of
// kSpan at a time: the scores of the whole span from a register-blocked product (kQB
// query vectors x 16 keys, one broadcast of q per dimension; no horizontal sum per key),
// one online-softmax rescale per vector and span, a vector exp, then the values kSub
// keys at a time (they stay in L1 while every block of kPB vectors reads them).
std::atomic<bool> g_float_tiles{true};  // schedkit_float_tiles_enable
constexpr int64_t kFloatTileRows = 16;
constexpr int64_t kFloatTileMinRows = 8;  // shorter chunks (decodes) take the item path

#if defined(__AVX512F__)
constexpr int kW = 16;
#else
constexpr int kW = 8;
#endif
typedef float vw __attribute__((vector_size(4 * kW)));
typedef int32_t vwi __attribute__((vector_size(4 * kW)));
constexpr int kNV = 16 / kW;       // vectors per row of 16 scores
constexpr int kQB = 12 / kNV;      // query vectors per score block: 12 accumulators
constexpr int kPB = 2;             // query vectors per value block (with kVB: 8 accumulators, kVB values in registers)
constexpr int kVB = 4;             // vectors of dimensions per value block: 8 accumulators
constexpr int64_t kQPad = 12;      // query vectors are padded to a multiple of kQB and kPB

inline vw loadw(const float* p) {
  vw v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void storew(float* p, vw v) { std::memcpy(p, &v, sizeof v); }
inline vw splat(float x) { return vw{} + x; }
inline vw maxw(vw a, vw b) { return a > b ? a : b; }
// the largest (kMax) or the sum of a vector's lanes, halves folded
template <bool kMax>
inline float hfold(vw v) {
#if defined(__AVX512F__)
  return kMax ? _mm512_reduce_max_ps(v) : _mm512_reduce_add_ps(v);
#elif defined(__AVX__)
  auto op = [](__m128 a, __m128 b) { return kMax ? _mm_max_ps(a, b) : _mm_add_ps(a, b); };
  __m128 x = op(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = op(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(op(x, _mm_movehdup_ps(x)));
#else
  float x = v[0];
  for (int i = 1; i < kW; ++i) x = kMax ? std::max(x, v[i]) : x + v[i];
  return x;
#endif
}

// exp of kW floats (x <= 0 here): 2^n p(r) as exp16, in portable vectors
inline vw expw(vw x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  const vw t = x * 1.44269504088896341f;
  const vwi n = __builtin_convertvector(t + (t < splat(0.0f) ? splat(-0.5f) : splat(0.5f)), vwi);
  const vw nf = __builtin_convertvector(n, vw);
  vw r = x - nf * 0.693145751953125f;
  r = r - nf * 1.428606765330187045e-06f;
  vw y = splat(1.0f / 5040);
  y = y * r + 1.0f / 720;
  y = y * r + 1.0f / 120;
  y = y * r + 1.0f / 24;
  y = y * r + 1.0f / 6;
  y = y * r + 0.5f;
  y = y * r + 1.0f;
  y = y * r + 1.0f;
  const vwi bits = (n + 127) << 23;
  vw two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return y * two_n;
}

// Where the float32 tiles take a problem's prefill chunks (head_dim a multiple of 2 kW).
inline bool float_tiles_fit(const Problem& p) {
  return g_float_tiles.load(std::memory_order_relaxed) && p.head_dim % (2 * kW) == 0 && p.head_dim <= 256;
}

// One sequence's keys and values as the tiles read them: per KV head, ceil(keys / 16)
// chunks of Kt [D][16] (zero past the last key), then the values as [keys][D] rows.
// Floats per KV head; the values start at float_tile_keys_size.
inline int64_t float_tile_keys_size(int64_t keys, int64_t D) { return (keys + 15) / 16 * 16 * D; }
inline int64_t float_tile_head_size(int64_t keys, int64_t D) { return float_tile_keys_size(keys, D) + keys * D; }

template <typename KT>
void float_tile_layout(const Problem& p, const KT* k_cache, const KT* v_cache, int64_t seq, int64_t g,
                       float* dst, float* row) {
  const int64_t D = p.head_dim, BS = p.block_size, KVH = p.num_kv_heads;
  const int64_t keys = p.seq_lens[seq];
  float* kt = dst + g * float_tile_head_size(keys, D);
  float* vrows = kt + float_tile_keys_size(keys, D);
  const int32_t* blocks = p.block_table + seq * p.block_table_stride;
  for (int64_t t = 0; t < (keys + 15) / 16 * 16; ++t) {
    float* col = kt + (t / 16) * 16 * D + t % 16;
    if (t >= keys) {
      for (int64_t d = 0; d < D; ++d) col[16 * d] = 0.0f;
      continue;
    }
    const int64_t off = ((static_cast<int64_t>(blocks[t / BS]) * BS + t % BS) * KVH + g) * D;
    const float* kr;
    if constexpr (std::is_same_v<KT, float>) {
      kr = k_cache + off;
      std::memcpy(vrows + t * D, v_cache + off, D * sizeof(float));
    } else {
      widen(k_cache + off, D, row);
      kr = row;
      widen(v_cache + off, D, vrows + t * D);
    }
    for (int64_t d = 0; d < D; ++d) col[16 * d] = kr[d];
  }
}

constexpr int64_t kSpan = 256;  // keys per span: scores for a span, then one softmax rescale
constexpr int64_t kSub = 64;    // keys per pass over the values

struct FloatTileScratch {
  float* q;      // [nqp][D]: one KV head's query vectors, scaled
  float* acc;    // [nqp][D]
  float* m;      // [nqp]
  float* l;      // [nqp]
  float* alpha;  // [nqp]
  int32_t* pos;  // [nqp]: each vector's position (-1 for padding)
  int32_t* vis;  // [nqp]: keys of the span each vector sees
  float* s;      // [nqp][kSpan]: scores, then probabilities
  float* rows;   // [kFloatTileRows][H][D]: the item's queries, scaled
};

inline int64_t float_tile_vectors(int64_t rows, int64_t G) { return (rows * G + kQPad - 1) / kQPad * kQPad; }

// S[j][0..16) = q_j . Kt for kQB query vectors (rows of s `ls` floats apart)
inline void float_tile_scores(const float* q, const float* kt, int64_t D, float* s, int64_t ls) {
  vw a[kQB][kNV] = {};
  for (int64_t d = 0; d < D; ++d) {
    vw k[kNV];
    for (int v = 0; v < kNV; ++v) k[v] = loadw(kt + 16 * d + kW * v);
    for (int j = 0; j < kQB; ++j) {
      const vw b = splat(q[j * D + d]);
      for (int v = 0; v < kNV; ++v) a[j][v] += b * k[v];
    }
  }
  for (int j = 0; j < kQB; ++j)
    for (int v = 0; v < kNV; ++v) storew(s + ls * j + kW * v, a[j][v]);
}

// acc[j] = acc[j] * alpha[j] + P[j] V over n value rows, kPB vectors, NVD vectors of
// dimensions at a time (rows of p `ls` floats apart)
template <int NVD>
inline void float_tile_values(const float* pj, int64_t ls, const float* vrows, int64_t n, int64_t D,
                              const float* alpha, float* acc) {
  for (int64_t dc = 0; dc < D; dc += NVD * kW) {
    vw x[kPB][NVD];
    for (int i = 0; i < kPB; ++i)
      for (int c = 0; c < NVD; ++c) {
        x[i][c] = loadw(acc + i * D + dc + kW * c);
        if (alpha) x[i][c] *= alpha[i];
      }
    const float* vr = vrows + dc;
    for (int64_t t = 0; t < n; ++t, vr += D) {
      vw v[NVD];
      for (int c = 0; c < NVD; ++c) v[c] = loadw(vr + kW * c);
      for (int i = 0; i < kPB; ++i) {
        const vw w = splat(pj[ls * i + t]);
        for (int c = 0; c < NVD; ++c) x[i][c] += w * v[c];
      }
    }
    for (int i = 0; i < kPB; ++i)
      for (int c = 0; c < NVD; ++c) storew(acc + i * D + dc + kW * c, x[i][c]);
  }
}

// The online softmax of one vector over the first `vis` of its span's scores (s, rounded
// up to whole vectors past vis with zeros up to `len`): the probabilities replace the
// scores, m and l are updated, and the rescale of the older accumulator is returned.
inline float float_tile_softmax(float* s, int64_t vis, int64_t len, float& m, float& l) {
  const vwi lane = [] {
    vwi x;
    for (int i = 0; i < kW; ++i) x[i] = i;
    return x;
  }();
  vw mv = splat(kNegBig);
  int64_t t = 0;
  for (; t + kW <= vis; t += kW) mv = maxw(mv, loadw(s + t));
  if (t < vis) {
    const vwi live = lane < static_cast<int32_t>(vis - t);
    mv = maxw(mv, live ? loadw(s + t) : splat(kNegBig));
  }
  const float m_new = std::max(m, hfold<true>(mv));
  const float alpha = m_new == m ? 1.0f : std::exp(m - m_new);
  vw sum = {};
  for (t = 0; t + kW <= vis; t += kW) {
    const vw pv = expw(loadw(s + t) - m_new);
    storew(s + t, pv);
    sum += pv;
  }
  if (t < vis) {
    const vwi live = lane < static_cast<int32_t>(vis - t);
    const vw pv = live ? expw(loadw(s + t) - m_new) : splat(0.0f);
    storew(s + t, pv);
    sum += pv;
    t += kW;
  }
  for (; t < len; t += kW) storew(s + t, splat(0.0f));
  l = l * alpha + hfold<false>(sum);
  m = m_new;
  return alpha;
}

// layout: this sequence's float_tile_layout
void run_item_float_tiles(const Problem& p, const float* layout, const Item& it, const FloatTileScratch& sc) {
  const int64_t D = p.head_dim, H = p.num_heads, KVH = p.num_kv_heads, G = H / KVH;
  const int64_t q0 = p.query_start_loc[it.seq];
  const int64_t q_len = p.query_start_loc[it.seq + 1] - q0;
  const int64_t keys = p.seq_lens[it.seq];
  const int64_t context = keys - q_len;
  const int64_t rows = it.row_end - it.row_begin;
  const int64_t nqv = rows * G, nqp = float_tile_vectors(rows, G);
  const int64_t num_keys = context + it.row_end;
  const int64_t first_pos = context + it.row_begin;
  {  // the item's queries, every head, scaled: one pass over contiguous rows
    const float* src = p.q + (q0 + it.row_begin) * H * D;
    for (int64_t x = 0; x < rows * H * D; ++x) sc.rows[x] = src[x] * p.scale;
  }
  for (int64_t g = 0; g < KVH; ++g) {
    const float* kt = layout + g * float_tile_head_size(keys, D);
    const float* vrows = kt + float_tile_keys_size(keys, D);
    for (int64_t j = 0; j < nqp; ++j) {
      float* dst = sc.q + j * D;
      if (j < nqv) {
        const float* row = sc.rows + ((j / G) * H + g * G + j % G) * D;
        std::memcpy(dst, row, D * sizeof(float));
        sc.pos[j] = static_cast<int32_t>(first_pos + j / G);
      } else {
        std::fill(dst, dst + D, 0.0f);
        sc.pos[j] = -1;
      }
    }
    std::fill(sc.acc, sc.acc + nqp * D, 0.0f);
    std::fill(sc.m, sc.m + nqp, kNegBig);
    std::fill(sc.l, sc.l + nqp, 0.0f);
    for (int64_t base = 0; base < num_keys; base += kSpan) {
      const int64_t len = std::min<int64_t>(kSpan, num_keys - base);
      // the first vectors, whose rows see none of these keys, are skipped
      const int64_t j0 = std::max<int64_t>(0, base - first_pos) * G / kQPad * kQPad;
      for (int64_t c = 0; c < len; c += 16) {  // scores, one chunk of 16 keys for every vector
        const float* ktc = kt + (base + c) * D;
        for (int64_t j = j0; j < nqp; j += kQB)
          float_tile_scores(sc.q + j * D, ktc, D, sc.s + j * kSpan + c, kSpan);
      }
      for (int64_t j = j0; j < nqp; ++j) {
        const int64_t vis = std::clamp<int64_t>(sc.pos[j] + 1 - base, 0, len);
        sc.vis[j] = static_cast<int32_t>(vis);
        sc.alpha[j] = vis > 0 ? float_tile_softmax(sc.s + j * kSpan, vis, len, sc.m[j], sc.l[j]) : 1.0f;
        if (vis == 0) std::fill(sc.s + j * kSpan, sc.s + j * kSpan + len, 0.0f);
      }
      // values kSub keys at a time, so that they stay in L1 while every block reads them;
      // the first pass rescales the accumulators
      for (int64_t c0 = 0; c0 < len; c0 += kSub) {
        const float* vc = vrows + (base + c0) * D;
        for (int64_t j = j0; j < nqp; j += kPB) {
          int64_t n = 0;  // the keys any vector of the block sees (the others' are zero)
          for (int i = 0; i < kPB; ++i) n = std::max<int64_t>(n, sc.vis[j + i]);
          n = std::min<int64_t>(kSub, n - c0);
          if (n <= 0) continue;
          const float* alpha = c0 == 0 ? sc.alpha + j : nullptr;
          if (D % (kVB * kW) == 0)
            float_tile_values<kVB>(sc.s + j * kSpan + c0, kSpan, vc, n, D, alpha, sc.acc + j * D);
          else
            float_tile_values<2>(sc.s + j * kSpan + c0, kSpan, vc, n, D, alpha, sc.acc + j * D);
        }
      }
    }
    for (int64_t j = 0; j < nqv; ++j) {
      float* a = sc.acc + j * D;
      const float inv = 1.0f / sc.l[j];
      for (int64_t d = 0; d < D; ++d) a[d] *= inv;
      store_row(p.out, p.out_dtype, ((q0 + it.row_begin + j / G) * H + g * G + j % G) * D, a, D);
    }
  }
}

#ifdef SCHEDKIT_AVX512_BF16
// Prefill tiles for bfloat16 caches: items of 32 query rows (two 16-row sub-tiles),
// computed transposed so that the online softmax runs across 16 rows in vector lanes:
// S^T = K Q^T ([16 keys][16 rows] per sub-tile), P^T rounded to bfloat16 in key pairs,
// O^T += V^T P^T ([16 dims][16 rows] per 16 columns of head_dim). Two engines run the
// products: AMX tiles (Sapphire Rapids and later) and, where there is no AMX, vdpbf16ps
// on AVX512-BF16 (AMD Zen 4) with the same operands in the same layouts, one key (or
// dimension) row broadcast against a vector of 16 rows' pairs.
#define SCHEDKIT_TILES 1
std::atomic<bool> g_dp_tiles{true};  // the vdpbf16ps engine (schedkit_bf16_tiles_enable)

constexpr int64_t kTileRows = 32;  // query rows of one tile work item (two sub-tiles)

// vdpbf16ps: lanes r of acc += the pair product of the 32-bit word w (two bfloat16)
// with lane r's pair in b.
inline __m512 dp_pair(__m512 acc, uint32_t w, __m512bh b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(static_cast<int>(w)), b);
}

// S^T of one sub-tile by vdpbf16ps: s[t][r] = sum over pairs of key row t (16 rows of a,
// `stride` elements apart) and Q^T's pair rows (qt: [D / 2][16] 32-bit words).
inline void dp_scores_t(const uint16_t* a, int64_t stride, const uint16_t* qt, int64_t D, float* s) {
  __m512 acc[16];
  for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
  const uint32_t* q32 = reinterpret_cast<const uint32_t*>(qt);
  for (int64_t c = 0; c < D / 2; ++c) {
    const __m512bh b = (__m512bh)_mm512_loadu_si512(q32 + 16 * c);
#pragma GCC unroll 16
    for (int t = 0; t < 16; ++t) {
      uint32_t w;
      std::memcpy(&w, a + t * stride + 2 * c, sizeof w);
      acc[t] = dp_pair(acc[t], w, b);
    }
  }
  for (int t = 0; t < 16; ++t) _mm512_storeu_ps(s + 16 * t, acc[t]);
}

// O^T (16 dims of one sub-tile, o: [16][16] float32) = o * alpha + V^T P^T by vdpbf16ps:
// vt: [16 dims][16 keys] bfloat16, pt: [8 key pairs][16 rows] 32-bit words.
inline void dp_values_t(const uint16_t* vt, const uint16_t* pt, __m512 alpha, float* o) {
  __m512bh b[8];
  for (int k = 0; k < 8; ++k) b[k] = (__m512bh)_mm512_loadu_si512(pt + 32 * k);
  const uint32_t* v32 = reinterpret_cast<const uint32_t*>(vt);
#pragma GCC unroll 4
  for (int d = 0; d < 16; ++d) {
    __m512 x = _mm512_setzero_ps(), y = _mm512_setzero_ps();
    for (int k = 0; k < 8; k += 2) {
      x = dp_pair(x, v32[8 * d + k], b[k]);
      y = dp_pair(y, v32[8 * d + k + 1], b[k + 1]);
    }
    _mm512_storeu_ps(o + 16 * d, _mm512_fmadd_ps(_mm512_loadu_ps(o + 16 * d), alpha, _mm512_add_ps(x, y)));
  }
}
#endif

#if defined(SCHEDKIT_TILES) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define SCHEDKIT_AMX 1
// The AMX engine. Tiles: 0 / 2 S^T and O^T of sub-tile 0 / 1, 1 K, 3 / 4 Q^T, 5 V^T,
// 6 / 7 P^T.
std::atomic<bool> g_amx{false};  // set by schedkit_amx_enable once the OS granted the tiles

struct alignas(64) TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void amx_configure() {
  TileConfig c;
  auto set = [&](int t, int rows, int colsb) { c.rows[t] = static_cast<uint8_t>(rows), c.colsb[t] = static_cast<uint16_t>(colsb); };
  set(0, 16, 64), set(1, 16, 64), set(2, 16, 64), set(3, 16, 64), set(4, 16, 64), set(5, 16, 32), set(6, 8, 64),
      set(7, 8, 64);
  _tile_loadconfig(&c);
}
#endif

#ifdef SCHEDKIT_TILES
struct TileScratch {
  uint16_t* qh;    // [16][D]: one sub-tile's queries in bfloat16, scaled
  uint16_t* qt;    // [H][2][D / 2][16][2]: Q^T, B operand of K Q^T
  uint16_t* kpad;  // [16][D]: a short chunk's keys, zero-padded
  uint16_t* vt;    // [D / 16][16][16]: V^T, A operand of V^T P^T
  uint16_t* pt;    // [2][8][16][2]: P^T in key pairs, B operand
  float* s;        // [2][16][16]
  float* pv;       // [2][16][16]
};

// A 16 x 16 transpose of 32-bit words: on return r[c] holds what was column c.
inline void transpose16(__m512i* r) {
  __m512i u[16];
  for (int t = 0; t < 16; t += 2)
    u[t] = _mm512_unpacklo_epi32(r[t], r[t + 1]), u[t + 1] = _mm512_unpackhi_epi32(r[t], r[t + 1]);
  for (int t = 0; t < 16; t += 4) {
    r[t] = _mm512_unpacklo_epi64(u[t], u[t + 2]), r[t + 1] = _mm512_unpackhi_epi64(u[t], u[t + 2]);
    r[t + 2] = _mm512_unpacklo_epi64(u[t + 1], u[t + 3]), r[t + 3] = _mm512_unpackhi_epi64(u[t + 1], u[t + 3]);
  }
  // r[4j + i]: in 128-bit lane L, the words of rows 4j..4j+3 in column 4L + i
  for (int i = 0; i < 4; ++i) {
    const __m512i a = _mm512_shuffle_i32x4(r[i], r[4 + i], 0x88), b = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0x88);
    const __m512i c = _mm512_shuffle_i32x4(r[i], r[4 + i], 0xDD), d = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0xDD);
    u[i] = _mm512_shuffle_i32x4(a, b, 0x88), u[8 + i] = _mm512_shuffle_i32x4(a, b, 0xDD);
    u[4 + i] = _mm512_shuffle_i32x4(c, d, 0x88), u[12 + i] = _mm512_shuffle_i32x4(c, d, 0xDD);
  }
  for (int t = 0; t < 16; ++t) r[t] = u[t];
}

// 16 rows (`stride` elements apart, n of them real, the rest zero) of D bfloat16 as the
// B operand of a product over D: out[r][t] = the dimension pair r of row t, as 32-bit words.
inline void amx_pack_keys(const uint16_t* k, int64_t stride, int64_t n, int64_t D, uint16_t* out) {
  for (int64_t c = 0; c < D / 32; ++c) {  // pairs 16c .. 16c + 15
    __m512i r[16];
    for (int t = 0; t < 16; ++t) r[t] = t < n ? _mm512_loadu_si512(k + t * stride + 32 * c) : _mm512_setzero_si512();
    transpose16(r);
    uint32_t* dst = reinterpret_cast<uint32_t*>(out) + c * 16 * 16;
    for (int t = 0; t < 16; ++t) _mm512_storeu_si512(dst + 16 * t, r[t]);
  }
}

// V^T of 16 value rows (`stride` apart, n real, the rest zero): out[dc][d][t] = row t's
// dimension 16 dc + d, bfloat16.
inline void amx_pack_values_t(const uint16_t* v, int64_t stride, int64_t n, int64_t D, uint16_t* out) {
  for (int64_t dc = 0; dc < D / 16; ++dc) {
    __m512i r[16];
    for (int t = 0; t < 16; ++t)
      r[t] = t < n ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + t * stride + 16 * dc)))
                   : _mm512_setzero_si512();
    transpose16(r);
    for (int d = 0; d < 16; ++d)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (dc * 16 + d) * 16), _mm512_cvtepi32_epi16(r[d]));
  }
}

// One item of up to kTileRows rows of one sequence, every head, computed transposed so
// that the softmax runs across rows in vector lanes: S^T = K Q^T ([16 keys][16 rows] per
// 16-row sub-tile, K read straight from the cache as the A operand), P^T rounded to
// bfloat16 in key pairs, O^T += V^T P^T ([16 dims][16 rows] per 16 columns of head_dim).
// accT: [H][2][D][16], m, l: [H][2][16]. Tiles: 0 / 2 S^T and O^T of sub-tile 0 / 1,
// 1 K, 3 / 4 Q^T, 5 V^T, 6 / 7 P^T.
template <bool kAmx>
void run_item_tiles(const Problem& p, const uint16_t* k_cache, const uint16_t* v_cache, const Item& it,
                    float* accT, float* m, float* l, const TileScratch& sc) {
  const int64_t D = p.head_dim, BS = p.block_size, H = p.num_heads, KVH = p.num_kv_heads, G = H / KVH;
  const int64_t q0 = p.query_start_loc[it.seq];
  const int64_t q_len = p.query_start_loc[it.seq + 1] - q0;
  const int64_t context = p.seq_lens[it.seq] - q_len;
  const int64_t rows = it.row_end - it.row_begin;
  const int64_t subs = rows > 16 ? 2 : 1;
  const int64_t num_keys = context + it.row_end;
  const int32_t* blocks = p.block_table + it.seq * p.block_table_stride;
  const int64_t token_stride = KVH * D;
  std::fill(accT, accT + H * 2 * D * 16, 0.0f);
  std::fill(m, m + H * 2 * 16, kNegBig);
  std::fill(l, l + H * 2 * 16, 0.0f);
  // Q^T per head and sub-tile, scaled, bfloat16, as the B operand of K Q^T
  const __m512 scale = _mm512_set1_ps(p.scale);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t sub = 0; sub < subs; ++sub) {
      const int64_t sub_rows = std::min<int64_t>(16, rows - 16 * sub);
      for (int64_t r = 0; r < sub_rows; ++r) {
        const float* src = p.q + (q0 + it.row_begin + 16 * sub + r) * H * D + h * D;
        for (int64_t d = 0; d < D; d += 16) store16(sc.qh + r * D + d, _mm512_mul_ps(_mm512_loadu_ps(src + d), scale));
      }
      amx_pack_keys(sc.qh, D, sub_rows, D, sc.qt + (h * 2 + sub) * D * 16);
    }
  __m512i row_pos[2];
  __mmask16 row_live[2];
  for (int64_t sub = 0; sub < 2; ++sub) {
    const int64_t sub_rows = std::max<int64_t>(0, std::min<int64_t>(16, rows - 16 * sub));
    row_pos[sub] = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(context + it.row_begin + 16 * sub)),
                                    _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    row_live[sub] = static_cast<__mmask16>((1u << sub_rows) - 1u);
  }
  alignas(64) static const uint16_t pair_idx[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                    8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i pairs = _mm512_load_si512(pair_idx);
#ifdef SCHEDKIT_AMX
  if constexpr (kAmx) amx_configure();
#endif
  for (int64_t g = 0; g < KVH; ++g) {
    for (int64_t base = 0, n = 0; base < num_keys; base += n) {  // chunks of up to 16 keys in one block
      const int64_t in_block = base % BS;
      n = std::min<int64_t>({16, num_keys - base, BS - in_block});
      const int64_t slot0 = static_cast<int64_t>(blocks[base / BS]) * BS + in_block;
      const uint16_t* kp = k_cache + slot0 * token_stride + g * D;
      const uint16_t* vp = v_cache + slot0 * token_stride + g * D;
      const uint16_t* ka = kp;  // the A operand: 16 key rows (a short chunk copied, zero-padded)
      int64_t ka_stride = token_stride;
      if (n < 16) {
        for (int64_t t = 0; t < 16; ++t)
          if (t < n) std::memcpy(sc.kpad + t * D, kp + t * token_stride, D * sizeof(uint16_t));
          else std::memset(sc.kpad + t * D, 0, D * sizeof(uint16_t));
        ka = sc.kpad, ka_stride = D;
      }
      amx_pack_values_t(vp, token_stride, n, D, sc.vt);
      __mmask16 key_live[2][16];
      for (int64_t sub = 0; sub < subs; ++sub)
        for (int64_t t = 0; t < 16; ++t)
          key_live[sub][t] = t < n ? static_cast<__mmask16>(
              row_live[sub] & _mm512_cmpge_epi32_mask(row_pos[sub], _mm512_set1_epi32(static_cast<int>(base + t)))) : 0;
      for (int64_t h = g * G; h < (g + 1) * G; ++h) {
        if constexpr (kAmx) {
#ifdef SCHEDKIT_AMX
          _tile_zero(0);
          _tile_zero(2);
          for (int64_t c = 0; c < D / 32; ++c) {
            _tile_loadd(1, ka + 32 * c, ka_stride * sizeof(uint16_t));
            _tile_loadd(3, sc.qt + (h * 2) * D * 16 + c * 16 * 16 * 2, 64);
            _tile_dpbf16ps(0, 1, 3);
            if (subs == 2) {
              _tile_loadd(4, sc.qt + (h * 2 + 1) * D * 16 + c * 16 * 16 * 2, 64);
              _tile_dpbf16ps(2, 1, 4);
            }
          }
          _tile_stored(0, sc.s, 64);
          if (subs == 2) _tile_stored(2, sc.s + 256, 64);
#endif
        } else {
          for (int64_t sub = 0; sub < subs; ++sub)
            dp_scores_t(ka, ka_stride, sc.qt + (h * 2 + sub) * D * 16, D, sc.s + 256 * sub);
        }
        __m512 alpha[2];
        for (int64_t sub = 0; sub < subs; ++sub) {  // the online softmax, 16 rows per vector
          const float* st = sc.s + 256 * sub;
          float* ms = m + (h * 2 + sub) * 16;
          float* ls = l + (h * 2 + sub) * 16;
          const __m512 m_old = _mm512_loadu_ps(ms);
          __m512 m_new = m_old;
          for (int64_t t = 0; t < n; ++t) m_new = _mm512_mask_max_ps(m_new, key_live[sub][t], m_new, _mm512_loadu_ps(st + 16 * t));
          alpha[sub] = exp16(_mm512_sub_ps(m_old, m_new));
          __m512 sum = _mm512_setzero_ps();
          uint16_t* pt = sc.pt + 256 * sub;  // [8 key pairs][16 rows][2]
          for (int64_t t = 0; t < 16; t += 2) {
            __m512 p0 = _mm512_setzero_ps(), p1 = _mm512_setzero_ps();
            if (t < n) p0 = round16(_mm512_maskz_mov_ps(key_live[sub][t], exp16_bf16(_mm512_sub_ps(_mm512_loadu_ps(st + 16 * t), m_new))));
            if (t + 1 < n) p1 = round16(_mm512_maskz_mov_ps(key_live[sub][t + 1], exp16_bf16(_mm512_sub_ps(_mm512_loadu_ps(st + 16 * (t + 1)), m_new))));
            sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
            const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);  // p0's 16 then p1's 16
            _mm512_storeu_si512(pt + t * 16, _mm512_permutexvar_epi16(pairs, both));
          }
          _mm512_storeu_ps(ms, m_new);
          _mm512_storeu_ps(ls, _mm512_fmadd_ps(_mm512_loadu_ps(ls), alpha[sub], sum));
        }
        if constexpr (!kAmx) {
          for (int64_t dc = 0; dc < D / 16; ++dc)
            for (int64_t sub = 0; sub < subs; ++sub)
              dp_values_t(sc.vt + dc * 256, sc.pt + 256 * sub, alpha[sub],
                          accT + ((h * 2 + sub) * D + 16 * dc) * 16);
          continue;
        }
#ifdef SCHEDKIT_AMX
        _tile_loadd(6, sc.pt, 64);
        if (subs == 2) _tile_loadd(7, sc.pt + 256, 64);
        for (int64_t dc = 0; dc < D / 16; ++dc) {
          _tile_loadd(5, sc.vt + dc * 256, 32);
          _tile_zero(0);
          _tile_dpbf16ps(0, 5, 6);
          if (subs == 2) {
            _tile_zero(2);
            _tile_dpbf16ps(2, 5, 7);
          }
          _tile_stored(0, sc.pv, 64);
          if (subs == 2) _tile_stored(2, sc.pv + 256, 64);
          for (int64_t sub = 0; sub < subs; ++sub) {
            float* o = accT + ((h * 2 + sub) * D + 16 * dc) * 16;
            for (int64_t d = 0; d < 16; ++d)
              _mm512_storeu_ps(o + 16 * d, _mm512_fmadd_ps(_mm512_loadu_ps(o + 16 * d), alpha[sub],
                                                           _mm512_loadu_ps(sc.pv + 256 * sub + 16 * d)));
          }
        }
#endif
      }
    }
  }
#ifdef SCHEDKIT_AMX
  if constexpr (kAmx) _tile_release();
#endif
  std::vector<float> out(16 * H * D);  // rows [row][head][D] of O^T / l, 16 at a time
  for (int64_t sub = 0; sub < subs; ++sub) {
    for (int64_t h = 0; h < H; ++h) {
      const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_loadu_ps(l + (h * 2 + sub) * 16));
      for (int64_t dc = 0; dc < D / 16; ++dc) {
        __m512i r[16];
        const float* o = accT + ((h * 2 + sub) * D + 16 * dc) * 16;
        for (int d = 0; d < 16; ++d) r[d] = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(o + 16 * d), inv));
        transpose16(r);
        for (int j = 0; j < 16; ++j) _mm512_storeu_si512(out.data() + (j * H + h) * D + 16 * dc, r[j]);
      }
    }
    const int64_t sub_rows = std::min<int64_t>(16, rows - 16 * sub);
    store_row(p.out, p.out_dtype, (q0 + it.row_begin + 16 * sub) * H * D, out.data(), sub_rows * H * D);
  }
}
#endif

// The item path for this head_dim and cache dtype.
template <typename KT>
void dispatch_item(const Problem& p, const KT* k_cache, const KT* v_cache, const Item& it, float* qbuf,
                   float* acc, float* m, float* l, float* kb, float* vb, float* s, uint16_t* qbh) {
#ifdef SCHEDKIT_AVX512
  switch (p.head_dim) {
    case 32: return run_item_avx512<KT, 2>(p, k_cache, v_cache, it, qbuf, acc, m, l, kb, vb, s, qbh);
    case 64: return run_item_avx512<KT, 4>(p, k_cache, v_cache, it, qbuf, acc, m, l, kb, vb, s, qbh);
    case 128: return run_item_avx512<KT, 8>(p, k_cache, v_cache, it, qbuf, acc, m, l, kb, vb, s, qbh);
    default: break;
  }
#else
  (void)qbh;
#endif
  run_item(p, k_cache, v_cache, it, qbuf, acc, m, l, kb, vb, s);
}

// This step's fused q/k/v projection, before attention: RoPE on q and k (neox layout,
// tables of D columns per position), q kept for attention, k and v written to their
// cache slots in the cache's dtype.
struct RopeStore {
  const void* qkv;
  int qkv_dtype;  // 0 float32, 1 bfloat16
  int64_t qkv_stride;
  const int64_t* positions;
  const float* cos;
  const float* sin;
  const int64_t* slot_mapping;
  int64_t num_tokens;
  int64_t num_positions;  // rows of the cos / sin tables
};

inline void rope(const float* x, const float* cos, const float* sin, int64_t D, float* out) {
  const int64_t half = D / 2;
  for (int64_t j = 0; j < half; ++j) {
    out[j] = x[j] * cos[j] - x[j + half] * sin[j];
    out[j + half] = x[j + half] * cos[j + half] + x[j] * sin[j + half];
  }
}

// tmp: D floats, wide: (H + 2 KVH) * D floats (a bfloat16 row widened)
template <typename KT>
void rope_store_token(const Problem& p, const RopeStore& rs, KT* k_cache, KT* v_cache, int64_t t,
                      float* tmp, float* wide) {
  const int64_t D = p.head_dim, H = p.num_heads, KVH = p.num_kv_heads;
  const float* row;
  if (rs.qkv_dtype == 0) {
    row = static_cast<const float*>(rs.qkv) + t * rs.qkv_stride;
  } else {
    widen(static_cast<const uint16_t*>(rs.qkv) + t * rs.qkv_stride, (H + 2 * KVH) * D, wide);
    row = wide;
  }
  const float* cos = rs.cos + rs.positions[t] * D;
  const float* sin = rs.sin + rs.positions[t] * D;
  for (int64_t h = 0; h < H; ++h) rope(row + h * D, cos, sin, D, p.q + (t * H + h) * D);
  const int64_t slot = rs.slot_mapping[t];
  KT* kdst = k_cache + slot * KVH * D;
  for (int64_t h = 0; h < KVH; ++h) {
    rope(row + (H + h) * D, cos, sin, D, tmp);
    store_as(kdst + h * D, tmp, D);
  }
  store_as(v_cache + slot * KVH * D, row + (H + KVH) * D, KVH * D);
}

#ifdef SCHEDKIT_TILES
constexpr int64_t kTileItemRows = kTileRows;
#else
constexpr int64_t kTileItemRows = 1;
#endif
enum class Tiles { kNone, kDot, kAmx };
// Which tile engine runs this problem's prefill items (chunks of 16+ rows): bfloat16
// caches, head_dim a multiple of 32 (at most 256); AMX where enabled
// (schedkit_amx_enable), else vdpbf16ps where enabled (schedkit_bf16_tiles_enable).
template <typename KT>
Tiles tile_engine(const Problem& p) {
#ifdef SCHEDKIT_TILES
  if (!std::is_same_v<KT, uint16_t> || p.head_dim % 32 != 0 || p.head_dim > 256) return Tiles::kNone;
#ifdef SCHEDKIT_AMX
  if (g_amx.load(std::memory_order_relaxed)) return Tiles::kAmx;
#endif
  return g_dp_tiles.load(std::memory_order_relaxed) ? Tiles::kDot : Tiles::kNone;
#else
  (void)p;
  return Tiles::kNone;
#endif
}

template <typename KT>
void run(const Problem& p, KT* k_cache, KT* v_cache, const int32_t* seqs, int64_t num_seqs,
         int64_t rows_per_item, int num_threads, const RopeStore* rs) {
  std::vector<Item> items;
  const Tiles tiles = tile_engine<KT>(p);
  const bool tiled = tiles != Tiles::kNone;
  // float32 tiles: every prefill chunk of kFloatTileMinRows+ rows that no bfloat16 engine takes
  const bool float_tiled = !tiled && float_tiles_fit(p);
  auto float_item = [&](int64_t q_len) { return float_tiled && q_len >= kFloatTileMinRows; };
  // their sequences' keys and values, laid out once for every item: (sequence, offset)
  std::vector<std::pair<int32_t, int64_t>> layouts;
  int64_t layout_size = 0;
  for (int64_t j = 0; j < num_seqs; ++j) {
    const int32_t seq = seqs ? seqs[j] : static_cast<int32_t>(j);
    const int32_t q_len = p.query_start_loc[seq + 1] - p.query_start_loc[seq];
    const int32_t step = static_cast<int32_t>(tiled && q_len >= 16 ? kTileItemRows
                                              : float_item(q_len)    ? kFloatTileRows
                                                                     : rows_per_item);
    const int64_t layout = float_item(q_len) ? static_cast<int64_t>(layouts.size()) : -1;
    if (layout >= 0) {
      layouts.push_back({seq, layout_size});
      layout_size += p.num_kv_heads * float_tile_head_size(p.seq_lens[seq], p.head_dim);
    }
    for (int32_t r = 0; r < q_len; r += step) items.push_back({seq, r, std::min<int32_t>(q_len, r + step), layout});
  }
  // every float of it is written by float_tile_layout, so it is not zero-filled first
  const std::unique_ptr<float[]> layout(layout_size > 0 ? new float[layout_size] : nullptr);
  const int64_t layout_work = static_cast<int64_t>(layouts.size()) * p.num_kv_heads;
  // longest items first: tiles late in a long sequence see the most keys
  auto keys = [&](const Item& a) {
    return p.seq_lens[a.seq] - (p.query_start_loc[a.seq + 1] - p.query_start_loc[a.seq]) + a.row_end;
  };
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) { return keys(a) > keys(b); });
  const int64_t D = p.head_dim, BS = p.block_size;
  const int64_t nq = rows_per_item * p.num_heads;
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t work = std::max(rs ? std::max(n_items, rs->num_tokens) : n_items, layout_work);
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, work)));
#pragma omp parallel num_threads(threads)
  {
    const int64_t block_elems = BS * p.num_kv_heads * D;
    const int64_t row_elems = (p.num_heads + 2 * p.num_kv_heads) * D;
    const int64_t s_elems = std::max<int64_t>(BS, 16);
    std::vector<float> buf(2 * nq * D + 2 * nq + 2 * block_elems + s_elems + D + row_elems + nq * D / 2 + 16);
#ifdef SCHEDKIT_TILES
    std::vector<float> tile_acc, tile_ml;
    std::vector<uint16_t> tile_buf;
    TileScratch tile_sc{};
    if (tiled) {
      tile_acc.resize(p.num_heads * 2 * D * 16);
      tile_ml.resize(2 * p.num_heads * 2 * 16);
      tile_buf.resize(16 * D + p.num_heads * 2 * D * 16 + 16 * D + D * 16 + 2 * 256 + 64);
      tile_sc.qh = tile_buf.data();
      tile_sc.qt = tile_sc.qh + 16 * D;
      tile_sc.kpad = tile_sc.qt + p.num_heads * 2 * D * 16;
      tile_sc.vt = tile_sc.kpad + 16 * D;
      tile_sc.pt = tile_sc.vt + D * 16;
    }
    alignas(64) float tile_s[512], tile_pv[512];
    tile_sc.s = tile_s, tile_sc.pv = tile_pv;
#endif
    std::vector<float> ft_buf;
    FloatTileScratch ft{};
    if (float_tiled) {
      const int64_t nqp = float_tile_vectors(kFloatTileRows, p.num_heads / p.num_kv_heads);
      ft_buf.resize(2 * nqp * D + 5 * nqp + nqp * kSpan + kFloatTileRows * p.num_heads * D);
      ft.q = ft_buf.data(), ft.acc = ft.q + nqp * D, ft.m = ft.acc + nqp * D, ft.l = ft.m + nqp;
      ft.alpha = ft.l + nqp, ft.pos = reinterpret_cast<int32_t*>(ft.alpha + nqp);
      ft.vis = ft.pos + nqp, ft.s = ft.alpha + 3 * nqp, ft.rows = ft.s + nqp * kSpan;
    }
    float* qbuf = buf.data();
    float* acc = qbuf + nq * D;
    float* m = acc + nq * D;
    float* l = m + nq;
    float* kb = l + nq;
    float* vb = kb + block_elems;
    float* s = vb + block_elems;
    float* tmp = s + s_elems;
    float* wide = tmp + D;
    uint16_t* qbh = reinterpret_cast<uint16_t*>(wide + row_elems);  // nq * D bfloat16
    if (rs) {
#pragma omp for schedule(static)
      for (int64_t t = 0; t < rs->num_tokens; ++t) rope_store_token(p, *rs, k_cache, v_cache, t, tmp, wide);
    }  // the implicit barrier: every key is in the cache before any item reads it
    if (layout_work > 0) {
#pragma omp for schedule(dynamic, 1)
      for (int64_t w = 0; w < layout_work; ++w) {
        const auto& [seq, offset] = layouts[w / p.num_kv_heads];
        float_tile_layout(p, k_cache, v_cache, seq, w % p.num_kv_heads, layout.get() + offset, tmp);
      }
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < n_items; ++w) {
#ifdef SCHEDKIT_TILES
      if constexpr (std::is_same_v<KT, uint16_t>) {
        const Item& it = items[w];
        if (tiled && p.query_start_loc[it.seq + 1] - p.query_start_loc[it.seq] >= 16) {
          float* ml = tile_ml.data();
          if (tiles == Tiles::kAmx)
            run_item_tiles<true>(p, k_cache, v_cache, it, tile_acc.data(), ml, ml + p.num_heads * 2 * 16, tile_sc);
          else
            run_item_tiles<false>(p, k_cache, v_cache, it, tile_acc.data(), ml, ml + p.num_heads * 2 * 16, tile_sc);
          continue;
        }
      }
#endif
      const Item& it = items[w];
      if (it.layout >= 0) {
        run_item_float_tiles(p, layout.get() + layouts[it.layout].second, it, ft);
        continue;
      }
      dispatch_item(p, k_cache, v_cache, it, qbuf, acc, m, l, kb, vb, s, qbh);
    }
  }
}

int attention(const Problem& p, void* k_cache, void* v_cache, const int32_t* seqs, int64_t num_seqs,
              int dtype, int64_t rows_per_item, int num_threads, const RopeStore* rs) {
  if (p.num_kv_heads <= 0 || p.num_heads % p.num_kv_heads != 0) return -2;
  if (p.head_dim % 8 != 0) return -3;
  // every index the kernel will follow, checked before anything is written
  for (int64_t j = 0; j < num_seqs; ++j) {
    const int32_t seq = seqs ? seqs[j] : static_cast<int32_t>(j);
    const int64_t q_len = p.query_start_loc[seq + 1] - p.query_start_loc[seq];
    const int64_t seq_len = p.seq_lens[seq];
    if (q_len < 0 || seq_len < q_len) return -7;
    const int64_t nb = (seq_len + p.block_size - 1) / p.block_size;
    if (q_len > 0 && nb > p.block_table_stride) return -4;
    for (int64_t b = 0; q_len > 0 && b < nb; ++b) {
      const int32_t id = p.block_table[seq * p.block_table_stride + b];
      if (id < 0 || id >= p.num_cache_blocks) return -4;
    }
  }
  if (rs)
    for (int64_t t = 0; t < rs->num_tokens; ++t) {
      if (rs->slot_mapping[t] < 0 || rs->slot_mapping[t] >= p.num_cache_blocks * p.block_size) return -5;
      if (rs->positions[t] < 0 || rs->positions[t] >= rs->num_positions) return -6;
    }
  rows_per_item = std::max<int64_t>(1, rows_per_item);
  switch (dtype) {
    case 0:
      run(p, static_cast<float*>(k_cache), static_cast<float*>(v_cache), seqs, num_seqs, rows_per_item,
          num_threads, rs);
      return 0;
    case 1:
      run(p, static_cast<uint16_t*>(k_cache), static_cast<uint16_t*>(v_cache), seqs, num_seqs,
          rows_per_item, num_threads, rs);
      return 0;
#ifdef SCHEDKIT_HAVE_FLOAT16
    case 2:
      run(p, static_cast<_Float16*>(k_cache), static_cast<_Float16*>(v_cache), seqs, num_seqs,
          rows_per_item, num_threads, rs);
      return 0;
#endif
    default:
      return -1;
  }
}

#ifdef SCHEDKIT_AVX512
// One row of schedkit_add_rms_norm, 16 columns at a time (dim % 16 == 0). T: the
// activations' type; bfloat16 rounds the sum and the normalised row as torch does.
template <typename T>
void add_rms_norm_row(const T* x, T* res, const float* weight, T* out, int64_t dim, float eps, float* sum) {
  constexpr bool kBf16 = std::is_same_v<T, uint16_t>;
  __m512 ss = _mm512_setzero_ps();
  for (int64_t i = 0; i < dim; i += 16) {
    __m512 v = load16(x + i);
    if (res) {
      v = _mm512_add_ps(v, load16(res + i));
      if constexpr (kBf16) v = round16(v);
      store16(res + i, v);
    }
    _mm512_storeu_ps(sum + i, v);
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(dim) + eps));
  for (int64_t i = 0; i < dim; i += 16) {
    __m512 n = _mm512_mul_ps(_mm512_loadu_ps(sum + i), inv);
    if constexpr (kBf16) n = round16(n);
    store16(out + i, _mm512_mul_ps(_mm512_loadu_ps(weight + i), n));
  }
}

// One row of schedkit_silu_and_mul, 16 columns at a time (dim % 16 == 0).
template <typename T>
void silu_and_mul_row(const T* g, const T* u, T* out, int64_t dim) {
  for (int64_t i = 0; i < dim; i += 16) {
    const __m512 gv = load16(g + i);
    const __m512 e = exp16(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv), _mm512_set1_ps(80.0f)));
    __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    silu = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(gv, _mm512_set1_ps(-80.0f), _CMP_GE_OQ), silu);
    if constexpr (std::is_same_v<T, uint16_t>) silu = round16(silu);
    store16(out + i, _mm512_mul_ps(silu, load16(u + i)));
  }
}
#endif

}  // namespace

namespace {

// One activation row times a weight matrix (a decode step of one sequence): out[n] =
// sum_k x[k] * W[n, k] (+ bias[n]). At one row the product is bound by reading W, and
// oneDNN's matmul spends about 15 us a call before it starts; this loop streams W once,
// in the layout schedkit.runners.paged.cpu_linear packs it in:
//   float32:  [N / 16, K, 16]         (16 outputs' weights for each k, side by side)
//   bfloat16: [N / 16, K / 2, 16, 2]  (pairs along k, as vdpbf16ps takes them)
// Each iteration computes two blocks of 16 outputs half the matrix apart: two streams
// through memory keep more reads in flight than one (an LM head of 49,152 x 576 in
// bfloat16 on one core: 4.4 ms, against 5.6 with one stream and 4.8 by oneDNN), each
// prefetched 4 KB ahead into L2. Two accumulators per block break the dependency chain.
// Float32 arithmetic; a bfloat16 result is rounded to nearest even.

// The blocks of 16 outputs over the threads, two half the matrix apart per call of
// two_blocks(a, b); an odd last block alone (a == b).
template <typename F>
void gemv_split(int64_t blocks, int threads, F two_blocks) {
  const int64_t half = blocks / 2;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < half + (blocks & 1); ++i) {
    if (i < half) two_blocks(i, i + half);
    else two_blocks(blocks - 1, blocks - 1);
  }
}

#ifdef SCHEDKIT_AVX512
template <typename T>
inline void gemv_store(T* o, const T* bias, int64_t block, __m512 acc) {
  if (bias != nullptr) acc = _mm512_add_ps(acc, load16(bias + block * 16));
  store16(o + block * 16, acc);
}

// One step of a block of 16 outputs: acc += x[k] * W[k] for one k (float32) or a pair
// of k (kPair: bfloat16, vdpbf16ps); w points at the block's packed weights.
template <typename T, bool kPair>
inline __m512 gemv_step(const T* x, const T* w, int64_t i, __m512 acc) {
  if constexpr (kPair) {
#ifdef SCHEDKIT_AVX512_BF16
    const __m512bh xi = (__m512bh)_mm512_broadcastss_ps(_mm_load_ss(reinterpret_cast<const float*>(x + 2 * i)));
    return _mm512_dpbf16_ps(acc, xi, (__m512bh)_mm512_loadu_si512(w + i * 32));
#else
    (void)x; (void)w; (void)i;
    return acc;
#endif
  } else {
    return _mm512_fmadd_ps(_mm512_set1_ps(x[i]), _mm512_loadu_ps(w + i * 16), acc);
  }
}

// Two blocks (a, b) of 16 outputs at once, two steps at a time.
template <typename T, bool kPair>
inline void gemv_two_blocks(const T* x, const T* w, int64_t K, int64_t a, int64_t b, const T* bias, T* o) {
  constexpr int64_t kStride = kPair ? 32 : 16;  // elements of W per step
  const T* wa = w + a * K * 16;
  const T* wb = w + b * K * 16;
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  const int64_t steps = kPair ? K / 2 : K;
  int64_t i = 0;
  for (; i + 2 <= steps; i += 2) {
    _mm_prefetch(reinterpret_cast<const char*>(wa + i * kStride) + 4096, _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(wb + i * kStride) + 4096, _MM_HINT_T1);
    a0 = gemv_step<T, kPair>(x, wa, i, a0);
    a1 = gemv_step<T, kPair>(x, wa, i + 1, a1);
    b0 = gemv_step<T, kPair>(x, wb, i, b0);
    b1 = gemv_step<T, kPair>(x, wb, i + 1, b1);
  }
  if (i < steps) {  // an odd number of steps
    a0 = gemv_step<T, kPair>(x, wa, i, a0);
    b0 = gemv_step<T, kPair>(x, wb, i, b0);
  }
  gemv_store(o, bias, a, _mm512_add_ps(a0, a1));
  if (b != a) gemv_store(o, bias, b, _mm512_add_ps(b0, b1));
}

template <typename T, bool kPair>
void gemv_run(const T* x, const T* w, int64_t K, int64_t blocks, const T* bias, T* o, int threads) {
  gemv_split(blocks, threads, [&](int64_t a, int64_t b) { gemv_two_blocks<T, kPair>(x, w, K, a, b, bias, o); });
}
#elif defined(__AVX2__) && defined(__FMA__)
// float32 on AVX2: the same layout and the same two streams, each block of 16 outputs
// in two 8-wide halves, two accumulators per half (even and odd k).
#define SCHEDKIT_GEMV_AVX2 1
inline void gemv_store8x2(float* o, const float* bias, int64_t block, v8f lo, v8f hi) {
  if (bias != nullptr) lo += load8(bias + block * 16), hi += load8(bias + block * 16 + 8);
  store8(o + block * 16, lo);
  store8(o + block * 16 + 8, hi);
}

inline void gemv_two_blocks_avx2(const float* x, const float* w, int64_t K, int64_t a, int64_t b,
                                 const float* bias, float* o) {
  const float* wa = w + a * K * 16;
  const float* wb = w + b * K * 16;
  v8f a0 = {}, a1 = {}, a2 = {}, a3 = {}, b0 = {}, b1 = {}, b2 = {}, b3 = {};
  int64_t i = 0;
  for (; i + 2 <= K; i += 2) {
    _mm_prefetch(reinterpret_cast<const char*>(wa + i * 16) + 4096, _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(wb + i * 16) + 4096, _MM_HINT_T1);
    const float x0 = x[i], x1 = x[i + 1];
    const float* pa = wa + i * 16;
    const float* pb = wb + i * 16;
    a0 += x0 * load8(pa), a1 += x0 * load8(pa + 8), a2 += x1 * load8(pa + 16), a3 += x1 * load8(pa + 24);
    b0 += x0 * load8(pb), b1 += x0 * load8(pb + 8), b2 += x1 * load8(pb + 16), b3 += x1 * load8(pb + 24);
  }
  if (i < K) {  // an odd K
    a0 += x[i] * load8(wa + i * 16), a1 += x[i] * load8(wa + i * 16 + 8);
    b0 += x[i] * load8(wb + i * 16), b1 += x[i] * load8(wb + i * 16 + 8);
  }
  gemv_store8x2(o, bias, a, a0 + a2, a1 + a3);
  if (b != a) gemv_store8x2(o, bias, b, b0 + b2, b1 + b3);
}

void gemv_run_avx2(const float* x, const float* w, int64_t K, int64_t blocks, const float* bias, float* o,
                   int threads) {
  gemv_split(blocks, threads, [&](int64_t a, int64_t b) { gemv_two_blocks_avx2(x, w, K, a, b, bias, o); });
}

#endif

#if defined(__AVX2__) && defined(__FMA__)
// Built wherever AVX2 and FMA are, AVX-512 builds included: whether it or oneDNN takes
// several rows on a given machine is decided at run time (cpu_linear.multi_row_gemm).
#define SCHEDKIT_GEMM_AVX2 1

// Several rows (a prefill chunk, a decode batch) times the same packed float32 weight,
// out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]). oneDNN reaches 60-65% of this AVX2
// core's FMA peak at SmolLM2's shapes (128 x 576 x 3072: 106 GFLOP/s on two cores); a
// tile of 6 rows x 16 outputs keeps 12 accumulators in registers, each k step reading
// one row of the block's packed weights (two vectors) and broadcasting 6 activations.
// Blocking as in BLIS: the rows in panels of kGemmRowPanel, k in chunks of at most
// kGemmMaxChunk; each thread copies a panel's chunk of x into tiles of 6 rows interleaved
// along k (one stream from L2 instead of six), then for each of its 16-output blocks runs every tile
// over the block's weights of the chunk (from L2 at these sizes: at SmolLM2's K of 576
// one chunk of 36 KB per block was 4-19% faster than two that fit L1, as each extra
// chunk reads and writes the panel's outputs again). The blocks go to the threads in
// groups of kGemmGroup handed out as each thread finishes its last, so a thread that
// another process holds up on its core leaves its share to the others (on two Zen 3
// cores with a process busy 20% of the time on one: a 128-token prefill step of
// SmolLM2 220.5 instead of 232.8 ms; the same 174-175 ms on a quiet machine). Each
// output is still summed by one thread per chunk, the chunks in order: the same bits on
// any thread count.
constexpr int kGemmTileRows = 6;
constexpr int64_t kGemmGroup = 2;
constexpr int64_t kGemmRowPanel = 144;
constexpr int64_t kGemmMaxChunk = 768;

// R rows over k in [0, kc) of one block: xp the rows' packed chunk ([kc][R]), w the
// block's packed weights from the chunk's first k; the accumulators start at zero (first
// chunk) or from o; bias added on the last chunk.
template <int R>
inline void gemm_tile_avx2(const float* xp, const float* w, int64_t kc, float* o, int64_t ldo, bool first,
                           const float* bias, const float* next) {
  __m256 lo[R], hi[R];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    lo[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(o + r * ldo);
    hi[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(o + r * ldo + 8);
  }
  for (int64_t k = 0; k < kc; ++k) {
    if (next != nullptr) _mm_prefetch(reinterpret_cast<const char*>(next + k * 16), _MM_HINT_T0);
    const __m256 b0 = _mm256_loadu_ps(w + k * 16), b1 = _mm256_loadu_ps(w + k * 16 + 8);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(xp + k * R + r);
      lo[r] = _mm256_fmadd_ps(a, b0, lo[r]);
      hi[r] = _mm256_fmadd_ps(a, b1, hi[r]);
    }
  }
  if (bias != nullptr) {
    const __m256 bl = _mm256_loadu_ps(bias), bh = _mm256_loadu_ps(bias + 8);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) lo[r] = _mm256_add_ps(lo[r], bl), hi[r] = _mm256_add_ps(hi[r], bh);
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(o + r * ldo, lo[r]);
    _mm256_storeu_ps(o + r * ldo + 8, hi[r]);
  }
}

using GemmTile = void (*)(const float*, const float*, int64_t, float*, int64_t, bool, const float*, const float*);
constexpr GemmTile kGemmTiles[kGemmTileRows + 1] = {nullptr, gemm_tile_avx2<1>, gemm_tile_avx2<2>, gemm_tile_avx2<3>,
                                               gemm_tile_avx2<4>, gemm_tile_avx2<5>, gemm_tile_avx2<6>};

void gemm_run_avx2(const float* x, int64_t M, int64_t ldx, const float* w, int64_t K, int64_t blocks,
                   const float* bias, float* o, int threads) {
  const int64_t chunks = (K + kGemmMaxChunk - 1) / kGemmMaxChunk;
  const int64_t kc_max = (K + chunks - 1) / chunks;  // even chunks: 1536 -> 768 + 768
  // the panel's copy, shared by the threads, kept by the calling thread from call to call
  static thread_local std::vector<float> panel;
  if (panel.size() < static_cast<size_t>(std::min(M, kGemmRowPanel) * kc_max))
    panel.resize(static_cast<size_t>(std::min(M, kGemmRowPanel) * kc_max));
  float* const packed = panel.data();
#pragma omp parallel num_threads(threads)
  {
    const int64_t groups = (blocks + kGemmGroup - 1) / kGemmGroup;
    for (int64_t m0 = 0; m0 < M; m0 += kGemmRowPanel) {
      const int64_t m1 = std::min(M, m0 + kGemmRowPanel);
      for (int64_t k0 = 0; k0 < K; k0 += kc_max) {
        const int64_t kc = std::min(kc_max, K - k0);
        const bool first = k0 == 0, last = k0 + kc == K;
#pragma omp barrier  // nobody still reads the last chunk's copy
#pragma omp for schedule(static)  // (its implicit barrier: the copy is whole before use)
        for (int64_t m = m0; m < m1; m += kGemmTileRows) {  // the tiles of the panel's chunk, [kc][rows] each
          const int64_t rows = std::min<int64_t>(kGemmTileRows, m1 - m);
          float* dst = packed + (m - m0) * kc;
          for (int64_t k = 0; k < kc; ++k)
            for (int64_t r = 0; r < rows; ++r) dst[k * rows + r] = x[(m + r) * ldx + k0 + k];
        }
#pragma omp for schedule(dynamic, 1) nowait  // (the next chunk starts with a barrier)
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t nb0 = g * kGemmGroup, nb1 = std::min(blocks, nb0 + kGemmGroup);
          for (int64_t nb = nb0; nb < nb1; ++nb) {
            const float* wk = w + nb * K * 16 + k0 * 16;
            const float* bk = last && bias != nullptr ? bias + nb * 16 : nullptr;
            for (int64_t m = m0; m < m1; m += kGemmTileRows) {
              const int rows = static_cast<int>(std::min<int64_t>(kGemmTileRows, m1 - m));
              // the first tile of a block fetches the next block's weights of the chunk (a
              // few rows leave the weights bound by memory)
              const float* next = m == m0 && nb + 1 < nb1 ? wk + K * 16 : nullptr;
              kGemmTiles[rows](packed + (m - m0) * kc, wk, kc, o + m * blocks * 16 + nb * 16, blocks * 16,
                               first, bk, next);
            }
          }
        }
      }
    }
  }
}
#endif

}  // namespace

extern "C" {

// dtype: 0 float32, 1 bfloat16, 2 float16 (of the caches). Each returns 0, or before
// touching anything -1 for a dtype this build lacks, -2 for heads that do not divide
// into KV heads, -3 for a head_dim that is not a multiple of 8, -4 for a block id
// outside the cache (or a table too short for seq_len), -5 for a slot outside the
// cache, -6 for a position outside the RoPE tables, -7 for lengths that do not add up.
// seqs: the sequences to attend (NULL: all num_seqs).

// Prefill tiles on AMX (bfloat16 caches): on = 1 asks the kernel for the tile state
// (arch_prctl ARCH_REQ_XCOMP_PERM) and turns them on where it is granted; 0 turns them
// off. Returns whether they are on. A build without AMX always returns 0.
int schedkit_amx_enable(int on) {
#ifdef SCHEDKIT_AMX
  if (!on) {
    g_amx.store(false);
    return 0;
  }
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  const bool granted = syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  g_amx.store(granted);
  return granted ? 1 : 0;
#else
  (void)on;
  return 0;
#endif
}

// Prefill tiles by vdpbf16ps (AVX512-BF16, bfloat16 caches), used where AMX is not:
// on = 1 turns them on (the default), 0 off. Returns whether they are on; a build without
// AVX512-BF16 always returns 0.
int schedkit_bf16_tiles_enable(int on) {
#ifdef SCHEDKIT_TILES
  g_dp_tiles.store(on != 0);
  return on != 0 ? 1 : 0;
#else
  (void)on;
  return 0;
#endif
}

// The float32 prefill tiles (every cache dtype where no bfloat16 tile engine runs): on = 1
// turns them on (the default), 0 off. Returns whether they are on.
int schedkit_float_tiles_enable(int on) {
  g_float_tiles.store(on != 0);
  return on != 0 ? 1 : 0;
}

// Bit 0: float16 caches are supported (the compiler has _Float16). Bit 1: the one-row
// GEMM (schedkit_gemm, M = 1) takes float32 weights (AVX-512, or AVX2 with FMA); bit 2:
// bfloat16 (AVX512-BF16); bit 3: schedkit_gemm takes several float32 rows (AVX2 with FMA,
// AVX-512 builds included).
int schedkit_kernel_features() {
  int bits = 0;
#ifdef SCHEDKIT_HAVE_FLOAT16
  bits |= 1;
#endif
#if defined(SCHEDKIT_AVX512) || defined(SCHEDKIT_GEMV_AVX2)
  bits |= 2;
#endif
#ifdef SCHEDKIT_AVX512_BF16
  bits |= 4;
#endif
#ifdef SCHEDKIT_GEMM_AVX2
  bits |= 8;
#endif
  return bits;
}

// Attention of q (already rotated) over the caches.
int schedkit_paged_attention(const float* q, const void* k_cache, const void* v_cache, float* out,
                             const int32_t* query_start_loc, const int32_t* seq_lens,
                             const int32_t* block_table, int64_t block_table_stride,
                             const int32_t* seqs, int64_t num_seqs, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                             int dtype, int64_t rows_per_item, int num_threads,
                             int64_t num_cache_blocks) {
  Problem p{const_cast<float*>(q), out, query_start_loc, seq_lens, block_table, block_table_stride,
            num_heads, num_kv_heads, head_dim, block_size, scale, num_cache_blocks, 0};
  return attention(p, const_cast<void*>(k_cache), const_cast<void*>(v_cache), seqs, num_seqs, dtype,
                   rows_per_item, num_threads, nullptr);
}

// One layer's attention from its q/k/v projection ([T, qkv_stride] in qkv_dtype, 0
// float32 or 1 bfloat16; q then k then v heads): RoPE, q kept in q_buf ([T, H, D]
// float32, may be out when out is float32), k and v stored at slot_mapping, attention;
// out [T, H, D] in out_dtype. seqs: the sequences to attend (NULL: all num_seqs; every
// token's k and v are stored either way).
int schedkit_rope_store_attention(const void* qkv, int qkv_dtype, int64_t qkv_stride,
                                  const int64_t* positions, const float* cos, const float* sin,
                                  const int64_t* slot_mapping, int64_t num_tokens, void* k_cache,
                                  void* v_cache, float* q_buf, void* out, int out_dtype,
                                  const int32_t* query_start_loc, const int32_t* seq_lens,
                                  const int32_t* block_table, int64_t block_table_stride,
                                  const int32_t* seqs, int64_t num_seqs, int64_t num_heads,
                                  int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                  float scale, int dtype, int64_t rows_per_item, int num_threads,
                                  int64_t num_cache_blocks, int64_t num_positions) {
  if ((qkv_dtype != 0 && qkv_dtype != 1) || (out_dtype != 0 && out_dtype != 1)) return -1;
  Problem p{q_buf, out, query_start_loc, seq_lens, block_table, block_table_stride, num_heads,
            num_kv_heads, head_dim, block_size, scale, num_cache_blocks, out_dtype};
  RopeStore rs{qkv, qkv_dtype, qkv_stride, positions, cos, sin, slot_mapping, num_tokens, num_positions};
  return attention(p, k_cache, v_cache, seqs, num_seqs, dtype, rows_per_item, num_threads, &rs);
}

// Activations are float32 (dtype 0) or bfloat16 (1); arithmetic is float32. With
// bfloat16, results are rounded where a bfloat16 model in torch rounds them (after each
// op), so that greedy decisions follow transformers' bfloat16 ones.

inline float round_bf16(float f) {
  const uint32_t w = static_cast<uint32_t>(to_bf16(f)) << 16;
  float r;
  std::memcpy(&r, &w, sizeof r);
  return r;
}

// RMSNorm of each row: with `residual` (in x's dtype), first residual += x in place and
// normalise the sum; without, normalise x. out = weight * (row / sqrt(mean(row^2) + eps)),
// weight float32 (for a bfloat16 model, its values).
void schedkit_add_rms_norm(const void* x, int dtype, void* residual, const float* weight, void* out,
                           int64_t rows, int64_t dim, float eps, int num_threads) {
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, rows / 4 + 1)));
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> wide(3 * dim);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
#ifdef SCHEDKIT_AVX512
      if (dim % 16 == 0) {
        if (dtype == 0)
          add_rms_norm_row(static_cast<const float*>(x) + r * dim,
                           residual ? static_cast<float*>(residual) + r * dim : nullptr, weight,
                           static_cast<float*>(out) + r * dim, dim, eps, wide.data());
        else
          add_rms_norm_row(static_cast<const uint16_t*>(x) + r * dim,
                           residual ? static_cast<uint16_t*>(residual) + r * dim : nullptr, weight,
                           static_cast<uint16_t*>(out) + r * dim, dim, eps, wide.data());
        continue;
      }
#endif
      float* src;
      if (dtype == 0) {
        src = const_cast<float*>(static_cast<const float*>(x)) + r * dim;
        if (residual) {
          float* res = static_cast<float*>(residual) + r * dim;
          for (int64_t i = 0; i < dim; ++i) res[i] += src[i];
          src = res;
        }
      } else {
        src = wide.data();
        widen(static_cast<const uint16_t*>(x) + r * dim, dim, src);
        if (residual) {
          uint16_t* res = static_cast<uint16_t*>(residual) + r * dim;
          float* other = wide.data() + dim;
          widen(res, dim, other);
          for (int64_t i = 0; i < dim; ++i) src[i] = round_bf16(src[i] + other[i]);
          store_as(res, src, dim);  // exact: already rounded
        }
      }
      float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < dim; ++i) ss += src[i] * src[i];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
      if (dtype == 0) {
        float* dst = static_cast<float*>(out) + r * dim;
        for (int64_t i = 0; i < dim; ++i) dst[i] = weight[i] * (src[i] * inv);
      } else {
        float* dst = wide.data() + 2 * dim;
        for (int64_t i = 0; i < dim; ++i) dst[i] = weight[i] * round_bf16(src[i] * inv);
        store_row(out, 1, r * dim, dst, dim);
      }
    }
  }
}

// out[r, i] = silu(x[r, i]) * x[r, dim + i] (the gate / up halves of one projection).
void schedkit_silu_and_mul(const void* x, int dtype, void* out, int64_t rows, int64_t dim, int num_threads) {
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, rows / 4 + 1)));
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> wide(3 * dim);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
#ifdef SCHEDKIT_AVX512
      if (dim % 16 == 0) {
        if (dtype == 0) {
          const float* g = static_cast<const float*>(x) + r * 2 * dim;
          silu_and_mul_row(g, g + dim, static_cast<float*>(out) + r * dim, dim);
        } else {
          const uint16_t* g = static_cast<const uint16_t*>(x) + r * 2 * dim;
          silu_and_mul_row(g, g + dim, static_cast<uint16_t*>(out) + r * dim, dim);
        }
        continue;
      }
#endif
      const float* g;
      if (dtype == 0) {
        g = static_cast<const float*>(x) + r * 2 * dim;
      } else {
        widen(static_cast<const uint16_t*>(x) + r * 2 * dim, 2 * dim, wide.data());
        g = wide.data();
      }
      const float* u = g + dim;
      float* dst = dtype == 0 ? static_cast<float*>(out) + r * dim : wide.data() + 2 * dim;
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) {  // below -80 silu is 0 to float precision; exp's
        // argument is clamped because 1 / inf is not 0 under -ffast-math
        const float e = std::exp(std::min(-g[i], 80.0f));
        dst[i] = (g[i] < -80.0f ? 0.0f : g[i] / (1.0f + e));
      }
      if (dtype == 0) {
        for (int64_t i = 0; i < dim; ++i) dst[i] *= u[i];
      } else {
        for (int64_t i = 0; i < dim; ++i) dst[i] = round_bf16(dst[i]) * u[i];
        store_row(out, 1, r * dim, dst, dim);
      }
    }
  }
}

// out[r] = the first index of row r's largest value (x: [rows, row_stride] float32, cols
// used), as torch.argmax: a NaN counts as the largest (its first one wins). NaN is told
// by its bits, which -ffast-math cannot optimise away.
void schedkit_argmax_rows(const float* x, int64_t rows, int64_t cols, int64_t row_stride, int64_t* out,
                          int num_threads) {
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, rows)));
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * row_stride;
    const uint32_t* bits = reinterpret_cast<const uint32_t*>(row);
    if (cols <= 0) {
      out[r] = 0;
      continue;
    }
    int64_t c = 0;
    float best = row[0];
    bool nan = false;
#if defined(__AVX512F__)
    if (cols >= 16) {
      __m512 vmax = _mm512_loadu_ps(row);
      __mmask16 any_nan = 0;
      const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF), inf_bits = _mm512_set1_epi32(0x7F800000);
      for (; c + 16 <= cols; c += 16) {
        const __m512 v = _mm512_loadu_ps(row + c);
        any_nan |= _mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), abs_mask), inf_bits);
        vmax = _mm512_max_ps(vmax, v);
      }
      nan = any_nan != 0;
      best = _mm512_reduce_max_ps(vmax);
    }
#endif
    for (int64_t t = c; t < cols; ++t) {
      nan = nan || (bits[t] & 0x7FFFFFFFu) > 0x7F800000u;
      best = row[t] > best ? row[t] : best;
    }
    int64_t found = 0;
    for (int64_t t = 0; t < cols; ++t) {
      if (nan ? (bits[t] & 0x7FFFFFFFu) > 0x7F800000u : row[t] == best) {
        found = t;
        break;
      }
    }
    out[r] = found;
  }
}

// Structured outputs: row logit_rows[i] of logits ([*, row_stride] float32) keeps the
// tokens its bitmask row words[mask_rows[i]] ([*, num_words] int32; bit t % 32 of word
// t / 32 set: token t allowed) allows, below vocab; the others become -inf (written as
// its bit pattern: the library is built with -ffast-math, which assumes no infinities).
// Tokens past 32 * num_words are disallowed. A row that allows no token keeps only its
// argmax (a bug upstream; the row still samples a real token) and sets none_allowed[i].
void schedkit_apply_grammar_bitmask(float* logits, int64_t row_stride, const int32_t* words,
                                    int64_t num_words, const int32_t* logit_rows,
                                    const int32_t* mask_rows, int64_t m, int64_t vocab,
                                    uint8_t* none_allowed, int num_threads) {
  constexpr uint32_t kNegInfBits = 0xFF800000u;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, m)));
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < m; ++i) {
    float* row = logits + static_cast<int64_t>(logit_rows[i]) * row_stride;
    uint32_t* bits_of_row = reinterpret_cast<uint32_t*>(row);
    const uint32_t* w = reinterpret_cast<const uint32_t*>(words) + static_cast<int64_t>(mask_rows[i]) * num_words;
    const int64_t need = (vocab + 31) / 32;
    bool any = false;
    for (int64_t k = 0; k < need && !any; ++k) {
      uint32_t bits = k < num_words ? w[k] : 0u;
      const int64_t left = vocab - 32 * k;
      if (left < 32) bits &= (1u << left) - 1u;
      any = bits != 0u;
    }
    none_allowed[i] = any ? 0 : 1;
    if (!any) {
      int64_t top = 0;
      for (int64_t t = 1; t < vocab; ++t) top = row[t] > row[top] ? t : top;
      for (int64_t t = 0; t < vocab; ++t) if (t != top) bits_of_row[t] = kNegInfBits;
      continue;
    }
    for (int64_t k = 0; k < need; ++k) {
      const uint32_t bits = k < num_words ? w[k] : 0u;
      if (bits == 0xFFFFFFFFu) continue;
      const int64_t base = 32 * k, end = std::min<int64_t>(base + 32, vocab);
      if (bits == 0u) {
        for (int64_t t = base; t < end; ++t) bits_of_row[t] = kNegInfBits;
        continue;
      }
      for (int64_t t = base; t < end; ++t)
        if (!((bits >> (t - base)) & 1u)) bits_of_row[t] = kNegInfBits;
    }
  }
}

// M rows of x ([M, K], row stride ldx) times a weight packed for the one-row GEMM: out
// [M, N] contiguous. One row: see gemv_run; several: gemm_run_avx2 (float32 wherever
// AVX2 and FMA are). Returns -1 where this build lacks the path for dtype (0 float32,
// 1 bfloat16) at this row count, -2 for shapes it does not take (N not a multiple of 16;
// bfloat16 K odd; M < 1; ldx < K).
int schedkit_gemm(const void* x, int dtype, int64_t M, int64_t ldx, int64_t K, const void* wp, const void* bias,
                  int64_t N, void* out, int num_threads) {
  if (N % 16 != 0 || K <= 0 || M < 1 || ldx < K || (dtype == 1 && K % 2 != 0)) return -2;
  const int64_t blocks = N / 16;
  if (M > 1) {
#if defined(SCHEDKIT_GEMM_AVX2)
    if (dtype == 0) {
      const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, blocks)));
      gemm_run_avx2(static_cast<const float*>(x), M, ldx, static_cast<const float*>(wp), K, blocks,
                    static_cast<const float*>(bias), static_cast<float*>(out), threads);
      return 0;
    }
#endif
    return -1;
  }
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, (blocks + 1) / 2)));
  if (dtype == 0) {
#if defined(SCHEDKIT_AVX512)
    gemv_run<float, false>(static_cast<const float*>(x), static_cast<const float*>(wp), K, blocks,
                           static_cast<const float*>(bias), static_cast<float*>(out), threads);
    return 0;
#elif defined(SCHEDKIT_GEMV_AVX2)
    gemv_run_avx2(static_cast<const float*>(x), static_cast<const float*>(wp), K, blocks,
                  static_cast<const float*>(bias), static_cast<float*>(out), threads);
    return 0;
#endif
  } else if (dtype == 1) {
#ifdef SCHEDKIT_AVX512_BF16
    gemv_run<uint16_t, true>(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(wp), K, blocks,
                             static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(out), threads);
    return 0;
#endif
  }
  (void)x; (void)wp; (void)bias; (void)out; (void)threads;
  return -1;
}

}  // extern "C"
