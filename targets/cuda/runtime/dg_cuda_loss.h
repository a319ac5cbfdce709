// dg_cuda_loss.h: softmax cross-entropy and its gradient on the GPU (dg_loss.h's
// names); bad labels fail the call like bad gather ids.
//
// Part of the deepgen CUDA runtime: hand-written, copied unchanged into every
// generated project that uses it. Header-only, C++17 (CUDA: needs --extended-lambda).
#pragma once

#include <cmath>
#include <cstdint>

#include "dg_cuda.h"
#include "dg_cuda_compat.h"
#include "dg_cuda_launch.h"
#include "dg_cuda_layout.h"
#include "dg_cuda_reduce.h"

namespace dg {

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
    for (int64_t i = 0; i < rows; ++i)
      counted += !ignore.skips(static_cast<int64_t>(labels[i]));
    scale[0] = counted > 0 ? g[0] / static_cast<float>(counted) : 0.0f;
  });
  for_each("softmax_xent_grad", rows, [=] DG_HD(int64_t i) {
    const float* z = logits + i * classes;
    float* d = d_logits + i * classes;
    const int64_t label = static_cast<int64_t>(labels[i]);
    if (ignore.skips(label)) {
      for (int64_t j = 0; j < classes; ++j)
        d[j] = 0.0f;
      return;
    }
    const float m = ops_detail::strided_max(z, classes, 1);
    const float sum = ops_detail::strided_sum_exp(z, classes, 1, m);
    for (int64_t j = 0; j < classes; ++j)
      d[j] = expf(z[j] - m) / sum * scale[0];
    if (label >= 0 && label < classes) d[label] -= scale[0];
  });
}

}  // namespace dg
