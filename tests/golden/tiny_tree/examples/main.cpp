// tiny_tree: an example program using the C++ API without Python.
// Build: cmake -S . -B build && cmake --build build && ./build/tiny_tree_example
#include <cstdio>
#include <vector>

#include "tiny_tree/model.h"

int main() {
  tiny_tree::Model model(/*seed=*/0);
  tiny_tree::Inputs inputs;
  std::vector<int64_t> trees_children_data = {
      -1, -1, -1, -1, -1, -1, -1, -1, 3,  1,  4,  0,  5,  2,  -1, -1, -1, -1, -1, -1,
      9,  8,  10, 7,  -1, -1, -1, -1, -1, -1, -1, -1, 14, 13, 16, 12, 17, 15};  // [trees_nodes, 2] with trees_nodes=19
  inputs.trees_children = {trees_children_data.data(), {19, 2}};
  std::vector<int64_t> trees_words_data = {8, 3, 4, 7, 1, 3, 1, 4, 9, 1,
                                           3, 4, 9, 2, 5, 2, 0, 7, 0};  // [trees_nodes] with trees_nodes=19
  inputs.trees_words = {trees_words_data.data(), {19}};
  std::vector<int64_t> trees_roots_data = {6, 11, 18};  // [trees_count] with trees_count=3
  inputs.trees_roots = {trees_roots_data.data(), {3}};
  tiny_tree::Outputs outputs = model.forward(inputs);
  double root_h_sum = 0;
  for (float v : outputs.root_h.data)
    root_h_sum += v;
  std::printf("root_h: shape %s, sum %.6g\n", dg::shape_str(outputs.root_h.shape).c_str(), root_h_sum);
  return 0;
}
