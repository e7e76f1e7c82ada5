#pragma once
// Shared by the GPU tests: skip with a clear message when this machine has no CUDA device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "cuda/cuda_check.h"
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

// Mean milliseconds of f over `iters` calls after 3 warm-up calls, by CUDA events on the default stream
// (the DISABLED_* timing tests; never an assertion).
template <typename F>
double time_ms(F&& f, int iters = 20) {
  for (int i = 0; i < 3; ++i) f();
  cudaEvent_t a, b;
  NDT_CUDA_CHECK(cudaEventCreate(&a));
  NDT_CUDA_CHECK(cudaEventCreate(&b));
  NDT_CUDA_CHECK(cudaEventRecord(a));
  for (int i = 0; i < iters; ++i) f();
  NDT_CUDA_CHECK(cudaEventRecord(b));
  NDT_CUDA_CHECK(cudaEventSynchronize(b));
  float ms = 0;
  NDT_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms / iters;
}
}  // namespace ndt::testing
