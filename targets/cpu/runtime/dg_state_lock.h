// dg_state_lock.h: the lock that lets threads share one generated Model
// (StateLock; SerialStateLock where calls cannot overlap at all).
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project that uses it.
#pragma once

#include <mutex>
#include <shared_mutex>

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

}  // namespace dg
