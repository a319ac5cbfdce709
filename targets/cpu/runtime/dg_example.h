// dg_example.h: what the generated example programs (examples/main.cpp) share:
// their command line, inputs read from .npy files and outputs for an .npz file.
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project.
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "dg_npz.h"
#include "dg_tensor.h"

namespace dg {

// The example program's arguments: [--weights W.npz] [--input NAME=FILE.npy ...] [--output OUT.npz].
struct ExampleOptions {
  std::string weights, output;
  std::vector<std::pair<std::string, std::string>> inputs;  // name, .npy path
};

// Throws std::invalid_argument naming a bad argument (an empty message for --help).
inline ExampleOptions parse_example_args(int argc, char** argv) {
  ExampleOptions options;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") throw std::invalid_argument("");
    if (flag != "--weights" && flag != "--input" && flag != "--output")
      throw std::invalid_argument("unknown argument '" + flag + "'");
    if (i + 1 == argc) throw std::invalid_argument(flag + " needs a value");
    const std::string value = argv[++i];
    if (value.empty()) throw std::invalid_argument(flag + ": the path is empty");
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
// A file that is not a regular .npy file, or malformed, is an error naming the input.
template <typename T>
View<T> read_input(const std::string& path, const std::string& name, std::vector<T>& storage) {
  NpyArray array;
  try {
    array = read_npy(path);
  } catch (const FileError& e) {
    throw FileError("input '" + name + "': " + e.what(), e.missing);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument("input '" + name + "': " + e.what());
  }
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
NpyOut to_npy(const std::string& name, const Tensor<T>& t) {
  NpyOut out;
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

}  // namespace dg
