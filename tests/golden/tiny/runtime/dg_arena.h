// dg_arena.h: the one block of memory that holds a call's intermediates.
//
// deepgen plans every intermediate's offset at generation time (as a formula
// in the symbolic sizes); the arena hands out those pieces, checks them against
// its size, and records the highest byte actually used, so the plan's
// prediction can be compared with what the code really touched.
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project. Header-only, C++17.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace dg {

class Arena {
 public:
  explicit Arena(int64_t floats) : data_(static_cast<size_t>(floats)) {}

  // The planned piece [offset, offset + count) of the arena, in floats.
  float* at(int64_t offset, int64_t count) {
    if (offset < 0 || count < 0 || offset + count > static_cast<int64_t>(data_.size()))
      throw std::logic_error("memory plan error: piece [" + std::to_string(offset) + ", " +
                             std::to_string(offset + count) + ") outside an arena of " +
                             std::to_string(data_.size()) + " floats");
    high_water_ = std::max(high_water_, offset + count);
    return data_.data() + offset;
  }

  int64_t size_bytes() const { return static_cast<int64_t>(data_.size() * sizeof(float)); }
  int64_t high_water_bytes() const { return high_water_ * static_cast<int64_t>(sizeof(float)); }

 private:
  std::vector<float> data_;
  int64_t high_water_ = 0;
};

// What the last call used: the arena's planned size and its measured high-water mark.
struct MemoryStats {
  int64_t peak_bytes = 0;            // highest arena byte the last call touched
  int64_t predicted_peak_bytes = 0;  // the plan's arena size for that call's sizes
  int64_t calls = 0;

  void record(const Arena& arena) {
    peak_bytes = arena.high_water_bytes();
    predicted_peak_bytes = arena.size_bytes();
    ++calls;
  }
};

}  // namespace dg
