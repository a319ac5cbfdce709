// dg_cuda_reduce.h: ops along one axis on the GPU (sums, means, maxima, softmax,
// log-softmax, prefix sums), with the CPU runtime's names and arguments (dg_reduce.h); the
// input is viewed as [outer, len, inner]. Along a long contiguous axis (inner ==
// 1) the GPU uses one block per row with a shared-memory tree; the per-output
// lambda is the CPU emulation's version and the GPU's for strided axes.
//
// Part of the deepgen CUDA runtime: hand-written, copied unchanged into every
// generated project that uses it. Header-only, C++17 (CUDA: needs --extended-lambda).
#pragma once

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <type_traits>

#include "dg_cuda.h"
#include "dg_cuda_compat.h"
#include "dg_cuda_launch.h"

namespace dg {

namespace ops_detail {

// NaN-propagating maximum, as numpy's (v != v is true only for NaN).
DG_HD inline float max_nan(float m, float v) {
  return (v > m || v != v) ? v : m;
}

// Maximum and sum of exp(x - max) of x[l * stride], l in [0, len); len > 0.
DG_HD inline float strided_max(const float* x, int64_t len, int64_t stride) {
  float m = x[0];
  for (int64_t l = 1; l < len; ++l)
    m = max_nan(m, x[l * stride]);
  return m;
}

DG_HD inline float strided_sum_exp(const float* x, int64_t len, int64_t stride, float m) {
  float s = 0.0f;
  for (int64_t l = 0; l < len; ++l)
    s += expf(x[l * stride] - m);
  return s;
}

enum class Reduce { kSum, kMax };

#ifdef __CUDACC__

constexpr int kRowThreads = 256;

// Combines the block's values in shared memory; every thread gets the result.
template <Reduce R>
__device__ float block_reduce(float value, float* shared) {
  const int t = static_cast<int>(threadIdx.x);
  shared[t] = value;
  __syncthreads();
  for (int half = kRowThreads / 2; half > 0; half /= 2) {
    if (t < half)
      shared[t] = R == Reduce::kSum ? shared[t] + shared[t + half] : max_nan(shared[t], shared[t + half]);
    __syncthreads();
  }
  const float result = shared[0];
  __syncthreads();
  return result;
}

// y[row] = sum or max of x[row, 0 .. len), one block per row; `scale` multiplies a sum (1/len for a mean).
template <Reduce R>
__global__ void __launch_bounds__(kRowThreads)
    reduce_rows_kernel(const float* x, float* y, int64_t len, float scale) {
  __shared__ float shared[kRowThreads];
  const float* row = x + static_cast<int64_t>(blockIdx.x) * len;
  float value = R == Reduce::kSum ? 0.0f : row[0];
  for (int64_t l = threadIdx.x; l < len; l += kRowThreads)
    value = R == Reduce::kSum ? value + row[l] : max_nan(value, row[l]);
  value = block_reduce<R>(value, shared);
  if (threadIdx.x == 0) y[blockIdx.x] = R == Reduce::kSum ? value * scale : value;
}

// Softmax (or log-softmax) of each row of x[rows, len], one block per row.
template <bool Log>
__global__ void __launch_bounds__(kRowThreads) softmax_rows_kernel(const float* x, float* y, int64_t len) {
  __shared__ float shared[kRowThreads];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * len;
  float m = x[base];
  for (int64_t l = threadIdx.x; l < len; l += kRowThreads)
    m = max_nan(m, x[base + l]);
  m = block_reduce<Reduce::kMax>(m, shared);
  float s = 0.0f;
  for (int64_t l = threadIdx.x; l < len; l += kRowThreads)
    s += expf(x[base + l] - m);
  s = block_reduce<Reduce::kSum>(s, shared);
  const float log_s = logf(s);
  for (int64_t l = threadIdx.x; l < len; l += kRowThreads)
    y[base + l] = Log ? (x[base + l] - m) - log_s : expf(x[base + l] - m) / s;
}

// Rows at least this long use a block each (when the axis is contiguous).
constexpr int64_t kBlockRowLength = 256;

inline bool use_row_blocks(int64_t len, int64_t inner) {
  return inner == 1 && len >= kBlockRowLength;
}

#endif

template <Reduce R>
void reduce(const char* what, const float* x, float* y, int64_t outer, int64_t len, int64_t inner,
            bool mean) {
#ifdef __CUDACC__
  if (use_row_blocks(len, inner) && outer > 0 && outer <= int64_t{0x7fffffff}) {
    const float scale = mean ? 1.0f / static_cast<float>(len) : 1.0f;
    reduce_rows_kernel<R><<<static_cast<unsigned>(outer), kRowThreads, 0, stream()>>>(x, y, len, scale);
    check_launch(what);
    return;
  }
#endif
  for_each(what, outer * inner, [=] DG_HD(int64_t j) {
    const int64_t o = j / inner, i = j % inner;
    const float* first = x + o * len * inner + i;
    if (R == Reduce::kMax) {
      y[j] = strided_max(first, len, inner);
    } else {
      float s = 0.0f;
      for (int64_t l = 0; l < len; ++l)
        s += first[l * inner];
      y[j] = mean ? s / static_cast<float>(len) : s;
    }
  });
}

template <bool Log>
void softmax_along(const char* what, const float* x, float* y, int64_t outer, int64_t len, int64_t inner) {
  if (len == 0) return;
#ifdef __CUDACC__
  if (use_row_blocks(len, inner) && outer <= int64_t{0x7fffffff}) {
    if (outer > 0)
      softmax_rows_kernel<Log><<<static_cast<unsigned>(outer), kRowThreads, 0, stream()>>>(x, y, len);
    check_launch(what);
    return;
  }
#endif
  for_each(what, outer * inner, [=] DG_HD(int64_t j) {
    const int64_t o = j / inner, i = j % inner;
    const int64_t base = o * len * inner + i;
    const float m = strided_max(x + base, len, inner);
    const float s = strided_sum_exp(x + base, len, inner, m);
    const float log_s = logf(s);
    for (int64_t l = 0; l < len; ++l) {
      const int64_t at = base + l * inner;
      y[at] = Log ? (x[at] - m) - log_s : expf(x[at] - m) / s;
    }
  });
}

}  // namespace ops_detail

// y[o, i] = sum over l of x[o, l, i].
inline void reduce_sum(const float* x, float* y, int64_t outer, int64_t len, int64_t inner) {
  ops_detail::reduce<ops_detail::Reduce::kSum>("reduce_sum", x, y, outer, len, inner, false);
}

// y[o, i] = mean over l of x[o, l, i] (NaN for an empty axis, as in numpy).
inline void reduce_mean(const float* x, float* y, int64_t outer, int64_t len, int64_t inner) {
  ops_detail::reduce<ops_detail::Reduce::kSum>("reduce_mean", x, y, outer, len, inner, true);
}

// y[o, i] = max over l of x[o, l, i]; NaN propagates.
inline void reduce_max(const float* x, float* y, int64_t outer, int64_t len, int64_t inner) {
  if (len == 0) throw std::invalid_argument("max over an empty axis");
  ops_detail::reduce<ops_detail::Reduce::kMax>("reduce_max", x, y, outer, len, inner, false);
}

// Softmax along the middle axis of [outer, len, inner], the maximum subtracted first.
inline void softmax(const float* x, float* y, int64_t outer, int64_t len, int64_t inner) {
  ops_detail::softmax_along<false>("softmax", x, y, outer, len, inner);
}

// log(softmax(x)) along the middle axis, as x - max - log(sum(exp(x - max))).
inline void log_softmax(const float* x, float* y, int64_t outer, int64_t len, int64_t inner) {
  ops_detail::softmax_along<true>("log_softmax", x, y, outer, len, inner);
}

// Inclusive prefix sums along the middle axis of [outer, len, inner], or from the end
// with `reverse` (dg_reduce.h's cumsum): one thread per (o, i), adding in order in float.
inline void cumsum(const float* x, float* y, int64_t outer, int64_t len, int64_t inner, bool reverse) {
  if (len == 0) return;
  for_each("cumsum", outer * inner, [=] DG_HD(int64_t j) {
    const int64_t o = j / inner, i = j % inner;
    const int64_t first = reverse ? len - 1 : 0, step = reverse ? -inner : inner;
    int64_t at = (o * len + first) * inner + i;
    float sum = x[at];
    y[at] = sum;
    for (int64_t l = 1; l < len; ++l) {
      at += step;
      sum = sum + x[at];
      y[at] = sum;
    }
  });
}

}  // namespace dg
