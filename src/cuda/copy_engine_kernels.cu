// Kernels of the copy-engine gradient reduction (copy_engine_kernels.h).
#include <cstdint>

#include "cuda/copy_engine_kernels.h"
#include "cuda/cuda_check.h"
#include "cuda/runtime.h"

namespace ndt::cuda {
namespace {

// One element's rank-order sum from the left; k counts the other ranks.
template <typename T>
__device__ __forceinline__ T sum_in_rank_order(T mine, const T* pulled, int64_t count, int64_t i, int n,
                                               int self);

template <>
__device__ __forceinline__ float sum_in_rank_order(float mine, const float* pulled, int64_t count, int64_t i,
                                                   int n, int self) {
  float acc = self == 0 ? mine : pulled[i];
  for (int q = 1, k = self == 0 ? 0 : 1; q < n; ++q) acc += q == self ? mine : pulled[(k++) * count + i];
  return acc;
}

template <>
__device__ __forceinline__ float4 sum_in_rank_order(float4 mine, const float4* pulled, int64_t count,
                                                    int64_t i, int n, int self) {
  float4 acc = self == 0 ? mine : pulled[i];
  for (int q = 1, k = self == 0 ? 0 : 1; q < n; ++q) {
    const float4 v = q == self ? mine : pulled[(k++) * count + i];
    acc.x += v.x;
    acc.y += v.y;
    acc.z += v.z;
    acc.w += v.w;
  }
  return acc;
}

// count elements of T (float4 where the pieces allow it: the same sums, four at a time).
template <typename T>
__global__ void sum_kernel(T* dst, const T* pulled, int64_t count, int n, int self) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride)
    dst[i] = sum_in_rank_order(dst[i], pulled, count, i, n, self);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

void ce_sum_in_rank_order(float* dst, const float* pulled, int64_t count, int n, int self,
                          cudaStream_t stream) {
  if (count <= 0) return;
  const int threads = 256;
  const bool vec = count % 4 == 0 && aligned16(dst) && aligned16(pulled);
  const int64_t items = vec ? count / 4 : count;
  const int64_t want = (items + threads - 1) / threads;
  const int64_t cap = 4 * static_cast<int64_t>(sm_count());  // four blocks per SM; the rest grid-strides
  const int blocks = static_cast<int>(want < cap ? want : cap);
  if (vec)
    sum_kernel<float4><<<blocks, threads, 0, stream>>>(
        reinterpret_cast<float4*>(dst), reinterpret_cast<const float4*>(pulled), items, n, self);
  else
    sum_kernel<float><<<blocks, threads, 0, stream>>>(dst, pulled, items, n, self);
  NDT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ndt::cuda
