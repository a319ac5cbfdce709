// dg_cuda.h: device memory for deepgen's CUDA target, as seen from the host.
//
// - DG_CUDA_CHECK(call): every CUDA call is checked; a failure throws
//   std::runtime_error naming the call, file:line and CUDA's message (the
//   Python module turns it into RuntimeError).
// - DeviceVector<T>: an owned device buffer, the CUDA twin of std::vector<T>
//   in lowered code (constructed from a size, zero-filled, .data(), .size()).
// - copy(first, last, dest): the twin of std::copy between device buffers.
// - DeviceTensor<T>: a parameter, gradient or optimizer slot. It lives on the
//   device; a host copy exists for initialization, numpy views, save and load.
// - Arena: the one device block that holds a call's intermediates, at offsets
//   planned by deepgen, with the same bounds checks and high-water mark as the
//   CPU arena.
// - DeviceInputs: copies a call's inputs to the device and remembers their host
//   data (the tree inspector runs on the host and reads it there).
// - Device-side checks (ids of a gather, labels of a loss): kernels record the
//   first bad position; CallScope::finish() waits for the device and throws
//   std::invalid_argument with the same message the CPU target gives.
//
// Everything runs on the calling thread's default stream (cudaStreamPerThread),
// so Python threads that release the GIL do not serialize on one stream.
//
// With DG_CUDA_EMULATE defined, "device" memory is host memory and copies are
// memcpy: the whole CUDA target then builds and runs on a CPU (tests without a
// GPU). Kernels themselves are launched by dg_cuda_launch.h.
//
// Part of the deepgen CUDA runtime: hand-written, copied unchanged into every
// generated project. Header-only, C++17; needs only the CUDA runtime API, so the
// host compiler can include it (the pybind11 module does).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "dg_tensor.h"

#ifndef DG_CUDA_EMULATE
#include <cuda_runtime_api.h>
#endif

namespace dg {

// ---------------------------------------------------------------- errors

#ifndef DG_CUDA_EMULATE
// Throws std::runtime_error if `status` is an error: "CUDA error in <call> at
// <file>:<line>: <name>: <message>".
inline void cuda_check(cudaError_t status, const char* call, const char* file, int line) {
  if (status == cudaSuccess) return;
  (void)cudaGetLastError();  // reset a non-sticky error so that later calls can go on
  throw std::runtime_error(std::string("CUDA error in ") + call + " at " + file + ":" + std::to_string(line) +
                           ": " + cudaGetErrorName(status) + ": " + cudaGetErrorString(status));
}

#define DG_CUDA_CHECK(call) ::dg::cuda_check((call), #call, __FILE__, __LINE__)

// The stream every deepgen call uses: the calling thread's default stream.
inline cudaStream_t stream() {
  return cudaStreamPerThread;
}

namespace cuda_detail {

// Whether the current device has stream-ordered allocation (cudaMallocAsync).
// Its default pool then keeps freed memory for the next call (the release
// threshold is raised once), so a call's arena costs no cudaMalloc.
inline bool pools_supported() {
  static std::once_flag once;
  static bool supported = false;
  std::call_once(once, [] {
    int device = 0, value = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return;
    if (cudaDeviceGetAttribute(&value, cudaDevAttrMemoryPoolsSupported, device) != cudaSuccess) return;
    supported = value != 0;
    if (supported) {
      cudaMemPool_t pool;
      if (cudaDeviceGetDefaultMemPool(&pool, device) == cudaSuccess) {
        uint64_t keep = std::numeric_limits<uint64_t>::max();
        (void)cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
      }
    }
    (void)cudaGetLastError();
  });
  return supported;
}

}  // namespace cuda_detail
#endif

// The current device's name, or why there is none ("no CUDA device: ...").
inline std::string device_name() {
#ifdef DG_CUDA_EMULATE
  return "none (CPU emulation of the CUDA target)";
#else
  int device = 0;
  cudaDeviceProp prop;
  cudaError_t status = cudaGetDevice(&device);
  if (status == cudaSuccess) status = cudaGetDeviceProperties(&prop, device);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    return std::string("no CUDA device: ") + cudaGetErrorString(status);
  }
  return std::string(prop.name) + " (compute capability " + std::to_string(prop.major) + "." +
         std::to_string(prop.minor) + ")";
#endif
}

// ---------------------------------------------------------------- memory

