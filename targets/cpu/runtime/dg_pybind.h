// dg_pybind.h: numpy <-> dg::View/Tensor conversion for the generated bindings,
// with the input checks a Python user sees as ValueError, and the Python
// exceptions of save() and load().
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>
#include <utility>
#include <vector>

#include "dg_npz.h"
#include "dg_tensor.h"

namespace dg {
namespace py = pybind11;

// Every keyword must be one of `known` and every name in `required` must be
// given (forward() requires fewer inputs than train_step() but accepts all).
// The list of names for the message is made only when there is one to give.
inline void check_input_names(const py::kwargs& given, const std::vector<std::string>& required,
                              const std::vector<std::string>& known) {
  auto all_names = [&known] {
    std::string names;
    for (const auto& n : known)
      names += (names.empty() ? "" : ", ") + n;
    return names;
  };
  for (const auto& item : given) {
    const std::string key = py::str(item.first);
    bool found = false;
    for (const auto& n : known)
      found = found || n == key;
    if (!found) throw py::value_error("unknown input '" + key + "'; the model's inputs are: " + all_names());
  }
  for (const auto& n : required)
    if (!given.contains(n.c_str()))
      throw py::value_error("missing input '" + n + "'; the model's inputs are: " + all_names());
}

// Arrays made for the call from inputs that were not numpy arrays; they must
// outlive the call (declare one before releasing the GIL).
using KeptInputs = std::vector<py::object>;

// Input `name` as a numpy array, without a copy: a numpy array as it is; an
// object with the buffer protocol (memoryview, array.array, bytes), with
// __dlpack__ (a CPU torch tensor) or __array__, viewed through numpy. A null
// handle when the object is none of these.
inline py::object as_numpy(py::handle obj, const char* name) {
  if (py::isinstance<py::array>(obj)) return py::reinterpret_borrow<py::object>(obj);
  const char* how = PyObject_CheckBuffer(obj.ptr())  ? "asarray"
                    : py::hasattr(obj, "__dlpack__") ? "from_dlpack"
                    : py::hasattr(obj, "__array__")  ? "asarray"
                                                     : nullptr;
  if (how == nullptr) return py::object();
  try {
    return py::module_::import("numpy").attr(how)(obj);
  } catch (py::error_already_set& e) {
    std::string why = py::str(e.value());
    why = why.substr(0, why.find('\n'));
    throw py::value_error(std::string("input '") + name + "': cannot read this " +
                          std::string(py::str(py::type::of(obj).attr("__name__"))) + " as an array (" + why +
                          ")");
  }
}

// A view of the array passed as input `name`: exact dtype, C-contiguous,
// aligned. The memory is the caller's (no copy): a numpy array stays alive in
// the caller's kwargs while the model runs, any other array in `kept`.
template <typename T>
View<T> input_view(const py::kwargs& given, const char* name, const char* declared, KeptInputs& kept) {
  py::handle obj = given[name];
  // The dtype's name, for a message only (numpy prints a dtype in Python code: microseconds a call).
  auto type_name = [] { return std::string(py::str(py::dtype::of<T>())); };
  py::object converted = as_numpy(obj, name);
  if (!converted)
    throw py::value_error(
        std::string("input '") + name + "': expected a numpy array of " + type_name() + " with shape " +
        declared + " (or a C-contiguous tensor or buffer: DLPack, __array__ or the buffer protocol), got " +
        std::string(py::str(py::type::of(obj).attr("__name__"))));
  const bool is_numpy = converted.is(obj);
  if (!is_numpy) kept.push_back(converted);
  auto arr = py::reinterpret_borrow<py::array>(converted);
  // Equal dtypes, not the same descriptor object: a pickled array or np.longlong
  // for int64 carries an equivalent descriptor of its own.
  if (!py::isinstance<py::array_t<T>>(arr)) {
    const std::string want = type_name();
    throw py::value_error(
        std::string("input '") + name + "': expected dtype " + want + ", got " +
        std::string(py::str(arr.dtype())) +
        (is_numpy ? " (convert with .astype(np." + want + "))" : " (convert it to " + want + " first)"));
  }
  if (!(arr.flags() & py::array::c_style))
    throw py::value_error(std::string("input '") + name + "': the array must be C-contiguous (" +
                          (is_numpy ? "use np.ascontiguousarray" : "a torch tensor: .contiguous()") + ")");
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

// A writable numpy view of a parameter (a Tensor, or a Slice of the gradient
// buffer); `owner` (the Python Model) is kept alive by it.
template <template <typename> class Storage, typename T>
py::array param_view(Storage<T>& t, py::handle owner) {
  return py::array_t<T>(t.shape, t.ptr(), owner);
}

// param_view, counted by `watch` while numpy holds it (a dg::ParameterVersion:
// watch.view_opened() now, watch.view_closed() when numpy frees the view).
template <template <typename> class Storage, typename T, class Watch>
py::array watched_view(Storage<T>& t, py::handle owner, Watch& watch) {
  struct Keep {
    Watch* watch;
    py::object owner;  // keeps the Model, and so `watch`, alive
  };
  auto* keep = new Keep{&watch, py::reinterpret_borrow<py::object>(owner)};
  watch.view_opened();
  py::capsule base(keep, [](void* p) {
    auto* k = static_cast<Keep*>(p);
    k->watch->view_closed();
    delete k;
  });
  return py::array_t<T>(t.shape, t.ptr(), base);
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
        throw py::value_error(
            "a tree node must be a word id, a tuple of children or (word, [children]), got " +
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
        for (int64_t k = count - 1; k >= 0; --k)
          stack.push_back({kids[k], false});
      }
    }
    roots.push_back(done.back());
  }
  if (roots.empty()) throw py::value_error("empty batch: no trees");
  const int64_t nodes = static_cast<int64_t>(words.size());
  py::dict batch;
  batch["children"] = py::array_t<int64_t>(std::vector<int64_t>{nodes, arity}, children.data());
  batch["words"] = py::array_t<int64_t>(std::vector<int64_t>{nodes}, words.data());
  batch["roots"] =
      py::array_t<int64_t>(std::vector<int64_t>{static_cast<int64_t>(roots.size())}, roots.data());
  return batch;
}

