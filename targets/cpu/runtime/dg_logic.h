// dg_logic.h: booleans: comparisons, logical and/or/not, and where (select).
// A bool is one byte (std::uint8_t, 0 or 1), as numpy stores it. Operands
// broadcast as in numpy: each arrives with its step along every axis of the
// output (0 where it is broadcast), so no operand is expanded in memory; the axes
// are walked a run along the last (merged) axis at a time.
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project that uses it.
#pragma once

#include <cstdint>

#include "dg_logic_element.h"

namespace dg {

// out = (a <how> b), numpy broadcasting; b may be a number (a float, its steps all 0).
template <typename A, typename B>
void compare(const A* a, B b, uint8_t* out, Compare how, int ndim, const int64_t* shape,
             const int64_t* a_step, const int64_t* b_step) {
  const logic_detail::Broadcast layout(ndim, shape, a_step, b_step, nullptr);
  const int64_t n = layout.inner(), as = layout.inner_step(0), bs = layout.inner_step(1);
  for (int64_t row = 0; row < layout.total; row += n) {  // a run along the last axis at a time
    const int64_t a0 = layout.offset(row, 0), b0 = layout.offset(row, 1);
    for (int64_t i = 0; i < n; ++i)
      out[row + i] =
          logic_detail::compare_one(a[a0 + i * as], logic_detail::read(b, b0 + i * bs), how) ? 1 : 0;
  }
}

inline void logical_and(const uint8_t* a, const uint8_t* b, uint8_t* out, int ndim, const int64_t* shape,
                        const int64_t* a_step, const int64_t* b_step) {
  const logic_detail::Broadcast layout(ndim, shape, a_step, b_step, nullptr);
  const int64_t n = layout.inner(), as = layout.inner_step(0), bs = layout.inner_step(1);
  for (int64_t row = 0; row < layout.total; row += n) {
    const int64_t a0 = layout.offset(row, 0), b0 = layout.offset(row, 1);
    for (int64_t i = 0; i < n; ++i)
      out[row + i] = (a[a0 + i * as] != 0 && b[b0 + i * bs] != 0) ? 1 : 0;
  }
}

inline void logical_or(const uint8_t* a, const uint8_t* b, uint8_t* out, int ndim, const int64_t* shape,
                       const int64_t* a_step, const int64_t* b_step) {
  const logic_detail::Broadcast layout(ndim, shape, a_step, b_step, nullptr);
  const int64_t n = layout.inner(), as = layout.inner_step(0), bs = layout.inner_step(1);
  for (int64_t row = 0; row < layout.total; row += n) {
    const int64_t a0 = layout.offset(row, 0), b0 = layout.offset(row, 1);
    for (int64_t i = 0; i < n; ++i)
      out[row + i] = (a[a0 + i * as] != 0 || b[b0 + i * bs] != 0) ? 1 : 0;
  }
}

inline void logical_not(const uint8_t* a, uint8_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    out[i] = a[i] != 0 ? 0 : 1;
}

// out = cond ? a : b, numpy broadcasting; a or b may be a number (a float, its steps all 0).
template <typename A, typename B>
void where(const uint8_t* cond, A a, B b, float* out, int ndim, const int64_t* shape,
           const int64_t* cond_step, const int64_t* a_step, const int64_t* b_step) {
  const logic_detail::Broadcast layout(ndim, shape, cond_step, a_step, b_step);
  const int64_t n = layout.inner(), cs = layout.inner_step(0), as = layout.inner_step(1),
                bs = layout.inner_step(2);
  for (int64_t row = 0; row < layout.total; row += n) {  // a run along the last axis at a time
    const int64_t c0 = layout.offset(row, 0), a0 = layout.offset(row, 1), b0 = layout.offset(row, 2);
    for (int64_t i = 0; i < n; ++i)
      out[row + i] =
          cond[c0 + i * cs] != 0 ? logic_detail::read(a, a0 + i * as) : logic_detail::read(b, b0 + i * bs);
  }
}

// out = in as another numeric type, element by element (static_cast: a float to an integer
// truncates toward zero, as numpy's astype does; a count of steps is exact below 2^24).
template <typename In, typename Out>
void cast(const In* in, Out* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    out[i] = static_cast<Out>(in[i]);
}

// Whether any of n flags is nonzero: a while loop's rows of the examples still running
// (1.0f or 0.0f each), read before a step to stop once no example runs.
inline bool any_running(const float* running, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (running[i] != 0.0f) return true;
  return false;
}

}  // namespace dg
