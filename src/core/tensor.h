#pragma once
// Tensor: a contiguous n-d array with a dtype and a device.
// Ownership: storage is shared (copying a Tensor aliases the same memory; use clone() for a deep copy).
// Device::CUDA storage (builds with NDT_HAVE_CUDA) comes from the stream-ordered pool of cuda/runtime.h:
// allocation, zeroing, clone and device copies are asynchronous on the compute stream; copies to the host
// (to(Device::CPU), to_vector, copy_from into a CPU tensor) wait for it. data_ptr() of a CUDA tensor is a
// device pointer: pass it to kernels, never dereference it on the host.
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/check.h"

namespace ndt {

enum class DType : uint8_t { F32, BF16, I32, I64, F64 };  // F64: host-side reductions (loss sums, norms)
enum class Device : uint8_t { CPU, CUDA };

size_t dtype_size(DType dt);
const char* dtype_name(DType dt);
const char* device_name(Device d);

using Shape = std::vector<int64_t>;
int64_t shape_numel(const Shape& s);
std::string shape_str(const Shape& s);

template <typename T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() {
  return DType::F32;
}
template <>
constexpr DType dtype_of<int32_t>() {
  return DType::I32;
}
template <>
constexpr DType dtype_of<int64_t>() {
  return DType::I64;
}
template <>
constexpr DType dtype_of<double>() {
  return DType::F64;
}
template <>
constexpr DType dtype_of<uint16_t>() {
  return DType::BF16;
}  // bf16 stored as raw 16-bit words

class Tensor {
 public:
  Tensor() = default;
  // Allocates uninitialized storage.
  static Tensor empty(Shape shape, DType dt = DType::F32, Device dev = Device::CPU);
  static Tensor zeros(Shape shape, DType dt = DType::F32, Device dev = Device::CPU);
  static Tensor full(Shape shape, float value);
  // A tensor over memory allocated elsewhere (its deleter frees it): at least nbytes of `dev` memory.
  static Tensor adopt(std::shared_ptr<uint8_t> storage, Shape shape, DType dt, Device dev);
  // Copies host data into a new CPU tensor.
  template <typename T>
  static Tensor from_vector(const std::vector<T>& v, Shape shape) {
    NDT_CHECK(shape_numel(shape) == static_cast<int64_t>(v.size()), "from_vector: {} elements for shape {}",
              v.size(), shape_str(shape));
    Tensor t = empty(std::move(shape), dtype_of<T>());
    if (!v.empty()) std::memcpy(t.data_ptr(), v.data(), v.size() * sizeof(T));
    return t;
  }

  bool defined() const { return static_cast<bool>(storage_); }
  const Shape& shape() const { return shape_; }
  int64_t dim() const { return static_cast<int64_t>(shape_.size()); }
  int64_t size(int64_t d) const;
  int64_t numel() const { return numel_; }
  size_t nbytes() const { return static_cast<size_t>(numel_) * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }

  void* data_ptr() { return storage_.get(); }
  const void* data_ptr() const { return storage_.get(); }
  template <typename T>
  T* data() {
    NDT_CHECK(dtype_of<T>() == dtype_, "tensor holds {}, accessed as {}", dtype_name(dtype_),
              dtype_name(dtype_of<T>()));
    return static_cast<T*>(data_ptr());
  }
  template <typename T>
  const T* data() const {
    NDT_CHECK(dtype_of<T>() == dtype_, "tensor holds {}, accessed as {}", dtype_name(dtype_),
              dtype_name(dtype_of<T>()));
    return static_cast<const T*>(data_ptr());
  }
  float* f32() { return data<float>(); }
  const float* f32() const { return data<float>(); }
  int32_t* i32() { return data<int32_t>(); }
  const int32_t* i32() const { return data<int32_t>(); }

  // Same storage, new shape (numel must match).
  Tensor view(Shape shape) const;
  // A view of `shape` starting `offset` elements into this tensor's storage (shares ownership).
  Tensor view_at(int64_t offset, Shape shape) const;
  // Rows [first, first + count) along dim 0, as a view (shares ownership).
  Tensor rows(int64_t first, int64_t count) const;
  Tensor clone() const;
  void zero_();
  void copy_from(const Tensor& src);  // same numel and dtype; any devices
  // This tensor on `dev`: itself (shared storage) when already there, else a copy.
  Tensor to(Device dev) const;
  template <typename T>
  std::vector<T> to_vector() const {
    if (device_ != Device::CPU) return to(Device::CPU).to_vector<T>();
    std::vector<T> v(static_cast<size_t>(numel_));
    if (numel_) std::memcpy(v.data(), data<T>(), v.size() * sizeof(T));
    return v;
  }

 private:
  std::shared_ptr<uint8_t> storage_;
  Shape shape_;
  int64_t numel_ = 0;
  DType dtype_ = DType::F32;
  Device device_ = Device::CPU;
};

}  // namespace ndt
