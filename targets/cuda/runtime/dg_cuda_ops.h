// dg_cuda_ops.h: the operators deepgen-generated code calls, on the GPU.
//
// Same names and arguments as the CPU runtime (dg_ops.h), so lowered code is
// the same for both targets; every pointer here is a device pointer (sizes and
// small shape arrays stay on the host). Tensors are dense row-major float
// arrays; ops along one axis view their input as [outer, len, inner].
//
// Most ops are one per-element (or per-output) lambda run by dg::for_each, so
// the CPU emulation runs the same code. Reductions and softmax along a long
// contiguous axis (inner == 1) use one block per row with a shared-memory tree
// on the GPU; their per-output lambda is the CPU emulation's version and the
// GPU's for strided axes.
//
// Checks that need device data (gather ids, loss labels) record the first bad
// position; CallScope::finish() raises it (dg_cuda.h).
//
// Part of the deepgen CUDA runtime: hand-written, copied unchanged into every
// generated project. Header-only, C++17 (CUDA: needs --extended-lambda).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "dg_cuda.h"
#include "dg_cuda_compat.h"
#include "dg_cuda_gemm.h"
#include "dg_cuda_launch.h"
#include "dg_cuda_layer_norm.h"

namespace dg {

namespace ops_detail {

// NaN-propagating maximum, as numpy's (v != v is true only for NaN).
DG_HD inline float max_nan(float m, float v) { return (v > m || v != v) ? v : m; }

// Maximum and sum of exp(x - max) of x[l * stride], l in [0, len); len > 0.
DG_HD inline float strided_max(const float* x, int64_t len, int64_t stride) {
  float m = x[0];
  for (int64_t l = 1; l < len; ++l) m = max_nan(m, x[l * stride]);
  return m;
}

DG_HD inline float strided_sum_exp(const float* x, int64_t len, int64_t stride, float m) {
  float s = 0.0f;
  for (int64_t l = 0; l < len; ++l) s += expf(x[l * stride] - m);
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
    if (t < half) shared[t] = R == Reduce::kSum ? shared[t] + shared[t + half] : max_nan(shared[t], shared[t + half]);
    __syncthreads();
  }
  const float result = shared[0];
  __syncthreads();
  return result;
}

// y[row] = sum or max of x[row, 0 .. len), one block per row; `scale` multiplies a sum (1/len for a mean).
template <Reduce R>
__global__ void __launch_bounds__(kRowThreads) reduce_rows_kernel(const float* x, float* y, int64_t len, float scale) {
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
  for (int64_t l = threadIdx.x; l < len; l += kRowThreads) m = max_nan(m, x[base + l]);
  m = block_reduce<Reduce::kMax>(m, shared);
  float s = 0.0f;
  for (int64_t l = threadIdx.x; l < len; l += kRowThreads) s += expf(x[base + l] - m);
  s = block_reduce<Reduce::kSum>(s, shared);
  const float log_s = logf(s);
  for (int64_t l = threadIdx.x; l < len; l += kRowThreads)
    y[base + l] = Log ? (x[base + l] - m) - log_s : expf(x[base + l] - m) / s;
}

// Rows at least this long use a block each (when the axis is contiguous).
constexpr int64_t kBlockRowLength = 256;

inline bool use_row_blocks(int64_t len, int64_t inner) { return inner == 1 && len >= kBlockRowLength; }

#endif

template <Reduce R>
void reduce(const char* what, const float* x, float* y, int64_t outer, int64_t len, int64_t inner, bool mean) {
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
      for (int64_t l = 0; l < len; ++l) s += first[l * inner];
      y[j] = mean ? s / static_cast<float>(len) : s;
    }
  });
}

