// The bfloat16 prefill tiles of the attention kernel: one item path, two engines (AMX,
// and vdpbf16ps on AVX512-BF16 where there is no AMX). Included by attention.cpp only.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "attention.h"

namespace {

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

}  // namespace
