// tiny_cuda: an example program using the C++ API without Python.
// Build: cmake -S . -B build && cmake --build build
// Run:   ./build/tiny_cuda_example [--weights W.npz] [--input NAME=FILE.npy ...] [--values NAME=V,V,... ...]
//                [--print NAME ...] [--output OUT.npz]
//   --weights  parameters from a file that save() wrote (Python or C++); default: drawn from seed 0
//   --input    an input from a .npy file (dtype and shape are checked); default: the example's own
//   --values   an input's values on the command line, comma-separated: the example's shape, its first
//              axis (the batch) as long as the count asks (`--values ids=1,2,3,4` for ids [N, 2]: N = 2)
//   --print    an output's values, a line per example (per index of its first axis)
//   --output   the outputs into an .npz file; each output's shape and sum are printed either way
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "tiny_cuda/model.h"
#include "dg_example.h"

// In the model's namespace: its names are the example's, whatever sits at global scope.
namespace tiny_cuda {
namespace {

const char kUsage[] =
    "usage: tiny_cuda_example [--weights W.npz] [--input NAME=FILE.npy ...] [--values NAME=V,V,... ...] "
    "[--print NAME ...] [--output OUT.npz]";

int run(const dg::ExampleOptions& options) {
  Model model(/*seed=*/0);
  if (!options.weights.empty()) model.load(options.weights);
  Inputs inputs;
  std::vector<float> x_data(6, 0);  // [N, 3] with N=2
  inputs.x = {x_data.data(), {2, 3}};
  for (const auto& [name, path] : options.inputs) {  // files replace the example's inputs
    if (name == "x") {
      inputs.x = dg::read_input(path, name, x_data);
    } else {
      throw std::invalid_argument("--input " + name + ": the model has no input '" + name +
                                  "' (its inputs: x)");
    }
  }
  for (const auto& [name, text] : options.values) {  // numbers replace the example's inputs
    if (name == "x") {
      inputs.x = dg::values_input(text, name, x_data, {2, 3});
    } else {
      throw std::invalid_argument("--values " + name + ": the model has no input '" + name +
                                  "' (its inputs: x)");
    }
  }
  for (const auto& name : options.prints) {  // checked before the model runs
    if (name != "logits")
      throw std::invalid_argument("--print " + name + ": the model has no output '" + name +
                                  "' (its outputs: logits)");
  }
  Outputs outputs = model.forward(inputs);
  double logits_sum = 0;
  for (auto v : outputs.logits.data)
    logits_sum += static_cast<double>(v);
  std::printf("logits: shape %s, sum %.6g\n", dg::shape_str(outputs.logits.shape).c_str(), logits_sum);
  for (const auto& name : options.prints) {
    if (name == "logits") dg::print_values(name, outputs.logits);
  }
  if (!options.output.empty()) {
    dg::write_npz(options.output, {dg::to_npy("logits", outputs.logits)});
    std::printf("wrote %s\n", options.output.c_str());
  }
  return 0;
}

}  // namespace
}  // namespace tiny_cuda

int main(int argc, char** argv) {
  dg::ExampleOptions options;
  try {
    options = dg::parse_example_args(argc, argv);
  } catch (const std::invalid_argument& e) {
    if (*e.what()) std::fprintf(stderr, "tiny_cuda_example: %s\n", e.what());
    std::fprintf(stderr, "%s\n", tiny_cuda::kUsage);
    return 2;
  }
  try {
    return tiny_cuda::run(options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tiny_cuda_example: error: %s\n", e.what());
    return 1;
  }
}
