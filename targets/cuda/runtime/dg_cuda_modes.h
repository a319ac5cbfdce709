// dg_cuda_modes.h: batch norm and dropout on the GPU, the ops whose behavior
// depends on the train/eval mode (dg::Mode, dg_rng.h).
//
// Same names and arguments as the CPU runtime (dg_modes.h); float pointers are
// device pointers, sizes and the mode stay on the host. Batch norm's statistics
// are one lambda per channel (sums in double), its normalization one per
// element; dropout draws the same bits as the CPU and the numpy reference,
// from DG_HD twins of dg_rng.h's mixing functions.
//
// Part of the deepgen CUDA runtime: hand-written, copied unchanged into every
// generated project. Header-only, C++17 (CUDA: needs --extended-lambda).
#pragma once

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "dg_cuda_compat.h"
#include "dg_cuda_launch.h"
#include "dg_rng.h"

namespace dg {

namespace modes_detail {

// dg_rng.h's splitmix64 steps, callable on the device.
DG_HD inline uint64_t fmix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

DG_HD inline bool keep(uint64_t key, int64_t i, float p) {
  const uint64_t w = fmix(key + (static_cast<uint64_t>(i) + 1) * 0x9E3779B97F4A7C15ULL);
  return static_cast<float>(w >> 40) * (1.0f / 16777216.0f) >= p;
}

}  // namespace modes_detail

inline void batch_norm(const float* x, const float* w, const float* b, float* running_mean,
                       float* running_var, float* y, float* mean, float* invstd, int64_t N, int64_t C,
                       int64_t HW, float eps, float momentum, const Mode& mode, const char* what) {
  const int64_t count = N * HW;
  if (mode.training && count < 2) {
    throw std::invalid_argument(std::string(what) +
                                ": training mode needs more than 1 value per channel, got " +
                                std::to_string(count) + " (use eval() for single examples)");
  }
  const bool training = mode.training;
  for_each("batch_norm statistics", C, [=] DG_HD(int64_t c) {
    double m, var;
    if (training) {
      double sum = 0.0;
      for (int64_t n = 0; n < N; ++n)
        for (int64_t i = 0; i < HW; ++i)
          sum += x[(n * C + c) * HW + i];
      m = sum / static_cast<double>(count);
      double squares = 0.0;
      for (int64_t n = 0; n < N; ++n)
        for (int64_t i = 0; i < HW; ++i) {
          const double d = x[(n * C + c) * HW + i] - m;
          squares += d * d;
        }
      var = squares / static_cast<double>(count);
      running_mean[c] = static_cast<float>((1.0 - momentum) * running_mean[c] + momentum * m);
      running_var[c] = static_cast<float>((1.0 - momentum) * running_var[c] +
                                          momentum * squares / static_cast<double>(count - 1));
    } else {
      m = running_mean[c];
      var = running_var[c];
    }
    mean[c] = static_cast<float>(m);
    invstd[c] = static_cast<float>(1.0 / sqrt(var + static_cast<double>(eps)));
  });
  for_each("batch_norm", N * C * HW, [=] DG_HD(int64_t j) {
    const int64_t c = (j / HW) % C;
    y[j] = (x[j] - mean[c]) * (invstd[c] * w[c]) + b[c];
  });
}

// y = batch norm's output made again from x and the mean and invstd it wrote, by
// the same expression as batch_norm's (so a recomputation is exact).
inline void batch_norm_apply(const float* x, const float* w, const float* b, const float* mean,
                             const float* invstd, float* y, int64_t N, int64_t C, int64_t HW) {
  for_each("batch_norm_apply", N * C * HW, [=] DG_HD(int64_t j) {
    const int64_t c = (j / HW) % C;
    y[j] = (x[j] - mean[c]) * (invstd[c] * w[c]) + b[c];
  });
}

inline void batch_norm_grad(const float* x, const float* w, const float* mean, const float* invstd,
                            const float* g, float* dx, float* dw, float* db, int64_t N, int64_t C, int64_t HW,
                            const Mode& mode) {
  const int64_t count = N * HW;
  for_each("batch_norm_grad sums", C, [=] DG_HD(int64_t c) {
    double sum_g = 0.0, sum_gx = 0.0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < HW; ++i) {
        const int64_t j = (n * C + c) * HW + i;
        sum_g += g[j];
        sum_gx += static_cast<double>(g[j]) * ((x[j] - mean[c]) * invstd[c]);
      }
    db[c] = static_cast<float>(sum_g);
    dw[c] = static_cast<float>(sum_gx);
  });
  const bool training = mode.training;
  for_each("batch_norm_grad", N * C * HW, [=] DG_HD(int64_t j) {
    const int64_t c = (j / HW) % C;
    if (training) {
      const float n = static_cast<float>(count);
      const float k = w[c] * invstd[c] / n;
      dx[j] = k * (n * g[j] - db[c] - (x[j] - mean[c]) * invstd[c] * dw[c]);
    } else {
      dx[j] = g[j] * (w[c] * invstd[c]);
    }
  });
}

inline void dropout(const float* x, float* y, int64_t n, float p, float scale, uint64_t stream,
                    const Mode& mode) {
  if (!mode.training) {
    for_each("dropout (eval)", n, [=] DG_HD(int64_t i) { y[i] = x[i]; });
    return;
  }
  const uint64_t key = dropout_key(mode, stream);  // on the host
  for_each("dropout", n,
           [=] DG_HD(int64_t i) { y[i] = modes_detail::keep(key, i, p) ? x[i] * scale : 0.0f; });
}

// Stochastic depth (torchvision): whole groups of `group` consecutive elements
// (a sample's residual branch, or the batch) kept or zeroed together; group g
// draws as dropout's element g does.
inline void stochastic_depth(const float* x, float* y, int64_t n, int64_t group, float p, float scale,
                             uint64_t stream, const Mode& mode) {
  if (!mode.training) {
    for_each("stochastic_depth (eval)", n, [=] DG_HD(int64_t i) { y[i] = x[i]; });
    return;
  }
  const uint64_t key = dropout_key(mode, stream);  // on the host
  for_each("stochastic_depth", n,
           [=] DG_HD(int64_t i) { y[i] = modes_detail::keep(key, i / group, p) ? x[i] * scale : 0.0f; });
}

}  // namespace dg
