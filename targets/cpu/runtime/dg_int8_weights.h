// dg_int8_weights.h: a weight kept quantized to int8 and packed between calls.
//
// A model generated with --precision int8 multiplies by each weight in int8
// (dg_int8.h). Quantizing the float32 weight with its per-channel scale and
// packing it costs a pass over the weight: at a few input rows, most of the
// product's time. So the Model keeps one KeptInt8Weight per weight, made by the
// first product that needs it and made again when the Model's ParameterVersion
// (dg_packed_weights.h) has counted a change since: train_step, load,
// parameters() (whose caller may write the weight or its scale), a numpy view's
// release, parameters_changed(). While a view is alive the weight may change
// unseen, so each call quantizes for itself and keeps nothing.
//
// It never stands in for the float32 weight (the int8 values cannot give it back):
// the stored weight stays.
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project that uses it. Header-only, C++17.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "dg_int8.h"
#include "dg_packed_weights.h"
#include "dg_tensor.h"

namespace dg {

// weight [K, N] (or [N, K] when tb: a PyTorch Linear weight) quantized with
// scale [N] (its buffer, named scale_name in errors) and packed. A convolution's
// weight [O, C, KH, KW] (tb, K = C * taps, taps = KH * KW > 1) is packed with
// each row's k in channels-last order, tap after tap and the channels of a tap
// side by side (k = t * C + c: the order of conv2d_int8's rows, dg_int8_conv.h);
// the values and each column's sum are the same. Thread-safe:
// forward() calls that run at once share one packing; a packing being read stays
// alive (shared_ptr) even if another call replaces it.
class KeptInt8Weight {
 public:
  KeptInt8Weight(ParameterVersion& version, const Tensor<float>& weight, const Tensor<float>& scale,
                 const char* scale_name, bool tb, int64_t K, int64_t N, int64_t taps = 1)
      : version_(version),
        weight_(weight),
        scale_(scale),
        scale_name_(scale_name),
        tb_(tb),
        K_(K),
        N_(N),
        taps_(taps) {}
  KeptInt8Weight(const KeptInt8Weight&) = delete;
  KeptInt8Weight& operator=(const KeptInt8Weight&) = delete;

  // The weight quantized and packed as the parameters are now: the kept packing,
  // made again if it is missing or older than the parameters.
  std::shared_ptr<const Int8PackedB> use() const {
    std::lock_guard<std::mutex> lock(mutex_);
    const uint64_t now = version_.current();
    if (!version_.watched()) return make();  // a view may write the weight: this call's own
    if (!kept_ || kept_version_ != now) {
      kept_ = make();
      kept_version_ = now;
    }
    return kept_;
  }

  // Bytes the kept packing holds (0 before the first product and after release()).
  int64_t bytes() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return kept_ ? kept_->bytes() : 0;
  }

  // Frees the packing (the next product makes it again); a call still reading it
  // keeps it alive until it is done.
  void release() {
    std::lock_guard<std::mutex> lock(mutex_);
    kept_.reset();
  }

 private:
  std::shared_ptr<const Int8PackedB> make() const {
    if (taps_ <= 1)
      return std::make_shared<const Int8PackedB>(
          quantize_pack_int8(weight_.ptr(), scale_.ptr(), K_, N_, /*stored_PK=*/tb_, scale_name_));
    // rows [N][C][taps] -> [N][taps][C] (a row's values are quantized with one scale:
    // reordered before or after, the same bytes)
    const int64_t C = K_ / taps_;
    std::vector<float> order(static_cast<size_t>(N_ * K_));
    for (int64_t j = 0; j < N_; ++j)
      for (int64_t c = 0; c < C; ++c)
        for (int64_t t = 0; t < taps_; ++t)
          order[static_cast<size_t>(j * K_ + t * C + c)] = weight_.ptr()[j * K_ + c * taps_ + t];
    return std::make_shared<const Int8PackedB>(
        quantize_pack_int8(order.data(), scale_.ptr(), K_, N_, /*stored_PK=*/true, scale_name_));
  }

  ParameterVersion& version_;
  const Tensor<float>& weight_;
  const Tensor<float>& scale_;
  const char* scale_name_;
  bool tb_;
  int64_t K_, N_, taps_;
  mutable std::mutex mutex_;
  mutable std::shared_ptr<const Int8PackedB> kept_;
  mutable uint64_t kept_version_ = 0;
};

// c[M, N] = the int8 product of a (quantize_int8's rows) by the kept weight, each
// finished piece given the epilogue epi (dg_int8.h's matmul_int8).
template <class Epilogue = NoEpilogue>
inline void matmul_int8(const int8_t* a, const float* a_scale, const KeptInt8Weight& w, float* c, int64_t M,
                        const Epilogue& epi = Epilogue()) {
  if (M <= 0) return;
  const std::shared_ptr<const Int8PackedB> packed = w.use();
  matmul_int8(a, a_scale, *packed, c, M, epi);
}

// The same, its output also handed over quantized (dg_int8.h's Int8Rows).
template <class Epilogue>
inline void matmul_int8(const int8_t* a, const float* a_scale, const KeptInt8Weight& w, float* c, int64_t M,
                        const Epilogue& epi, const Int8Rows& out) {
  if (M <= 0) return;
  const std::shared_ptr<const Int8PackedB> packed = w.use();
  matmul_int8(a, a_scale, *packed, c, M, epi, out);
}

}  // namespace dg
