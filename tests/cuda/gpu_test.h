#pragma once
// Shared by the GPU tests: skip with a clear message when this machine has no CUDA device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

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

// Relative L2 error ||gpu - cpu|| / ||cpu|| (absolute when cpu is all zeros) <= tol, printed; every GPU
// element must be finite (outputs are NaN-poisoned before a test writes them).
inline void expect_close(const char* what, const Tensor& gpu, const Tensor& cpu, double tol) {
  const Tensor g = ops::to_host_f32(gpu);
  ASSERT_EQ(g.numel(), cpu.numel()) << what;
  double num = 0, den = 0;
  for (int64_t i = 0; i < cpu.numel(); ++i) {
    const double x = g.f32()[i], r = cpu.f32()[i];
    ASSERT_TRUE(std::isfinite(x)) << what << ": element " << i << " unwritten or not finite";
    num += (x - r) * (x - r);
    den += r * r;
  }
  const double e = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  std::printf("[err] %-40s %.3e (tol %.0e)\n", what, e, tol);
  EXPECT_LE(e, tol) << what;
}

// Mean milliseconds of f over `iters` calls after 3 warm-up calls, by CUDA events on `stream` (the
// DISABLED_* timing tests; never an assertion). The stream must be the one f's work runs on: the default
// stream for the cuda:: kernels called without one, cuda::stream() (non-blocking, so events on the
// default stream do not wait for it) for ops:: calls.
template <typename F>
double time_ms(F&& f, int iters = 20, cudaStream_t stream = 0) {
  for (int i = 0; i < 3; ++i) f();
  cudaEvent_t a, b;
  NDT_CUDA_CHECK(cudaEventCreate(&a));
  NDT_CUDA_CHECK(cudaEventCreate(&b));
  NDT_CUDA_CHECK(cudaEventRecord(a, stream));
  for (int i = 0; i < iters; ++i) f();
  NDT_CUDA_CHECK(cudaEventRecord(b, stream));
  NDT_CUDA_CHECK(cudaEventSynchronize(b));
  float ms = 0;
  NDT_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms / iters;
}
}  // namespace ndt::testing
