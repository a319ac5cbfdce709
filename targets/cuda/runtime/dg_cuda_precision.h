// dg_cuda_precision.h: reduced precision on the GPU, with the CPU runtime's names
// and arguments (dg_precision.h): round_bf16 rounds a product's operands to
// bfloat16 (ties to even), kept in floats.
//
// Part of the deepgen CUDA runtime: hand-written, copied unchanged into every
// generated project that uses it. Header-only, C++17 (CUDA: needs --extended-lambda).
#pragma once

#include <cstdint>
#include <cstring>

#include "dg_cuda.h"
#include "dg_cuda_compat.h"
#include "dg_cuda_launch.h"

namespace dg {

// x rounded to the nearest bfloat16 value, ties to even (dg_precision.h's
// round_bf16_value, bit for bit): a NaN is returned as it is.
DG_HD inline float round_bf16_value(float x) {
  uint32_t bits;
  memcpy(&bits, &x, sizeof bits);
  const bool nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  const uint32_t out = nan ? bits : rounded;
  float y;
  memcpy(&y, &out, sizeof y);
  return y;
}

// y[i] = x[i] rounded to bfloat16, one thread per element (y may be x).
inline void round_bf16(const float* x, float* y, int64_t n) {
  for_each("round_bf16", n, [=] DG_HD(int64_t i) { y[i] = round_bf16_value(x[i]); });
}

}  // namespace dg
