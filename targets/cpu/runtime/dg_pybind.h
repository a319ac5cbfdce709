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

}  // namespace dg
