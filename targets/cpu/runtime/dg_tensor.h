// dg_tensor.h: the small tensor types of the generated C++ API, and the input
// checks that turn a wrong shape into a clear std::invalid_argument.
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project. Header-only, C++17, no dependencies.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace dg {

inline std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i)
    s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// The element count of `shape`; a product beyond int64 throws std::length_error
// (Python: ValueError) instead of wrapping around.
inline int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape)
    if (__builtin_mul_overflow(n, d, &n))
      throw std::length_error("a tensor of shape " + shape_str(shape) +
                              " has more elements than int64 can count");
  return n;
}

// A read-only view of caller-owned, dense row-major data (an input).
template <typename T>
struct View {
  const T* data = nullptr;
  std::vector<int64_t> shape;

  int64_t size() const { return numel(shape); }
};

// Tensor(shape, dg::unallocated): the shape, storage later (allocate()): the
// Model's gradients and optimizer state before training starts.
struct Unallocated {};
constexpr Unallocated unallocated{};

// An owning dense row-major tensor (a parameter or an output).
template <typename T>
struct Tensor {
  std::vector<int64_t> shape;
  std::vector<T> data;

  Tensor() = default;
  explicit Tensor(std::vector<int64_t> s) : shape(std::move(s)), data(numel(shape)) {}
  Tensor(std::vector<int64_t> s, Unallocated) : shape(std::move(s)) {}
  Tensor(std::vector<int64_t> s, std::vector<T>&& d) : shape(std::move(s)), data(std::move(d)) {}
  // Copies `numel(s)` elements from `src`.
  Tensor(std::vector<int64_t> s, const T* src) : shape(std::move(s)), data(src, src + numel(shape)) {}

  T* ptr() { return data.data(); }
  const T* ptr() const { return data.data(); }
  int64_t size() const { return static_cast<int64_t>(data.size()); }
  bool allocated() const { return size() == numel(shape); }
  void allocate() { data.assign(static_cast<size_t>(numel(shape)), T(0)); }  // zeros
  // Frees the storage, keeping the shape (allocated() is false until allocate()):
  // a weight whose kept packing holds its only copy (dg_packed_weights.h).
  void release() { std::vector<T>().swap(data); }

  // The values on the host, and the note that they were changed there: the calls
  // of dg::DeviceTensor (CUDA), so that code shared by both targets reads alike.
  T* host() { return data.data(); }
  void host_written() {}
};

// Binds the symbolic dims of a model (N, T, ...) from its inputs' shapes and
// reports the first mismatch in terms of the model's declared shapes.
// A tensor inside memory another object owns: a parameter's gradient is a slice
// of the Model's one gradient buffer. Same interface as Tensor, but no storage.
template <typename T>
struct Slice {
  std::vector<int64_t> shape;
  T* data = nullptr;

  Slice(std::vector<int64_t> s, T* at) : shape(std::move(s)), data(at) {}
  Slice(const Slice&) = delete;  // would alias another model's buffer
  Slice& operator=(const Slice&) = delete;

  T* ptr() { return data; }
  const T* ptr() const { return data; }
  int64_t size() const { return numel(shape); }

  T* host() { return data; }
  void host_written() {}
};

// Where the backward pass writes a parameter's gradient: its member of the Model while
// gradients are kept (compute_gradients(), train_step() with keep_gradients set), else the
// piece of the arena the step planned for it, which lives until the parameter's update has
// used it (the arena holds that piece only then).
template <typename Arena>
class GradientPlaces {
 public:
  GradientPlaces(bool kept, Arena& arena) : kept_(kept), arena_(&arena) {}

  template <typename Member>
  float* at(Member& member, int64_t offset) const {
    return kept_ ? member.ptr() : arena_->at(offset, member.size());
  }

 private:
  bool kept_;
  Arena* arena_;
};

// compute_gradients(): tells the caller's callback (if any) that gradient `index` is complete.
template <typename Callback>
void gradient_ready(const Callback& ready, int index) {
  if (ready) ready(index);
}

// A parameter's update in the backward pass: compute_gradients() (`only` set) leaves it to
// apply_update(), says gradient `index` is complete and returns true; train_step() (nullptr)
// returns false and the caller updates the parameter there.
template <typename Callback>
bool gradients_only(const Callback* only, int index) {
  if (only == nullptr) return false;
  gradient_ready(*only, index);
  return true;
}

class ShapeChecker {
 public:
  explicit ShapeChecker(size_t num_dims) : value_(num_dims, 0), bound_by_(num_dims) {}

  // Starts checking `input`, declared as `declared` (e.g. "[N, 784]").
  void input(const char* name, const std::vector<int64_t>& shape, size_t rank, const char* declared,
             bool has_data) {
    name_ = name;
    shape_ = &shape;
    declared_ = declared;
    if (shape.size() != rank)
      fail("expected " + std::to_string(rank) + " dimensions " + declared + ", got shape " +
           shape_str(shape));
    for (int64_t d : shape)
      if (d < 0) fail("negative dimension in shape " + shape_str(shape));
    if (!has_data && numel(shape) > 0) fail("data pointer is null");
  }

  // Axis `axis` must have the concrete size `size`.
  void fixed(size_t axis, int64_t size) {
    if ((*shape_)[axis] != size)
      fail("dimension " + std::to_string(axis) + " must be " + std::to_string(size) + " (expected " +
           declared_ + ", got " + shape_str(*shape_) + ")");
  }

  // Axis `axis` is symbolic dim number `index`, called `dim`: the first input
  // that uses a dim sets its size, later ones must agree.
  void symbolic(size_t axis, size_t index, const char* dim) {
    const int64_t actual = (*shape_)[axis];
    if (actual < 1)
      fail("dimension " + std::to_string(axis) + " is " + dim + ", which must be at least 1 (got " +
           std::to_string(actual) + "); memory plans assume every symbolic size is 1 or more");
    if (bound_by_[index].empty()) {
      value_[index] = actual;
      bound_by_[index] = name_;
    } else if (actual != value_[index]) {
      fail("dimension " + std::to_string(axis) + " is " + dim + ", which input '" + bound_by_[index] +
           "' set to " + std::to_string(value_[index]) + ", but here it is " + std::to_string(actual) +
           " (expected " + declared_ + ", got " + shape_str(*shape_) + ")");
    }
  }

  int64_t dim(size_t index) const { return value_[index]; }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw std::invalid_argument("input '" + std::string(name_) + "': " + what);
  }
  std::vector<int64_t> value_;
  std::vector<std::string> bound_by_;
  const char* name_ = "";
  const std::vector<int64_t>* shape_ = nullptr;
  const char* declared_ = "";
};

// A condition on the symbolic dims that the model needs at run time.
inline void require(bool ok, const char* why) {
  if (!ok) throw std::invalid_argument(std::string("input sizes not supported: ") + why);
}

}  // namespace dg
