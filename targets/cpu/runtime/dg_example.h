// dg_example.h: what the generated example programs (examples/main.cpp) share:
// their command line, inputs read from .npy files or given as numbers, outputs for an
// .npz file or printed as numbers.
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "dg_npz.h"
#include "dg_tensor.h"

namespace dg {

// The example program's arguments: [--weights W.npz] [--input NAME=FILE.npy ...]
// [--values NAME=V,V,... ...] [--print NAME ...] [--output OUT.npz].
struct ExampleOptions {
  std::string weights, output;
  std::vector<std::pair<std::string, std::string>> inputs;  // name, .npy path
  std::vector<std::pair<std::string, std::string>> values;  // name, comma-separated values
  std::vector<std::string> prints;                          // outputs whose values are printed
};

// Throws std::invalid_argument naming a bad argument (an empty message for --help).
inline ExampleOptions parse_example_args(int argc, char** argv) {
  ExampleOptions options;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") throw std::invalid_argument("");
    if (flag != "--weights" && flag != "--input" && flag != "--output" && flag != "--values" &&
        flag != "--print")
      throw std::invalid_argument("unknown argument '" + flag + "'");
    if (i + 1 == argc) throw std::invalid_argument(flag + " needs a value");
    const std::string value = argv[++i];
    if (value.empty())
      throw std::invalid_argument(flag + (flag == "--print" ? ": the name is empty" : ": the path is empty"));
    if (flag == "--weights") {
      options.weights = value;
    } else if (flag == "--output") {
      options.output = value;
    } else if (flag == "--print") {
      options.prints.push_back(value);
    } else {
      const size_t eq = value.find('=');
      const bool file = flag == "--input";
      if (eq == std::string::npos || eq == 0)
        throw std::invalid_argument(flag + " " + value +
                                    (file ? ": expected NAME=FILE.npy" : ": expected NAME=V,V,..."));
      (file ? options.inputs : options.values).emplace_back(value.substr(0, eq), value.substr(eq + 1));
    }
  }
  return options;
}

// Input `name` from `text`, comma-separated numbers, into `storage`: its shape is
// `example` (the program's own input's) with the first axis, the batch, as long as
// the count of numbers asks (a multiple of the other axes' product).
template <typename T>
View<T> values_input(const std::string& text, const std::string& name, std::vector<T>& storage,
                     std::vector<int64_t> example) {
  storage.clear();
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    const std::string word = text.substr(start, comma - start);
    size_t used = 0;
    try {
      if constexpr (std::is_floating_point<T>::value) {
        storage.push_back(std::stof(word, &used));
      } else {
        storage.push_back(static_cast<T>(std::stoll(word, &used)));
      }
    } catch (const std::exception&) {
      used = 0;
    }
    if (word.empty() || used != word.size())
      throw std::invalid_argument("--values " + name + ": '" + word + "' is not " +
                                  (std::is_floating_point<T>::value ? "a number" : "an integer"));
    start = comma + 1;
  }
  int64_t rest = 1;
  for (size_t k = 1; k < example.size(); ++k)
    rest *= example[k];
  const int64_t count = static_cast<int64_t>(storage.size());
  if (example.empty() ? count != 1 : count % rest != 0)
    throw std::invalid_argument(
        "--values " + name + ": " + std::to_string(count) + " values, expected " +
        (example.empty() ? std::string("1") : "a multiple of " + std::to_string(rest)) + " (the shape " +
        shape_str(example) + " with the first axis fitted)");
  if (!example.empty()) example[0] = count / rest;
  return {storage.data(), example};
}

// Output `name`'s values printed as text: one line per index of its first axis (one
// per example), its other axes' values in order after the name and the index.
template <typename T>
void print_values(const std::string& name, const Tensor<T>& t) {
  const int64_t rows = t.shape.empty() ? 1 : t.shape[0];
  const int64_t width = rows ? static_cast<int64_t>(t.data.size()) / rows : 0;
  for (int64_t r = 0; r < rows; ++r) {
    std::string line = t.shape.empty() ? name + ":" : name + "[" + std::to_string(r) + "]:";
    for (int64_t k = 0; k < width; ++k) {
      char number[32];
      if constexpr (std::is_floating_point<T>::value) {
        std::snprintf(number, sizeof number, " %.6g", static_cast<double>(t.data[r * width + k]));
      } else {
        std::snprintf(number, sizeof number, " %lld", static_cast<long long>(t.data[r * width + k]));
      }
      line += number;
    }
    std::printf("%s\n", line.c_str());
  }
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
