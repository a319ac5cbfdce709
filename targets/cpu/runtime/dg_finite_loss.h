// dg_finite_loss.h: a train_step whose loss is not finite changes nothing: the
// error it throws and the module state put back when it does.
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project that uses it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace dg {

// A train_step whose loss is NaN or infinite: thrown before any gradient,
// parameter or optimizer state changed (Python: NonFiniteLossError, a ValueError).
class NonFiniteLoss : public std::domain_error {
 public:
  using std::domain_error::domain_error;
};

// Module state as a train_step found it, put back when the step fails: batch
// norm moves its running statistics (and a training-mode call takes a dropout
// draw) in the forward part, before the loss is known to be finite.  Tensor is
// dg::Tensor or dg::DeviceTensor (host() and host_written() on either).
template <typename Tensor>
class KeptState {
 public:
  KeptState(const std::vector<std::pair<std::string, Tensor*>>& tensors, uint64_t draws) : draws_(draws) {
    for (const auto& named : tensors) {
      const auto* values = named.second->host();
      kept_.emplace_back(named.second, std::vector<float>(values, values + named.second->size()));
    }
  }
  void put_back(uint64_t& draws) {
    for (auto& [tensor, values] : kept_) {
      std::copy(values.begin(), values.end(), tensor->host());
      tensor->host_written();
    }
    draws = draws_;
  }

 private:
  std::vector<std::pair<Tensor*, std::vector<float>>> kept_;
  uint64_t draws_;
};

inline void require_finite_loss(float loss, int64_t step) {
  if (std::isfinite(loss)) return;
  throw NonFiniteLoss("train_step " + std::to_string(step) + ": the loss is " +
                      (std::isnan(loss) ? "nan" : "inf") +
                      "; nothing was updated (look at the inputs, the labels and the learning rate)");
}

}  // namespace dg
