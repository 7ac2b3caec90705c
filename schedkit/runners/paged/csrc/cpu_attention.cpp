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
// (float32 read in place, bfloat16 / float16 widened to float32 once per item) (the hardware
// prefetcher streams each block; software prefetch only cost time). Softmax is online, one rescale per
// block and query. Items are spread over the threads of the OpenMP runtime torch
// itself uses (the library is loaded after torch, so libgomp.so.1 resolves to torch's).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>

namespace {

constexpr float kNegBig = -1e30f;  // finite: the kernel is built with -ffast-math

#if defined(__FLT16_MAX__)
#define SCHEDKIT_HAVE_FLOAT16 1  // _Float16: GCC >= 12 / clang >= 15 on x86
#endif

struct Item {
  int32_t seq, row_begin, row_end;
};

struct Problem {
  const float* q;
  float* out;
  const int32_t* query_start_loc;
  const int32_t* seq_lens;
  const int32_t* block_table;
  int64_t block_table_stride, num_heads, num_kv_heads, head_dim, block_size;
  float scale;
  int64_t num_cache_blocks;
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

// n values widened to float32 (n a multiple of 8: whole KV rows)
inline void widen(const uint16_t* src, int64_t n, float* dst) {  // bfloat16
  for (int64_t c = 0; c < n; c += 8) {
    v8u16 h;
    std::memcpy(&h, src + c, sizeof h);
    v8u32 w = __builtin_convertvector(h, v8u32) << 16;
    std::memcpy(dst + c, &w, sizeof w);
  }
}
#ifdef SCHEDKIT_HAVE_FLOAT16
inline void widen(const _Float16* src, int64_t n, float* dst) {
  for (int64_t c = 0; c < n; ++c) dst[c] = static_cast<float>(src[c]);
}
#endif

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
  float* dst = p.out + (q0 + it.row_begin) * H * D;
  for (int64_t i = 0; i < nq; ++i) {
    const float inv = 1.0f / l[i];
    for (int64_t d = 0; d < D; ++d) dst[i * D + d] = acc[i * D + d] * inv;
  }
}

inline uint16_t to_bf16(float f) {  // round to nearest even, as torch's .to(bfloat16)
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline void store_as(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store_as(uint16_t* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_bf16(src[i]);
}
#ifdef SCHEDKIT_HAVE_FLOAT16
inline void store_as(_Float16* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<_Float16>(src[i]);
}
#endif

// This step's fused q/k/v projection, before attention: RoPE on q and k (neox layout,
// tables of D columns per position), q kept for attention, k and v written to their
// cache slots in the cache's dtype.
struct RopeStore {
  const float* qkv;
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

template <typename KT>
void rope_store_token(const Problem& p, const RopeStore& rs, KT* k_cache, KT* v_cache, int64_t t,
                      float* tmp) {
  const int64_t D = p.head_dim, H = p.num_heads, KVH = p.num_kv_heads;
  const float* row = rs.qkv + t * rs.qkv_stride;
  const float* cos = rs.cos + rs.positions[t] * D;
  const float* sin = rs.sin + rs.positions[t] * D;
  for (int64_t h = 0; h < H; ++h) rope(row + h * D, cos, sin, D, p.out + (t * H + h) * D);
  const int64_t slot = rs.slot_mapping[t];
  KT* kdst = k_cache + slot * KVH * D;
  for (int64_t h = 0; h < KVH; ++h) {
    rope(row + (H + h) * D, cos, sin, D, tmp);
    store_as(kdst + h * D, tmp, D);
  }
  store_as(v_cache + slot * KVH * D, row + (H + KVH) * D, KVH * D);
}

template <typename KT>
void run(const Problem& p, KT* k_cache, KT* v_cache, const int32_t* seqs, int64_t num_seqs,
         int64_t rows_per_item, int num_threads, const RopeStore* rs) {
  std::vector<Item> items;
  for (int64_t j = 0; j < num_seqs; ++j) {
    const int32_t seq = seqs ? seqs[j] : static_cast<int32_t>(j);
    const int32_t q_len = p.query_start_loc[seq + 1] - p.query_start_loc[seq];
    for (int32_t r = 0; r < q_len; r += rows_per_item)
      items.push_back({seq, r, std::min<int32_t>(q_len, r + rows_per_item)});
  }
  // longest items first: tiles late in a long sequence see the most keys
  auto keys = [&](const Item& a) {
    return p.seq_lens[a.seq] - (p.query_start_loc[a.seq + 1] - p.query_start_loc[a.seq]) + a.row_end;
  };
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) { return keys(a) > keys(b); });
  const int64_t D = p.head_dim, BS = p.block_size;
  const int64_t nq = rows_per_item * p.num_heads;
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t work = rs ? std::max(n_items, rs->num_tokens) : n_items;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, work)));
#pragma omp parallel num_threads(threads)
  {
    const int64_t block_elems = BS * p.num_kv_heads * D;
    std::vector<float> buf(2 * nq * D + 2 * nq + 2 * block_elems + BS + D);
    float* qbuf = buf.data();
    float* acc = qbuf + nq * D;
    float* m = acc + nq * D;
    float* l = m + nq;
    float* kb = l + nq;
    float* vb = kb + block_elems;
    float* s = vb + block_elems;
    if (rs) {
#pragma omp for schedule(static)
      for (int64_t t = 0; t < rs->num_tokens; ++t) rope_store_token(p, *rs, k_cache, v_cache, t, s + BS);
    }  // the implicit barrier: every key is in the cache before any item reads it
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < n_items; ++w) run_item(p, k_cache, v_cache, items[w], qbuf, acc, m, l, kb, vb, s);
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

