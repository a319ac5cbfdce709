// dg_pybind.h: numpy <-> dg::View/Tensor conversion for the generated bindings,
// with the input checks a Python user sees as ValueError.
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "dg_tensor.h"

namespace dg {
namespace py = pybind11;

// Every keyword must be one of `known` and every name in `required` must be
// given (forward() requires fewer inputs than train_step() but accepts all).
inline void check_input_names(const py::kwargs& given, const std::vector<std::string>& required,
                              const std::vector<std::string>& known) {
  std::string names;
  for (const auto& n : known) names += (names.empty() ? "" : ", ") + n;
  for (const auto& item : given) {
    const std::string key = py::str(item.first);
    bool found = false;
    for (const auto& n : known) found = found || n == key;
    if (!found) throw py::value_error("unknown input '" + key + "'; the model's inputs are: " + names);
  }
  for (const auto& n : required)
    if (!given.contains(n.c_str()))
      throw py::value_error("missing input '" + n + "'; the model's inputs are: " + names);
}

// A view of the numpy array passed as input `name`: exact dtype, C-contiguous.
// The array stays alive in the caller's kwargs while the model runs.
template <typename T>
View<T> input_view(const py::kwargs& given, const char* name, const char* declared) {
  py::handle obj = given[name];
  const std::string want = py::str(py::dtype::of<T>());
  if (!py::isinstance<py::array>(obj))
    throw py::value_error(std::string("input '") + name + "': expected a numpy array of " + want + " with shape " +
                          declared + ", got " + std::string(py::str(py::type::of(obj).attr("__name__"))));
  auto arr = py::reinterpret_borrow<py::array>(obj);
  // Equal dtypes, not the same descriptor object: a pickled array or np.longlong
  // for int64 carries an equivalent descriptor of its own.
  if (!py::isinstance<py::array_t<T>>(arr))
    throw py::value_error(std::string("input '") + name + "': expected dtype " + want + ", got " +
                          std::string(py::str(arr.dtype())) + " (convert with .astype(np." + want + "))");
  if (!(arr.flags() & py::array::c_style))
    throw py::value_error(std::string("input '") + name +
                          "': the array must be C-contiguous (use np.ascontiguousarray)");
  if (!(arr.flags() & py::detail::npy_api::NPY_ARRAY_ALIGNED_))  // kernels load whole elements
    throw py::value_error(std::string("input '") + name +
                          "': the array's data is not aligned to its dtype (np.require(x, requirements='CA') "
                          "makes an aligned copy)");
  View<T> v;
  v.data = static_cast<const T*>(arr.data());
  v.shape.assign(arr.shape(), arr.shape() + arr.ndim());
  return v;
}

// Hands an output's storage to numpy without copying.
template <typename T>
py::array to_numpy(Tensor<T>&& t) {
  auto* owned = new std::vector<T>(std::move(t.data));
  py::capsule release(owned, [](void* p) { delete static_cast<std::vector<T>*>(p); });
  return py::array_t<T>(t.shape, owned->data(), release);
}

// A writable numpy view of a parameter; `owner` (the Python Model) is kept alive by it.
template <typename T>
py::array param_view(Tensor<T>& t, py::handle owner) {
  return py::array_t<T>(t.shape, t.ptr(), owner);
}

// A tree node's word id: a Python int that fits int64 (a bool is not an id).
inline int64_t word_id(py::handle value) {
  if (!py::isinstance<py::int_>(value) || py::isinstance<py::bool_>(value))
    throw py::value_error("a word id must be an int, got " + std::string(py::repr(value)));
  int overflow = 0;
  const long long id = PyLong_AsLongLongAndOverflow(value.ptr(), &overflow);
  if (overflow != 0) throw py::value_error("word id " + std::string(py::repr(value)) + " does not fit int64");
  return static_cast<int64_t>(id);
}

// Flat arrays for a list of nested trees, as generator.treebatch.from_nested
// makes them: a leaf is a word id (int); an internal node is a tuple of
// children, or (word, [children...]). Iterative: deep trees are fine.
inline py::dict trees_from_nested(const py::sequence& trees, int64_t arity) {
  std::vector<int64_t> children, words, roots;
  struct Item {
    py::handle node;
    bool expanded;
  };
  for (py::handle tree : trees) {
    std::vector<Item> stack{{tree, false}};
    std::vector<int64_t> done;
    while (!stack.empty()) {
      Item item = stack.back();
      stack.pop_back();
      int64_t word = -1;
      py::sequence kids;
      bool leaf = false;
      if (py::isinstance<py::int_>(item.node) && !py::isinstance<py::bool_>(item.node)) {
        word = word_id(item.node);
        leaf = true;
      } else if (py::isinstance<py::tuple>(item.node) && py::len(item.node) == 2 &&
                 py::isinstance<py::list>(py::reinterpret_borrow<py::tuple>(item.node)[1])) {
        auto pair = py::reinterpret_borrow<py::tuple>(item.node);
        word = word_id(pair[0]);
        kids = pair[1];
      } else if ((py::isinstance<py::tuple>(item.node) || py::isinstance<py::list>(item.node)) &&
                 py::len(item.node) > 0) {
        kids = py::reinterpret_borrow<py::sequence>(item.node);
      } else {
        throw py::value_error("a tree node must be a word id, a tuple of children or (word, [children]), got " +
                              std::string(py::repr(item.node)));
      }
      const int64_t count = leaf ? 0 : static_cast<int64_t>(py::len(kids));
      if (leaf || item.expanded) {
        if (count > arity)
          throw py::value_error("a node has " + std::to_string(count) + " children, more than the arity " +
                                std::to_string(arity));
        std::vector<int64_t> ids(done.end() - count, done.end());
        done.resize(done.size() - count);
        ids.resize(arity, -1);
        children.insert(children.end(), ids.begin(), ids.end());
        words.push_back(word);
        done.push_back(static_cast<int64_t>(words.size()) - 1);
      } else {
        stack.push_back({item.node, true});
        for (int64_t k = count - 1; k >= 0; --k) stack.push_back({kids[k], false});
      }
    }
    roots.push_back(done.back());
  }
  if (roots.empty()) throw py::value_error("empty batch: no trees");
  const int64_t nodes = static_cast<int64_t>(words.size());
  py::dict batch;
  batch["children"] = py::array_t<int64_t>(std::vector<int64_t>{nodes, arity}, children.data());
  batch["words"] = py::array_t<int64_t>(std::vector<int64_t>{nodes}, words.data());
  batch["roots"] = py::array_t<int64_t>(std::vector<int64_t>{static_cast<int64_t>(roots.size())}, roots.data());
  return batch;
}

// ---- load(): read everything, check everything, and only then change the model.

// A tensor load() fills: its name in the file and its shape.
struct Expected {
  std::string name;
  std::vector<int64_t> shape;
};

// What load() read and checked, converted to float32, before any of the model changed.
struct StagedLoad {
  std::vector<py::array_t<float, py::array::c_style>> arrays;  // in the order of the Expected lists
  bool with_state = false;                                     // optimizer state (and step) came along
  int64_t step = 0;
};

namespace load_detail {

[[noreturn]] inline void raise(PyObject* type, const std::string& message) {
  PyErr_SetString(type, message.c_str());
  throw py::error_already_set();
}

// save("x") writes x.npz (numpy adds the suffix), so load("x") looks there too.
inline std::string existing_path(const std::string& given) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists(given, ec)) return given;
  if (fs::exists(given + ".npz", ec)) return given + ".npz";
  raise(PyExc_FileNotFoundError, "no such file: " + given + " (nor " + given + ".npz)");
}

