// dg_layout.h: ops that move data without computing: transpose, copies along
// an axis (concat, split, slice), fill.
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project that uses it.
#pragma once

#include <cstdint>
#include <vector>

#include "dg_parallel.h"

namespace dg {

// numpy.transpose(x, perm): y's axis d is x's axis perm[d].
// Walks y in row-major order, keeping the matching offset into x up to date
// like an odometer, so each element costs O(1) amortized. The trailing axes
// that stay in place (a head split [B, T, H, D] -> [B, H, T, D] keeps D) are
// one contiguous run in both, copied whole at each step of the odometer over
// the axes before them (BERT's head splits: one float a step took 9% of a bf16
// encoder at batch 64).
// x may be a row-strided piece of a larger buffer, read in place (a split's
// piece, LowerCtx.slice_view): with ld > 0, x's axes before row_axes index rows
// ld floats apart, the axes from row_axes on being contiguous within a row
// (BERT's q, k and v read straight from the fused projection's rows [N, T,
// 3 x 768], with no copy of each piece first).
inline void transpose(const float* x, float* y, int ndim, const int64_t* shape, const int* perm,
                      int row_axes = 0, int64_t ld = 0) {
  // The strides of x, then the shape of y and x's stride for each y axis.
  std::vector<int64_t> x_stride(ndim), y_shape(ndim), step(ndim);
  int64_t stride = 1, total = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (ld > 0 && d == row_axes - 1) stride = ld;  // the axes before row_axes step whole rows
    x_stride[d] = stride;
    stride *= shape[d];
    total *= shape[d];
  }
  if (total == 0) return;
  for (int d = 0; d < ndim; ++d) {
    y_shape[d] = shape[perm[d]];
    step[d] = x_stride[perm[d]];
  }
  int outer = ndim;  // the axes [outer, ndim) stay in place: runs of `run` floats (within a row of x)
  int64_t run = 1;
  while (outer > (ld > 0 ? row_axes : 0) && perm[outer - 1] == outer - 1) {
    --outer;
    run *= shape[outer];
  }

  // The runs are shared out over threads in contiguous ranges, each thread
  // starting its odometer where its range begins (a bf16 BERT's head splits at
  // batch 64 ran on one thread while the other waited).
  const int64_t runs = total / run;
  const int threads = threads_for(2 * total);
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) if (threads > 1)
#else
  (void)threads;
#endif
  {
#ifdef _OPENMP
    const int64_t parts = omp_get_num_threads(), me = omp_get_thread_num();
#else
    const int64_t parts = 1, me = 0;
#endif
    const int64_t r0 = runs * me / parts, r1 = runs * (me + 1) / parts;
    std::vector<int64_t> index(ndim, 0);  // position in y (axes before `outer`) of run r0
    int64_t src = 0;                      // matching offset in x
    for (int64_t rest = r0, d = outer - 1; d >= 0; --d) {
      index[d] = rest % y_shape[d];
      rest /= y_shape[d];
      src += index[d] * step[d];
    }
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t dst = r * run;
      for (int64_t j = 0; j < run; ++j)
        y[dst + j] = x[src + j];
      // Advance index like an odometer, the last moving axis fastest.
      for (int d = outer - 1; d >= 0; --d) {
        if (++index[d] < y_shape[d]) {
          src += step[d];
          break;
        }
        src -= (y_shape[d] - 1) * step[d];
        index[d] = 0;
      }
    }
  }
}

// Copies src[:, src_start : src_start+count, :] into dst[:, dst_start : dst_start+count, :],
// with src viewed as [outer, src_len, inner] and dst as [outer, dst_len, inner].
// Used for concat, split and slice (step 1).  Each outer block is contiguous.
template <typename T>  // float, or an int64 tensor's elements (token ids, lengths)
void copy_axis(const T* src, T* dst, int64_t outer, int64_t src_len, int64_t src_start, int64_t dst_len,
               int64_t dst_start, int64_t count, int64_t inner) {
  const int64_t block = count * inner;
  for (int64_t o = 0; o < outer; ++o) {
    const T* from = src + (o * src_len + src_start) * inner;
    T* to = dst + (o * dst_len + dst_start) * inner;
    for (int64_t j = 0; j < block; ++j)
      to[j] = from[j];
  }
}

// x[0..n) = value.
inline void fill(float* x, int64_t n, float value) {
  for (int64_t i = 0; i < n; ++i)
    x[i] = value;
}

}  // namespace dg