// `bytes` of uninitialized device memory for the current call (stream-ordered).
inline void* device_alloc(size_t bytes) {
  if (bytes == 0) return nullptr;
  void* p = nullptr;
#ifdef DG_CUDA_EMULATE
  p = std::malloc(bytes);
  if (p == nullptr) throw std::bad_alloc();
#else
  if (cuda_detail::pools_supported()) {
    DG_CUDA_CHECK(cudaMallocAsync(&p, bytes, stream()));
  } else {
    DG_CUDA_CHECK(cudaMalloc(&p, bytes));
  }
#endif
  return p;
}

// Gives back what device_alloc returned. Never throws (it runs in destructors,
// also while an exception unwinds after a device error).
inline void device_free(void* p) noexcept {
  if (p == nullptr) return;
#ifdef DG_CUDA_EMULATE
  std::free(p);
#else
  if (cuda_detail::pools_supported()) {
    (void)cudaFreeAsync(p, stream());
  } else {
    (void)cudaFree(p);
  }
#endif
}

// Copies `bytes` between any two of host and device memory, in stream order.
inline void copy_bytes(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
#ifdef DG_CUDA_EMULATE
  std::memmove(dst, src, bytes);
#else
  DG_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream()));
#endif
}

// Sets `bytes` bytes of device memory to `byte`, in stream order.
inline void fill_bytes(void* dst, int byte, size_t bytes) {
  if (bytes == 0) return;
#ifdef DG_CUDA_EMULATE
  std::memset(dst, byte, bytes);
#else
  DG_CUDA_CHECK(cudaMemsetAsync(dst, byte, bytes, stream()));
#endif
}

inline void zero_bytes(void* dst, size_t bytes) {
  fill_bytes(dst, 0, bytes);
}

// Waits until the device has done everything this thread asked of it.
inline void synchronize() {
#ifndef DG_CUDA_EMULATE
  DG_CUDA_CHECK(cudaStreamSynchronize(stream()));
#endif
}

// std::copy for device buffers: dest[0 .. last - first) = first[0 ..).
template <typename T>
void copy(const T* first, const T* last, T* dest) {
  copy_bytes(dest, first, static_cast<size_t>(last - first) * sizeof(T));
}

// An owned device buffer of `n` zeros: what std::vector<T>(n) is on the CPU.
template <typename T>
class DeviceVector {
 public:
  DeviceVector() = default;
  explicit DeviceVector(int64_t n) : size_(n), data_(static_cast<T*>(device_alloc(bytes(n)))) {
    zero_bytes(data_, bytes(n));
  }
  DeviceVector(DeviceVector&& other) noexcept : size_(other.size_), data_(other.data_) {
    other.size_ = 0;
    other.data_ = nullptr;
  }
  DeviceVector& operator=(DeviceVector&& other) noexcept {
    std::swap(size_, other.size_);
    std::swap(data_, other.data_);
    return *this;
  }
  DeviceVector(const DeviceVector&) = delete;
  DeviceVector& operator=(const DeviceVector&) = delete;
  ~DeviceVector() { device_free(data_); }

  T* data() { return data_; }
  const T* data() const { return data_; }
  int64_t size() const { return size_; }

 private:
  static size_t bytes(int64_t n) { return static_cast<size_t>(n) * sizeof(T); }
  int64_t size_ = 0;
  T* data_ = nullptr;
};

// A tensor the model keeps between calls (a parameter, its gradient, an
// optimizer slot). The values live on the device (ptr()); a host copy serves
// initialization, numpy views, save() and load(). Which side is newer is
// tracked, so values cross the bus only when the host looks at them:
//   host()            the values on the host (downloaded first if the device is newer);
//   host_written()    after changing them through host(): upload before the next use;
//   views             open host views (numpy arrays): while there are any, every call
//                     uploads before it runs and downloads after it changes the values.
template <typename T>
class DeviceTensor {
 public:
  std::vector<int64_t> shape;
  int views = 0;  // live numpy views of host() (the Python module counts them)

  explicit DeviceTensor(std::vector<int64_t> s)
      : shape(std::move(s)), host_(static_cast<size_t>(numel(shape))), device_(alloc(host_.size())) {
    zero_bytes(device_, host_.size() * sizeof(T));
  }
  // The shape only, no memory on either side until allocate() (zeros): the
  // Model's gradients and optimizer state before training starts.
  DeviceTensor(std::vector<int64_t> s, Unallocated) : shape(std::move(s)) {}
  bool allocated() const { return size() == numel(shape); }
  void allocate() {
    if (allocated()) return;
    DeviceTensor zeros(shape);
    zeros.views = views;
    swap(zeros);
  }
  DeviceTensor(const DeviceTensor& other)
      : shape(other.shape), host_(other.host()), device_(alloc(host_.size())) {
    copy_bytes(device_, other.ptr(), host_.size() * sizeof(T));
    synchronize();
  }
  DeviceTensor& operator=(const DeviceTensor& other) {
    if (this != &other) {
      DeviceTensor copy(other);
      swap(copy);
    }
    return *this;
  }
  DeviceTensor(DeviceTensor&& other) noexcept { swap(other); }
  DeviceTensor& operator=(DeviceTensor&& other) noexcept {
    swap(other);
    return *this;
  }
  ~DeviceTensor() { release(device_); }

