// dg_cuda_tree.h: recursive models on the GPU.
//
// The inspector (dg_schedule.h, shared with the CPU target) runs on the host,
// on the caller's own arrays of the batch (DeviceInputs keeps them); the parts
// of its schedule that kernels read (the row order and each child's row) are
// copied to the device once per batch. The level loop then runs on the host,
// reading level bounds from the host copy, and launches one batched step per
// level: gather the children's states, the cell's GEMM and kernels.
//
// Same names and arguments as the CPU runtime's dg_tree.h; data pointers are
// device pointers.
//
// Part of the deepgen CUDA runtime: hand-written, copied unchanged into every
// generated project. Header-only, C++17 (CUDA: needs --extended-lambda).
#pragma once

#include <cstdint>
#include <vector>

#include "dg_cuda.h"
#include "dg_cuda_compat.h"
#include "dg_cuda_launch.h"
#include "dg_schedule.h"

namespace dg {

struct LevelSchedule {
  DeviceVector<int64_t> order;       // row -> original node id (on the device)
  DeviceVector<int64_t> child_row;   // [rows * arity]: each child slot's row, -1 if empty (on the device)
  std::vector<int64_t> level_start;  // level l is rows [level_start[l], level_start[l + 1]) (on the host)
  int64_t max_level_rows = 0;        // the largest internal level (buffers are sized for it)

  int64_t levels() const { return static_cast<int64_t>(level_start.size()) - 1; }
  int64_t leaves() const { return level_start.size() > 1 ? level_start[1] : 0; }
  int64_t rows() const { return level_start.empty() ? 0 : level_start.back(); }

  // In a batch of sequences' words (see HostSchedule).
  int64_t steps() const { return levels(); }
  int64_t sequences() const { return leaves(); }
  int64_t step_start(int64_t step) const { return level_start[step]; }
  const int64_t* previous_rows(int64_t start) const { return child_row.data() + start; }
  int64_t max_step_rows() const { return max_level_rows; }
};

// What kernels read of a host schedule, copied to the device.
inline LevelSchedule to_device(const HostSchedule& s) {
  LevelSchedule d;
  d.order = DeviceVector<int64_t>(static_cast<int64_t>(s.order.size()));
  d.child_row = DeviceVector<int64_t>(static_cast<int64_t>(s.child_row.size()));
  copy_bytes(d.order.data(), s.order.data(), s.order.size() * sizeof(int64_t));
  copy_bytes(d.child_row.data(), s.child_row.data(), s.child_row.size() * sizeof(int64_t));
  d.level_start = s.level_start;
  d.max_level_rows = s.max_level_rows;
  return d;  // (a copy from pageable host memory has read it when cudaMemcpyAsync returns)
}

// Checks the batch and computes its schedule on the host (errors name the
// node, as on the CPU), then copies what kernels read to the device.
// `children` and `roots` are device copies of the caller's arrays.
inline LevelSchedule schedule_levels(const int64_t* children, int64_t nodes, int64_t arity,
                                     const int64_t* roots, int64_t num_roots, bool dag, const char* what) {
  const std::vector<int64_t> host_children = host_values(children, nodes * arity);
  const std::vector<int64_t> host_roots = host_values(roots, num_roots);
  return to_device(
      inspect_levels(host_children.data(), nodes, arity, host_roots.data(), num_roots, dag, what));
}

// Checks a batch of padded sequences on the host and computes its schedule
// (inspect_sequences), then copies what kernels read to the device.
inline LevelSchedule schedule_sequences(const int64_t* lengths, int64_t count, int64_t steps, bool reverse,
                                        const char* what) {
  const std::vector<int64_t> host_lengths = host_values(lengths, count);
  return to_device(inspect_sequences(host_lengths.data(), count, steps, reverse, what));
}

// out[n] = the node of sequence n's last step (its first with `reverse`), computed
// on the host from a copy of the lengths (checked there) and copied back.
inline void last_steps(const int64_t* lengths, int64_t count, int64_t steps, bool reverse, int64_t* out,
                       const char* what) {
  const std::vector<int64_t> host_lengths = host_values(lengths, count);
  std::vector<int64_t> ends(count);
  host_last_steps(host_lengths.data(), count, steps, reverse, ends.data(), what);
  copy_bytes(out, ends.data(), ends.size() * sizeof(int64_t));
}

namespace tree_detail {

// out[r, :] = state[row, :] with row = child_row[r * arity + slot], looked up in
// `order` when one is given, or zeros for an empty slot; rows of out lie
// out_stride floats apart (default: width).
inline void gather(const char* name, const float* state, int64_t width, const int64_t* order,
                   const int64_t* child_row, int64_t arity, int64_t slot, int64_t rows, float* out,
                   int64_t out_stride) {
  if (out_stride < 0) out_stride = width;
  for_each(name, rows * width, [=] DG_HD(int64_t j) {
    const int64_t r = j / width, c = j % width;
    const int64_t child = child_row[r * arity + slot];
    out[r * out_stride + c] = child < 0 ? 0.0f : state[(order != nullptr ? order[child] : child) * width + c];
  });
}

}  // namespace tree_detail

// out[r, :] = state[child_row[r * arity + slot], :], or zeros for an empty slot;
// rows of out lie out_stride floats apart (default: width; see the CPU runtime).
inline void gather_children(const float* state, int64_t width, const int64_t* child_row, int64_t arity,
                            int64_t slot, int64_t rows, float* out, int64_t out_stride = -1) {
  tree_detail::gather("gather_children", state, width, nullptr, child_row, arity, slot, rows, out,
                      out_stride);
}

// out[r, :] = state[order[child_row[r * arity + slot]], :], or zeros for an empty
// slot: gather_children for states kept in node order (order: row -> node).
inline void gather_child_nodes(const float* state, int64_t width, const int64_t* order,
                               const int64_t* child_row, int64_t arity, int64_t slot, int64_t rows,
                               float* out, int64_t out_stride = -1) {
  tree_detail::gather("gather_child_nodes", state, width, order, child_row, arity, slot, rows, out,
                      out_stride);
}

// A batch of sequences' words for the three above (one child slot: the previous step).
inline void gather_previous(const float* state, int64_t width, const int64_t* prev_row, int64_t rows,
                            float* out, int64_t out_stride = -1) {
  gather_children(state, width, prev_row, 1, 0, rows, out, out_stride);
}
inline void gather_previous_step(const float* state, int64_t width, const int64_t* order,
                                 const int64_t* prev_row, int64_t rows, float* out, int64_t out_stride = -1) {
  gather_child_nodes(state, width, order, prev_row, 1, 0, rows, out, out_stride);
}

// out[i] = values[order[i]] for i in [0, count): per-node ids in row order.
template <typename T>
void permute_rows(const T* values, const int64_t* order, int64_t count, T* out) {
  for_each("permute_rows", count, [=] DG_HD(int64_t i) { out[i] = values[order[i]]; });
}

// out[order[r], :] = state[r, :]: rows made in schedule order put at their nodes' rows.
inline void unsort_rows(const float* state, const int64_t* order, int64_t rows, int64_t width, float* out) {
  for_each("unsort_rows", rows * width, [=] DG_HD(int64_t j) {
    const int64_t r = j / width, c = j % width;
    out[order[r] * width + c] = state[j];
  });
}

// out[r, :] = state[order[r], :]: states (or their gradients) in schedule order.
inline void sort_rows(const float* state, const int64_t* order, int64_t rows, int64_t width, float* out) {
  for_each("sort_rows", rows * width, [=] DG_HD(int64_t j) {
    const int64_t r = j / width, c = j % width;
    out[j] = state[order[r] * width + c];
  });
}

// The backward of gather_children: d_state[child_row[r * arity + slot], :] += d_child[r, :].
// One thread per column walks the rows in order: a child shared by several
// parents (a DAG) sums them in one fixed order, with no atomics.
inline void scatter_children_add(const float* d_child, int64_t width, const int64_t* child_row, int64_t arity,
                                 int64_t slot, int64_t rows, float* d_state) {
  for_each("scatter_children_add", width, [=] DG_HD(int64_t k) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t c = child_row[r * arity + slot];
      if (c >= 0) d_state[c * width + k] += d_child[r * width + k];
    }
  });
}