// A path argument of save() and load(): str, bytes or os.PathLike (pathlib.Path),
// as the file system's bytes (os.fsencode). Anything else is a TypeError.
inline std::string path_arg(const py::object& path) {
  return py::module_::import("os").attr("fsencode")(path).cast<std::string>();
}

// `text` as a Python str: UTF-8, except that a path in it may hold any bytes
// (those show as \xNN).
inline py::str utf8_str(const std::string& text) {
  PyObject* decoded =
      PyUnicode_DecodeUTF8(text.data(), static_cast<Py_ssize_t>(text.size()), "backslashreplace");
  if (decoded == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(decoded);
}

[[noreturn]] inline void raise_error(PyObject* type, const std::string& message) {
  PyErr_SetObject(type, utf8_str(message).ptr());
  throw py::error_already_set();
}

// A Python UserWarning (an exception where warnings are errors).
inline void warn(const std::string& message) {
  py::module_::import("warnings").attr("warn")(utf8_str(message), py::handle(PyExc_UserWarning), 1);
}

// Runs `body` (a model's save() or load()) and returns what it returns, turning
// dg::FileError into Python's FileNotFoundError or OSError, bad file contents
// (std::invalid_argument) into ValueError and dg::OutOfMemory into MemoryError,
// each with its message (which names the file) whatever bytes its path holds.
template <typename F>
auto with_file_errors(F&& body) -> decltype(body()) {
  try {
    return body();
  } catch (const FileError& e) {  // the GIL is back: body's gil_scoped_release has ended
    raise_error(e.missing ? PyExc_FileNotFoundError : PyExc_OSError, e.what());
  } catch (const std::invalid_argument& e) {
    raise_error(PyExc_ValueError, e.what());
  } catch (const std::bad_alloc& e) {
    raise_error(PyExc_MemoryError, e.what());
  }
}

}  // namespace dg
