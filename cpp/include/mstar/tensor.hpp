// mstar/tensor.hpp — a dense, row-major tensor: raw bytes plus dtype and shape.
//
// What C++ nodes read and write, and what requests take in and stream out. A Tensor shares its
// bytes (copying a Tensor copies a reference, like torch); clone() copies the bytes. It either
// owns them (empty(), from()) or views memory someone else owns (view(); an optional `owner`
// keeps that memory alive as long as any Tensor refers to it). data<T>() checks the dtype, so a
// node that reads float32 from an int64 input gets an error naming both, not garbage.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace mstar {

enum class DType : std::uint8_t { float32, float64, float16, bfloat16, int8, int16, int32, int64,
                                  uint8, boolean };

std::size_t dtype_size(DType dtype) noexcept;
const char* dtype_name(DType dtype) noexcept;  ///< numpy's names: "float32", "int64", "bool", ...
/// The dtype named by numpy's name; throws std::invalid_argument for an unknown name.
DType dtype_from_name(const std::string& name);

template <class T> struct DTypeOf;
template <> struct DTypeOf<float> { static constexpr DType value = DType::float32; };
template <> struct DTypeOf<double> { static constexpr DType value = DType::float64; };
template <> struct DTypeOf<std::int8_t> { static constexpr DType value = DType::int8; };
template <> struct DTypeOf<std::int16_t> { static constexpr DType value = DType::int16; };
template <> struct DTypeOf<std::int32_t> { static constexpr DType value = DType::int32; };
template <> struct DTypeOf<std::int64_t> { static constexpr DType value = DType::int64; };
template <> struct DTypeOf<std::uint8_t> { static constexpr DType value = DType::uint8; };
template <> struct DTypeOf<bool> { static constexpr DType value = DType::boolean; };
template <class T> inline constexpr DType dtype_of = DTypeOf<T>::value;

using Shape = std::vector<std::int64_t>;

class Tensor {
 public:
  /// An undefined tensor (defined() is false): "no value".
  Tensor() = default;

  /// Owning, zero-filled. Throws std::invalid_argument for a negative dimension.
  static Tensor empty(DType dtype, Shape shape);
  /// Owning copy of `values`; throws std::invalid_argument if the shape does not hold them all.
  template <class T>
  static Tensor from(const std::vector<T>& values, Shape shape) {
    Tensor t = empty(dtype_of<T>, std::move(shape));
    t.check_count(values.size());
    T* out = t.data<T>();
    for (std::size_t i = 0; i < values.size(); ++i) out[i] = values[i];
    return t;
  }
  /// A 0-d tensor holding one value.
  template <class T>
  static Tensor scalar(T value) { return from<T>({value}, {}); }
  /// Views `data` (not null) without copying. Without `owner` the caller keeps the memory alive while any
  /// Tensor refers to it; with one, the Tensor holds a reference to `owner`.
  static Tensor view(void* data, DType dtype, Shape shape, std::shared_ptr<void> owner = nullptr);

  bool defined() const noexcept { return data_ != nullptr; }
  DType dtype() const noexcept { return dtype_; }
  const Shape& shape() const noexcept { return shape_; }
  std::size_t ndim() const noexcept { return shape_.size(); }
  std::int64_t dim(std::size_t i) const;  ///< throws std::out_of_range
  std::size_t numel() const noexcept;
  std::size_t nbytes() const noexcept { return numel() * dtype_size(dtype_); }

  /// Typed access; throws std::invalid_argument when T is not the tensor's dtype.
  template <class T>
  T* data() {
    check_dtype(dtype_of<T>);
    return static_cast<T*>(data_);
  }
  template <class T>
  const T* data() const {
    check_dtype(dtype_of<T>);
    return static_cast<const T*>(data_);
  }
  void* raw() noexcept { return data_; }
  const void* raw() const noexcept { return data_; }

  /// A new owning tensor with a copy of the bytes.
  Tensor clone() const;
  /// "float32[20, 2]"; "undefined" for Tensor().
  std::string describe() const;

 private:
  void check_dtype(DType want) const;
  void check_count(std::size_t count) const;

  std::shared_ptr<void> owner_;
  void* data_ = nullptr;
  DType dtype_ = DType::float32;
  Shape shape_;
};

/// What a request input must look like: a dtype (or any) and a shape whose -1 entries match any
/// size (an empty spec accepts anything).
struct TensorSpec {
  bool any_dtype = true;
  DType dtype = DType::float32;
  bool any_shape = true;
  Shape shape;

  static TensorSpec of(DType dtype, Shape shape) { return {false, dtype, false, std::move(shape)}; }
  /// Empty when `t` matches; else what is wrong, e.g. "expected float32[8], got float32[7]".
  std::string mismatch(const Tensor& t) const;
  std::string describe() const;
};

}  // namespace mstar
