// dg_logic_element.h: one element of the boolean ops (dg_logic.h on the CPU,
// dg_cuda_logic.h on the GPU): the comparison codes, numpy broadcasting as an
// output element's offset into each operand (a step per axis, 0 where the operand
// is broadcast), an operand's element (a tensor's, or a number's everywhere) and one
// comparison, mixed types in double as numpy does.
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project that uses it. Header-only, C++17.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <type_traits>

// Functions that run on the host and, in the CUDA target, on the device too
// (dg_cuda_compat.h, included before this header there, defines it).
#ifndef DG_HD
#define DG_HD
#endif

namespace dg {

enum class Compare { less, less_equal, greater, greater_equal, equal, not_equal };

// Most axes a broadcast handles (shapes and steps travel by value).
constexpr int kMaxBroadcastRank = 8;

namespace logic_detail {

// The output's shape and up to three operands' steps along each of its axes.
struct Broadcast {
  int ndim = 0;
  int64_t shape[kMaxBroadcastRank] = {};
  int64_t step[3][kMaxBroadcastRank] = {};
  int64_t total = 1;

  // Axes of size 1 are dropped and an axis is merged into the one before it where every
  // operand steps over both as over one (a [rows, 1, 1, 1] flag against [rows, 4, 15, 8]
  // values: [rows, 480], the flag's steps 1 and 0): the same offsets, fewer axes to walk.
  Broadcast(int rank, const int64_t* out_shape, const int64_t* s0, const int64_t* s1, const int64_t* s2) {
    if (rank > kMaxBroadcastRank) throw std::invalid_argument("broadcast: more than 8 axes");
    const int64_t* steps[3] = {s0, s1, s2};
    for (int d = 0; d < rank; ++d) {
      total *= out_shape[d];
      if (out_shape[d] == 1) continue;
      int64_t at[3];
      for (int k = 0; k < 3; ++k)
        at[k] = steps[k] != nullptr ? steps[k][d] : 0;
      const int last = ndim - 1;
      bool merge = last >= 0;
      for (int k = 0; k < 3 && merge; ++k)
        merge = step[k][last] == at[k] * out_shape[d];
      const int into = merge ? last : ndim++;
      shape[into] = merge ? shape[into] * out_shape[d] : out_shape[d];
      for (int k = 0; k < 3; ++k)
        step[k][into] = at[k];
    }
  }
  // The last axis: its length (1 without axes) and operand k's step along it.
  int64_t inner() const { return ndim > 0 ? shape[ndim - 1] : 1; }
  int64_t inner_step(int k) const { return ndim > 0 ? step[k][ndim - 1] : 0; }

  // The element of operand k that output element `at` reads.
  DG_HD int64_t offset(int64_t at, int k) const {
    int64_t where = 0;
    for (int d = ndim - 1; d >= 0; --d) {
      where += (at % shape[d]) * step[k][d];
      at /= shape[d];
    }
    return where;
  }
};

// An operand's element: a tensor's at `at`, a number's everywhere.
template <typename T>
DG_HD inline T read(const T* x, int64_t at) {
  return x[at];
}
DG_HD inline float read(float value, int64_t) {
  return value;
}

template <typename A, typename B>
DG_HD inline bool compare_one(A a_in, B b_in, Compare how) {
  // Mixed types compare as double (as numpy compares int64 with a float: exactly for ids below 2^53).
  using Common = typename std::conditional<std::is_same<A, B>::value, A, double>::type;
  const Common a = static_cast<Common>(a_in), b = static_cast<Common>(b_in);
  switch (how) {
    case Compare::less:
      return a < b;
    case Compare::less_equal:
      return a <= b;
    case Compare::greater:
      return a > b;
    case Compare::greater_equal:
      return a >= b;
    case Compare::equal:
      return a == b;
    default:
      return a != b;
  }
}

}  // namespace logic_detail

}  // namespace dg
