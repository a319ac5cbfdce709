// dg_cuda_launch.h: running per-element code on the GPU, or on the host.
//
//   dg::for_each("relu", n, [=] DG_HD(int64_t i) { y[i] = fmaxf(x[i], 0.0F); });
//
// runs the lambda for i in [0, n): under nvcc as a grid-stride CUDA kernel on
// the thread's stream (the launch is checked), in the CPU emulation
// (DG_CUDA_EMULATE, a plain C++ compiler) as a host loop. Kernels written as
// such per-element lambdas (the generated elementwise kernels, the optimizer
// update, most runtime ops) therefore run the same code in both builds, and
// the tests check them on machines without a GPU.
//
// Also here: the atomics those bodies use, with host twins.
//
// Part of the deepgen CUDA runtime: hand-written, copied unchanged into every
// generated project. Header-only, C++17 (CUDA: needs --extended-lambda).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "dg_cuda.h"
#include "dg_cuda_compat.h"

#if !defined(__CUDACC__) && !defined(DG_CUDA_EMULATE)
#error "CUDA kernels: compile this file with nvcc, or define DG_CUDA_EMULATE to run them on the CPU"
#endif

namespace dg {

constexpr int kThreads = 256;  // threads per block of the per-element kernels

#ifdef __CUDACC__

// A launch's own errors (no device, no kernel image for this GPU, a bad
// configuration) are reported at once; faults inside the kernel surface at the
// next synchronization (CallScope::finish) with the call that waited.
inline void check_launch(const char* what) {
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess)
    cuda_check(status, (std::string("launch of kernel '") + what + "'").c_str(), __FILE__, __LINE__);
}

// Blocks for `total` elements; a grid-stride loop covers any excess.
inline unsigned blocks_for(int64_t total, int threads = kThreads) {
  const int64_t blocks = (total + threads - 1) / threads;
  return static_cast<unsigned>(std::min<int64_t>(blocks, int64_t{1} << 20));
}

namespace cuda_detail {

template <typename F>
__global__ void for_each_kernel(int64_t total, F f) {
  const int64_t step = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += step)
    f(i);
}

}  // namespace cuda_detail

// f(i) for i in [0, total), on the GPU; `what` names the kernel in errors.
template <typename F>
void for_each(const char* what, int64_t total, F f) {
  if (total <= 0) return;
  cuda_detail::for_each_kernel<<<blocks_for(total), kThreads, 0, stream()>>>(total, f);
  check_launch(what);
}

#else  // DG_CUDA_EMULATE: the same bodies as host loops

template <typename F>
void for_each(const char* /*what*/, int64_t total, F f) {
  for (int64_t i = 0; i < total; ++i)
    f(i);
}

#endif

// *address += value, atomically on the GPU.
DG_HD inline void atomic_add(float* address, float value) {
#ifdef __CUDA_ARCH__
  atomicAdd(address, value);
#else
  *address += value;
#endif
}

// slot[0] = min(slot[0], position), atomically on the GPU (positions are >= 0).
DG_HD inline void atomic_min_position(int64_t* slot, int64_t position) {
#ifdef __CUDA_ARCH__
  atomicMin(reinterpret_cast<unsigned long long*>(slot), static_cast<unsigned long long>(position));
#else
  if (position < *slot) *slot = position;
#endif
}

}  // namespace dg
