// MoE row movement on the device: permute (gather rows, optionally scaled), unpermute (weighted sum of each
// token's k expert rows, in slot order) and the gate gradient (one dot product per slot). One block per
// output row; fp32 arithmetic; no atomics, so results are deterministic and match the CPU twin's order.
#include "cuda/cuda_kernel_utils.cuh"
#include "cuda/cuda_ops.h"

namespace ndt::cuda {
namespace {

using detail::from_f;
using detail::to_f;

template <typename E>
__global__ void permute_kernel(E* out, const E* x, const int32_t* src, const float* scale, int64_t C) {
  const int64_t i = blockIdx.x;
  const E* in = x + static_cast<int64_t>(src[i]) * C;
  const float s = scale ? scale[i] : 1.0f;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) out[i * C + c] = from_f<E>(to_f(in[c]) * s);
}

template <typename E>
__global__ void unpermute_kernel(E* out, const E* y, const int32_t* pos, const float* gates, int64_t k,
                                 int64_t C, bool accumulate) {
  const int64_t t = blockIdx.x;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    float acc = accumulate ? to_f(out[t * C + c]) : 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t p = pos[t * k + j];
      if (p < 0) continue;
      acc += (gates ? gates[t * k + j] : 1.0f) * to_f(y[static_cast<int64_t>(p) * C + c]);
    }
    out[t * C + c] = from_f<E>(acc);
  }
}

template <typename E>
__global__ void gate_grad_kernel(float* dgates, const E* dout, const E* y, const int32_t* pos, int64_t k,
                                 int64_t C) {
  const int64_t slot = blockIdx.x, t = slot / k;
  const int32_t p = pos[slot];
  float acc = 0.0f;
  if (p >= 0)
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
      acc += to_f(dout[t * C + c]) * to_f(y[static_cast<int64_t>(p) * C + c]);
  // Block reduction in a fixed order (warp shuffles, then the warps' sums in order).
  __shared__ float warp_sums[32];
  acc = detail::warp_sum(acc);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.0f;
    for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) s += warp_sums[w];
    dgates[slot] = s;
  }
}

constexpr int kThreads = 256;

}  // namespace

template <typename E>
void moe_permute(E* out, const E* x, const int32_t* src, const float* scale, int64_t R, int64_t C,
                 cudaStream_t stream) {
  if (R > 0) permute_kernel<E><<<static_cast<unsigned>(R), kThreads, 0, stream>>>(out, x, src, scale, C);
}

template <typename E>
void moe_unpermute(E* out, const E* y, const int32_t* pos, const float* gates, int64_t N, int64_t k,
                   int64_t C, bool accumulate, cudaStream_t stream) {
  if (N > 0)
    unpermute_kernel<E>
        <<<static_cast<unsigned>(N), kThreads, 0, stream>>>(out, y, pos, gates, k, C, accumulate);
}

template <typename E>
void moe_gate_grad(float* dgates, const E* dout, const E* y, const int32_t* pos, int64_t N, int64_t k,
                   int64_t C, cudaStream_t stream) {
  if (N * k > 0)
    gate_grad_kernel<E><<<static_cast<unsigned>(N * k), kThreads, 0, stream>>>(dgates, dout, y, pos, k, C);
}

#define NDT_INSTANTIATE(E)                                                                                  \
  template void moe_permute<E>(E*, const E*, const int32_t*, const float*, int64_t, int64_t, cudaStream_t); \
  template void moe_unpermute<E>(E*, const E*, const int32_t*, const float*, int64_t, int64_t, int64_t,     \
                                 bool, cudaStream_t);                                                       \
  template void moe_gate_grad<E>(float*, const E*, const E*, const int32_t*, int64_t, int64_t, int64_t,     \
                                 cudaStream_t);
NDT_INSTANTIATE(float)
NDT_INSTANTIATE(__nv_bfloat16)

}  // namespace ndt::cuda