  // Device pointer, for kernels.
  T* ptr() { return device_; }
  const T* ptr() const { return device_; }
  int64_t size() const { return static_cast<int64_t>(host_.size()); }

  // Current values on the host.
  T* host() {
    download_if_stale();
    return host_.data();
  }
  const T* host() const {
    download_if_stale();
    return host_.data();
  }
  void host_written() { device_stale_ = true; }

  // The model calls these around a call: upload what the host changed before,
  // and after the device changed the values, download them if views are open.
  void before_device_use() const {
    if (host_.empty()) return;  // unallocated (or empty): nothing to move
    if (device_stale_ || views > 0) {
      download_if_stale();
      copy_bytes(device_, host_.data(), host_.size() * sizeof(T));
      device_stale_ = false;
    }
  }
  void after_device_write() {
    if (host_.empty()) return;
    host_stale_ = true;
    if (views > 0) download_if_stale();
  }

 private:
  static T* alloc(size_t n) {
    if (n == 0) return nullptr;
#ifdef DG_CUDA_EMULATE
    return static_cast<T*>(device_alloc(n * sizeof(T)));
#else
    void* p = nullptr;  // long-lived: plain cudaMalloc, outside the per-call pool
    DG_CUDA_CHECK(cudaMalloc(&p, n * sizeof(T)));
    return static_cast<T*>(p);
#endif
  }
  static void release(T* p) noexcept {
#ifdef DG_CUDA_EMULATE
    device_free(p);
#else
    if (p != nullptr) (void)cudaFree(p);
#endif
  }
  void download_if_stale() const {
    if (!host_stale_) return;
    copy_bytes(host_.data(), device_, host_.size() * sizeof(T));
    synchronize();
    host_stale_ = false;
  }
  void swap(DeviceTensor& other) noexcept {
    std::swap(shape, other.shape);
    std::swap(views, other.views);
    std::swap(host_, other.host_);
    std::swap(device_, other.device_);
    std::swap(host_stale_, other.host_stale_);
    std::swap(device_stale_, other.device_stale_);
  }

  mutable std::vector<T> host_;
  T* device_ = nullptr;
  mutable bool host_stale_ = false;    // the device holds newer values
  mutable bool device_stale_ = false;  // the host holds newer values
};

// ---------------------------------------------------------------- the arena

// The one block of device memory that holds a call's intermediates; deepgen
// plans every piece's offset at generation time.
class Arena {
 public:
  explicit Arena(int64_t floats)
      : size_(floats),
        data_(static_cast<float*>(device_alloc(static_cast<size_t>(floats) * sizeof(float)))) {}
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  ~Arena() { device_free(data_); }

  // The planned piece [offset, offset + count) of the arena, in floats.
  float* at(int64_t offset, int64_t count) {
    if (offset < 0 || count < 0 || offset + count > size_)
      throw std::logic_error("memory plan error: piece [" + std::to_string(offset) + ", " +
                             std::to_string(offset + count) + ") outside an arena of " +
                             std::to_string(size_) + " floats");
    high_water_ = std::max(high_water_, offset + count);
    return data_ + offset;
  }

  int64_t size_bytes() const { return size_ * static_cast<int64_t>(sizeof(float)); }
  int64_t high_water_bytes() const { return high_water_ * static_cast<int64_t>(sizeof(float)); }

 private:
  int64_t size_;
  float* data_;
  int64_t high_water_ = 0;
};

// ---------------------------------------------------------------- inputs and outputs

namespace cuda_detail {

struct Staged {
  const void* device;
  const void* host;
  size_t bytes;
};

// Inputs staged by live DeviceInputs of this thread.
inline std::vector<Staged>& staged() {
  thread_local std::vector<Staged> list;
  return list;
}

}  // namespace cuda_detail

// Copies a call's inputs to the device (one buffer each) and keeps them, with
// a note of their host data, until the call returns.
class DeviceInputs {
 public:
  DeviceInputs() = default;
  DeviceInputs(const DeviceInputs&) = delete;
  DeviceInputs& operator=(const DeviceInputs&) = delete;
  ~DeviceInputs() {
    auto& list = cuda_detail::staged();
    for (const auto& buffer : buffers_)
      list.erase(std::remove_if(list.begin(), list.end(),
                                [&](const cuda_detail::Staged& s) { return s.device == buffer.data(); }),
                 list.end());
  }