// Bit 0: float16 caches are supported (the compiler has _Float16).
int schedkit_kernel_features() {
#ifdef SCHEDKIT_HAVE_FLOAT16
  return 1;
#else
  return 0;
#endif
}

// Attention of q (already rotated) over the caches.
int schedkit_paged_attention(const float* q, const void* k_cache, const void* v_cache, float* out,
                             const int32_t* query_start_loc, const int32_t* seq_lens,
                             const int32_t* block_table, int64_t block_table_stride,
                             const int32_t* seqs, int64_t num_seqs, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                             int dtype, int64_t rows_per_item, int num_threads,
                             int64_t num_cache_blocks) {
  Problem p{q, out, query_start_loc, seq_lens, block_table, block_table_stride, num_heads,
            num_kv_heads, head_dim, block_size, scale, num_cache_blocks};
  return attention(p, const_cast<void*>(k_cache), const_cast<void*>(v_cache), seqs, num_seqs, dtype,
                   rows_per_item, num_threads, nullptr);
}

// One layer's attention from its q/k/v projection ([T, qkv_stride] float32, q then k
// then v heads): RoPE, k and v stored at slot_mapping, attention; out [T, H, D].
int schedkit_rope_store_attention(const float* qkv, int64_t qkv_stride, const int64_t* positions,
                                  const float* cos, const float* sin, const int64_t* slot_mapping,
                                  int64_t num_tokens, void* k_cache, void* v_cache, float* out,
                                  const int32_t* query_start_loc, const int32_t* seq_lens,
                                  const int32_t* block_table, int64_t block_table_stride,
                                  int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                  int64_t head_dim, int64_t block_size, float scale, int dtype,
                                  int64_t rows_per_item, int num_threads, int64_t num_cache_blocks,
                                  int64_t num_positions) {
  Problem p{out, out, query_start_loc, seq_lens, block_table, block_table_stride, num_heads,
            num_kv_heads, head_dim, block_size, scale, num_cache_blocks};
  RopeStore rs{qkv, qkv_stride, positions, cos, sin, slot_mapping, num_tokens, num_positions};
  return attention(p, k_cache, v_cache, nullptr, num_seqs, dtype, rows_per_item, num_threads, &rs);
}

// RMSNorm of each row (float32): with `residual`, first residual += x in place and
// normalise the sum; without, normalise x. out = weight * row / sqrt(mean(row^2) + eps).
void schedkit_add_rms_norm(const float* x, float* residual, const float* weight, float* out,
                           int64_t rows, int64_t dim, float eps, int num_threads) {
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, rows / 4 + 1)));
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = x + r * dim;
    if (residual) {
      float* res = residual + r * dim;
      for (int64_t i = 0; i < dim; ++i) res[i] += src[i];
      src = res;
    }
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < dim; ++i) ss += src[i] * src[i];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
    float* dst = out + r * dim;
    for (int64_t i = 0; i < dim; ++i) dst[i] = weight[i] * (src[i] * inv);
  }
}

// out[r, i] = silu(x[r, i]) * x[r, dim + i] (the gate / up halves of one projection).
void schedkit_silu_and_mul(const float* x, float* out, int64_t rows, int64_t dim, int num_threads) {
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, rows / 4 + 1)));
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = x + r * 2 * dim;
    const float* u = g + dim;
    float* dst = out + r * dim;
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) {  // below -80 silu is 0 to float precision; exp's
      // argument is clamped because 1 / inf is not 0 under -ffast-math
      const float e = std::exp(std::min(-g[i], 80.0f));
      dst[i] = (g[i] < -80.0f ? 0.0f : g[i] / (1.0f + e)) * u[i];
    }
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

}  // extern "C"
