// dg_precision.h: reduced precision. A model generated with --precision bf16 rounds
// the operands of every product (matmul, convolution) to bfloat16 with round_bf16
// before the product, which multiplies and accumulates in float as always.
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project that uses it.
#pragma once

#include <cstdint>
#include <cstring>

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

// y[i] = x[i] rounded to bfloat16, for n elements (y may be x).
inline void round_bf16(const float* x, float* y, int64_t n) {
  const int threads = threads_for(2 * n);
#ifdef _OPENMP
#pragma omp parallel for simd num_threads(threads) if (threads > 1) schedule(static)
#else
  (void)threads;
#endif
  for (int64_t i = 0; i < n; ++i)
    y[i] = round_bf16_value(x[i]);
}

}  // namespace dg
