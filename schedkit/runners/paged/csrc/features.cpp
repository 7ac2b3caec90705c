// What this build of the library has (from its -march target): the bits Python reads
// to choose the paths it calls.

#include "simd.h"

extern "C" {

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

}  // extern "C"
