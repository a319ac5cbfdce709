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
// Weights stored once: with the Model's keep_plain_weights false, a weight the
// forward pass reads only through its packing is freed once packed (the
// packing stands in for it) and written back, exactly, when something needs it
// as stored: parameters() (and so load, save and the numpy views), a training
// call (StepScope, change_on_exit), release_packed_weights(), or setting
// keep_plain_weights again.  The stored pointer of such a weight is then valid
// until the next forward(): C++ code that keeps a Tensor* from parameters()
// across calls leaves keep_plain_weights set (the C++ Model's default; the
// Python module, which hands out no raw pointers, clears it).
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project. Header-only, C++17.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <vector>

#include "dg_gemm.h"
#include "dg_tensor.h"

namespace dg {

class KeptPackedB;

// The Model's count of parameter changes, of live views that could write
// parameters unseen, and the kept packings that may hold a weight's only copy.
class ParameterVersion {
 public:
  ParameterVersion() = default;
  ParameterVersion(const ParameterVersion&) = delete;
  ParameterVersion& operator=(const ParameterVersion&) = delete;

  uint64_t current() const { return count_.load(std::memory_order_acquire); }
  void changed() { count_.fetch_add(1, std::memory_order_acq_rel); }

  // A numpy view of a parameter was made / released (dg_pybind.h: param_view).
  void view_opened() { views_.fetch_add(1, std::memory_order_acq_rel); }
  void view_closed() {
    changed();  // whatever it wrote is seen by the next product
    views_.fetch_sub(1, std::memory_order_acq_rel);
  }
  // Views are about to be made (the Python module's parameters()): from now on
  // no call frees a stored weight; the end counts as a change.
  struct ViewScope {
    ParameterVersion& version;
    ~ViewScope() { version.view_closed(); }
  };
  ViewScope views_opening() {
    view_opened();
    return ViewScope{*this};
  }

  // Counts a change when it goes out of scope (apply_update(), however it ends);
  // the weights are stored (restore_plain) from its start.
  struct OnExit {
    ParameterVersion& version;
    ~OnExit() { version.changed(); }
  };
  OnExit change_on_exit() {
    restore_plain();
    return OnExit{*this};
  }

  // Whether weights keep their stored copy while packed (the Model's
  // keep_plain_weights); setting it writes back every freed weight.
  bool plain_kept() const { return keep_plain_.load(std::memory_order_acquire); }
  void keep_plain(bool keep) {
    keep_plain_.store(keep, std::memory_order_release);
    if (keep) restore_plain();
  }
  // Writes back every weight whose packing holds its only copy (exact).
  void restore_plain();
  // Bytes of stored weights freed because their packings stand in for them.
  int64_t freed_plain_bytes() const;

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
    restore_plain();  // the step reads and writes the weights as stored
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
  std::atomic<bool> keep_plain_{true};
  friend class KeptPackedB;
  std::vector<KeptPackedB*> stand_ins_;  // registered at construction, before any call
};

// One weight, as the products op(B) of shape [K, N] read it (tb: B stored
// [N, K], a PyTorch Linear weight), packed and kept.  Thread-safe: forward()
// calls that run at once share one packing; a packing being read by one call
// stays alive (shared_ptr) even if another call replaces it.
//
// stands_in: the forward pass reads this weight through this packing only (the
// generator checks), so the packing may hold its only copy: while the Model's
// keep_plain_weights is false, the call that packs it frees the stored
// weight (Tensor::release), and ParameterVersion::restore_plain() writes it back
// from the packing (exactly) before anything reads or writes it as stored.
//
// prepare: a function `prepare(weight, out, n)` the packing applies to the
// weight's n floats before it packs them (dg::round_bf16 in a bf16 project: the
// weight is rounded once per change, not at every call), or null. A prepared
// packing is always what the products read (at every M, and per call, unkept,
// while a view or a step may be writing the weight), and never stands in.
class KeptPackedB {
 public:
  using Prepare = void (*)(const float*, float*, int64_t);
  KeptPackedB(ParameterVersion& version, Tensor<float>& weight, bool tb, int64_t K, int64_t N, bool stands_in,
              Prepare prepare = nullptr)
      : version_(version),
        weight_(weight),
        tb_(tb),
        K_(K),
        N_(N),
        stands_in_(stands_in && prepare == nullptr),
        prepare_(prepare) {
    if (stands_in_) version_.stand_ins_.push_back(this);
  }
  KeptPackedB(const KeptPackedB&) = delete;
  KeptPackedB& operator=(const KeptPackedB&) = delete;

