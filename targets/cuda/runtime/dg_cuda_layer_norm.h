// dg_cuda_layer_norm.h: layer normalization over the last axis, on the GPU.
//
// Same names and arguments as the CPU runtime (dg_layer_norm.h): x viewed as
// [rows, D], y = (x - mean) * rstd * w + b per row with the row's mean and
// biased variance, rstd = 1 / sqrt(var + eps); mean and rstd are written for
// the gradient. Pointers are device pointers.
//
// One lambda per row computes its statistics (two passes: mean, then the
// centred variance), one per element the output; the gradient's dw and db are
// one lambda per column summing the rows in order (neighbouring threads read
// neighbouring columns). The CPU emulation runs the same lambdas.
//
// Part of the deepgen CUDA runtime: hand-written, copied unchanged into every
// generated project. Header-only, C++17 (CUDA: needs --extended-lambda).
#pragma once

#include <cmath>
#include <cstdint>

#include "dg_cuda_compat.h"
#include "dg_cuda_launch.h"

namespace dg {

inline void layer_norm(const float* x, const float* w, const float* b, float* y, float* mean, float* rstd,
                       int64_t rows, int64_t D, float eps) {
  for_each("layer_norm statistics", rows, [=] DG_HD(int64_t r) {
    const float* xr = x + r * D;
    float sum = 0.0f;
    for (int64_t d = 0; d < D; ++d)
      sum += xr[d];
    const float m = sum / static_cast<float>(D);
    float squares = 0.0f;
    for (int64_t d = 0; d < D; ++d)
      squares += (xr[d] - m) * (xr[d] - m);
    mean[r] = m;
    rstd[r] = 1.0f / sqrtf(squares / static_cast<float>(D) + eps);
  });
  for_each("layer_norm", rows * D, [=] DG_HD(int64_t j) {
    const int64_t r = j / D, d = j % D;
    y[j] = (x[j] - mean[r]) * rstd[r] * w[d] + b[d];
  });
}

// dx, dw, db of layer_norm: with xhat = (x - mean) * rstd and gw = g * w, per row
// dx = rstd * (gw - mean(gw) - xhat * mean(gw * xhat)); dw and db sum g * xhat
// and g over the rows.
inline void layer_norm_grad(const float* x, const float* w, const float* mean, const float* rstd,
                            const float* g, float* dx, float* dw, float* db, int64_t rows, int64_t D) {
  for_each("layer_norm_grad rows", rows, [=] DG_HD(int64_t r) {
    const float* xr = x + r * D;
    const float* gr = g + r * D;
    const float m = mean[r], s = rstd[r];
    float sum_gw = 0.0f, sum_gwx = 0.0f;
    for (int64_t d = 0; d < D; ++d) {
      sum_gw += gr[d] * w[d];
      sum_gwx += gr[d] * w[d] * ((xr[d] - m) * s);
    }
    const float mean_gw = sum_gw / static_cast<float>(D), mean_gwx = sum_gwx / static_cast<float>(D);
    for (int64_t d = 0; d < D; ++d)
      dx[r * D + d] = s * (gr[d] * w[d] - mean_gw - (xr[d] - m) * s * mean_gwx);
  });
  for_each("layer_norm_grad columns", D, [=] DG_HD(int64_t d) {
    float sum_gx = 0.0f, sum_g = 0.0f;
    for (int64_t r = 0; r < rows; ++r) {
      const float gv = g[r * D + d];
      sum_gx += gv * ((x[r * D + d] - mean[r]) * rstd[r]);
      sum_g += gv;
    }
    dw[d] = sum_gx;
    db[d] = sum_g;
  });
}

}  // namespace dg
