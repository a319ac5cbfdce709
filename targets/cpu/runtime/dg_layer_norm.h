// dg_layer_norm.h - layer normalization over the last axis (transformer layers).
//
// x is viewed as [rows, D]. Each row is normalized by its own mean and biased
// variance, then scaled and shifted per column:
//   y = (x - mean) * rstd * w + b,   rstd = 1 / sqrt(var + eps)
// and the mean and rstd of every row are written for the gradient.
//
// A row (D floats, a few KiB) stays in L1 across its passes: the mean, the
// centred variance (two passes: no cancellation for rows far from 0), and
// the output. Each pass is a plain loop over the contiguous row that the
// compiler vectorizes (`omp simd` lets it reorder the sums). Rows are shared out
// over threads; the column sums of the gradient (dw, db) are split by columns,
// each summed over the rows in order, so results do not depend on the thread
// count.
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project.
#pragma once

#include <cmath>
#include <cstdint>

#include "dg_parallel.h"

// OpenMP pragmas, left out (without a warning) where OpenMP is off.
#ifdef _OPENMP
#define DG_OMP(text) _Pragma(text)
#else
#define DG_OMP(text)
#endif

namespace dg {

namespace layer_norm_detail {

inline float row_mean(const float* x, int64_t D) {
  float sum = 0.0f;
  DG_OMP("omp simd reduction(+ : sum)")
  for (int64_t d = 0; d < D; ++d)
    sum += x[d];
  return sum / static_cast<float>(D);
}

// mean over the row of f(d), for a vectorizable body f.
template <class F>
inline float mean_of(int64_t D, F f) {
  float sum = 0.0f;
  DG_OMP("omp simd reduction(+ : sum)")
  for (int64_t d = 0; d < D; ++d)
    sum += f(d);
  return sum / static_cast<float>(D);
}

}  // namespace layer_norm_detail

inline void layer_norm(const float* x, const float* w, const float* b, float* y, float* mean, float* rstd,
                       int64_t rows, int64_t D, float eps) {
  [[maybe_unused]] const int threads = threads_for(5 * rows * D);
  DG_OMP("omp parallel for num_threads(threads) if (threads > 1)")
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * D;
    float* yr = y + r * D;
    const float m = layer_norm_detail::row_mean(xr, D);
    const float var = layer_norm_detail::mean_of(D, [=](int64_t d) { return (xr[d] - m) * (xr[d] - m); });
    const float s = 1.0f / std::sqrt(var + eps);
    mean[r] = m;
    rstd[r] = s;
    DG_OMP("omp simd")
    for (int64_t d = 0; d < D; ++d)
      yr[d] = (xr[d] - m) * s * w[d] + b[d];
  }
}

// dx, dw, db of layer_norm from x, w, the mean and rstd it wrote, and g. With
// xhat = (x - mean) * rstd and gw = g * w, per row:
//   dx = rstd * (gw - mean(gw) - xhat * mean(gw * xhat))
// and dw = sum over rows of g * xhat, db = sum over rows of g.
inline void layer_norm_grad(const float* x, const float* w, const float* mean, const float* rstd,
                            const float* g, float* dx, float* dw, float* db, int64_t rows, int64_t D) {
  [[maybe_unused]] const int threads = threads_for(8 * rows * D);
  DG_OMP("omp parallel for num_threads(threads) if (threads > 1)")
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * D;
    const float* gr = g + r * D;
    float* out = dx + r * D;
    const float m = mean[r], s = rstd[r];
    const float mean_gw = layer_norm_detail::mean_of(D, [=](int64_t d) { return gr[d] * w[d]; });
    const float mean_gwx =
        layer_norm_detail::mean_of(D, [=](int64_t d) { return gr[d] * w[d] * ((xr[d] - m) * s); });
    DG_OMP("omp simd")
    for (int64_t d = 0; d < D; ++d)
      out[d] = s * (gr[d] * w[d] - mean_gw - (xr[d] - m) * s * mean_gwx);
  }
  // Column sums: each thread owns a range of columns and adds the rows in order.
  const int col_threads = threads_for(3 * rows * D);
  const int64_t parts = col_threads > 1 ? col_threads : 1;
  DG_OMP("omp parallel for num_threads(col_threads) if (col_threads > 1)")
  for (int64_t part = 0; part < parts; ++part) {
    const int64_t d0 = D * part / parts, d1 = D * (part + 1) / parts;
    for (int64_t d = d0; d < d1; ++d)
      dw[d] = db[d] = 0.0f;
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * D;
      const float* gr = g + r * D;
      const float m = mean[r], s = rstd[r];
      DG_OMP("omp simd")
      for (int64_t d = d0; d < d1; ++d) {
        dw[d] += gr[d] * ((xr[d] - m) * s);
        db[d] += gr[d];
      }
    }
  }
}

}  // namespace dg

#undef DG_OMP
