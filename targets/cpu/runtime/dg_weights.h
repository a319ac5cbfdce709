// dg_weights.h: Model::save() and Model::load(), the .npz weights files of the
// generated C++ API and the Python module alike.
//
// A file holds every parameter (and module buffer) by name; a trainable model
// adds its optimizer state as "optimizer/<param>/<slot>" and the step count as
// "optimizer/step". load() reads and checks the whole file first (names,
// shapes and float dtypes from the arrays' headers before any data is read or
// inflated, then finite values within float32's range, the step), and only
// then changes the model, so a bad file leaves it as it was. A file without
// optimizer state (parameters only) loaded into a trainable model resets its
// optimizer state to zeros and its step to 0, as a new Model's; apply_weights()
// says whether that discarded state the model had.
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project. Header-only, C++17, no dependencies.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "dg_npz.h"
#include "dg_tensor.h"

namespace dg {

// Tensors by name, as Model::parameters() lists them. Tensor is dg::Tensor or
// dg::DeviceTensor: both have host() and host_written().
template <typename Tensor>
using NamedTensors = std::vector<std::pair<std::string, Tensor*>>;

// What load() read and checked, as float32, before any of the model changed.
struct StagedWeights {
  std::vector<std::vector<float>> arrays;  // the parameters', then the optimizer state's
  bool with_state = false;                 // optimizer state (and step) came along
  int64_t step = 0;
};

// What Model::load() did with a trainable model's optimizer state.
struct LoadResult {
  bool optimizer_state_loaded = false;  // the file had optimizer state and step: they were loaded
  // The file had none, and the model's (a step count, or state not all zeros)
  // was reset to a new Model's: zeros and step 0.
  bool optimizer_state_discarded = false;
};

namespace weights_detail {

struct Expected {
  std::string name;
  std::vector<int64_t> shape;
};

template <typename Tensor>
std::vector<Expected> expected(const NamedTensors<Tensor>& tensors, const std::string& prefix) {
  std::vector<Expected> list;
  for (const auto& [name, tensor] : tensors)
    list.push_back({prefix + name, tensor->shape});
  return list;
}

// save("x") writes x.npz (as numpy's savez), so load("x") looks there too.
inline std::string existing_path(const std::string& given) {
  npz_detail::check_path(given);
  std::error_code ec;
  if (std::filesystem::exists(given, ec)) return given;
  if (std::filesystem::exists(given + ".npz", ec)) return given + ".npz";
  throw FileError("no such file: " + given + " (nor " + given + ".npz)", true);
}

// Checks an array's shape and dtype from its header (before its data is read).
inline void check_header(const std::string& path, const NpyArray& header, const Expected& e,
                         const char* what) {
  const std::string where = path + ": " + what + " '" + e.name + "'";
  if (header.shape != e.shape)
    throw std::invalid_argument(where + " has shape " + shape_str(header.shape) + ", expected " +
                                shape_str(e.shape));
  if (header.kind != 'f')
    throw std::invalid_argument(where + " has dtype " + header.dtype() + ", expected a float array");
}

// The array as float32 (its header checked already), after checking its values.
inline std::vector<float> checked(const std::string& path, const NpyArray& array, const Expected& e,
                                  const char* what) {
  const std::string where = path + ": " + what + " '" + e.name + "'";
  std::vector<float> values(static_cast<size_t>(array.size()));
  for (int64_t i = 0; i < array.size(); ++i) {
    const double v = array.number(i);
    if (!std::isfinite(v)) throw std::invalid_argument(where + " has non-finite values (nan or inf)");
    if (std::abs(v) > static_cast<double>(std::numeric_limits<float>::max()))
      throw std::invalid_argument(where + " has values beyond float32's range (they would become inf)");
    values[i] = static_cast<float>(v);
  }
  return values;
}

inline std::string number_str(double v) {
  std::ostringstream s;
  s.precision(17);
  s << v;
  return s.str();
}

// optimizer/step: a whole number >= 0 stored as a scalar.
inline int64_t checked_step(const std::string& path, const NpyArray& array) {
  const std::string where = path + ": 'optimizer/step'";
  if (!array.shape.empty())
    throw std::invalid_argument(where + " must be a scalar, got shape " + shape_str(array.shape));
  if (array.kind != 'f' && array.kind != 'i' && array.kind != 'u')
    throw std::invalid_argument(where + " must be an integer, got dtype " + array.dtype());
  const uint64_t raw = npz_detail::le(array.bytes.data(), array.itemsize);
  const double v = array.number(0);
  const std::string shown = array.kind == 'u' ? std::to_string(raw)
                            : array.kind == 'i' && array.itemsize == 8
                                ? std::to_string(static_cast<int64_t>(raw))
                                : number_str(v);
  if (array.kind == 'f' && (!std::isfinite(v) || v != std::floor(v)))
    throw std::invalid_argument(where + " must be a whole number, got " + shown);
  const bool too_big = array.kind == 'u'   ? raw >= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())
                       : array.kind == 'i' ? array.itemsize == 8 && static_cast<int64_t>(raw) ==
                                                                        std::numeric_limits<int64_t>::max()
                                           : v >= 9223372036854775807.0;  // 2**63 as a double
  if (v < 0 || too_big)
    throw std::invalid_argument(where + " must be >= 0 and below 2**63 - 1, got " + shown);
  return array.kind == 'f' ? static_cast<int64_t>(v) : static_cast<int64_t>(raw);
}

// Reads the file at `given` (or given + ".npz") that save() wrote: `params`
// must all be there; optimizer state with 'optimizer/step' comes along when the
// model is trainable and the file has it. Throws before anything changed.
inline StagedWeights stage(const std::string& given, const std::vector<Expected>& params,
                           const std::vector<Expected>& state, bool trainable) {
  const std::string path = existing_path(given);
  const NpzFile file(path);  // names, dtypes and shapes: no data read yet
  auto find = [&](const std::string& key) -> int {
    for (size_t i = 0; i < file.size(); ++i)
      if (file.name(i) == key) return static_cast<int>(i);
    return -1;
  };
  StagedWeights staged;
  staged.with_state = trainable && find("optimizer/step") >= 0;
  auto known = [&](const std::string& key) {
    for (const auto& e : params)
      if (e.name == key) return true;
    if (staged.with_state) {
      for (const auto& e : state)
        if (e.name == key) return true;
      if (key == "optimizer/step") return true;
    }
    return false;
  };
  for (size_t i = 0; i < file.size(); ++i) {
    const std::string& key = file.name(i);
    if (known(key)) continue;
    if (key.rfind("meta/", 0) == 0) continue;  // notes beside the weights (an importer's state_dict keys)
    const bool optimizer = key.rfind("optimizer/", 0) == 0;
    if (trainable && !staged.with_state && optimizer)
      throw std::invalid_argument(path + ": has optimizer state ('" + key + "') but no 'optimizer/step'");
    throw std::invalid_argument(path + ": unexpected array '" + key + "': the model has no such " +
                                (optimizer ? "optimizer state" : "parameter"));
  }
  // Every array's name, shape and dtype first: a wrong one costs no inflating.
  std::vector<std::pair<const Expected*, const char*>> wanted;
  for (const auto& e : params)
    wanted.emplace_back(&e, "parameter");
  if (staged.with_state)
    for (const auto& e : state)
      wanted.emplace_back(&e, "optimizer state");
  for (const auto& [e, what] : wanted) {
    const int i = find(e->name);
    if (i < 0) throw std::invalid_argument(path + ": missing " + what + " '" + e->name + "'");
    check_header(path, file.header(i), *e, what);
  }
  for (const auto& [e, what] : wanted)
    staged.arrays.push_back(checked(path, file.read(find(e->name)), *e, what));
  if (staged.with_state) staged.step = checked_step(path, file.read(find("optimizer/step")));
  return staged;
}

template <typename Tensor>
void copy_in(const std::vector<float>& from, Tensor* to) {
  if (to->size() !=
      static_cast<int64_t>(from.size()))  // unallocated optimizer state: the caller allocates first
    throw std::logic_error("dg::apply_weights: a tensor holds " + std::to_string(to->size()) +
                           " values, the file " + std::to_string(from.size()));
  std::copy(from.begin(), from.end(), to->host());
  to->host_written();
}

template <typename Tensor>
NpyOut copy_out(const std::string& name, Tensor* from) {
  NpyOut out;
  out.name = name;
  out.shape = from->shape;
  if (from->size() < numel(from->shape)) {  // optimizer state not allocated yet: zeros
    out.floats.assign(static_cast<size_t>(numel(from->shape)), 0.0f);
    return out;
  }
  const float* values = from->host();
  out.floats.assign(values, values + from->size());
  return out;
}

}  // namespace weights_detail

