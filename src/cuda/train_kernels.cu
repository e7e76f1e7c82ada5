#include "cuda/cuda_check.h"
#include "cuda/train_kernels.h"

namespace ndt::cuda {
namespace {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void store(float* p, float x) { *p = x; }
__device__ __forceinline__ void store(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }

template <typename E>
__global__ void add_bias_rows_kernel(E* x, const E* bias, int64_t n, int64_t C) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    store(x + i, to_float(x[i]) + to_float(bias[i % C]));
}

__global__ void scale_mask_kernel(float* dloss, const float* mask, float scale, int64_t T) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < T) dloss[i] = scale * mask[i];
}

constexpr int kLossThreads = 1024;
__global__ void masked_loss_sum_kernel(double* result, const float* logprob, const float* mask, int64_t T) {
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

unsigned blocks_for(int64_t n, int threads) {
  int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > 65535 * 8 ? 65535 * 8 : b));
}

}  // namespace

template <typename E>
void add_bias_rows(E* x, const E* bias, int64_t T, int64_t C, cudaStream_t stream) {
  const int64_t n = T * C;
  if (n == 0) return;
  add_bias_rows_kernel<E><<<blocks_for(n, 256), 256, 0, stream>>>(x, bias, n, C);
  NDT_CUDA_CHECK_LAUNCH();
}
template void add_bias_rows<float>(float*, const float*, int64_t, int64_t, cudaStream_t);
template void add_bias_rows<__nv_bfloat16>(__nv_bfloat16*, const __nv_bfloat16*, int64_t, int64_t,
                                           cudaStream_t);

void scale_mask(float* dloss, const float* mask, float scale, int64_t T, cudaStream_t stream) {
  if (T == 0) return;
  scale_mask_kernel<<<static_cast<unsigned>((T + 255) / 256), 256, 0, stream>>>(dloss, mask, scale, T);
  NDT_CUDA_CHECK_LAUNCH();
}

void masked_loss_sum(double* result, const float* logprob, const float* mask, int64_t T,
                     cudaStream_t stream) {
  masked_loss_sum_kernel<<<1, kLossThreads, 0, stream>>>(result, logprob, mask, T);
  NDT_CUDA_CHECK_LAUNCH();
}

}  // namespace ndt::cuda
