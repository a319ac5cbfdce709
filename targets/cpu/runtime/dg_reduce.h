// dg_reduce.h: ops along one axis: sums, means, maxima, softmax, log-softmax
// and prefix sums. A tensor is viewed as [outer, len, inner] around the axis:
// `outer` is the product of the dimensions before it, `len` the axis itself and
// `inner` the product of those after it, so one loop serves every axis of every rank.
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project that uses it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>

#include "dg_math.h"
#include "dg_parallel.h"

namespace dg {

// y[o, i] = sum over l of x[o, l, i].  The innermost loop runs over `inner`,
// which is contiguous in both x and y.
inline void reduce_sum(const float* x, float* y, int64_t outer, int64_t len, int64_t inner) {
  for (int64_t o = 0; o < outer; ++o) {
    float* y_row = y + o * inner;
    for (int64_t i = 0; i < inner; ++i)
      y_row[i] = 0.0f;
    for (int64_t l = 0; l < len; ++l) {
      const float* x_row = x + (o * len + l) * inner;
      for (int64_t i = 0; i < inner; ++i)
        y_row[i] += x_row[i];
    }
  }
}

// y[o, i] = mean over l of x[o, l, i].  An empty axis gives NaN, as in numpy.
inline void reduce_mean(const float* x, float* y, int64_t outer, int64_t len, int64_t inner) {
  reduce_sum(x, y, outer, len, inner);
  const float count = static_cast<float>(len);
  for (int64_t j = 0; j < outer * inner; ++j)
    y[j] /= count;
}

// y[o, i] = max over l of x[o, l, i].  NaN propagates, as in numpy.
inline void reduce_max(const float* x, float* y, int64_t outer, int64_t len, int64_t inner) {
  if (len == 0) throw std::invalid_argument("max over an empty axis");
  for (int64_t o = 0; o < outer; ++o) {
    float* y_row = y + o * inner;
    const float* x_first = x + o * len * inner;
    for (int64_t i = 0; i < inner; ++i)
      y_row[i] = x_first[i];
    for (int64_t l = 1; l < len; ++l) {
      const float* x_row = x + (o * len + l) * inner;
      for (int64_t i = 0; i < inner; ++i) {
        const float v = x_row[i];
        // Once y holds NaN, `v > NaN` is false, so the NaN is kept.
        if (v > y_row[i] || std::isnan(v)) y_row[i] = v;
      }
    }
  }
}

namespace ops_detail {

// Operations (threads_for) a value of softmax and log-softmax counts for: its
// maximum, exp and sum passes.
constexpr int64_t kExpWork = 16;

// Maximum of x[l * stride] over l in [0, len); len must be > 0.
inline float strided_max(const float* x, int64_t len, int64_t stride) {
  float m = x[0];
  for (int64_t l = 1; l < len; ++l) {
    const float v = x[l * stride];
    if (v > m || std::isnan(v)) m = v;
  }
  return m;
}

// Sum of exp(x[l * stride] - m) over l in [0, len), added in order. The exps are
// dg::math::exp_f (dg_math.h: inline, within 1 ulp), so that a contiguous row's
// are computed 16 at a time (into a block on the stack, then summed in order):
// std::exp, a libm call for each value, twice a value with softmax's, was 8% of an
// int8 BERT encoder's time at batch 64.
inline float strided_sum_exp(const float* x, int64_t len, int64_t stride, float m) {
  float s = 0.0f;
  if (stride != 1) {
    for (int64_t l = 0; l < len; ++l)
      s += math::exp_f(x[l * stride] - m);
    return s;
  }
  constexpr int64_t kBlock = 256;
  alignas(64) float e[kBlock];
  for (int64_t l0 = 0; l0 < len; l0 += kBlock) {
    const int64_t n = std::min(kBlock, len - l0);
    for (int64_t l = 0; l < n; ++l)
      e[l] = math::exp_f(x[l0 + l] - m);
    for (int64_t l = 0; l < n; ++l)
      s += e[l];
  }
  return s;
}

// Softmax's and log-softmax's loop over the rows of [outer, len, inner]: for
// each (o, i), its maximum m and sum of exp(x - m) s, t = of_sum(s) once, then
// value(v, m, t) for each of its values v. Rows are shared out over threads
// (each computed as on one thread: the same values however many).
template <class OfSum, class Value>
inline void softmax_rows(const float* x, float* y, int64_t outer, int64_t len, int64_t inner,
                         const OfSum& of_sum, const Value& value) {
  if (len == 0) return;
  const int threads = threads_for(kExpWork * outer * len * inner);
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
#else
  (void)threads;
#endif
  for (int64_t row = 0; row < outer * inner; ++row) {
    const int64_t o = row / inner, i = row % inner, base = o * len * inner + i;
    const float m = strided_max(x + base, len, inner);
    const float t = of_sum(strided_sum_exp(x + base, len, inner, m));
    if (inner == 1) {  // (a unit stride the compiler sees: 16 values at a time)
      const float* xr = x + base;
      float* yr = y + base;
      for (int64_t l = 0; l < len; ++l)
        yr[l] = value(xr[l], m, t);
      continue;
    }
    for (int64_t l = 0; l < len; ++l) {
      const int64_t at = base + l * inner;
      y[at] = value(x[at], m, t);
    }
  }
}

}  // namespace ops_detail

// Softmax along the middle axis of [outer, len, inner].  The maximum is
// subtracted first so exp never overflows.
inline void softmax(const float* x, float* y, int64_t outer, int64_t len, int64_t inner) {
  ops_detail::softmax_rows(
      x, y, outer, len, inner, [](float s) { return s; },
      [](float v, float m, float s) { return math::exp_f(v - m) / s; });
}

// log(softmax(x)) along the middle axis, computed as x - max - log(sum(exp(x - max)))
// so that very negative entries do not underflow to log(0).
inline void log_softmax(const float* x, float* y, int64_t outer, int64_t len, int64_t inner) {
  ops_detail::softmax_rows(
      x, y, outer, len, inner, [](float s) { return std::log(s); },
      [](float v, float m, float log_s) { return (v - m) - log_s; });
}

// Inclusive prefix sums along the middle axis of [outer, len, inner] (numpy.cumsum):
// y[o, l, i] = x[o, 0, i] + ... + x[o, l, i], added in that order in float. With
// `reverse`, the sums run from the end: y[o, l, i] = x[o, l, i] + ... + x[o, len - 1, i]
// (cumsum's gradient).
inline void cumsum(const float* x, float* y, int64_t outer, int64_t len, int64_t inner, bool reverse) {
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t step = 0; step < len; ++step) {
      const int64_t l = reverse ? len - 1 - step : step;
      const float* x_row = x + (o * len + l) * inner;
      float* y_row = y + (o * len + l) * inner;
      if (step == 0) {
        for (int64_t i = 0; i < inner; ++i)
          y_row[i] = x_row[i];
        continue;
      }
      const float* before = reverse ? y_row + inner : y_row - inner;  // the sum so far
      for (int64_t i = 0; i < inner; ++i)
        y_row[i] = before[i] + x_row[i];
    }
  }
}

}  // namespace dg
