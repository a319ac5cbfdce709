// dg_gather.h: rows gathered by integer ids (an embedding lookup) and its
// adjoint, rows added back by id.
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project that uses it.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "dg_layout.h"

namespace dg {

// Embedding lookup: out[i, :] = table[ids[i], :], table being [rows, width].
// Ids come from model inputs, so they are checked; `what` names the lookup in
// the error, e.g. "embedding 'emb' ids 'tokens'".
template <typename Id>
void gather_rows(const float* table, int64_t rows, int64_t width, const Id* ids, int64_t n, float* out,
                 const char* what) {
  static_assert(std::is_integral<Id>::value, "gather_rows ids must be integers");
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = static_cast<int64_t>(ids[i]);
    if (id < 0 || id >= rows) {
      throw std::invalid_argument(std::string(what) + ": index " + std::to_string(id) + " at position " +
                                  std::to_string(i) + " is out of range [0, " + std::to_string(rows) + ")");
    }
    const float* row = table + id * width;
    float* dst = out + i * width;
    for (int64_t j = 0; j < width; ++j)
      dst[j] = row[j];
  }
}

// The adjoint of gather_rows: table_grad[rows, width] = 0, then
// table_grad[ids[i], :] += src[i, :]. Ids were range-checked by the gather.
template <typename Id>
void scatter_add_rows(const Id* ids, int64_t n, const float* src, int64_t width, float* table_grad,
                      int64_t rows) {
  fill(table_grad, rows * width, 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    float* dst = table_grad + static_cast<int64_t>(ids[i]) * width;
    const float* row = src + i * width;
    for (int64_t j = 0; j < width; ++j)
      dst[j] += row[j];
  }
}

}  // namespace dg
