// The float32 prefill tiles of the attention kernel (any cache dtype, portable vectors
// of 16 or 8 floats). Included by attention.cpp only, whose run lays out the keys and
// hands these tiles the prefill chunks no bfloat16 tile engine takes.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "attention.h"

namespace {

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

}  // namespace
