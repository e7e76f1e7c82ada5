// MoE row movement on the device: permute (gather rows, optionally scaled), unpermute (weighted sum of each
// token's k expert rows, in slot order) and the gate gradient (one dot product per slot). One block per
// output row, 16-byte accesses where the rows are aligned; fp32 arithmetic; no atomics, so results are
// deterministic (permute and unpermute also add in the CPU twin's order).
#include "cuda/cuda_kernel_utils.cuh"
#include "cuda/cuda_ops.h"

namespace ndt::cuda {
namespace {

using detail::from_f;
using detail::to_f;

// V elements per thread per access (16-byte packs when the row pointers allow, else 1).
template <typename E, int V>
__global__ void permute_kernel(E* out, const E* x, const int32_t* src, const float* scale, int64_t C) {
  const int64_t i = blockIdx.x;
  const E* in = x + static_cast<int64_t>(src[i]) * C;
  const float s = scale ? scale[i] : 1.0f;
  for (int64_t c = threadIdx.x * V; c < C; c += blockDim.x * V) {
    float v[V];
    detail::load<V>(v, in, c);
#pragma unroll
    for (int j = 0; j < V; ++j) v[j] *= s;
    detail::store<V>(out + i * C, c, v);
  }
}

template <typename E, int V>
__global__ void unpermute_kernel(E* out, const E* y, const int32_t* pos, const float* gates, int64_t k,
                                 int64_t C, bool accumulate) {
  const int64_t t = blockIdx.x;
  for (int64_t c = threadIdx.x * V; c < C; c += blockDim.x * V) {
    float acc[V];
    if (accumulate) {
      detail::load<V>(acc, out + t * C, c);
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) acc[j] = 0.0f;
    }
    for (int64_t j = 0; j < k; ++j) {
      const int32_t p = pos[t * k + j];
      if (p < 0) continue;
      const float g = gates ? gates[t * k + j] : 1.0f;
      float v[V];
      detail::load<V>(v, y + static_cast<int64_t>(p) * C, c);
#pragma unroll
      for (int q = 0; q < V; ++q) acc[q] += g * v[q];
    }
    detail::store<V>(out + t * C, c, acc);
  }
}

template <typename E, int V>
__global__ void gate_grad_kernel(float* dgates, const E* dout, const E* y, const int32_t* pos, int64_t k,
                                 int64_t C) {
  const int64_t slot = blockIdx.x, t = slot / k;
  const int32_t p = pos[slot];
  float acc = 0.0f;
  if (p >= 0)
    for (int64_t c = threadIdx.x * V; c < C; c += blockDim.x * V) {
      float a[V], b[V];
      detail::load<V>(a, dout + t * C, c);
      detail::load<V>(b, y + static_cast<int64_t>(p) * C, c);
#pragma unroll
      for (int q = 0; q < V; ++q) acc += a[q] * b[q];
    }
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

// Threads per row: enough for one pass over C in packs of V, a multiple of 32, at most 256.
unsigned row_threads(int64_t C, int V) {
  const int64_t need = (C / V + 31) / 32 * 32;
  return static_cast<unsigned>(std::max<int64_t>(32, std::min<int64_t>(256, need)));
}

// Packs of 16 bytes when every row of every tensor starts 16-byte aligned.
template <typename E>
bool rows_vectorizable(int64_t C, std::initializer_list<const void*> ps) {
  return C % detail::kVec<E> == 0 && detail::all_aligned16(ps);
}

}  // namespace

template <typename E>
void moe_permute(E* out, const E* x, const int32_t* src, const float* scale, int64_t R, int64_t C,
                 cudaStream_t stream) {
  if (R <= 0) return;
  constexpr int V = detail::kVec<E>;
  if (rows_vectorizable<E>(C, {out, x}))
    permute_kernel<E, V><<<static_cast<unsigned>(R), row_threads(C, V), 0, stream>>>(out, x, src, scale, C);
  else
    permute_kernel<E, 1><<<static_cast<unsigned>(R), row_threads(C, 1), 0, stream>>>(out, x, src, scale, C);
  NDT_CUDA_CHECK_LAUNCH();
}

template <typename E>
void moe_unpermute(E* out, const E* y, const int32_t* pos, const float* gates, int64_t N, int64_t k,
                   int64_t C, bool accumulate, cudaStream_t stream) {
  if (N <= 0) return;
  constexpr int V = detail::kVec<E>;
  if (rows_vectorizable<E>(C, {out, y}))
    unpermute_kernel<E, V>
        <<<static_cast<unsigned>(N), row_threads(C, V), 0, stream>>>(out, y, pos, gates, k, C, accumulate);
  else
    unpermute_kernel<E, 1>
        <<<static_cast<unsigned>(N), row_threads(C, 1), 0, stream>>>(out, y, pos, gates, k, C, accumulate);
  NDT_CUDA_CHECK_LAUNCH();
}

template <typename E>
void moe_gate_grad(float* dgates, const E* dout, const E* y, const int32_t* pos, int64_t N, int64_t k,
                   int64_t C, cudaStream_t stream) {
  if (N * k <= 0) return;
  constexpr int V = detail::kVec<E>;
  if (rows_vectorizable<E>(C, {dout, y}))
    gate_grad_kernel<E, V>
        <<<static_cast<unsigned>(N * k), row_threads(C, V), 0, stream>>>(dgates, dout, y, pos, k, C);
  else
    gate_grad_kernel<E, 1>
        <<<static_cast<unsigned>(N * k), row_threads(C, 1), 0, stream>>>(dgates, dout, y, pos, k, C);
  NDT_CUDA_CHECK_LAUNCH();
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
