// dg_tree.h: recursive models on the CPU. The inspector (dg_schedule.h) checks a
// batch of trees (or DAGs) and numbers the nodes by height so that every level
// is a contiguous block of rows; the executor in the generated model.cpp then
// runs one batched step per level with the helpers below (gather the children's
// states, put rows in order and back).
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project. Header-only, C++17.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "dg_schedule.h"

namespace dg {

// On the CPU the executor reads the inspector's schedule (dg_schedule.h) as it is.
using LevelSchedule = HostSchedule;

// Checks the batch and computes its schedule (see inspect_levels).
inline LevelSchedule schedule_levels(const int64_t* children, int64_t nodes, int64_t arity,
                                     const int64_t* roots, int64_t num_roots, bool dag, const char* what) {
  return inspect_levels(children, nodes, arity, roots, num_roots, dag, what);
}

// Checks a batch of padded sequences and computes its schedule (see inspect_sequences).
inline LevelSchedule schedule_sequences(const int64_t* lengths, int64_t count, int64_t steps, bool reverse,
                                        const char* what) {
  return inspect_sequences(lengths, count, steps, reverse, what);
}

// out[n] = the node of sequence n's last step (its first with `reverse`); see host_last_steps.
inline void last_steps(const int64_t* lengths, int64_t count, int64_t steps, bool reverse, int64_t* out,
                       const char* what) {
  host_last_steps(lengths, count, steps, reverse, out, what);
}

namespace tree_detail {

// out[r, :] = state[row, :] with row = child_row[r * arity + slot], looked up in
// `order` when one is given, or zeros for an empty slot; rows of out lie
// out_stride floats apart (default: width).
inline void gather(const float* state, int64_t width, const int64_t* order, const int64_t* child_row,
                   int64_t arity, int64_t slot, int64_t rows, float* out, int64_t out_stride) {
  if (out_stride < 0) out_stride = width;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t c = child_row[r * arity + slot];
    float* dst = out + r * out_stride;
    if (c < 0) {
      std::fill(dst, dst + width, 0.0f);
    } else {
      const float* src = state + (order != nullptr ? order[c] : c) * width;
      std::copy(src, src + width, dst);
    }
  }
}

}  // namespace tree_detail

// out[r, :] = state[child_row[r * arity + slot], :], or zeros for an empty slot.
// Rows of out lie out_stride floats apart (default: width), so that a child's
// state can land straight in its columns of a wider operand (a concat of the
// children's states that feeds the level's GEMM).
inline void gather_children(const float* state, int64_t width, const int64_t* child_row, int64_t arity,
                            int64_t slot, int64_t rows, float* out, int64_t out_stride = -1) {
  tree_detail::gather(state, width, nullptr, child_row, arity, slot, rows, out, out_stride);
}

// out[r, :] = state[order[child_row[r * arity + slot]], :], or zeros for an empty
// slot: gather_children for states kept in node order (order: row -> node), as
// the forward executor keeps them (each state's rows written once, where the
// caller reads them).
inline void gather_child_nodes(const float* state, int64_t width, const int64_t* order,
                               const int64_t* child_row, int64_t arity, int64_t slot, int64_t rows,
                               float* out, int64_t out_stride = -1) {
  tree_detail::gather(state, width, order, child_row, arity, slot, rows, out, out_stride);
}

// A batch of sequences' words for the two above (one child slot: the same sequence's
// previous step).
inline void gather_previous(const float* state, int64_t width, const int64_t* prev_row, int64_t rows,
                            float* out, int64_t out_stride = -1) {
  gather_children(state, width, prev_row, 1, 0, rows, out, out_stride);
}
inline void gather_previous_step(const float* state, int64_t width, const int64_t* order,
                                 const int64_t* prev_row, int64_t rows, float* out, int64_t out_stride = -1) {
  gather_child_nodes(state, width, order, prev_row, 1, 0, rows, out, out_stride);
}

// out[i] = values[order[i]] for the rows [0, count): per-node ids in row order.
template <typename T>
void permute_rows(const T* values, const int64_t* order, int64_t count, T* out) {
  for (int64_t i = 0; i < count; ++i)
    out[i] = values[order[i]];
}

// out[order[r], :] = state[r, :]: rows made in schedule order put at their nodes' rows (a cell
// result made by a GEMM or a gather, after its block; `order` from the block's first row).
inline void unsort_rows(const float* state, const int64_t* order, int64_t rows, int64_t width, float* out) {
  for (int64_t r = 0; r < rows; ++r)
    std::copy(state + r * width, state + (r + 1) * width, out + order[r] * width);
}

// out[r, :] = state[order[r], :]: states (or their gradients) in schedule order.
inline void sort_rows(const float* state, const int64_t* order, int64_t rows, int64_t width, float* out) {
  for (int64_t r = 0; r < rows; ++r)
    std::copy(state + order[r] * width, state + (order[r] + 1) * width, out + r * width);
}

// The backward of gather_children: d_state[child_row[r * arity + slot], :] += d_child[r, :]
// for each row with a child in that slot. Rows in order, so a child shared by
// several parents (a DAG) sums them in one fixed order at any thread count.
inline void scatter_children_add(const float* d_child, int64_t width, const int64_t* child_row, int64_t arity,
                                 int64_t slot, int64_t rows, float* d_state) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t c = child_row[r * arity + slot];
    if (c < 0) continue;
    const float* src = d_child + r * width;
    float* dst = d_state + c * width;
    for (int64_t k = 0; k < width; ++k)
      dst[k] += src[k];
  }
}

// The backward of gather_previous.
inline void scatter_previous_add(const float* d_previous, int64_t width, const int64_t* prev_row,
                                 int64_t rows, float* d_state) {
  scatter_children_add(d_previous, width, prev_row, 1, 0, rows, d_state);
}

// A while loop's compaction by index lists. Of a step's `rows` rows (one per example: `order`
// their rows of the states, `prev_row` their previous steps' rows in the schedule, whose rows
// of the states `all_order` gives), the examples still running are those whose previous
// step ran (its row of `running` is 1, not 0). Their positions among the step's rows go to
// live[0, n), their previous rows to live_prev and their rows of the states to live_order, in
// the step's order; returns n. The step then runs as one batched block of those n rows.
inline int64_t still_running(const float* running, const int64_t* all_order, const int64_t* prev_row,
                             const int64_t* order, int64_t rows, int64_t* live, int64_t* live_prev,
                             int64_t* live_order) {
  int64_t n = 0;
  for (int64_t r = 0; r < rows; ++r) {
    if (running[all_order[prev_row[r]]] == 0.0f) continue;
    live[n] = r;
    live_prev[n] = prev_row[r];
    live_order[n] = order[r];
    ++n;
  }
  return n;
}

// dg.cond compacted: the examples that take the then-branch (pred[n] != 0) listed by index
// in then_examples, the others in else_examples, each in example order; returns how many
// take the then-branch (the else-branch's count is n minus that). Each branch then runs as
// one batched block of its examples' rows.
inline int64_t branch_examples(const std::uint8_t* pred, int64_t n, int64_t* then_examples,
                               int64_t* else_examples) {
  int64_t taken = 0, other = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (pred[i] != 0)
      then_examples[taken++] = i;
    else
      else_examples[other++] = i;
  }
  return taken;
}

}  // namespace dg
