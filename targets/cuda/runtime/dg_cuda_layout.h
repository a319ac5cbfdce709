// dg_cuda_layout.h: ops that move data on the GPU (transpose, copies along an
// axis, fill), with the CPU runtime's names and arguments (dg_layout.h). Pointers
// are device pointers; sizes and small shape arrays stay on the host.
//
// Part of the deepgen CUDA runtime: hand-written, copied unchanged into every
// generated project that uses it. Header-only, C++17 (CUDA: needs --extended-lambda).
#pragma once

#include <cstdint>
#include <stdexcept>

#include "dg_cuda.h"
#include "dg_cuda_compat.h"
#include "dg_cuda_launch.h"

namespace dg {

// Most axes a transpose handles (the shape and permutation travel by value).
constexpr int kMaxRank = 8;

namespace ops_detail {

struct TransposeLayout {
  int64_t y_shape[kMaxRank];
  int64_t x_step[kMaxRank];  // x's stride along each axis of y
};

}  // namespace ops_detail

// numpy.transpose(x, perm): y's axis d is x's axis perm[d]. `shape` and `perm`
// are host arrays; each output element finds its source by its coordinates. x
// may be a row-strided piece of a larger buffer (the CPU runtime's row_axes and
// ld: x's axes before row_axes index rows ld floats apart).
inline void transpose(const float* x, float* y, int ndim, const int64_t* shape, const int* perm,
                      int row_axes = 0, int64_t ld = 0) {
  if (ndim > kMaxRank) throw std::invalid_argument("transpose: more than 8 axes");
  ops_detail::TransposeLayout layout{};
  int64_t x_stride[kMaxRank], stride = 1, total = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (ld > 0 && d == row_axes - 1) stride = ld;  // the axes before row_axes step whole rows
    x_stride[d] = stride;
    stride *= shape[d];
  }
  for (int d = ndim - 1; d >= 0; --d) {
    layout.x_step[d] = x_stride[perm[d]];
    layout.y_shape[d] = shape[perm[d]];
    total *= layout.y_shape[d];
  }
  for_each("transpose", total, [=] DG_HD(int64_t at) {
    int64_t rest = at, src = 0;
    for (int d = ndim - 1; d >= 0; --d) {
      src += (rest % layout.y_shape[d]) * layout.x_step[d];
      rest /= layout.y_shape[d];
    }
    y[at] = x[src];
  });
}

// dst[:, dst_start : dst_start+count, :] = src[:, src_start : src_start+count, :]
// with src viewed as [outer, src_len, inner] and dst as [outer, dst_len, inner]
// (concat, split and slice).
template <typename T>  // float, or an int64 tensor's elements (token ids, lengths)
void copy_axis(const T* src, T* dst, int64_t outer, int64_t src_len, int64_t src_start, int64_t dst_len,
               int64_t dst_start, int64_t count, int64_t inner) {
  const int64_t block = count * inner;
  for_each("copy_axis", outer * block, [=] DG_HD(int64_t j) {
    const int64_t o = j / block, r = j % block;
    dst[(o * dst_len + dst_start) * inner + r] = src[(o * src_len + src_start) * inner + r];
  });
}

// x[0..n) = value.
inline void fill(float* x, int64_t n, float value) {
  for_each("fill", n, [=] DG_HD(int64_t i) { x[i] = value; });
}

}  // namespace dg
