// Row scatter on the device: dst[rows[i]] = src[i] (the twin of ops::scatter_rows' host loop). One block
// per source row; used to append a forward's K/V rows to a KV cache in one launch per tensor.
#include "cuda/cuda_check.h"
#include "cuda/cuda_ops.h"

namespace ndt::cuda {
namespace {

template <typename E>
__global__ void scatter_rows_kernel(E* dst, const int32_t* rows, const E* src, int64_t C) {
  const int64_t i = blockIdx.x;
  E* d = dst + static_cast<int64_t>(rows[i]) * C;
  const E* s = src + i * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) d[c] = s[c];
}

}  // namespace

template <typename E>
void scatter_rows(E* dst, const int32_t* rows, const E* src, int64_t n, int64_t C, cudaStream_t stream) {
  if (n == 0 || C == 0) return;
  scatter_rows_kernel<E><<<static_cast<unsigned>(n), 256, 0, stream>>>(dst, rows, src, C);
  NDT_CUDA_CHECK(cudaGetLastError());
}

template void scatter_rows<float>(float*, const int32_t*, const float*, int64_t, int64_t, cudaStream_t);
template void scatter_rows<__nv_bfloat16>(__nv_bfloat16*, const int32_t*, const __nv_bfloat16*, int64_t,
                                          int64_t, cudaStream_t);

}  // namespace ndt::cuda
