#include "cuda/cuda_check.h"
#include "cuda/cuda_kernel_utils.cuh"
#include "cuda/train_kernels.h"

namespace ndt::cuda {
namespace {

// The scale is an argument, or read from device memory (a CUDA graph replays it with each step's value).
__global__ void scale_mask_kernel(float* dloss, const float* mask, float scale, const float* scale_at,
                                  int64_t T) {
  detail::pdl_prologue();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < T) dloss[i] = (scale_at ? *scale_at : scale) * mask[i];
}

constexpr int kLossThreads = 1024;
__global__ void masked_loss_sum_kernel(double* result, const float* logprob, const float* mask, int64_t T) {
  detail::pdl_prologue();
  __shared__ double sm[kLossThreads];
  double acc = 0;
  for (int64_t t = threadIdx.x; t < T; t += kLossThreads)
    if (mask[t] != 0.0f) acc -= static_cast<double>(logprob[t]) * mask[t];
  sm[threadIdx.x] = acc;
  __syncthreads();
  for (int s = kLossThreads / 2; s > 0; s >>= 1) {
    if (static_cast<int>(threadIdx.x) < s) sm[threadIdx.x] += sm[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) *result += sm[0];
}

// Spins on a flag nothing sets; the volatile read keeps the loop from being optimised away.
__device__ int g_never_set = 0;
__global__ void hang_kernel() {
  detail::pdl_prologue();  // (launched the ordinary way: a no-op; kept for the file's rule)
  while (*static_cast<volatile int*>(&g_never_set) == 0) __nanosleep(1000000);
}

}  // namespace

void scale_mask(float* dloss, const float* mask, float scale, int64_t T, cudaStream_t stream) {
  if (T == 0) return;
  detail::launch_pdl(scale_mask_kernel, static_cast<unsigned>((T + 255) / 256), 256, 0, stream, dloss, mask,
                     scale, nullptr, T);
  NDT_CUDA_CHECK_LAUNCH();
}

void scale_mask_at(float* dloss, const float* mask, const float* scale, int64_t T, cudaStream_t stream) {
  if (T == 0) return;
  detail::launch_pdl(scale_mask_kernel, static_cast<unsigned>((T + 255) / 256), 256, 0, stream, dloss, mask,
                     0.f, scale, T);
  NDT_CUDA_CHECK_LAUNCH();
}

void masked_loss_sum(double* result, const float* logprob, const float* mask, int64_t T,
                     cudaStream_t stream) {
  detail::launch_pdl(masked_loss_sum_kernel, 1, kLossThreads, 0, stream, result, logprob, mask, T);
  NDT_CUDA_CHECK_LAUNCH();
}

void hang_stream(cudaStream_t stream) {
  hang_kernel<<<1, 1, 0, stream>>>();
  NDT_CUDA_CHECK_LAUNCH();
}

}  // namespace ndt::cuda
