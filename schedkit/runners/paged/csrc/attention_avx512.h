// The attention item path on AVX-512 (head_dim 32, 64 or 128), 16 keys at a time;
// bfloat16 keys read in place by vdpbf16ps on AVX512-BF16. Included by attention.cpp
// only, whose dispatch_item picks it.
#pragma once

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "attention.h"

namespace {

#ifdef SCHEDKIT_AVX512
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

}  // namespace
