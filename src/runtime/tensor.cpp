// Tensor and TensorSpec (see mstar/tensor.hpp).
#include <cstring>
#include <stdexcept>

#include "mstar/tensor.hpp"

namespace mstar {

namespace {

struct DTypeInfo {
  DType dtype;
  std::size_t size;
  const char* name;
};

constexpr DTypeInfo kDTypes[] = {
    {DType::float32, 4, "float32"}, {DType::float64, 8, "float64"}, {DType::float16, 2, "float16"},
    {DType::bfloat16, 2, "bfloat16"}, {DType::int8, 1, "int8"},     {DType::int16, 2, "int16"},
    {DType::int32, 4, "int32"},     {DType::int64, 8, "int64"},     {DType::uint8, 1, "uint8"},
    {DType::boolean, 1, "bool"},
};

std::string shape_text(const Shape& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += shape[i] < 0 ? std::string("*") : std::to_string(shape[i]);
  }
  return s + "]";
}

// The shape as given (shape_text prints a spec's -1 as "*"), for errors about a tensor's shape.
std::string literal_shape(const Shape& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// A negative dimension, or a size whose bytes wrap around size_t (a wrapped size would
// allocate too little and every write past it would corrupt the heap), is refused.
void check_shape(const Shape& shape, std::size_t element_size) {
  std::size_t bytes = element_size;
  for (std::int64_t d : shape) {
    if (d < 0)
      throw std::invalid_argument("tensor shape " + literal_shape(shape) + " has a negative dimension");
    if (__builtin_mul_overflow(bytes, static_cast<std::size_t>(d), &bytes))
      throw std::invalid_argument("tensor shape " + literal_shape(shape) +
                                  " is too large: its size in bytes overflows");
  }
}

}  // namespace

std::size_t dtype_size(DType dtype) noexcept {
  for (const auto& d : kDTypes)
    if (d.dtype == dtype) return d.size;
  return 0;
}

const char* dtype_name(DType dtype) noexcept {
  for (const auto& d : kDTypes)
    if (d.dtype == dtype) return d.name;
  return "?";
}

DType dtype_from_name(const std::string& name) {
  for (const auto& d : kDTypes)
    if (name == d.name) return d.dtype;
  throw std::invalid_argument("unknown dtype '" + name +
                              "'; use float32, float64, float16, bfloat16, int8, int16, int32, "
                              "int64, uint8 or bool");
}

Tensor Tensor::empty(DType dtype, Shape shape) {
  Tensor t;
  t.dtype_ = dtype;
  t.shape_ = std::move(shape);
  check_shape(t.shape_, dtype_size(dtype));
  // At least one byte, so that a tensor with no elements is still defined.
  const std::size_t bytes = t.nbytes() ? t.nbytes() : 1;
  std::shared_ptr<unsigned char[]> storage(new unsigned char[bytes]());
  t.data_ = storage.get();
  t.owner_ = std::shared_ptr<void>(storage, storage.get());
  return t;
}

Tensor Tensor::view(void* data, DType dtype, Shape shape, std::shared_ptr<void> owner) {
  if (data == nullptr) throw std::invalid_argument("Tensor::view of a null pointer");
  check_shape(shape, dtype_size(dtype));
  Tensor t;
  t.data_ = data;
  t.dtype_ = dtype;
  t.shape_ = std::move(shape);
  t.owner_ = std::move(owner);
  return t;
}

std::int64_t Tensor::dim(std::size_t i) const {
  if (i >= shape_.size())
    throw std::out_of_range("dimension " + std::to_string(i) + " of a " + describe() + " tensor");
  return shape_[i];
}

std::size_t Tensor::numel() const noexcept {
  std::size_t n = 1;
  for (std::int64_t d : shape_) n *= static_cast<std::size_t>(d);
  return n;
}

Tensor Tensor::clone() const {
  if (!defined()) return Tensor();
  Tensor t = empty(dtype_, shape_);
  std::memcpy(t.data_, data_, nbytes());
  return t;
}

std::string Tensor::describe() const {
  if (!defined()) return "undefined";
  return std::string(dtype_name(dtype_)) + shape_text(shape_);
}

void Tensor::check_dtype(DType want) const {
  if (!defined()) throw std::invalid_argument("reading data of an undefined tensor");
  if (want != dtype_)
    throw std::invalid_argument(std::string("tensor is ") + describe() + ", read as " +
                                dtype_name(want) + "; read it with its own dtype or convert it");
}

void Tensor::check_count(std::size_t count) const {
  if (count != numel())
    throw std::invalid_argument(std::to_string(count) + " values do not fill shape " +
                                shape_text(shape_) + " (" + std::to_string(numel()) + " elements)");
}

std::string TensorSpec::mismatch(const Tensor& t) const {
  if (!t.defined()) return "expected " + describe() + ", got no tensor";
  bool ok = any_dtype || t.dtype() == dtype;
  if (ok && !any_shape) {
    ok = t.ndim() == shape.size();
    for (std::size_t i = 0; ok && i < shape.size(); ++i) ok = shape[i] < 0 || shape[i] == t.shape()[i];
  }
  return ok ? std::string() : "expected " + describe() + ", got " + t.describe();
}

std::string TensorSpec::describe() const {
  return std::string(any_dtype ? "any dtype" : dtype_name(dtype)) +
         (any_shape ? std::string(any_dtype ? "" : "[any shape]") : shape_text(shape));
}

}  // namespace mstar
