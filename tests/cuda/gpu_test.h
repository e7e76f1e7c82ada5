#pragma once
// Shared by the GPU tests: skip with a clear message when this machine has no CUDA device.
#include <gtest/gtest.h>

#include "cuda/device.h"
#include "ops/ops.h"

#define NDT_REQUIRE_GPU()                                                                   \
  do {                                                                                      \
    if (::ndt::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device on this machine"; \
  } while (0)

namespace ndt::testing {
// A host f32 tensor on the GPU in dtype dt (f32 or bf16, rounded to nearest even).
inline Tensor to_device_as(const Tensor& host, DType dt) {
  Tensor f = host.to(Device::CUDA);
  if (dt == DType::F32) return f;
  Tensor d = Tensor::empty(host.shape(), dt, Device::CUDA);
  ops::cast_into(d, f);
  return d;
}
}  // namespace ndt::testing
