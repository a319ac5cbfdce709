// dg_cuda_compat.h: the one macro that lets code run on both sides.
//
// DG_HD marks a function (or an extended lambda) that runs on the GPU and on the
// host. Under nvcc it is `__host__ __device__`; under a plain C++ compiler it is
// nothing, so the same per-element code also compiles into host loops: the CPU
// emulation of the CUDA target (DG_CUDA_EMULATE) and tests without a GPU.
//
// Part of the deepgen CUDA runtime: hand-written, copied unchanged into every
// generated project. Header-only, C++17.
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define DG_HD __host__ __device__
#else
#define DG_HD
#endif

#if defined(__CUDACC__) && defined(DG_CUDA_EMULATE)
#error "DG_CUDA_EMULATE builds the CUDA target for the CPU: compile it with a C++ compiler, not nvcc"
#endif

namespace dg {
namespace math {

// max and min that keep a NaN operand (fmaxf/fminf drop it): the printed
// kernels put the number first (max_f(0, x)), so relu(NaN) is NaN, as in the
// numpy reference, the CPU target and PyTorch.
DG_HD inline float max_f(float a, float b) {
  return a > b ? a : b;
}
DG_HD inline float min_f(float a, float b) {
  return a < b ? a : b;
}
// 1 / (1 + e^-x), written with e^-|x| so that it neither overflows nor loses the
// small values below x = -10 (as the CPU's dg_math.h): the printer's form of the
// ops' (1 + tanh(x/2)) / 2 and of its derivative's s (1 - s).
DG_HD inline float sigmoid_f(float x) {
  const float t = expf(-fabsf(x));
  return (x < 0.0F ? t : 1.0F) / (1.0F + t);
}
// x, or +0 where x is subnormal: the optimizers' decaying state (as the CPU's dg_math.h).
DG_HD inline float flush_subnormal_f(float x) {
  return fabsf(x) < 1.17549435e-38F ? 0.0F : x;
}

}  // namespace math
}  // namespace dg
