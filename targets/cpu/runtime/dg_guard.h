// dg_guard.h: what keeps a generated Model's state whole: the lock that lets
// threads share one Model, the memory statistics calls record in turn, the
// check that a train_step with a non-finite loss changes nothing, the ranges of
// the hyperparameters, and overflow-checked sizes.
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace dg {

// One Model shared by threads: calls that only read its state (forward, save)
// hold it for reading and may overlap one another; calls that write it
// (train_step, load, setting hyperparameters) hold it for writing, alone, so a
// reader sees the state before or after a write, never halfway.
// reading() or writing(), chosen when the call starts (holding()).
struct HeldLock {
  std::shared_lock<std::shared_mutex> shared;
  std::unique_lock<std::shared_mutex> exclusive;
};

class StateLock {
 public:
  std::shared_lock<std::shared_mutex> reading() const { return std::shared_lock<std::shared_mutex>(mutex_); }
  std::unique_lock<std::shared_mutex> writing() const { return std::unique_lock<std::shared_mutex>(mutex_); }
  // writing() when the call changes the model (forward() in training mode), else reading().
  HeldLock holding(bool exclusive) const {
    HeldLock held;
    if (exclusive) {
      held.exclusive = writing();
    } else {
      held.shared = reading();
    }
    return held;
  }

 private:
  mutable std::shared_mutex mutex_;
};

// The same interface where calls cannot overlap at all (the CUDA target: a
// call moves host changes to the device and uses the device's one stream):
// reading is exclusive too.
class SerialStateLock {
 public:
  std::unique_lock<std::shared_mutex> reading() const { return std::unique_lock<std::shared_mutex>(mutex_); }
  std::unique_lock<std::shared_mutex> writing() const { return std::unique_lock<std::shared_mutex>(mutex_); }
  HeldLock holding(bool) const {
    HeldLock held;
    held.exclusive = writing();
    return held;
  }

 private:
  mutable std::shared_mutex mutex_;
};

// What the last call used: the arena's planned size and its measured high-water
// mark (either target's Arena). Calls running at once (forward() from several
// threads) record in turn.
class MemoryStats {
 public:
  struct Reading {
    int64_t peak_bytes = 0;            // highest arena byte the last call touched
    int64_t predicted_peak_bytes = 0;  // the plan's arena size for that call's sizes
    int64_t calls = 0;
  };

  template <class Arena>
  void record(const Arena& arena) {
    std::lock_guard<std::mutex> hold(mutex_);
    last_.peak_bytes = arena.high_water_bytes();
    last_.predicted_peak_bytes = arena.size_bytes();
    ++last_.calls;
  }

  Reading read() const {
    std::lock_guard<std::mutex> hold(mutex_);
    return last_;
  }

 private:
  mutable std::mutex mutex_;
  Reading last_;
};

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
  throw NonFiniteLoss("train_step " + std::to_string(step) + ": the loss is " + (std::isnan(loss) ? "nan" : "inf") +
                      "; nothing was updated (look at the inputs, the labels and the learning rate)");
}

// Hyperparameter ranges: checked when a value is set and again by every
// train_step (hand-written code may set them directly).
inline void require_non_negative(const char* name, double value) {
  if (!(std::isfinite(value) && value >= 0.0))
    throw std::invalid_argument(std::string(name) + " must be a finite number >= 0, got " + std::to_string(value));
}

inline void require_positive(const char* name, double value) {
  if (!(std::isfinite(value) && value > 0.0))
    throw std::invalid_argument(std::string(name) + " must be a finite number > 0, got " + std::to_string(value));
}

inline void require_unit_interval(const char* name, double value) {  // [0, 1)
  if (!(value >= 0.0 && value < 1.0))
    throw std::invalid_argument(std::string(name) + " must be in [0, 1), got " + std::to_string(value));
}

// A step count train_step can still add one to.
inline void require_step(int64_t step) {
  if (step < 0 || step == std::numeric_limits<int64_t>::max())
    throw std::invalid_argument("step must be >= 0 and below 2**63 - 1, got " + std::to_string(step));
}

// A size computed from the symbolic dims, evaluated in double before the int64
// arithmetic that allocates it: inputs whose sizes would make it wrap around
// are refused (Python: ValueError) instead.
inline void require_size(double elements, const char* what) {
  if (!(elements < 9.2e18))
    throw std::length_error(std::string("input sizes too large: ") + what + " would need " + std::to_string(elements) +
                            " elements, more than int64 can index");
}

}  // namespace dg
