// dg_cuda_pybind.h: numpy views of the CUDA target's device tensors.
//
// A parameter (or gradient, or optimizer slot) lives on the device; its numpy
// view is a view of the tensor's host copy. While such a view is alive the
// model uploads the host copy before each call and downloads after a
// train_step, so the view behaves as on the CPU target (writes reach the
// model, training shows in it); with no view alive nothing crosses the bus.
//
// Part of the deepgen CUDA runtime: hand-written, copied unchanged into every
// generated project.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include "dg_cuda.h"
#include "dg_pybind.h"

namespace dg {
namespace py = pybind11;

// A writable numpy view of t's host copy. It keeps `owner` (the Python Model)
// alive and counts itself in t.views until numpy frees it.
template <typename T>
py::array device_tensor_view(DeviceTensor<T>& t, py::handle owner) {
  struct Keep {
    DeviceTensor<T>* tensor;
    py::object owner;
  };
  T* data = t.host();  // current values (downloaded if the device is newer)
  auto* keep = new Keep{&t, py::reinterpret_borrow<py::object>(owner)};
  ++t.views;
  py::capsule base(keep, [](void* p) {
    auto* k = static_cast<Keep*>(p);
    --k->tensor->views;
    delete k;
  });
  return py::array_t<T>(t.shape, data, base);
}

// build_info() of the module: how it was built and which device it runs on.
inline py::dict build_info() {
  py::dict info;
  info["target"] = "cuda";
#ifdef DG_CUDA_EMULATE
  info["emulated"] = true;
#else
  info["emulated"] = false;
#endif
#ifdef DG_USE_CUBLAS
  info["cublas"] = true;
#else
  info["cublas"] = false;
#endif
  info["device"] = device_name();
  return info;
}

}  // namespace dg
