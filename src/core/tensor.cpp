#include "core/tensor.h"

#include <cstdlib>

#ifdef NDT_HAVE_CUDA
#include "cuda/runtime.h"
#endif

namespace ndt {

size_t dtype_size(DType dt) {
  switch (dt) {
    case DType::F32:
      return 4;
    case DType::BF16:
      return 2;
    case DType::I32:
      return 4;
    case DType::I64:
      return 8;
    case DType::F64:
      return 8;
  }
  return 0;
}

const char* dtype_name(DType dt) {
  switch (dt) {
    case DType::F32:
      return "f32";
    case DType::BF16:
      return "bf16";
    case DType::I32:
      return "i32";
    case DType::I64:
      return "i64";
    case DType::F64:
      return "f64";
  }
  return "?";
}

const char* device_name(Device d) { return d == Device::CPU ? "cpu" : "cuda"; }

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) {
    NDT_CHECK(d >= 0, "negative dimension in shape {}", shape_str(s));
    n *= d;
  }
  return n;
}

std::string shape_str(const Shape& s) {
  std::string out = "(";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + ")";
}

int64_t Tensor::size(int64_t d) const {
  if (d < 0) d += dim();
  NDT_CHECK(d >= 0 && d < dim(), "dim {} out of range for shape {}", d, shape_str(shape_));
  return shape_[static_cast<size_t>(d)];
}

Tensor Tensor::adopt(std::shared_ptr<uint8_t> storage, Shape shape, DType dt, Device dev) {
  NDT_CHECK(storage, "Tensor::adopt: no storage");
  Tensor t;
  t.numel_ = shape_numel(shape);
  t.shape_ = std::move(shape);
  t.dtype_ = dt;
  t.device_ = dev;
  t.storage_ = std::move(storage);
  return t;
}

Tensor Tensor::empty(Shape shape, DType dt, Device dev) {
  Tensor t;
  t.numel_ = shape_numel(shape);
  t.shape_ = std::move(shape);
  t.dtype_ = dt;
  t.device_ = dev;
  if (dev == Device::CUDA) {
#ifdef NDT_HAVE_CUDA
    // 256-byte granules keep every tensor aligned for vector loads and tensor-core matmuls.
    const size_t bytes = (std::max<size_t>(t.nbytes(), 1) + 255) / 256 * 256;
    void* p = cuda::device_alloc(bytes);
    t.storage_ = std::shared_ptr<uint8_t>(static_cast<uint8_t*>(p), [](uint8_t* q) { cuda::device_free(q); });
    return t;
#else
    NDT_FAIL("CUDA tensors need the GPU backend (not built into this binary)");
#endif
  }
  // 64-byte alignment for SIMD; at least one byte so that defined() holds for empty tensors.
  size_t bytes = (std::max<size_t>(t.nbytes(), 1) + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, bytes);
  NDT_CHECK(p != nullptr, "out of memory allocating {} bytes", bytes);
  t.storage_ = std::shared_ptr<uint8_t>(static_cast<uint8_t*>(p), [](uint8_t* q) { std::free(q); });
  return t;
}

Tensor Tensor::zeros(Shape shape, DType dt, Device dev) {
  Tensor t = empty(std::move(shape), dt, dev);
  t.zero_();
  return t;
}

Tensor Tensor::full(Shape shape, float value) {
  Tensor t = empty(std::move(shape));
  float* p = t.f32();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = value;
  return t;
}

Tensor Tensor::view(Shape shape) const {
  NDT_CHECK(shape_numel(shape) == numel_, "view: cannot view {} as {}", shape_str(shape_), shape_str(shape));
  Tensor t = *this;
  t.shape_ = std::move(shape);
  return t;
}

Tensor Tensor::view_at(int64_t offset, Shape shape) const {
  int64_t n = shape_numel(shape);
  NDT_CHECK(offset >= 0 && offset + n <= numel_, "view_at: [{}, {}) outside a tensor of {} elements", offset,
            offset + n, numel_);
  Tensor t = *this;
  t.storage_ = std::shared_ptr<uint8_t>(storage_, storage_.get() + offset * dtype_size(dtype_));
  t.shape_ = std::move(shape);
  t.numel_ = n;
  return t;
}

Tensor Tensor::rows(int64_t first, int64_t count) const {
  NDT_CHECK(dim() >= 1 && first >= 0 && count >= 0 && first + count <= shape_[0],
            "rows: [{}, {}) outside a tensor of shape {}", first, first + count, shape_str(shape_));
  Shape s = shape_;
  s[0] = count;
  return view_at(shape_[0] ? first * (numel_ / shape_[0]) : 0, std::move(s));
}

Tensor Tensor::clone() const {
  Tensor t = empty(shape_, dtype_, device_);
  t.copy_from(*this);
  return t;
}

void Tensor::zero_() {
  if (!numel_) return;
  if (device_ == Device::CPU) {
    std::memset(data_ptr(), 0, nbytes());
    return;
  }
#ifdef NDT_HAVE_CUDA
  cuda::memset_zero(data_ptr(), nbytes());
#endif
}

void Tensor::copy_from(const Tensor& src) {
  NDT_CHECK(src.numel_ == numel_ && src.dtype_ == dtype_, "copy_from: {} {} into {} {}",
            shape_str(src.shape_), dtype_name(src.dtype_), shape_str(shape_), dtype_name(dtype_));
  if (!numel_) return;
  if (device_ == Device::CPU && src.device_ == Device::CPU) {
    std::memcpy(data_ptr(), src.data_ptr(), nbytes());
    return;
  }
#ifdef NDT_HAVE_CUDA
  if (device_ == Device::CUDA && src.device_ == Device::CUDA)
    cuda::copy_d2d(data_ptr(), src.data_ptr(), nbytes());
  else if (device_ == Device::CUDA)
    cuda::copy_h2d(data_ptr(), src.data_ptr(), nbytes());
  else
    cuda::copy_d2h(data_ptr(), src.data_ptr(), nbytes());
#endif
}

Tensor Tensor::to(Device dev) const {
  if (dev == device_) return *this;
  Tensor t = empty(shape_, dtype_, dev);
  t.copy_from(*this);
  return t;
}

}  // namespace ndt