// Reads and checks the file for a model whose tensors are `params` (with
// module buffers) and, when `trainable`, `state` (optimizer state, named
// without the "optimizer/" prefix). Call it before taking the model's lock.
template <typename Tensor>
StagedWeights stage_weights(const std::string& path, const NamedTensors<Tensor>& params,
                            const NamedTensors<Tensor>& state, bool trainable) {
  return weights_detail::stage(path, weights_detail::expected(params, ""),
                               weights_detail::expected(state, "optimizer/"), trainable);
}

// Writes what stage_weights() read into the model (under its writer lock).
// Optimizer state is loaded when the file had it, and reset otherwise (zeros,
// step 0): the result says whether that discarded state the model had.
template <typename Tensor>
LoadResult apply_weights(const StagedWeights& staged, const NamedTensors<Tensor>& params,
                         const NamedTensors<Tensor>& state, int64_t* step) {
  LoadResult result;
  result.optimizer_state_loaded = staged.with_state;
  if (!staged.with_state) {
    result.optimizer_state_discarded = step != nullptr && *step != 0;
    auto nonzero = [](float v) { return v != 0; };
    for (const auto& [name, tensor] : state)
      if (tensor->size() > 0 && !result.optimizer_state_discarded) {
        const float* values = tensor->host();
        result.optimizer_state_discarded = std::any_of(values, values + tensor->size(), nonzero);
      }
  }
  for (size_t i = 0; i < params.size(); ++i)
    weights_detail::copy_in(staged.arrays[i], params[i].second);
  for (size_t i = 0; i < state.size(); ++i) {
    Tensor* to = state[i].second;
    if (staged.with_state) {
      weights_detail::copy_in(staged.arrays[params.size() + i], to);
    } else {
      std::fill(to->host(), to->host() + to->size(), 0.0f);
      to->host_written();
    }
  }
  if (step != nullptr) *step = staged.with_state ? staged.step : 0;
  return result;
}

