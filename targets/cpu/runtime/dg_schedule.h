// dg_schedule.h: the inspector of recursive models, shared by every target. It
// takes a batch of trees (or DAGs, or padded sequences) as flat host arrays,
// checks them, and numbers the nodes by height so that every level is a contiguous block of rows: leaves
// first, then the nodes whose children are all leaves, and so on. The executor
// (dg_tree.h on the CPU, dg_cuda_tree.h on a GPU) then runs one batched step per
// level.
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project. Header-only, C++17.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace dg {

struct HostSchedule {
  std::vector<int64_t> order;        // row -> original node id (rows sorted by height)
  std::vector<int64_t> row_of;       // original node id -> row
  std::vector<int64_t> level_start;  // level l is rows [level_start[l], level_start[l + 1])
  std::vector<int64_t> child_row;    // [rows * arity]: the row of each child slot, -1 if empty
  int64_t max_level_rows = 0;        // the largest internal level (buffers are sized for it)

  int64_t levels() const { return static_cast<int64_t>(level_start.size()) - 1; }
  int64_t leaves() const { return level_start.size() > 1 ? level_start[1] : 0; }
  // The rows scheduled: every node of a batch of trees; of a batch of sequences,
  // the steps before each length (the padding past it is no node of the schedule).
  int64_t rows() const { return level_start.empty() ? 0 : level_start.back(); }

  // The same schedule in a batch of sequences' words: level l is time step l, its rows the
  // sequences still running, a row's one child the same sequence's previous step.
  int64_t steps() const { return levels(); }
  int64_t sequences() const { return leaves(); }
  int64_t step_start(int64_t step) const { return level_start[step]; }
  const int64_t* previous_rows(int64_t start) const { return child_row.data() + start; }
  int64_t max_step_rows() const { return max_level_rows; }
};

// Checks the batch and computes its schedule. `children` is [nodes, arity] with
// -1 for an empty slot; `roots` lists each tree's root. Errors name the node.
inline HostSchedule inspect_levels(const int64_t* children, int64_t nodes, int64_t arity,
                                   const int64_t* roots, int64_t num_roots, bool dag, const char* what) {
  auto fail = [&](const std::string& message) {
    throw std::invalid_argument(std::string(what) + ": " + message);
  };
  if (nodes == 0) fail("empty batch: there are no nodes");
  if (num_roots == 0) fail("empty batch: there are no roots");
  // Parents per node, and each node's number of children.
  std::vector<int64_t> parents(nodes, 0), pending(nodes, 0);
  for (int64_t n = 0; n < nodes; ++n) {
    for (int64_t k = 0; k < arity; ++k) {
      const int64_t c = children[n * arity + k];
      if (c == -1) continue;
      if (c < 0 || c >= nodes)
        fail("node " + std::to_string(n) + " has child " + std::to_string(c) + ", outside [0, " +
             std::to_string(nodes) + ")");
      if (c == n) fail("node " + std::to_string(n) + " is its own child (a cycle)");
      ++parents[c];
      ++pending[n];
      if (!dag && parents[c] > 1)
        fail("node " + std::to_string(c) + " has more than one parent (node " + std::to_string(n) +
             " is another); trees cannot share a child, declare a DAG for that");
    }
  }
  for (int64_t r = 0; r < num_roots; ++r) {
    const int64_t root = roots[r];
    if (root < 0 || root >= nodes)
      fail("root " + std::to_string(r) + " is node " + std::to_string(root) + ", outside [0, " +
           std::to_string(nodes) + ")");
    if (!dag && parents[root] != 0)
      fail("root " + std::to_string(r) + " (node " + std::to_string(root) + ") has a parent");
  }
  // Parent lists (CSR), then heights in topological order (Kahn): a node is
  // ready once all its children are done; nodes never ready lie on a cycle.
  std::vector<int64_t> first(nodes + 1, 0), parent_of;
  for (int64_t n = 0; n < nodes; ++n)
    first[n + 1] = first[n] + parents[n];
  parent_of.resize(first[nodes]);
  std::vector<int64_t> fill(first.begin(), first.end() - 1);
  for (int64_t n = 0; n < nodes; ++n)
    for (int64_t k = 0; k < arity; ++k) {
      const int64_t c = children[n * arity + k];
      if (c != -1) parent_of[fill[c]++] = n;
    }
  std::vector<int64_t> height(nodes, 0), ready;
  ready.reserve(nodes);
  for (int64_t n = 0; n < nodes; ++n)
    if (pending[n] == 0) ready.push_back(n);
  for (size_t i = 0; i < ready.size(); ++i) {
    const int64_t n = ready[i];
    for (int64_t p = first[n]; p < first[n + 1]; ++p) {
      const int64_t parent = parent_of[p];
      height[parent] = std::max(height[parent], height[n] + 1);
      if (--pending[parent] == 0) ready.push_back(parent);
    }
  }
  if (static_cast<int64_t>(ready.size()) != nodes) {
    for (int64_t n = 0; n < nodes; ++n)
      if (pending[n] != 0) fail("node " + std::to_string(n) + " lies on a cycle");
  }
  // Counting sort by height: stable, so nodes keep their order within a level.
  const int64_t top = *std::max_element(height.begin(), height.end());
  HostSchedule s;
  s.level_start.assign(top + 2, 0);
  for (int64_t n = 0; n < nodes; ++n)
    ++s.level_start[height[n] + 1];
  for (int64_t l = 0; l <= top; ++l)
    s.level_start[l + 1] += s.level_start[l];
  s.order.resize(nodes);
  s.row_of.resize(nodes);
  std::vector<int64_t> next(s.level_start.begin(), s.level_start.end() - 1);
  for (int64_t n = 0; n < nodes; ++n) {
    const int64_t row = next[height[n]]++;
    s.order[row] = n;
    s.row_of[n] = row;
  }
  s.child_row.resize(nodes * arity);
  for (int64_t row = 0; row < nodes; ++row)
    for (int64_t k = 0; k < arity; ++k) {
      const int64_t c = children[s.order[row] * arity + k];
      s.child_row[row * arity + k] = c == -1 ? -1 : s.row_of[c];
    }
  for (int64_t l = 1; l <= top; ++l)
    s.max_level_rows = std::max(s.max_level_rows, s.level_start[l + 1] - s.level_start[l]);
  return s;
}

// A batch of `count` sequences of up to `steps` steps, padded: node n * steps + t
// is step t of sequence n, present while t < lengths[n]. Each sequence is a
// chain (a step's child is the step before it, or after it with `reverse`), so
// level l holds the l-th step taken of every sequence longer than l: PyTorch's
// PackedSequence batches. Within a level the sequences are sorted by length,
// longest first (ties in index order), so a level is a prefix of the one before
// and a row's child is the row at the same place one level down.
inline HostSchedule inspect_sequences(const int64_t* lengths, int64_t count, int64_t steps, bool reverse,
                                      const char* what) {
  auto fail = [&](const std::string& message) {
    throw std::invalid_argument(std::string(what) + ": " + message);
  };
  if (count == 0) fail("empty batch: there are no sequences");
  int64_t longest = 0;
  for (int64_t n = 0; n < count; ++n) {
    if (lengths[n] < 1 || lengths[n] > steps)
      fail("lengths[" + std::to_string(n) + "] is " + std::to_string(lengths[n]) + ", outside [1, " +
           std::to_string(steps) + "] (the padded length)");
    longest = std::max(longest, lengths[n]);
  }
  std::vector<int64_t> by_length(count);
  for (int64_t n = 0; n < count; ++n)
    by_length[n] = n;
  std::stable_sort(by_length.begin(), by_length.end(),
                   [&](int64_t a, int64_t b) { return lengths[a] > lengths[b]; });
  HostSchedule s;
  s.level_start.assign(longest + 1, 0);
  s.row_of.assign(count * steps, -1);
  for (int64_t l = 0; l < longest; ++l) {
    s.level_start[l + 1] = s.level_start[l];
    for (int64_t i = 0; i < count && lengths[by_length[i]] > l; ++i) {
      const int64_t n = by_length[i], t = reverse ? lengths[n] - 1 - l : l;
      s.order.push_back(n * steps + t);
      s.row_of[n * steps + t] = s.level_start[l + 1]++;
      s.child_row.push_back(l == 0 ? -1 : s.level_start[l - 1] + i);
    }
    if (l > 0) s.max_level_rows = std::max(s.max_level_rows, s.level_start[l + 1] - s.level_start[l]);
  }
  return s;
}

// The node of each sequence's last step (n * steps + lengths[n] - 1), or of its
// first with `reverse`: where a recurrence's final state is. Lengths are checked
// as inspect_sequences checks them.
inline void host_last_steps(const int64_t* lengths, int64_t count, int64_t steps, bool reverse, int64_t* out,
                            const char* what) {
  for (int64_t n = 0; n < count; ++n) {
    if (lengths[n] < 1 || lengths[n] > steps)
      throw std::invalid_argument(std::string(what) + ": lengths[" + std::to_string(n) + "] is " +
                                  std::to_string(lengths[n]) + ", outside [1, " + std::to_string(steps) +
                                  "] (the padded length)");
    out[n] = n * steps + (reverse ? 0 : lengths[n] - 1);
  }
}

}  // namespace dg
