// Row scatter on the device: dst[rows[i]] = src[i] (the twin of ops::scatter_rows' host loop). One block
// per source row; used to append a forward's K/V rows to a KV cache in one launch per tensor. And the
// row-wise concatenation of three matrices (the q, k, v gradients into one operand of a fused matmul).
#include <algorithm>
#include <cstdint>

#include "cuda/cuda_check.h"
#include "cuda/cuda_kernel_utils.cuh"
#include "cuda/cuda_ops.h"

namespace ndt::cuda {
namespace {

template <typename E>
__global__ void scatter_rows_kernel(E* dst, const int32_t* rows, const E* src, int64_t C) {
  detail::pdl_prologue();
  const int64_t i = blockIdx.x;
  E* d = dst + static_cast<int64_t>(rows[i]) * C;
  const E* s = src + i * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) d[c] = s[c];
}

// U: the unit copied (uint4: 16 bytes, or one element), in units of E per unit (V).
template <typename U, int V, typename E>
__global__ void concat_cols3_kernel(E* dst, const E* a, int64_t wa, const E* b, int64_t wb, const E* c,
                                    int64_t wc, int64_t T) {
  detail::pdl_prologue();
  const int64_t w = wa + wb + wc, units = w / V, n = T * units;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / units, col = (i - t * units) * V;
    const E* src = col < wa        ? a + t * wa + col
                   : col < wa + wb ? b + t * wb + (col - wa)
                                   : c + t * wc + (col - wa - wb);
    *reinterpret_cast<U*>(dst + t * w + col) = *reinterpret_cast<const U*>(src);
  }
}

}  // namespace

template <typename E>
void concat_cols3(E* dst, const E* a, int64_t wa, const E* b, int64_t wb, const E* c, int64_t wc, int64_t T,
                  cudaStream_t stream) {
  const int64_t w = wa + wb + wc;
  if (T <= 0 || w <= 0) return;
  constexpr int V = 16 / sizeof(E);
  const auto aligned = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; };
  const bool vec =
      wa % V == 0 && wb % V == 0 && wc % V == 0 && aligned(dst) && aligned(a) && aligned(b) && aligned(c);
  const int64_t n = T * (vec ? w / V : w);
  const auto grid = static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 65535));
  if (vec)
    detail::launch_pdl(concat_cols3_kernel<uint4, V, E>, grid, 256, 0, stream, dst, a, wa, b, wb, c, wc, T);
  else
    detail::launch_pdl(concat_cols3_kernel<E, 1, E>, grid, 256, 0, stream, dst, a, wa, b, wb, c, wc, T);
  NDT_CUDA_CHECK(cudaGetLastError());
}

template void concat_cols3<float>(float*, const float*, int64_t, const float*, int64_t, const float*, int64_t,
                                  int64_t, cudaStream_t);
template void concat_cols3<__nv_bfloat16>(__nv_bfloat16*, const __nv_bfloat16*, int64_t, const __nv_bfloat16*,
                                          int64_t, const __nv_bfloat16*, int64_t, int64_t, cudaStream_t);

__global__ void decode_advance_kernel(int32_t* tokens, int32_t* positions, const int32_t* sampled,
                                      int32_t* rows, int32_t* pos_q, int32_t* pos_k, int64_t n,
                                      int64_t rows_k) {
  detail::pdl_prologue();
  const int64_t s = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (s >= n) return;
  tokens[s] = sampled[s];
  positions[s] += 1;
  const int32_t r = ++rows[s], p = ++pos_q[s];
  if (r >= 0 && r < rows_k) pos_k[r] = p;
}

void decode_advance(int32_t* tokens, int32_t* positions, const int32_t* sampled, int32_t* rows,
                    int32_t* pos_q, int32_t* pos_k, int64_t n, int64_t rows_k, cudaStream_t stream) {
  if (n == 0) return;
  detail::launch_pdl(decode_advance_kernel, static_cast<unsigned>((n + 127) / 128), 128, 0, stream, tokens,
                     positions, sampled, rows, pos_q, pos_k, n, rows_k);
  NDT_CUDA_CHECK(cudaGetLastError());
}

template <typename E>
void scatter_rows(E* dst, const int32_t* rows, const E* src, int64_t n, int64_t C, cudaStream_t stream) {
  if (n == 0 || C == 0) return;
  detail::launch_pdl(scatter_rows_kernel<E>, static_cast<unsigned>(n), 256, 0, stream, dst, rows, src, C);
  NDT_CUDA_CHECK(cudaGetLastError());
}

template void scatter_rows<float>(float*, const int32_t*, const float*, int64_t, int64_t, cudaStream_t);
template void scatter_rows<__nv_bfloat16>(__nv_bfloat16*, const int32_t*, const __nv_bfloat16*, int64_t,
                                          int64_t, cudaStream_t);

}  // namespace ndt::cuda
