// dg_loss.h: softmax cross-entropy against integer labels and its gradient.
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project that uses it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "dg_reduce.h"

namespace dg {

// A label that softmax_xent skips (PyTorch's ignore_index): dg::IgnoreIndex{-1};
// IgnoreIndex{} skips none (every int64 label is then checked against the classes).
struct IgnoreIndex {
  int64_t label = 0;
  bool active = false;
  IgnoreIndex() = default;
  explicit IgnoreIndex(int64_t l) : label(l), active(true) {}
  bool skips(int64_t l) const { return active && l == label; }
};

// Mean softmax cross-entropy of logits[rows, classes] against integer labels:
// loss = mean_i (logsumexp(logits_i) - logits_i[label_i]) over the rows whose
// label is not ignore_index (PyTorch's ignore_index); 0 when no row is labeled.
template <typename Id>
void softmax_xent(const float* logits, const Id* labels, float* loss, int64_t rows, int64_t classes,
                  const char* what, IgnoreIndex ignore = IgnoreIndex()) {
  double total = 0.0;
  int64_t counted = 0;
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t label = static_cast<int64_t>(labels[i]);
    if (ignore.skips(label)) continue;
    if (label < 0 || label >= classes) {
      throw std::invalid_argument(std::string(what) + ": label " + std::to_string(label) + " at position " +
                                  std::to_string(i) + " is out of range [0, " + std::to_string(classes) +
                                  ")");
    }
    const float* z = logits + i * classes;
    const float m = ops_detail::strided_max(z, classes, 1);
    const float logz = m + std::log(ops_detail::strided_sum_exp(z, classes, 1, m));
    total += static_cast<double>(logz - z[label]);
    ++counted;
  }
  loss[0] = counted > 0 ? static_cast<float>(total / static_cast<double>(counted)) : 0.0f;
}

// Gradient of softmax_xent: d_logits = (softmax(logits) - onehot(labels)) * g / labeled rows,
// zero on the rows it skips.
template <typename Id>
void softmax_xent_grad(const float* logits, const Id* labels, const float* g, float* d_logits, int64_t rows,
                       int64_t classes, IgnoreIndex ignore = IgnoreIndex()) {
  int64_t counted = 0;
  for (int64_t i = 0; i < rows; ++i)
    counted += !ignore.skips(static_cast<int64_t>(labels[i]));
  const float scale = counted > 0 ? g[0] / static_cast<float>(counted) : 0.0f;
  for (int64_t i = 0; i < rows; ++i) {
    const float* z = logits + i * classes;
    float* d = d_logits + i * classes;
    const int64_t label = static_cast<int64_t>(labels[i]);
    if (ignore.skips(label)) {
      std::fill(d, d + classes, 0.0f);
      continue;
    }
    const float m = ops_detail::strided_max(z, classes, 1);
    const float sum = ops_detail::strided_sum_exp(z, classes, 1, m);
    for (int64_t j = 0; j < classes; ++j)
      d[j] = std::exp(z[j] - m) / sum * scale;
    d[label] -= scale;
  }
}

}  // namespace dg
