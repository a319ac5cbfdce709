// dg_packed_weights.h: parameters kept packed for dg::gemm between calls.
//
// A matrix product by a weight (x @ W^T in a Linear layer) reads the weight in
// the micro-kernel's panel layout.  Packing it costs a pass over the weight and
// a write of the same size: for a few input rows that is most of the product's
// time (the weight is read once either way).  So the generated Model keeps one
// KeptPackedB per (weight, layout) that its forward pass multiplies by, packs it
// at the first product that needs it, and reuses it until the weight changes.
//
// How a change is noticed: the Model's ParameterVersion counts changes, and a
// packing made at an older count is made again before it is read.  The Model
// counts what it does itself (train_step, apply_update, load); a call of
// parameters() counts too, since the caller may write through what it returns;
// code that writes a parameter in any other way calls the Model's
// parameters_changed().  The Python module's parameters() hands out numpy views
// that can be written at any time: while any is alive the products read the
// weights in place (packing them per call, as without a kept packing), and the
// view's release counts as a change.  Training steps do not use the kept
// packings (see StepScope): they are for inference.
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project. Header-only, C++17.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <new>

#include "dg_gemm.h"

namespace dg {

// The Model's count of parameter changes, and of live views that could write
// parameters unseen.
class ParameterVersion {
 public:
  uint64_t current() const { return count_.load(std::memory_order_acquire); }
  void changed() { count_.fetch_add(1, std::memory_order_acq_rel); }

  // A numpy view of a parameter was made / released (dg_pybind.h: param_view).
  void view_opened() { views_.fetch_add(1, std::memory_order_acq_rel); }
  void view_closed() {
    changed();  // whatever it wrote is seen by the next product
    views_.fetch_sub(1, std::memory_order_acq_rel);
  }
  // Counts a change when it goes out of scope (apply_update(), however it ends).
  struct OnExit {
    ParameterVersion& version;
    ~OnExit() { version.changed(); }
  };
  OnExit change_on_exit() { return OnExit{*this}; }

  // train_step() and compute_gradients(): while the scope lasts the products
  // read the weights in place, packing them per call into scratch memory as
  // before (the weights change every step, so a kept packing would serve one
  // call and hold memory between steps); its end counts a change.
  struct StepScope {
    ParameterVersion& version;
    ~StepScope() {
      version.stepping_.fetch_sub(1, std::memory_order_acq_rel);
      version.changed();
    }
  };
  StepScope step_scope() {
    stepping_.fetch_add(1, std::memory_order_acq_rel);
    return StepScope{*this};
  }

  // True while no view is alive and no step runs: kept packings are used.
  bool watched() const {
    return views_.load(std::memory_order_acquire) == 0 && stepping_.load(std::memory_order_acquire) == 0;
  }

 private:
  std::atomic<uint64_t> count_{1};
  std::atomic<int64_t> views_{0};
  std::atomic<int64_t> stepping_{0};
};

// One weight, as the products op(B) of shape [K, N] read it (tb: B stored
// [N, K], a PyTorch Linear weight), packed and kept.  Thread-safe: forward()
// calls that run at once share one packing; a packing being read by one call
// stays alive (shared_ptr) even if another call replaces it.
class KeptPackedB {
 public:
  KeptPackedB(const ParameterVersion& version, bool tb, int64_t K, int64_t N)
      : version_(version), tb_(tb), K_(K), N_(N) {}
  KeptPackedB(const KeptPackedB&) = delete;
  KeptPackedB& operator=(const KeptPackedB&) = delete;

  // The packing of B (row stride ldb) for a product of M rows, packed now if
  // it is missing or older than the parameters; null when the product should
  // read B in place: a view may be writing it, or an M that streams
  // row-major B directly (dg_gemm.h) and would not read a packing.
  std::shared_ptr<const PackedB> get(const float* B, int64_t ldb, int64_t M) const {
    if (M <= 0 || (!tb_ && M <= gemm_detail::kStreamMaxRows) || !version_.watched()) return nullptr;
    const uint64_t now = version_.current();
    std::lock_guard<std::mutex> lock(mutex_);
    if (!kept_ || kept_->version != now || kept_->packed.source() != B || kept_->packed.ldb() != ldb) {
      Storage storage;
      if (kept_ && kept_.use_count() == 1) storage = std::move(kept_->storage);  // no call reads it now
      if (!storage) storage.reset(static_cast<float*>(::operator new(bytes_now(), std::align_val_t(64))));
      auto fresh = std::make_shared<Packing>(std::move(storage), now, tb_, K_, N_, B, ldb);
      fresh->packed.packed();  // packs now, under the lock: no call sees half a packing
      kept_ = std::move(fresh);
    }
    return std::shared_ptr<const PackedB>(kept_, &kept_->packed);
  }

  // Bytes held (0 until the first product that packs, and after release()).
  int64_t bytes() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return kept_ ? static_cast<int64_t>(bytes_now()) : 0;
  }

  // Frees the packing (the next product packs again); a call still reading
  // it keeps it alive until it is done.
  void release() {
    std::lock_guard<std::mutex> lock(mutex_);
    kept_.reset();
  }

 private:
  struct AlignedDelete {
    void operator()(float* p) const { ::operator delete(p, std::align_val_t(64)); }
  };
  using Storage = std::unique_ptr<float, AlignedDelete>;
  struct Packing {
    Packing(Storage s, uint64_t v, bool tb, int64_t K, int64_t N, const float* B, int64_t ldb)
        : storage(std::move(s)), version(v), packed(tb, K, N, B, ldb, storage.get()) {}
    Storage storage;
    uint64_t version;  // the parameters' count it was packed at
    PackedB packed;
  };
  size_t bytes_now() const { return sizeof(float) * static_cast<size_t>(PackedB::storage_floats(K_, N_)); }

  const ParameterVersion& version_;
  bool tb_;
  int64_t K_, N_;
  mutable std::mutex mutex_;
  mutable std::shared_ptr<Packing> kept_;
};

// c[M,N] = a[M,K] @ b[K,N] (matmul) or a @ b^T with b stored [N,K]
// (matmul_nt), reading b through its kept packing where that pays (above).
template <class Epilogue = NoEpilogue>
void matmul(const float* a, const KeptPackedB& kept, const float* b, float* c, int64_t M, int64_t K, int64_t N,
            const Epilogue& epi = Epilogue()) {
  if (const auto packed = kept.get(b, N, M)) {
    gemm(false, M, a, K, *packed, c, N, epi);
  } else {
    gemm(false, false, M, N, K, a, K, b, N, c, N, epi);
  }
}

template <class Epilogue = NoEpilogue>
void matmul_nt(const float* a, const KeptPackedB& kept, const float* b, float* c, int64_t M, int64_t K,
               int64_t N, const Epilogue& epi = Epilogue()) {
  if (const auto packed = kept.get(b, K, M)) {
    gemm(false, M, a, K, *packed, c, N, epi);
  } else {
    gemm(false, true, M, N, K, a, K, b, K, c, N, epi);
  }
}

}  // namespace dg
