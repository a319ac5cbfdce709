// dg_masks.h: attention's additive masks (0 to keep, -inf to drop): padded
// sequences, Hugging Face's 0/1 attention_mask, causal attention.
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project that uses it.
#pragma once

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

namespace dg {

// An additive mask for sequences padded to T: mask[n, t] = 0 where t < lengths[n],
// -inf past it (added to attention scores, a padded key gets weight 0).  Lengths
// come from model inputs, so they are checked: each must lie in [1, T] (a row of
// only -inf would make a softmax of NaN); `what` names them in the error.
template <typename Id>
void length_mask(const Id* lengths, float* mask, int64_t N, int64_t T, const char* what) {
  static_assert(std::is_integral<Id>::value, "length_mask lengths must be integers");
  for (int64_t n = 0; n < N; ++n) {
    const int64_t length = static_cast<int64_t>(lengths[n]);
    if (length < 1 || length > T) {
      throw std::invalid_argument(std::string(what) + ": length " + std::to_string(length) + " at position " +
                                  std::to_string(n) + " is out of range [1, " + std::to_string(T) + "]");
    }
    float* row = mask + n * T;
    for (int64_t t = 0; t < T; ++t)
      row[t] = t < length ? 0.0f : -std::numeric_limits<float>::infinity();
  }
}

// The additive mask of a 0/1 integer mask [N, T] (Hugging Face's attention_mask):
// out[n, t] = 0 where mask[n, t] != 0, -inf where it is 0. The mask comes from a
// model input, so a row that keeps no position is an error naming it (`what`):
// its softmax would be NaN.
template <typename Id>
void key_mask(const Id* mask, float* out, int64_t N, int64_t T, const char* what) {
  static_assert(std::is_integral<Id>::value, "key_mask masks must be integers");
  for (int64_t n = 0; n < N; ++n) {
    bool kept = false;
    for (int64_t t = 0; t < T; ++t) {
      const bool keep = mask[n * T + t] != 0;
      out[n * T + t] = keep ? 0.0f : -std::numeric_limits<float>::infinity();
      kept = kept || keep;
    }
    if (!kept) {
      throw std::invalid_argument(std::string(what) + ": row " + std::to_string(n) +
                                  " keeps no position (all zeros)");
    }
  }
}

// The additive mask of causal attention [T, T]: 0 where key k <= query q, -inf above.
inline void causal_mask(float* out, int64_t T) {
  for (int64_t q = 0; q < T; ++q)
    for (int64_t k = 0; k < T; ++k)
      out[q * T + k] = k <= q ? 0.0f : -std::numeric_limits<float>::infinity();
}

}  // namespace dg
