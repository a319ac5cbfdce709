// tiny_tree: an example program using the C++ API without Python.
// Build: cmake -S . -B build && cmake --build build
// Run:   ./build/tiny_tree_example [--weights W.npz] [--input NAME=FILE.npy ...] [--values NAME=V,V,... ...]
//                [--print NAME ...] [--output OUT.npz]
//   --weights  parameters from a file that save() wrote (Python or C++); default: drawn from seed 0
//   --input    an input from a .npy file (dtype and shape are checked); default: the example's own
//   --values   an input's values on the command line, comma-separated: the example's shape, its first
//              axis (the batch) as long as the count asks (`--values ids=1,2,3,4` for ids [N, 2]: N = 2)
//   --print    an output's values, a line per example (per index of its first axis)
//   --output   the outputs into an .npz file; each output's shape and sum are printed either way
// Its first line says how it was built: the GEMM micro-kernel compiled in (avx512, avx2, neon
// or portable), OpenMP and the compiler, as build_info() of the Python module does.
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "tiny_tree/model.h"
#include "dg_example.h"
#include "dg_gemm.h"

// In the model's namespace: its names are the example's, whatever sits at global scope.
namespace tiny_tree {
namespace {

const char kUsage[] =
    "usage: tiny_tree_example [--weights W.npz] [--input NAME=FILE.npy ...] [--values NAME=V,V,... ...] "
    "[--print NAME ...] [--output OUT.npz]";

void print_build_info() {
#ifdef _OPENMP
  const char* openmp = "on";
#else
  const char* openmp = "off";
#endif
#ifdef __VERSION__
  const char* compiler = __VERSION__;
#else
  const char* compiler = "unknown";
#endif
  std::printf("build_info: gemm_kernel %s, openmp %s, compiler %s\n", dg::gemm_isa(), openmp, compiler);
}

int run(const dg::ExampleOptions& options) {
  print_build_info();
  Model model(/*seed=*/0);
  if (!options.weights.empty()) model.load(options.weights);
  Inputs inputs;
  std::vector<std::int64_t> trees_children_data = {
      -1, -1, -1, -1, -1, -1, -1, -1, 3,  1,  4,  0,  5,  2,  -1, -1, -1, -1, -1, -1,
      9,  8,  10, 7,  -1, -1, -1, -1, -1, -1, -1, -1, 14, 13, 16, 12, 17, 15};  // [trees_nodes, 2] with trees_nodes=19
  inputs.trees_children = {trees_children_data.data(), {19, 2}};
  std::vector<std::int64_t> trees_words_data = {
      8, 3, 4, 7, 1, 3, 1, 4, 9, 1, 3, 4, 9, 2, 5, 2, 0, 7, 0};  // [trees_nodes] with trees_nodes=19
  inputs.trees_words = {trees_words_data.data(), {19}};
  std::vector<std::int64_t> trees_roots_data = {6, 11, 18};  // [trees_count] with trees_count=3
  inputs.trees_roots = {trees_roots_data.data(), {3}};
  for (const auto& [name, path] : options.inputs) {  // files replace the example's inputs
    if (name == "trees_children") {
      inputs.trees_children = dg::read_input(path, name, trees_children_data);
    } else if (name == "trees_words") {
      inputs.trees_words = dg::read_input(path, name, trees_words_data);
    } else if (name == "trees_roots") {
      inputs.trees_roots = dg::read_input(path, name, trees_roots_data);
    } else {
      throw std::invalid_argument("--input " + name + ": the model has no input '" + name +
                                  "' (its inputs: trees_children, trees_words, trees_roots)");
    }
  }
  for (const auto& [name, text] : options.values) {  // numbers replace the example's inputs
    if (name == "trees_children") {
      inputs.trees_children = dg::values_input(text, name, trees_children_data, {19, 2});
    } else if (name == "trees_words") {
      inputs.trees_words = dg::values_input(text, name, trees_words_data, {19});
    } else if (name == "trees_roots") {
      inputs.trees_roots = dg::values_input(text, name, trees_roots_data, {3});
    } else {
      throw std::invalid_argument("--values " + name + ": the model has no input '" + name +
                                  "' (its inputs: trees_children, trees_words, trees_roots)");
    }
  }
  for (const auto& name : options.prints) {  // checked before the model runs
    if (name != "root_h")
      throw std::invalid_argument("--print " + name + ": the model has no output '" + name +
                                  "' (its outputs: root_h)");
  }
  Outputs outputs = model.forward(inputs);
  double root_h_sum = 0;
  for (auto v : outputs.root_h.data)
    root_h_sum += static_cast<double>(v);
  std::printf("root_h: shape %s, sum %.6g\n", dg::shape_str(outputs.root_h.shape).c_str(), root_h_sum);
  for (const auto& name : options.prints) {
    if (name == "root_h") dg::print_values(name, outputs.root_h);
  }
  if (!options.output.empty()) {
    dg::write_npz(options.output, {dg::to_npy("root_h", outputs.root_h)});
    std::printf("wrote %s\n", options.output.c_str());
  }
  return 0;
}

}  // namespace
}  // namespace tiny_tree

int main(int argc, char** argv) {
  dg::ExampleOptions options;
  try {
    options = dg::parse_example_args(argc, argv);
  } catch (const std::invalid_argument& e) {
    if (*e.what()) std::fprintf(stderr, "tiny_tree_example: %s\n", e.what());
    std::fprintf(stderr, "%s\n", tiny_tree::kUsage);
    return 2;
  }
  try {
    return tiny_tree::run(options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tiny_tree_example: error: %s\n", e.what());
    return 1;
  }
}