// The array `name` of the archive as float32, after checking shape, dtype and values.
inline py::array_t<float, py::array::c_style> checked(const std::string& path, const py::object& file,
                                                      const Expected& e, const char* what) {
  const std::string where = path + ": " + what + " '" + e.name + "'";
  py::array array = file.attr("__getitem__")(e.name);
  std::vector<int64_t> shape(array.shape(), array.shape() + array.ndim());
  if (shape != e.shape)
    throw py::value_error(where + " has shape " + shape_str(shape) + ", expected " + shape_str(e.shape));
  if (array.dtype().kind() != 'f')
    throw py::value_error(where + " has dtype " + std::string(py::str(array.dtype())) + ", expected a float array");
  py::module_ np = py::module_::import("numpy");
  if (array.size() > 0) {
    if (!np.attr("isfinite")(array).attr("all")().cast<bool>())
      throw py::value_error(where + " has non-finite values (nan or inf)");
    if (array.dtype().itemsize() > 4 &&
        np.attr("abs")(array).attr("max")().cast<double>() > static_cast<double>(std::numeric_limits<float>::max()))
      throw py::value_error(where + " has values beyond float32's range (they would become inf)");
  }
  py::array_t<float, py::array::c_style> converted = np.attr("ascontiguousarray")(array, py::arg("dtype") = "float32");
  return converted;
}

