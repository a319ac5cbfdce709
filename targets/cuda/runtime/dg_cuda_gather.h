// dg_cuda_gather.h: rows gathered by integer ids on the GPU and the adjoint
// (dg_gather.h's names). A bad id is recorded on the device and raised by
// CallScope::finish() (dg_cuda.h).
//
// Part of the deepgen CUDA runtime: hand-written, copied unchanged into every
// generated project that uses it. Header-only, C++17 (CUDA: needs --extended-lambda).
#pragma once

#include <cstdint>
#include <type_traits>

#include "dg_cuda.h"
#include "dg_cuda_compat.h"
#include "dg_cuda_launch.h"
#include "dg_cuda_layout.h"

namespace dg {

// Embedding lookup: out[i, :] = table[ids[i], :], table being [rows, width].
// A bad id leaves zeros in its row and fails the call (CallScope::finish) with
// the CPU target's message; `what` names the lookup.
template <typename Id>
void gather_rows(const float* table, int64_t rows, int64_t width, const Id* ids, int64_t n, float* out,
                 const char* what) {
  static_assert(std::is_integral<Id>::value, "gather_rows ids must be integers");
  if (n * width == 0) return;
  int64_t* bad = new_check(what, "index", rows);
  for_each("gather_rows", n * width, [=] DG_HD(int64_t j) {
    const int64_t i = j / width, c = j % width;
    const int64_t id = static_cast<int64_t>(ids[i]);
    if (id < 0 || id >= rows) {
      out[j] = 0.0f;
      if (c == 0) atomic_min_position(bad, i);
    } else {
      out[j] = table[id * width + c];
    }
  });
  // The value at the first bad position, for the message.
  for_each("gather_rows check", 1, [=] DG_HD(int64_t) {
    if (bad[0] != kNoBadPosition) bad[1] = static_cast<int64_t>(ids[bad[0]]);
  });
}

// The adjoint of gather_rows: table_grad[rows, width] = 0, then
// table_grad[ids[i], :] += src[i, :] (atomically: ids repeat). The ids were
// checked by the gather, whose errors are raised before the backward pass.
template <typename Id>
void scatter_add_rows(const Id* ids, int64_t n, const float* src, int64_t width, float* table_grad,
                      int64_t rows) {
  fill(table_grad, rows * width, 0.0f);
  for_each("scatter_add_rows", n * width, [=] DG_HD(int64_t j) {
    const int64_t i = j / width, c = j % width;
    const int64_t id = static_cast<int64_t>(ids[i]);
    if (id >= 0 && id < rows) atomic_add(table_grad + id * width + c, src[j]);
  });
}

}  // namespace dg
