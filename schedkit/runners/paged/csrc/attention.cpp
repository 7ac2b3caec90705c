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
//
// The item paths this file picks from: run_item below (8-wide GCC vectors, any CPU),
// attention_avx512.h, attention_float_tiles.h and attention_bf16_tiles.h (AMX and
// vdpbf16ps). This file also holds the fused per-layer call (RoPE, the cache store,
// attention) and the switches that turn the tile paths on and off.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "attention.h"
#include "attention_avx512.h"
#include "attention_bf16_tiles.h"
#include "attention_float_tiles.h"
#include "simd.h"

namespace {

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

}  // extern "C"
