// dg_pybind.h: numpy <-> dg::View/Tensor conversion for the generated bindings,
// with the input checks a Python user sees as ValueError.
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

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
  if (!arr.dtype().is(py::dtype::of<T>()))
    throw py::value_error(std::string("input '") + name + "': expected dtype " + want + ", got " +
                          std::string(py::str(arr.dtype())) + " (convert with .astype(np." + want + "))");
  if (!(arr.flags() & py::array::c_style))
    throw py::value_error(std::string("input '") + name +
                          "': the array must be C-contiguous (use np.ascontiguousarray)");
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
        word = item.node.cast<int64_t>();
        leaf = true;
      } else if (py::isinstance<py::tuple>(item.node) && py::len(item.node) == 2 &&
                 py::isinstance<py::list>(py::reinterpret_borrow<py::tuple>(item.node)[1])) {
        auto pair = py::reinterpret_borrow<py::tuple>(item.node);
        word = pair[0].cast<int64_t>();
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

}  // namespace dg