  // What one product reads: the packing, or (packed null) the weight as stored.
  // While a Use reads the stored weight, no call frees it.
  class Use {
   public:
    Use(const KeptPackedB* owner, std::shared_ptr<const PackedB> packed, const float* stored)
        : owner_(owner), packed_(std::move(packed)), stored_(stored) {}
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;
    ~Use() {
      if (owner_ != nullptr) owner_->plain_readers_.fetch_sub(1, std::memory_order_acq_rel);
    }
    const PackedB* packed() const { return packed_.get(); }
    const float* stored() const { return stored_; }

   private:
    const KeptPackedB* owner_;  // set while this Use counts as a reader of the stored weight
    std::shared_ptr<const PackedB> packed_;
    const float* stored_;
  };

  // For a product of M rows: the packing, packed now if it is missing or older
  // than the parameters (read packed at every M, dg_gemm.h); or the stored
  // weight where the product should read it in place: a view may be writing it.
  Use use(int64_t M) const {
    std::lock_guard<std::mutex> lock(mutex_);
    if (prepare_ != nullptr) return use_prepared(M);
    const bool stored = weight_.allocated();
    const bool watched = version_.watched();
    const bool frees = stands_in_ && !version_.plain_kept() && watched;  // the packing becomes the only copy
    if (stored && (M <= 0 || !watched)) {
      plain_readers_.fetch_add(1, std::memory_order_acq_rel);
      return Use(this, nullptr, weight_.ptr());
    }
    const uint64_t now = version_.current();
    if (!stored) {
      kept_->version = now;  // the packing is the weight: nothing else could have changed it
    } else if (!kept_ || kept_->version != now || kept_->packed.source() != weight_.ptr()) {
      Storage storage;
      if (kept_ && kept_.use_count() == 1) storage = std::move(kept_->storage);  // no call reads it now
      if (!storage) storage.reset(static_cast<float*>(::operator new(bytes_now(), std::align_val_t(64))));
      auto fresh =
          std::make_shared<Packing>(std::move(storage), now, tb_, K_, N_, weight_.ptr(), tb_ ? K_ : N_);
      fresh->packed.packed();  // packs now, under the lock: no call sees half a packing
      kept_ = std::move(fresh);
    }
    if (frees && stored && plain_readers_.load(std::memory_order_acquire) == 0) {
      kept_->packed.set_source(nullptr);
      weight_.release();
    }
    return Use(nullptr, std::shared_ptr<const PackedB>(kept_, &kept_->packed), nullptr);
  }

  // Writes the stored weight back from the packing if the packing holds its
  // only copy (the same floats); the packing stays, still current.
  void restore_plain() {
    std::lock_guard<std::mutex> lock(mutex_);
    restore_plain_locked();
  }

