// dg_cuda_logic.h: booleans on the GPU (dg_logic.h's names and arguments): comparisons,
// logical and/or/not, where. Pointers are device pointers; shapes and steps are host
// arrays, copied into each kernel by value.
// A bool is one byte (std::uint8_t, 0 or 1), as numpy stores it. Operands
// broadcast as in numpy: each arrives with its step along every axis of the
// output (0 where it is broadcast), so no operand is expanded in memory.
//
// Part of the deepgen CUDA runtime: hand-written, copied unchanged into every
// generated project that uses it. Header-only, C++17 (CUDA: needs --extended-lambda).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <type_traits>

#include "dg_cuda.h"
#include "dg_cuda_compat.h"
#include "dg_cuda_launch.h"

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

  Broadcast(int rank, const int64_t* out_shape, const int64_t* s0, const int64_t* s1, const int64_t* s2)
      : ndim(rank) {
    if (rank > kMaxBroadcastRank) throw std::invalid_argument("broadcast: more than 8 axes");
    const int64_t* steps[3] = {s0, s1, s2};
    for (int d = 0; d < rank; ++d) {
      shape[d] = out_shape[d];
      total *= out_shape[d];
      for (int k = 0; k < 3; ++k)
        step[k][d] = steps[k] != nullptr ? steps[k][d] : 0;
    }
  }

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

// out = (a <how> b), numpy broadcasting; b may be a number (a float, its steps all 0).
template <typename A, typename B>
void compare(const A* a, B b, uint8_t* out, Compare how, int ndim, const int64_t* shape,
             const int64_t* a_step, const int64_t* b_step) {
  const logic_detail::Broadcast layout(ndim, shape, a_step, b_step, nullptr);
  for_each("compare", layout.total, [=] DG_HD(int64_t at) {
    out[at] =
        logic_detail::compare_one(a[layout.offset(at, 0)], logic_detail::read(b, layout.offset(at, 1)), how)
            ? 1
            : 0;
  });
}

inline void logical_and(const uint8_t* a, const uint8_t* b, uint8_t* out, int ndim, const int64_t* shape,
                        const int64_t* a_step, const int64_t* b_step) {
  const logic_detail::Broadcast layout(ndim, shape, a_step, b_step, nullptr);
  for_each("logical_and", layout.total, [=] DG_HD(int64_t at) {
    out[at] = (a[layout.offset(at, 0)] != 0 && b[layout.offset(at, 1)] != 0) ? 1 : 0;
  });
}

inline void logical_or(const uint8_t* a, const uint8_t* b, uint8_t* out, int ndim, const int64_t* shape,
                       const int64_t* a_step, const int64_t* b_step) {
  const logic_detail::Broadcast layout(ndim, shape, a_step, b_step, nullptr);
  for_each("logical_or", layout.total, [=] DG_HD(int64_t at) {
    out[at] = (a[layout.offset(at, 0)] != 0 || b[layout.offset(at, 1)] != 0) ? 1 : 0;
  });
}

inline void logical_not(const uint8_t* a, uint8_t* out, int64_t n) {
  for_each("logical_not", n, [=] DG_HD(int64_t i) { out[i] = a[i] != 0 ? 0 : 1; });
}

// out = cond ? a : b, numpy broadcasting; a or b may be a number (a float, its steps all 0).
template <typename A, typename B>
void where(const uint8_t* cond, A a, B b, float* out, int ndim, const int64_t* shape,
           const int64_t* cond_step, const int64_t* a_step, const int64_t* b_step) {
  const logic_detail::Broadcast layout(ndim, shape, cond_step, a_step, b_step);
  for_each("where", layout.total, [=] DG_HD(int64_t at) {
    out[at] = cond[layout.offset(at, 0)] != 0 ? logic_detail::read(a, layout.offset(at, 1))
                                              : logic_detail::read(b, layout.offset(at, 2));
  });
}

}  // namespace dg