// optimizer/step: a whole number >= 0, stored as a scalar.
inline int64_t checked_step(const std::string& path, const py::object& file) {
  py::array array = file.attr("__getitem__")("optimizer/step");
  const std::string where = path + ": 'optimizer/step'";
  if (array.ndim() != 0) throw py::value_error(where + " must be a scalar, got shape " + shape_str({array.shape(), array.shape() + array.ndim()}));
  const char kind = array.dtype().kind();
  py::object value = array.attr("item")();
  if (kind == 'f') {
    const double v = value.cast<double>();
    if (!std::isfinite(v) || v != std::floor(v)) throw py::value_error(where + " must be a whole number, got " + std::string(py::repr(value)));
    value = py::int_(py::reinterpret_steal<py::object>(PyNumber_Long(value.ptr())));
  } else if (kind != 'i' && kind != 'u') {
    throw py::value_error(where + " must be an integer, got dtype " + std::string(py::str(array.dtype())));
  }
  int overflow = 0;
  const long long step = PyLong_AsLongLongAndOverflow(value.ptr(), &overflow);
  if (overflow != 0 || step < 0 || step == std::numeric_limits<long long>::max())
    throw py::value_error(where + " must be >= 0 and below 2**63 - 1, got " + std::string(py::repr(value)));
  return static_cast<int64_t>(step);
}

}  // namespace load_detail

// Reads the .npz archive at `given` (or given + ".npz") that save() wrote:
// `params` must all be there; `state` (optimizer state) with 'optimizer/step'
// comes along when the file has it. Any problem raises (ValueError, or
// FileNotFoundError) before the caller changes anything.
inline StagedLoad stage_npz(const std::string& given, const std::vector<Expected>& params,
                            const std::vector<Expected>& state, bool trainable) {
  using namespace load_detail;
  const std::string path = existing_path(given);
  py::object file;
  try {
    file = py::module_::import("numpy").attr("load")(path, py::arg("allow_pickle") = false);
  } catch (py::error_already_set& e) {
    if (e.matches(PyExc_OSError) && !e.matches(PyExc_EOFError)) throw;  // not found, a folder, no permission
    std::string why = py::str(e.value());
    why = why.substr(0, why.find('\n'));
    if (why.find("pickle") != std::string::npos) why = "it is not a numpy file";
    throw py::value_error(path + ": not an .npz archive that save() wrote (" + why + ")");
  }
  if (!py::hasattr(file, "files"))
    throw py::value_error(path + ": holds a single array (.npy); load() reads the .npz archive that save() writes");
  struct Closer {
    py::object f;
    ~Closer() {
      try {
        f.attr("close")();
      } catch (...) {
      }
    }
  } closer{file};
  std::vector<std::string> keys;
  for (py::handle key : file.attr("files")) keys.push_back(py::str(key));
  auto has = [&](const std::string& key) { return std::find(keys.begin(), keys.end(), key) != keys.end(); };
  StagedLoad staged;
  staged.with_state = trainable && has("optimizer/step");
  std::vector<std::string> known;
  for (const auto& e : params) known.push_back(e.name);
  if (staged.with_state) {
    for (const auto& e : state) known.push_back(e.name);
    known.push_back("optimizer/step");
  }
  for (const auto& key : keys) {
    if (std::find(known.begin(), known.end(), key) != known.end()) continue;
    if (trainable && !staged.with_state && key.rfind("optimizer/", 0) == 0)
      throw py::value_error(path + ": has optimizer state ('" + key + "') but no 'optimizer/step'");
    throw py::value_error(path + ": unexpected array '" + key + "': the model has no such " +
                          (key.rfind("optimizer/", 0) == 0 ? "optimizer state" : "parameter"));
  }
  for (const auto& e : params) {
    if (!has(e.name)) throw py::value_error(path + ": missing parameter '" + e.name + "'");
    staged.arrays.push_back(checked(path, file, e, "parameter"));
  }
  if (staged.with_state) {
    for (const auto& e : state) {
      if (!has(e.name)) throw py::value_error(path + ": missing optimizer state '" + e.name + "'");
      staged.arrays.push_back(checked(path, file, e, "optimizer state"));
    }
    staged.step = checked_step(path, file);
  }
  return staged;
}

}  // namespace dg
