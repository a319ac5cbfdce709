// dg_modes.h - the ops whose behavior depends on the train/eval mode (dg::Mode,
// dg_rng.h), as in PyTorch: batch norm and dropout.
//
// Batch norm views x as [N, C, HW] (NCHW, or [N, C] with HW = 1). In training
// mode it normalizes with the batch's per-channel mean and biased variance and
// moves the running statistics by `momentum` (the unbiased variance), in place;
// in evaluation mode it normalizes with the running statistics. Either way it
// writes the mean and 1/sqrt(var + eps) it used, which the gradient reads.
// Sums run in double, so a large batch loses no precision.
//
// Dropout draws its mask from the counter-based RNG of dg_rng.h, so the numpy
// reference drops the same elements; its gradient is the same call on g (the
// mask is drawn again, not kept).
#pragma once

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "dg_parallel.h"
#include "dg_rng.h"

namespace dg {

namespace modes_detail {

// y = (x - mean) * (invstd * w) + b on channel c, from the statistics as stored:
// batch_norm and batch_norm_apply compute alike, so a recomputation is exact.
// to[i] = (from[i] - m) * scale + shift for i < n (from may be to): the
// normalization every batch norm function here applies, so all round alike (and
// the int8 convolutions' epilogue: NormalizeEpilogue::in_register in dg_conv.h, the
// same expression on 16 values in a register).
inline void normalize_values(const float* from, float* to, int64_t n, float m, float scale, float shift) {
  for (int64_t i = 0; i < n; ++i)
    to[i] = (from[i] - m) * scale + shift;
}

inline void normalize_channel(const float* x, const float* w, const float* b, const float* mean,
                              const float* invstd, float* y, int64_t N, int64_t C, int64_t HW, int64_t c) {
  const float m = mean[c], scale = invstd[c] * w[c], shift = b[c];
  for (int64_t n = 0; n < N; ++n)
    normalize_values(x + (n * C + c) * HW, y + (n * C + c) * HW, HW, m, scale, shift);
}

// 1 / sqrt(var + eps), in double, rounded to float.
inline float inverse_std(double var, float eps) {
  return static_cast<float>(1.0 / std::sqrt(var + static_cast<double>(eps)));
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
  const int threads = threads_for(2 * N * C * HW);
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) if (threads > 1)
#else
  (void)threads;
#endif
  for (int64_t c = 0; c < C; ++c) {
    double m, var;
    if (mode.training) {
      double sum = 0.0;
      for (int64_t n = 0; n < N; ++n) {
        const float* row = x + (n * C + c) * HW;
        for (int64_t i = 0; i < HW; ++i)
          sum += row[i];
      }
      m = sum / static_cast<double>(count);
      double squares = 0.0;
      for (int64_t n = 0; n < N; ++n) {
        const float* row = x + (n * C + c) * HW;
        for (int64_t i = 0; i < HW; ++i) {
          const double d = row[i] - m;
          squares += d * d;
        }
      }
      var = squares / static_cast<double>(count);
      const double unbiased = squares / static_cast<double>(count - 1);
      running_mean[c] = static_cast<float>((1.0 - momentum) * running_mean[c] + momentum * m);
      running_var[c] = static_cast<float>((1.0 - momentum) * running_var[c] + momentum * unbiased);
    } else {
      m = running_mean[c];
      var = running_var[c];
    }
    mean[c] = static_cast<float>(m);
    invstd[c] = modes_detail::inverse_std(var, eps);
    modes_detail::normalize_channel(x, w, b, mean, invstd, y, N, C, HW, c);
  }
}

// The mean and invstd batch_norm uses in evaluation mode: the running
// statistics, invstd = 1 / sqrt(running_var + eps) (dg::conv2d_batch_norm).
inline void batch_norm_eval_statistics(const float* running_mean, const float* running_var, float* mean,
                                       float* invstd, int64_t C, float eps) {
  for (int64_t c = 0; c < C; ++c) {
    mean[c] = running_mean[c];
    invstd[c] = modes_detail::inverse_std(running_var[c], eps);
  }
}

// y = batch norm's output made again from x and the mean and invstd it wrote
// (the backward pass recomputes it rather than keep it: see ops/modes.py).
inline void batch_norm_apply(const float* x, const float* w, const float* b, const float* mean,
                             const float* invstd, float* y, int64_t N, int64_t C, int64_t HW) {
  const int threads = threads_for(2 * N * C * HW);
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) if (threads > 1)
#else
  (void)threads;
#endif
  for (int64_t c = 0; c < C; ++c)
    modes_detail::normalize_channel(x, w, b, mean, invstd, y, N, C, HW, c);
}

