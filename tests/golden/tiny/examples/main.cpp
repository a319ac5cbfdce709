// tiny: an example program using the C++ API without Python.
// Build: cmake -S . -B build && cmake --build build
// Run:   ./build/tiny_example [--weights W.npz] [--input NAME=FILE.npy ...] [--output OUT.npz]
//   --weights  parameters from a file that save() wrote (Python or C++); default: drawn from seed 0
//   --input    an input from a .npy file (dtype and shape are checked); default: the example's own
//   --output   the outputs into an .npz file; each output's shape and sum are printed either way
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "tiny/model.h"
#include "dg_npz.h"

namespace {

const char kUsage[] = "usage: tiny_example [--weights W.npz] [--input NAME=FILE.npy ...] [--output OUT.npz]";

struct Options {
  std::string weights, output;
  std::vector<std::pair<std::string, std::string>> inputs;  // name, .npy path
};

Options parse(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") throw std::invalid_argument("");
    if (flag != "--weights" && flag != "--input" && flag != "--output")
      throw std::invalid_argument("unknown argument '" + flag + "'");
    if (i + 1 == argc) throw std::invalid_argument(flag + " needs a value");
    const std::string value = argv[++i];
    if (flag == "--weights") {
      options.weights = value;
    } else if (flag == "--output") {
      options.output = value;
    } else {
      const size_t eq = value.find('=');
      if (eq == std::string::npos || eq == 0)
        throw std::invalid_argument("--input " + value + ": expected NAME=FILE.npy");
      options.inputs.emplace_back(value.substr(0, eq), value.substr(eq + 1));
    }
  }
  return options;
}

// Input `name` from the .npy file at `path` into `storage`: float32 for a float
// input, int64 (or int32, widened) for an integer one. forward() checks the shape.
template <typename T>
dg::View<T> read_input(const std::string& path, const std::string& name, std::vector<T>& storage) {
  const dg::NpyArray array = dg::read_npy(path);
  constexpr bool is_float = std::is_floating_point<T>::value;
  const bool fits = is_float ? array.kind == 'f' && array.itemsize == 4
                             : array.kind == 'i' && (array.itemsize == 8 || array.itemsize == 4);
  if (!fits)
    throw std::invalid_argument("input '" + name + "' (" + path + "): has dtype " + array.dtype() +
                                ", expected " + (is_float ? "float32" : "int64 (or int32)"));
  storage.resize(static_cast<size_t>(array.size()));
  for (int64_t i = 0; i < array.size(); ++i) {
    if constexpr (is_float) {
      std::memcpy(&storage[i], array.bytes.data() + 4 * i, 4);
    } else {
      storage[i] = array.integer(i);
    }
  }
  return {storage.data(), array.shape};
}

// An output as np.savez would store it: float32, or int64.
template <typename T>
dg::NpyOut to_npy(const std::string& name, const dg::Tensor<T>& t) {
  dg::NpyOut out;
  out.name = name;
  out.shape = t.shape;
  out.is_int = std::is_integral<T>::value;
  if constexpr (std::is_integral<T>::value) {
    out.ints.assign(t.data.begin(), t.data.end());
  } else {
    out.floats.assign(t.data.begin(), t.data.end());
  }
  return out;
}

int run(const Options& options) {
  tiny::Model model(/*seed=*/0);
  if (!options.weights.empty()) model.load(options.weights);
  tiny::Inputs inputs;
  std::vector<float> x_data(6, 0);  // [N, 3] with N=2
  inputs.x = {x_data.data(), {2, 3}};
  for (const auto& [name, path] : options.inputs) {  // files replace the example's inputs
    if (name == "x") {
      inputs.x = read_input(path, name, x_data);
    } else {
      throw std::invalid_argument("--input " + name + ": the model has no input '" + name +
                                  "' (its inputs: x)");
    }
  }
  tiny::Outputs outputs = model.forward(inputs);
  double y_sum = 0;
  for (auto v : outputs.y.data)
    y_sum += static_cast<double>(v);
  std::printf("y: shape %s, sum %.6g\n", dg::shape_str(outputs.y.shape).c_str(), y_sum);
  if (!options.output.empty()) {
    dg::write_npz(options.output, {to_npy("y", outputs.y)});
    std::printf("wrote %s\n", options.output.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  try {
    options = parse(argc, argv);
  } catch (const std::invalid_argument& e) {
    if (*e.what()) std::fprintf(stderr, "tiny_example: %s\n", e.what());
    std::fprintf(stderr, "%s\n", kUsage);
    return 2;
  }
  try {
    return run(options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tiny_example: error: %s\n", e.what());
    return 1;
  }
}
