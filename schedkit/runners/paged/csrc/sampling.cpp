// Kernels on the logits: the greedy argmax of each row, and the grammar bitmask of
// structured outputs.

#include <algorithm>
#include <cstdint>

#include "simd.h"

extern "C" {

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

}  // extern "C"
