// How numpy arrays map onto ring items: a dtype and an item shape declared per stream.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstddef>
#include <string>
#include <vector>

namespace mstar::py_bind {

namespace py = pybind11;

struct ItemLayout {
  py::dtype dtype;
  std::vector<py::ssize_t> shape;  ///< of one item; empty for scalars
  std::size_t item_bytes = 0;

  ItemLayout(const py::object& dtype_like, std::vector<py::ssize_t> item_shape);

  /// Checks `array` against the layout and returns how many items it holds: an array of the
  /// item's own shape is one item, (n, *item_shape) is n. Raises TypeError/ValueError naming the
  /// mismatch. `array` is replaced by a C-contiguous version if it was not one.
  std::size_t count_items(py::array& array, const char* where) const;

  /// An ndarray of `count` items over `data` without copying; `base` keeps the memory alive.
  py::array view(const void* data, std::size_t count, py::handle base, bool writable) const;

  std::string describe() const;  ///< e.g. "float32 items of shape (320,)"
};

}  // namespace mstar::py_bind
