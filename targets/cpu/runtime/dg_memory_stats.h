// dg_memory_stats.h: what the last call's arena used, planned and measured
// (Model::memory_stats()).
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project that uses it.
#pragma once

#include <cstdint>
#include <mutex>

namespace dg {

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

}  // namespace dg
