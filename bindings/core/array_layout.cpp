#include "core/array_layout.hpp"

#include <algorithm>
#include <sstream>
#include <stdexcept>

namespace mstar::py_bind {

namespace {

std::string shape_str(const py::ssize_t* dims, std::size_t n) {
  std::ostringstream s;
  s << "(";
  for (std::size_t i = 0; i < n; ++i) s << dims[i] << (n == 1 ? "," : (i + 1 < n ? ", " : ""));
  s << ")";
  return s.str();
}

std::string batch_str(const std::vector<py::ssize_t>& item) {
  std::string s = "(n";
  for (py::ssize_t d : item) s += ", " + std::to_string(d);
  return s + (item.empty() ? ",)" : ")");
}

}  // namespace

ItemLayout::ItemLayout(const py::object& dtype_like, std::vector<py::ssize_t> item_shape)
    : dtype(py::dtype::from_args(dtype_like)), shape(std::move(item_shape)) {
  if (dtype.attr("hasobject").cast<bool>())
    throw py::type_error("streams hold raw bytes: dtype " + py::str(dtype).cast<std::string>() +
                         " contains Python objects; use a numeric or fixed-size dtype");
  // (checked here, not at the first pop: the views have one dimension more)
  if (shape.size() > 15) throw py::value_error("items may have at most 15 dimensions");
  std::size_t bytes = static_cast<std::size_t>(dtype.itemsize());
  for (py::ssize_t d : shape) {
    if (d <= 0) throw py::value_error("item_shape " + shape_str(shape.data(), shape.size()) +
                                      " must have positive dimensions");
    // a wrapped product made 4-byte items of (2^63-1, 2^63-1), then a segfault
    if (__builtin_mul_overflow(bytes, static_cast<std::size_t>(d), &bytes) || bytes > (SIZE_MAX >> 2))
      throw py::value_error("item_shape " + shape_str(shape.data(), shape.size()) +
                            " is too large: one item would not fit in memory");
  }
  item_bytes = bytes;
  if (item_bytes == 0) throw py::value_error("items must be at least one byte");
}

std::string ItemLayout::describe() const {
  return py::str(dtype).cast<std::string>() + " items of shape " +
         shape_str(shape.data(), shape.size());
}

std::size_t ItemLayout::count_items(py::array& array, const char* where) const {
  auto& api = py::detail::npy_api::get();
  const auto* proxy = py::detail::array_proxy(array.ptr());
  if (!api.PyArray_EquivTypes_(proxy->descr, dtype.ptr()))
    throw py::type_error(std::string(where) + ": got an array of dtype " +
                         py::str(array.dtype()).cast<std::string>() + ", but this stream holds " +
                         describe() + "; convert it first (array.astype(...))");
  const auto nd = static_cast<std::size_t>(array.ndim());
  const std::size_t k = shape.size();
  const bool batch = nd == k + 1;
  if (nd != k && !batch)
    throw py::value_error(std::string(where) + ": got shape " + shape_str(array.shape(), nd) +
                          ", expected one item of shape " + shape_str(shape.data(), k) +
                          " or a batch of shape " + batch_str(shape));
  for (std::size_t i = 0; i < k; ++i) {
    if (array.shape(static_cast<py::ssize_t>(nd - k + i)) != shape[i])
      throw py::value_error(std::string(where) + ": got shape " + shape_str(array.shape(), nd) +
                            ", but items have shape " + shape_str(shape.data(), k));
  }
  if (!(array.flags() & py::array::c_style))
    array = py::array::ensure(array, py::array::c_style);  // the one unavoidable copy
  return batch ? static_cast<std::size_t>(array.shape(0)) : 1;
}

py::array ItemLayout::view(const void* data, std::size_t count, py::handle base,
                           bool writable) const {
  // Straight through numpy's C API with the shape on the stack: this runs once per chunk, and
  // pybind11's array constructor would allocate shape and stride vectors each time.
  constexpr std::size_t kMaxDims = 16;
  if (shape.size() + 1 > kMaxDims) throw py::value_error("items may have at most 15 dimensions");
  py::ssize_t dims[kMaxDims];
  dims[0] = static_cast<py::ssize_t>(count);
  std::copy(shape.begin(), shape.end(), dims + 1);
  const int nd = static_cast<int>(shape.size() + 1);
  auto& api = py::detail::npy_api::get();
  if (data == nullptr) {  // a fresh, owned array
    return py::reinterpret_steal<py::array>(api.PyArray_NewFromDescr_(
        api.PyArray_Type_, dtype.inc_ref().ptr(), nd, dims, nullptr, nullptr, 0, nullptr));
  }
  int flags = py::detail::npy_api::NPY_ARRAY_C_CONTIGUOUS_ | py::detail::npy_api::NPY_ARRAY_ALIGNED_;
  if (writable) flags |= py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  auto out = py::reinterpret_steal<py::array>(api.PyArray_NewFromDescr_(
      api.PyArray_Type_, dtype.inc_ref().ptr(), nd, dims, nullptr, const_cast<void*>(data), flags,
      nullptr));
  if (!out) throw py::error_already_set();
  // The base keeps the ring's memory alive for as long as the view lives.
  if (api.PyArray_SetBaseObject_(out.ptr(), base.inc_ref().ptr()) != 0) throw py::error_already_set();
  return out;
}

}  // namespace mstar::py_bind