// The backward of gather_previous.
inline void scatter_previous_add(const float* d_previous, int64_t width, const int64_t* prev_row,
                                 int64_t rows, float* d_state) {
  scatter_children_add(d_previous, width, prev_row, 1, 0, rows, d_state);
}

// A while loop's compaction by index lists (see the CPU runtime): the examples of a step
// whose previous step ran, listed in live, live_prev and live_order (device arrays); returns
// their count, read on the host (the step's block size). The flags are read on the host
// once per step, as dg::any_running does (live_prev holds them until it is filled).
inline int64_t still_running(const float* running, const int64_t* all_order, const int64_t* prev_row,
                             const int64_t* order, int64_t rows, int64_t* live, int64_t* live_prev,
                             int64_t* live_order) {
  if (rows == 0) return 0;
  int64_t* ran = live_prev;
  for_each("still_running", rows,
           [=] DG_HD(int64_t r) { ran[r] = running[all_order[prev_row[r]]] != 0.0f ? 1 : 0; });
  const std::vector<int64_t> host_ran = host_values(ran, rows);
  std::vector<int64_t> positions;
  for (int64_t r = 0; r < rows; ++r)
    if (host_ran[r] != 0) positions.push_back(r);
  const int64_t n = static_cast<int64_t>(positions.size());
  if (n == 0) return 0;
  copy_bytes(live, positions.data(), static_cast<size_t>(n) * sizeof(int64_t));
  const int64_t* at = live;
  for_each("still_running_rows", n, [=] DG_HD(int64_t i) {
    live_prev[i] = prev_row[at[i]];
    live_order[i] = order[at[i]];
  });
  return n;
}

// dg.cond compacted (see the CPU runtime): each branch's examples listed by index (device
// arrays); returns how many take the then-branch, read on the host (its block's size). The
// flags are read on the host once per cond, the lists copied back.
inline int64_t branch_examples(const std::uint8_t* pred, int64_t n, int64_t* then_examples,
                               int64_t* else_examples) {
  if (n == 0) return 0;
  const std::vector<std::uint8_t> flags = host_values(pred, n);
  std::vector<int64_t> taken, other;
  for (int64_t i = 0; i < n; ++i)
    (flags[i] != 0 ? taken : other).push_back(i);
  if (!taken.empty()) copy_bytes(then_examples, taken.data(), taken.size() * sizeof(int64_t));
  if (!other.empty()) copy_bytes(else_examples, other.data(), other.size() * sizeof(int64_t));
  return static_cast<int64_t>(taken.size());
}

}  // namespace dg