template <bool Log>
void softmax_along(const char* what, const float* x, float* y, int64_t outer, int64_t len, int64_t inner) {
  if (len == 0) return;
#ifdef __CUDACC__
  if (use_row_blocks(len, inner) && outer <= int64_t{0x7fffffff}) {
    if (outer > 0) softmax_rows_kernel<Log><<<static_cast<unsigned>(outer), kRowThreads, 0, stream()>>>(x, y, len);
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

// Most axes a transpose handles (the shape and permutation travel by value).
constexpr int kMaxRank = 8;

namespace ops_detail {

struct TransposeLayout {
  int64_t y_shape[kMaxRank];
  int64_t x_step[kMaxRank];  // x's stride along each axis of y
};

}  // namespace ops_detail

// numpy.transpose(x, perm): y's axis d is x's axis perm[d]. `shape` and `perm`
// are host arrays; each output element finds its source by its coordinates.
inline void transpose(const float* x, float* y, int ndim, const int64_t* shape, const int* perm) {
  if (ndim > kMaxRank) throw std::invalid_argument("transpose: more than 8 axes");
  ops_detail::TransposeLayout layout{};
  int64_t total = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    layout.x_step[d] = 1;
    for (int e = perm[d] + 1; e < ndim; ++e) layout.x_step[d] *= shape[e];
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
inline void copy_axis(const float* src, float* dst, int64_t outer, int64_t src_len, int64_t src_start,
                      int64_t dst_len, int64_t dst_start, int64_t count, int64_t inner) {
  const int64_t block = count * inner;
  for_each("copy_axis", outer * block, [=] DG_HD(int64_t j) {
    const int64_t o = j / block, r = j % block;
    dst[(o * dst_len + dst_start) * inner + r] = src[(o * src_len + src_start) * inner + r];
  });
}

// Embedding lookup: out[i, :] = table[ids[i], :], table being [rows, width].
// A bad id leaves zeros in its row and fails the call (CallScope::finish) with
// the CPU target's message; `what` names the lookup.
template <typename Id>
void gather_rows(const float* table, int64_t rows, int64_t width, const Id* ids, int64_t n, float* out,
                 const char* what) {
  static_assert(std::is_integral<Id>::value, "gather_rows ids must be integers");
  if (n * width == 0) return;
  int64_t* bad = new_check(what, "index", rows);
  for_each("gather_rows", n * width, [=] DG_HD(int64_t j) {
    const int64_t i = j / width, c = j % width;
    const int64_t id = static_cast<int64_t>(ids[i]);
    if (id < 0 || id >= rows) {
      out[j] = 0.0f;
      if (c == 0) atomic_min_position(bad, i);
    } else {
      out[j] = table[id * width + c];
    }
  });
  // The value at the first bad position, for the message.
  for_each("gather_rows check", 1, [=] DG_HD(int64_t) {
    if (bad[0] != kNoBadPosition) bad[1] = static_cast<int64_t>(ids[bad[0]]);
  });
}

// An additive mask for sequences padded to T: mask[n, t] = 0 where t < lengths[n],
// -inf past it. The lengths are checked on the host (an input's are read from
// the caller's array, without a copy back): each must lie in [1, T], else
// std::invalid_argument with the CPU target's message.
template <typename Id>
void length_mask(const Id* lengths, float* mask, int64_t N, int64_t T, const char* what) {
  static_assert(std::is_integral<Id>::value, "length_mask lengths must be integers");
  const std::vector<Id> host = host_values(lengths, N);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t length = static_cast<int64_t>(host[static_cast<size_t>(n)]);
    if (length < 1 || length > T) {
      throw std::invalid_argument(std::string(what) + ": length " + std::to_string(length) + " at position " +
                                  std::to_string(n) + " is out of range [1, " + std::to_string(T) + "]");
    }
  }
  const float minus_inf = -std::numeric_limits<float>::infinity();
  for_each("length_mask", N * T, [=] DG_HD(int64_t j) {
    mask[j] = j % T < static_cast<int64_t>(lengths[j / T]) ? 0.0f : minus_inf;
  });
}

// The additive mask of a 0/1 integer mask [N, T] (Hugging Face's attention_mask):
// out[n, t] = 0 where mask[n, t] != 0, -inf where it is 0. Each row is checked on
// the host to keep a position (else std::invalid_argument with the CPU target's message).
template <typename Id>
void key_mask(const Id* mask, float* out, int64_t N, int64_t T, const char* what) {
  static_assert(std::is_integral<Id>::value, "key_mask masks must be integers");
  const std::vector<Id> host = host_values(mask, N * T);
  for (int64_t n = 0; n < N; ++n) {
    bool kept = false;
    for (int64_t t = 0; t < T; ++t) kept = kept || host[static_cast<size_t>(n * T + t)] != 0;
    if (!kept) {
      throw std::invalid_argument(std::string(what) + ": row " + std::to_string(n) + " keeps no position (all zeros)");
    }
  }
  const float minus_inf = -std::numeric_limits<float>::infinity();
  for_each("key_mask", N * T, [=] DG_HD(int64_t j) { out[j] = mask[j] != 0 ? 0.0f : minus_inf; });
}

// The additive mask of causal attention [T, T]: 0 where key k <= query q, -inf above.
inline void causal_mask(float* out, int64_t T) {
  const float minus_inf = -std::numeric_limits<float>::infinity();
  for_each("causal_mask", T * T, [=] DG_HD(int64_t j) { out[j] = j % T <= j / T ? 0.0f : minus_inf; });
}

// x[0..n) = value.
inline void fill(float* x, int64_t n, float value) {
  for_each("fill", n, [=] DG_HD(int64_t i) { x[i] = value; });
}

// The adjoint of gather_rows: table_grad[rows, width] = 0, then
// table_grad[ids[i], :] += src[i, :] (atomically: ids repeat). The ids were
// checked by the gather, whose errors are raised before the backward pass.
template <typename Id>
void scatter_add_rows(const Id* ids, int64_t n, const float* src, int64_t width, float* table_grad, int64_t rows) {
  fill(table_grad, rows * width, 0.0f);
  for_each("scatter_add_rows", n * width, [=] DG_HD(int64_t j) {
    const int64_t i = j / width, c = j % width;
    const int64_t id = static_cast<int64_t>(ids[i]);
    if (id >= 0 && id < rows) atomic_add(table_grad + id * width + c, src[j]);
  });
}

// A label that softmax_xent skips (PyTorch's ignore_index): dg::IgnoreIndex{-1};
// IgnoreIndex{} skips none (every int64 label is then checked against the classes).
struct IgnoreIndex {
    int64_t label = 0;
    bool active = false;
    IgnoreIndex() = default;
    explicit IgnoreIndex(int64_t l) : label(l), active(true) {}
    DG_HD bool skips(int64_t l) const { return active && l == label; }
};

// Mean softmax cross-entropy of logits[rows, classes] against integer labels:
// loss = mean_i (logsumexp(logits_i) - logits_i[label_i]) over the rows whose label
// is not ignore_index; 0 when no row is labeled. Bad labels fail the call like bad
// gather ids.
template <typename Id>
void softmax_xent(const float* logits, const Id* labels, float* loss, int64_t rows, int64_t classes,
                  const char* what, IgnoreIndex ignore = IgnoreIndex()) {
  if (rows == 0) {
    fill(loss, 1, 0.0f);
    return;
  }
  int64_t* bad = new_check(what, "label", classes);
  DeviceVector<float> per_row(rows);
  float* row_loss = per_row.data();
  for_each("softmax_xent", rows, [=] DG_HD(int64_t i) {
    const int64_t label = static_cast<int64_t>(labels[i]);
    if (ignore.skips(label)) {
      row_loss[i] = 0.0f;
      return;
    }
    if (label < 0 || label >= classes) {
      atomic_min_position(bad, i);
      row_loss[i] = 0.0f;
      return;
    }
    const float* z = logits + i * classes;
    const float m = ops_detail::strided_max(z, classes, 1);
    row_loss[i] = (m + logf(ops_detail::strided_sum_exp(z, classes, 1, m))) - z[label];
  });
  // The mean, in double and in a fixed order.
  for_each("softmax_xent mean", 1, [=] DG_HD(int64_t) {
    double total = 0.0;
    int64_t counted = 0;
    for (int64_t i = 0; i < rows; ++i) {
      total += static_cast<double>(row_loss[i]);
      counted += !ignore.skips(static_cast<int64_t>(labels[i]));
    }
    loss[0] = counted > 0 ? static_cast<float>(total / static_cast<double>(counted)) : 0.0f;
    if (bad[0] != kNoBadPosition) bad[1] = static_cast<int64_t>(labels[bad[0]]);
  });
}

// Gradient of softmax_xent: d_logits = (softmax(logits) - onehot(labels)) * g / labeled rows,
// with g a device scalar; zero on the rows it skips.
template <typename Id>
void softmax_xent_grad(const float* logits, const Id* labels, const float* g, float* d_logits, int64_t rows,
                       int64_t classes, IgnoreIndex ignore = IgnoreIndex()) {
  if (rows == 0) return;
  DeviceVector<float> scale_slot(1);
  float* scale = scale_slot.data();
  for_each("softmax_xent_grad count", 1, [=] DG_HD(int64_t) {
    int64_t counted = 0;
    for (int64_t i = 0; i < rows; ++i) counted += !ignore.skips(static_cast<int64_t>(labels[i]));
    scale[0] = counted > 0 ? g[0] / static_cast<float>(counted) : 0.0f;
  });
  for_each("softmax_xent_grad", rows, [=] DG_HD(int64_t i) {
    const float* z = logits + i * classes;
    float* d = d_logits + i * classes;
    const int64_t label = static_cast<int64_t>(labels[i]);
    if (ignore.skips(label)) {
      for (int64_t j = 0; j < classes; ++j) d[j] = 0.0f;
      return;
    }
    const float m = ops_detail::strided_max(z, classes, 1);
    const float sum = ops_detail::strided_sum_exp(z, classes, 1, m);
    for (int64_t j = 0; j < classes; ++j) d[j] = expf(z[j] - m) / sum * scale[0];
    if (label >= 0 && label < classes) d[label] -= scale[0];
  });
}

// Windowed attention's constant tables (ops/windows.py; the same formulas as dg_ops.h's).
inline void relative_position_index(int64_t* out, int64_t wh, int64_t ww) {
  const int64_t L = wh * ww;
  for_each("relative_position_index", L * L, [=] DG_HD(int64_t j) {
    const int64_t p = j / L, q = j % L;
    out[j] = (p / ww - q / ww + wh - 1) * (2 * ww - 1) + (p % ww - q % ww + ww - 1);
  });
}

DG_HD inline int64_t window_region(int64_t i, int64_t length, int64_t window, int64_t shift) {
  if (shift == 0) return 0;
  return (i >= length - window ? 1 : 0) + (i >= length - shift ? 1 : 0);
}

inline void shifted_window_mask(float* out, int64_t H, int64_t W, int64_t wh, int64_t ww, int64_t sh, int64_t sw,
                                float value) {
  const int64_t L = wh * ww, across = W / ww, windows = (H / wh) * across;
  for_each("shifted_window_mask", windows * L * L, [=] DG_HD(int64_t j) {
    const int64_t w = j / (L * L), p = (j / L) % L, q = j % L;
    const int64_t top = (w / across) * wh, left = (w % across) * ww;
    const int64_t lp = window_region(top + p / ww, H, wh, sh) * 3 + window_region(left + p % ww, W, ww, sw);
    const int64_t lq = window_region(top + q / ww, H, wh, sh) * 3 + window_region(left + q % ww, W, ww, sw);
    out[j] = lp != lq ? value : 0.0f;
  });
}

DG_HD inline float log_spaced_coord(int64_t d, int64_t w) {
  const double t = 8.0 * static_cast<double>(d) / static_cast<double>(w - 1);
  const double s = t > 0 ? 1.0 : (t < 0 ? -1.0 : 0.0);
  return static_cast<float>(s * log2(fabs(t) + 1.0) / 3.0);
}

inline void relative_coords_table(float* out, int64_t wh, int64_t ww) {
  const int64_t across = 2 * ww - 1;
  for_each("relative_coords_table", (2 * wh - 1) * across, [=] DG_HD(int64_t j) {
    out[j * 2] = log_spaced_coord(j / across - (wh - 1), wh);
    out[j * 2 + 1] = log_spaced_coord(j % across - (ww - 1), ww);
  });
}

}  // namespace dg