  // A device copy of `input` (nullptr when it is empty).
  template <typename T>
  const T* add(const View<T>& input) {
    const size_t bytes = static_cast<size_t>(input.size()) * sizeof(T);
    buffers_.emplace_back(static_cast<int64_t>(bytes));
    DeviceVector<unsigned char>& buffer = buffers_.back();
    copy_bytes(buffer.data(), input.data, bytes);
    if (bytes > 0) cuda_detail::staged().push_back({buffer.data(), input.data, bytes});
    return reinterpret_cast<const T*>(buffer.data());
  }

 private:
  std::vector<DeviceVector<unsigned char>> buffers_;
};

// values[0 .. count) of device data, on the host: read from the caller's array
// when `values` is a staged input, else copied back from the device.
template <typename T>
std::vector<T> host_values(const T* values, int64_t count) {
  std::vector<T> out(static_cast<size_t>(count));
  const size_t bytes = out.size() * sizeof(T);
  for (const auto& s : cuda_detail::staged()) {
    if (s.device == values && bytes <= s.bytes) {
      if (bytes > 0) std::memcpy(out.data(), s.host, bytes);
      return out;
    }
  }
  copy_bytes(out.data(), values, bytes);
  synchronize();
  return out;
}

// An output for the caller: `shape` elements copied from device data.
template <typename T>
Tensor<T> to_host(std::vector<int64_t> shape, const T* device) {
  Tensor<T> t(std::move(shape));
  copy_bytes(t.ptr(), device, static_cast<size_t>(t.size()) * sizeof(T));
  return t;
}

// One value of device memory (the loss), read on the host.
template <typename T>
T to_host_scalar(const T* device) {
  T value{};
  copy_bytes(&value, device, sizeof(T));
  synchronize();
  return value;
}

// ---------------------------------------------------------------- device-side checks

namespace cuda_detail {

// A check made by device code: slot[0] is the first bad position (or "none"),
// slot[1] the bad value there.
struct PendingCheck {
  DeviceVector<int64_t> slot;
  std::string what;  // e.g. "gather 'emb' by 'ids' (model.py:12)"
  std::string noun;  // "index", "label"
  int64_t limit;     // valid values are [0, limit)
};

inline std::vector<PendingCheck>& pending_checks() {
  thread_local std::vector<PendingCheck> list;
  return list;
}

}  // namespace cuda_detail

// "No bad position yet": every byte 0x7f, so a memset (no host round trip) sets it.
constexpr int64_t kNoBadPosition = 0x7f7f7f7f7f7f7f7f;

// A new slot for a kernel checking values against [0, limit); the kernel
// records the first bad position in slot[0] and its value in slot[1].
inline int64_t* new_check(const char* what, const char* noun, int64_t limit) {
  cuda_detail::PendingCheck check{DeviceVector<int64_t>(2), what, noun, limit};
  fill_bytes(check.slot.data(), 0x7f, 2 * sizeof(int64_t));
  auto& list = cuda_detail::pending_checks();
  list.push_back(std::move(check));
  return list.back().slot.data();
}

// Waits for the device, then throws std::invalid_argument for the first failed
// check (the CPU target's message); forgets the checks either way.
inline void raise_device_errors() {
  auto& list = cuda_detail::pending_checks();
  if (list.empty()) return;
  std::vector<int64_t> found(2 * list.size());
  for (size_t i = 0; i < list.size(); ++i)
    copy_bytes(&found[2 * i], list[i].slot.data(), 2 * sizeof(int64_t));
  synchronize();
  for (size_t i = 0; i < list.size(); ++i) {
    if (found[2 * i] == kNoBadPosition) continue;
    const std::string message = list[i].what + ": " + list[i].noun + " " + std::to_string(found[2 * i + 1]) +
                                " at position " + std::to_string(found[2 * i]) + " is out of range [0, " +
                                std::to_string(list[i].limit) + ")";
    list.clear();
    throw std::invalid_argument(message);
  }
  list.clear();
}

// One call of the model (forward or train_step): starts with no pending
// checks, and finish() waits for the device and raises what it found.
class CallScope {
 public:
  CallScope() { cuda_detail::pending_checks().clear(); }
  CallScope(const CallScope&) = delete;
  CallScope& operator=(const CallScope&) = delete;
  ~CallScope() { cuda_detail::pending_checks().clear(); }

  void finish() {
    synchronize();
    raise_device_errors();
  }
};

}  // namespace dg