  // Bytes the packing holds (0 until the first product that packs, and after
  // release()), and bytes of the stored weight it stands in for (freed).
  int64_t bytes() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return kept_ ? static_cast<int64_t>(bytes_now()) : 0;
  }
  int64_t freed_bytes() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return weight_.allocated() ? 0 : numel(weight_.shape) * static_cast<int64_t>(sizeof(float));
  }

  // Frees the packing (the next product packs again), writing the stored weight
  // back first if the packing held its only copy; a call still reading the
  // packing keeps it alive until it is done.  Both under one hold of the lock:
  // between the two a product could free the stored weight again (the packing
  // standing in for it), and the weight would be lost with the packing.
  void release() {
    std::lock_guard<std::mutex> lock(mutex_);
    restore_plain_locked();
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
    const float* from = nullptr;  // a prepared packing: the stored weight it was made from
  };
  size_t bytes_now() const { return sizeof(float) * static_cast<size_t>(PackedB::storage_floats(K_, N_)); }
  // use() of a packing that prepares the weight, with mutex_ held: the prepared
  // floats packed now if the kept packing is missing, older than the parameters
  // or made from another stored weight; made for this call only, and not kept,
  // while the weight may change under it (a view is alive, a step runs).
  Use use_prepared(int64_t M) const {
    if (M <= 0) {  // no product to make: nothing is read
      plain_readers_.fetch_add(1, std::memory_order_acq_rel);
      return Use(this, nullptr, weight_.ptr());
    }
    if (!weight_.allocated())  // the generator never lets another packing of it stand in
      throw std::logic_error("dg::KeptPackedB: the weight a prepared packing reads was freed");
    const uint64_t now = version_.current();
    if (!version_.watched()) {
      std::shared_ptr<Packing> once = prepared_packing(now, Storage());
      return Use(nullptr, std::shared_ptr<const PackedB>(once, &once->packed), nullptr);
    }
    if (!kept_ || kept_->version != now || kept_->from != weight_.ptr()) {
      Storage storage;
      if (kept_ && kept_.use_count() == 1) storage = std::move(kept_->storage);  // no call reads it now
      kept_ = prepared_packing(now, std::move(storage));
    }
    return Use(nullptr, std::shared_ptr<const PackedB>(kept_, &kept_->packed), nullptr);
  }
  // The weight prepared into a scratch copy, packed from it (into `storage`, or
  // new storage), the copy dropped: the packing has no source (read packed).
  std::shared_ptr<Packing> prepared_packing(uint64_t now, Storage storage) const {
    std::vector<float> prepared(static_cast<size_t>(numel(weight_.shape)));
    prepare_(weight_.ptr(), prepared.data(), static_cast<int64_t>(prepared.size()));
    if (!storage) storage.reset(static_cast<float*>(::operator new(bytes_now(), std::align_val_t(64))));
    auto fresh =
        std::make_shared<Packing>(std::move(storage), now, tb_, K_, N_, prepared.data(), tb_ ? K_ : N_);
    fresh->packed.packed();
    fresh->packed.set_source(nullptr);
    fresh->from = weight_.ptr();
    return fresh;
  }
  // restore_plain() with mutex_ held.
  void restore_plain_locked() {
    if (weight_.allocated() || !kept_) return;
    weight_.data.resize(static_cast<size_t>(numel(weight_.shape)));
    kept_->packed.unpack(weight_.ptr(), tb_ ? K_ : N_);
    kept_->packed.set_source(weight_.ptr());
  }

  ParameterVersion& version_;
  Tensor<float>& weight_;
  bool tb_;
  int64_t K_, N_;
  bool stands_in_;
  Prepare prepare_;
  mutable std::mutex mutex_;
  mutable std::shared_ptr<Packing> kept_;
  mutable std::atomic<int64_t> plain_readers_{0};  // Uses reading the stored weight now
};

inline void ParameterVersion::restore_plain() {
  for (KeptPackedB* kept : stand_ins_)
    kept->restore_plain();
}

inline int64_t ParameterVersion::freed_plain_bytes() const {
  int64_t bytes = 0;
  for (const KeptPackedB* kept : stand_ins_)
    bytes += kept->freed_bytes();
  return bytes;
}

// c[M,N] = a[M,K] @ b[K,N] (matmul) or a @ b^T with b stored [N,K]
// (matmul_nt), b being the weight `kept` packs, read through its kept packing
// where that pays (above).
template <class Epilogue = NoEpilogue>
void matmul(const float* a, const KeptPackedB& kept, float* c, int64_t M, int64_t K, int64_t N,
            const Epilogue& epi = Epilogue()) {
  const KeptPackedB::Use b = kept.use(M);
  if (b.packed() != nullptr) {
    gemm(false, M, a, K, *b.packed(), c, N, epi);
  } else {
    gemm(false, false, M, N, K, a, K, b.stored(), N, c, N, epi);
  }
}

template <class Epilogue = NoEpilogue>
void matmul_nt(const float* a, const KeptPackedB& kept, float* c, int64_t M, int64_t K, int64_t N,
               const Epilogue& epi = Epilogue()) {
  const KeptPackedB::Use b = kept.use(M);
  if (b.packed() != nullptr) {
    gemm(false, M, a, K, *b.packed(), c, N, epi);
  } else {
    gemm(false, true, M, N, K, a, K, b.stored(), K, c, N, epi);
  }
}

}  // namespace dg