// dx, dw, db of batch_norm from x, w, the mean and invstd it used, and g.
// Training: dx = w * invstd / count * (count * g - db - xhat * dw); evaluation
// (fixed statistics): dx = g * w * invstd.
inline void batch_norm_grad(const float* x, const float* w, const float* mean, const float* invstd,
                            const float* g, float* dx, float* dw, float* db, int64_t N, int64_t C, int64_t HW,
                            const Mode& mode) {
  const int64_t count = N * HW;
  const int threads = threads_for(3 * N * C * HW);
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) if (threads > 1)
#else
  (void)threads;
#endif
  for (int64_t c = 0; c < C; ++c) {
    const float m = mean[c], inv = invstd[c];
    double sum_g = 0.0, sum_gx = 0.0;
    for (int64_t n = 0; n < N; ++n) {
      const float* xr = x + (n * C + c) * HW;
      const float* gr = g + (n * C + c) * HW;
      for (int64_t i = 0; i < HW; ++i) {
        sum_g += gr[i];
        sum_gx += static_cast<double>(gr[i]) * ((xr[i] - m) * inv);
      }
    }
    db[c] = static_cast<float>(sum_g);
    dw[c] = static_cast<float>(sum_gx);
    if (mode.training) {
      const float k = w[c] * inv / static_cast<float>(count);
      const float total_g = static_cast<float>(sum_g), total_gx = static_cast<float>(sum_gx);
      const float n = static_cast<float>(count);
      for (int64_t r = 0; r < N; ++r) {
        const float* xr = x + (r * C + c) * HW;
        const float* gr = g + (r * C + c) * HW;
        float* out = dx + (r * C + c) * HW;
        for (int64_t i = 0; i < HW; ++i)
          out[i] = k * (n * gr[i] - total_g - (xr[i] - m) * inv * total_gx);
      }
    } else {
      const float k = w[c] * inv;
      for (int64_t r = 0; r < N; ++r) {
        const float* gr = g + (r * C + c) * HW;
        float* out = dx + (r * C + c) * HW;
        for (int64_t i = 0; i < HW; ++i)
          out[i] = gr[i] * k;
      }
    }
  }
}

// y = x * scale where the mask keeps an element (probability 1 - p), else 0, in
// training mode; y = x in evaluation mode. `stream` names this dropout.
inline void dropout(const float* x, float* y, int64_t n, float p, float scale, uint64_t stream,
                    const Mode& mode) {
  if (!mode.training) {
    for (int64_t i = 0; i < n; ++i)
      y[i] = x[i];
    return;
  }
  const uint64_t key = dropout_key(mode, stream);
  const int threads = threads_for(8 * n);
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) if (threads > 1)
#else
  (void)threads;
#endif
  for (int64_t i = 0; i < n; ++i)
    y[i] = dropout_keep(key, i, p) ? x[i] * scale : 0.0f;
}

// Stochastic depth (torchvision): y = x * scale where the mask keeps a whole
// group of `group` consecutive elements (a sample's residual branch, or the whole
// batch), probability 1 - p, else 0, in training mode; y = x in evaluation mode.
// Group g draws as dropout's element g does.
inline void stochastic_depth(const float* x, float* y, int64_t n, int64_t group, float p, float scale,
                             uint64_t stream, const Mode& mode) {
  if (!mode.training) {
    for (int64_t i = 0; i < n; ++i)
      y[i] = x[i];
    return;
  }
  const uint64_t key = dropout_key(mode, stream);
  for (int64_t start = 0; start < n; start += group) {
    const float k = dropout_keep(key, start / group, p) ? scale : 0.0f;
    const int64_t end = start + group < n ? start + group : n;
    for (int64_t i = start; i < end; ++i)
      y[i] = x[i] * k;
  }
}

}  // namespace dg
