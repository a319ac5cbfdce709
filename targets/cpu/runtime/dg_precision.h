// dg_precision.h: reduced precision. A model generated with --precision bf16 rounds
// the operands of every product (matmul, convolution) to bfloat16 with round_bf16
// before the product, which multiplies and accumulates in float as always.
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project that uses it.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "dg_parallel.h"

namespace dg {

// x rounded to the nearest bfloat16 value (ties to even), returned as the float
// whose low 16 bits are zero: add 0x7FFF plus the lowest kept bit to the float's
// bits, then clear the low 16. A NaN is returned as it is (the addition could
// carry it into an infinity); the largest finite floats round up to infinity.
// Integer operations only, so it vectorizes and no FPU mode (flush-to-zero,
// rounding direction) changes it: subnormals round like any other value.
inline float round_bf16_value(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const bool nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  const uint32_t out = nan ? bits : rounded;
  float y;
  std::memcpy(&y, &out, sizeof y);
  return y;
}

// y[i] = x[i] rounded to bfloat16, for n elements (y may be x): with AVX-512, 16
// at a time, round_bf16_value's integer steps on a register (GCC 12 left the loop
// scalar, `omp parallel for simd` or not: 7.5% of a bf16 BERT encoder's time at
// batch 64, rounding attention's operands). (The shift is written as its zero-masking
// form with every lane set: GCC 12 warns of the plain form's undefined operand.)
inline void round_bf16(const float* x, float* y, int64_t n) {
  const int64_t blocks = (n + 15) / 16;
  const int threads = threads_for(2 * n);
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
#else
  (void)threads;
#endif
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t i = blk * 16, count = n - i < 16 ? n - i : 16;
#if defined(__AVX512F__)
    const __mmask16 lanes = static_cast<__mmask16>(count == 16 ? 0xffffu : (1u << count) - 1u);
    const __m512i bits = _mm512_maskz_loadu_epi32(lanes, x + i);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)),
                                                  _mm512_set1_epi32(0x7F800000));
    const __m512i odd = _mm512_and_si512(_mm512_maskz_srli_epi32(static_cast<__mmask16>(0xffff), bits, 16),
                                         _mm512_set1_epi32(1));
    const __m512i rounded =
        _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd),
                         _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
    _mm512_mask_storeu_epi32(y + i, lanes, _mm512_mask_blend_epi32(nan, rounded, bits));
#else
    for (int64_t j = i; j < i + count; ++j)
      y[j] = round_bf16_value(x[j]);
#endif
  }
}

}  // namespace dg
