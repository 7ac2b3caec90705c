// The attention kernel's problem and work item, shared by attention.cpp and the item
// paths it includes (attention_avx512.h, attention_float_tiles.h, attention_bf16_tiles.h).
#pragma once

#include <cstdint>

#include "simd.h"

namespace {

constexpr float kNegBig = -1e30f;  // finite: the kernel is built with -ffast-math

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

// acc / l of nq query vectors, written to out from element `offset` on.
inline void finish_item(const Problem& p, float* acc, const float* l, int64_t offset, int64_t nq) {
  const int64_t D = p.head_dim;
  for (int64_t i = 0; i < nq; ++i) {
    const float inv = 1.0f / l[i];
    for (int64_t d = 0; d < D; ++d) acc[i * D + d] *= inv;
  }
  store_row(p.out, p.out_dtype, offset, acc, nq * D);
}

}  // namespace
