// dg_arena.h: the one block of memory that holds a call's intermediates.
//
// deepgen plans every intermediate's offset at generation time (as a formula
// in the symbolic sizes); the arena hands out those pieces, checks them against
// its size, and records the highest byte actually used, so the plan's
// prediction can be compared with what the code really touched.
//
// The arena and the per-call buffers of recursive ops (level buffers, states
// in schedule order) are Scratch: uninitialized memory kept by each thread for
// its next call.  A model called in a loop then neither asks the OS for fresh
// pages (page faults, zeroing) nor clears memory that every op overwrites.
// Memory that comes fresh from the system is filled with NaN bytes, so code
// that reads a buffer before writing it shows up as NaN on the first call
// instead of passing by luck with zeros.
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project. Header-only, C++17.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace dg {

namespace scratch_detail {

constexpr size_t kAlign = 64;                      // a cache line (and an AVX-512 vector)
constexpr size_t kMaxKeptBytes = size_t(1) << 30;  // per thread, beyond it blocks go back
constexpr size_t kMaxKeptBlocks = 64;

// One thread's blocks free for reuse: (size in bytes, memory).
class Cache {
 public:
  Cache() = default;
  Cache(const Cache&) = delete;
  Cache& operator=(const Cache&) = delete;
  ~Cache() {
    for (auto& block : free_)
      release_to_system(block.second);
  }

  // A block of at least `bytes`: the smallest kept one that is not more than
  // twice too big, else fresh memory filled with 0xFF bytes (NaN as floats).
  void* take(size_t bytes) {
    size_t best = free_.size();
    for (size_t i = 0; i < free_.size(); ++i) {
      const size_t have = free_[i].first;
      if (have >= bytes && have <= 2 * bytes + 4096 && (best == free_.size() || have < free_[best].first))
        best = i;
    }
    if (best != free_.size()) {
      void* p = free_[best].second;
      kept_bytes_ -= free_[best].first;
      free_[best] = free_.back();
      free_.pop_back();
      return p;
    }
    void* p = ::operator new(bytes, std::align_val_t(kAlign));
    std::memset(p, 0xFF, bytes);
    return p;
  }

  // Keeps the block for a later take() unless the cache is full.
  void give_back(void* p, size_t bytes) {
    if (kept_bytes_ + bytes > kMaxKeptBytes || free_.size() >= kMaxKeptBlocks) {
      release_to_system(p);
      return;
    }
    free_.emplace_back(bytes, p);
    kept_bytes_ += bytes;
  }

 private:
  static void release_to_system(void* p) { ::operator delete(p, std::align_val_t(kAlign)); }
  std::vector<std::pair<size_t, void*>> free_;
  size_t kept_bytes_ = 0;
};

inline Cache& cache() {
  thread_local Cache c;
  return c;
}

}  // namespace scratch_detail

// A std::vector allocator whose storage starts on a cache line: the packed
// weights of the bf16 and int8 products (Bf16PackedB, Int8PackedB), whose
// 64-byte panel rows AMX tiles load (from std::allocator's 16-byte alignment
// every row straddled two lines).
template <typename T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) noexcept {}  // NOLINT(google-explicit-constructor): rebinding
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(scratch_detail::kAlign)));
  }
  void deallocate(T* p, size_t) noexcept { ::operator delete(p, std::align_val_t(scratch_detail::kAlign)); }
  template <typename U>
  bool operator==(const LineAligned<U>&) const noexcept {
    return true;
  }
  template <typename U>
  bool operator!=(const LineAligned<U>&) const noexcept {
    return false;
  }
};

// n uninitialized values of T, from this thread's cache (see the top of the
// file); the memory goes back to the cache of the thread that took it.
template <typename T>
class Scratch {
  static_assert(std::is_trivially_copyable<T>::value, "Scratch holds plain values only");

 public:
  explicit Scratch(int64_t n) : size_(n < 0 ? 0 : n) {
    if (size_ > 0) data_ = static_cast<T*>(scratch_detail::cache().take(bytes()));
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  Scratch(Scratch&& other) noexcept : size_(other.size_), data_(other.data_) {  // (returned by value)
    other.size_ = 0;
    other.data_ = nullptr;
  }
  ~Scratch() {
    if (data_ != nullptr) scratch_detail::cache().give_back(data_, bytes());
  }

  T* data() { return data_; }
  const T* data() const { return data_; }
  int64_t size() const { return size_; }

 private:
  size_t bytes() const { return static_cast<size_t>(size_) * sizeof(T); }
  int64_t size_;
  T* data_ = nullptr;
};

class Arena {
 public:
  explicit Arena(int64_t floats) : data_(floats) {}

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
  Scratch<float> data_;
  int64_t high_water_ = 0;
};

}  // namespace dg
