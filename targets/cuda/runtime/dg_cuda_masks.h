// dg_cuda_masks.h: attention's additive masks on the GPU (dg_masks.h's names);
// lengths and mask rows are checked on the host, with the CPU target's messages.
//
// Part of the deepgen CUDA runtime: hand-written, copied unchanged into every
// generated project that uses it. Header-only, C++17 (CUDA: needs --extended-lambda).
#pragma once

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "dg_cuda.h"
#include "dg_cuda_compat.h"
#include "dg_cuda_launch.h"

namespace dg {

// An additive mask for sequences padded to T: mask[n, t] = 0 where t < lengths[n],
// -inf past it. The lengths are checked on the host (an input's are read from
// the caller's array, without a copy back): each must lie in [1, T], else
// std::invalid_argument with the CPU target's message.
template <typename Id>
void length_mask(const Id* lengths, float* mask, int64_t N, int64_t T, const char* what) {
  static_assert(std::is_integral<Id>::value, "length_mask lengths must be integers");
  const std::vector<Id> host = host_values(lengths, N);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t length = static_cast<int64_t>(host[static_cast<size_t>(n)]);
    if (length < 1 || length > T) {
      throw std::invalid_argument(std::string(what) + ": length " + std::to_string(length) + " at position " +
                                  std::to_string(n) + " is out of range [1, " + std::to_string(T) + "]");
    }
  }
  const float minus_inf = -std::numeric_limits<float>::infinity();
  for_each("length_mask", N * T, [=] DG_HD(int64_t j) {
    mask[j] = j % T < static_cast<int64_t>(lengths[j / T]) ? 0.0f : minus_inf;
  });
}

// The additive mask of a 0/1 integer mask [N, T] (Hugging Face's attention_mask):
// out[n, t] = 0 where mask[n, t] != 0, -inf where it is 0. Each row is checked on
// the host to keep a position (else std::invalid_argument with the CPU target's message).
template <typename Id>
void key_mask(const Id* mask, float* out, int64_t N, int64_t T, const char* what) {
  static_assert(std::is_integral<Id>::value, "key_mask masks must be integers");
  const std::vector<Id> host = host_values(mask, N * T);
  for (int64_t n = 0; n < N; ++n) {
    bool kept = false;
    for (int64_t t = 0; t < T; ++t)
      kept = kept || host[static_cast<size_t>(n * T + t)] != 0;
    if (!kept) {
      throw std::invalid_argument(std::string(what) + ": row " + std::to_string(n) +
                                  " keeps no position (all zeros)");
    }
  }
  const float minus_inf = -std::numeric_limits<float>::infinity();
  for_each("key_mask", N * T, [=] DG_HD(int64_t j) { out[j] = mask[j] != 0 ? 0.0f : minus_inf; });
}

// The additive mask of causal attention [T, T]: 0 where key k <= query q, -inf above.
inline void causal_mask(float* out, int64_t T) {
  const float minus_inf = -std::numeric_limits<float>::infinity();
  for_each("causal_mask", T * T, [=] DG_HD(int64_t j) { out[j] = j % T <= j / T ? 0.0f : minus_inf; });
}

}  // namespace dg
