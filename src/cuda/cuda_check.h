#pragma once
// Error checking for CUDA runtime calls, usable from .cu files. Rule for this folder: .cu files include
// only CUDA headers and fmt-free headers like this one (nvcc cannot compile fmt's consteval format
// checks); Tensor-level wrappers that use core/ live in .cpp files compiled by the host compiler.
#include <cuda_runtime.h>

namespace ndt::cuda {
// Throws ndt::Error naming the expression, the CUDA error and file:line.
[[noreturn]] void cuda_failed(cudaError_t err, const char* expr, const char* file, int line);
}  // namespace ndt::cuda

#define NDT_CUDA_CHECK(expr)                                                     \
  do {                                                                           \
    cudaError_t ndt_err_ = (expr);                                               \
    if (ndt_err_ != cudaSuccess) ::ndt::cuda::cuda_failed(ndt_err_, #expr, __FILE__, __LINE__); \
  } while (0)

// After a kernel launch: launch-configuration errors surface here, execution errors at the next sync.
#define NDT_CUDA_CHECK_LAUNCH() NDT_CUDA_CHECK(cudaGetLastError())