// Copies of everything save() writes (under the model's reader lock):
// `params`, then `state` as "optimizer/<name>" and `step` as "optimizer/step"
// when `step` is given.
template <typename Tensor>
std::vector<NpyOut> weights_to_save(const NamedTensors<Tensor>& params, const NamedTensors<Tensor>& state,
                                    const int64_t* step) {
  std::vector<NpyOut> arrays;
  for (const auto& [name, tensor] : params)
    arrays.push_back(weights_detail::copy_out(name, tensor));
  for (const auto& [name, tensor] : state)
    arrays.push_back(weights_detail::copy_out("optimizer/" + name, tensor));
  if (step != nullptr) {
    NpyOut s;
    s.name = "optimizer/step";
    s.is_int = true;
    s.ints = {*step};
    arrays.push_back(s);
  }
  return arrays;
}

// Writes the arrays to `path`, adding ".npz" unless it ends so (as numpy's savez).
// A path that is empty or names a folder, a device or a FIFO is refused
// (save("/dev/full") does not write /dev/full.npz).
inline void save_weights(const std::string& path, const std::vector<NpyOut>& arrays) {
  npz_detail::check_writable_path(path);
  const bool has_suffix = path.size() >= 4 && path.compare(path.size() - 4, 4, ".npz") == 0;
  write_npz(has_suffix ? path : path + ".npz", arrays);
}

}  // namespace dg
