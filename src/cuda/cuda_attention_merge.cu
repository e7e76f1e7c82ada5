// Log-sum-exp merge of two attention results over disjoint key sets (ring context parallelism): the CUDA
// twin of ndt::cpu::attention_merge. One warp per row; math in fp32 with the CPU twin's expf/logf.
#include <cmath>

#include "cuda/cuda_kernel_utils.cuh"
#include "cuda/cuda_ops.h"

namespace ndt::cuda {
namespace {

template <typename E>
__global__ void merge_kernel(E* out, float* lse, const E* o, const float* l, int64_t rows, int64_t D) {
  detail::pdl_prologue();
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const float ql = l[row], pl = lse[row];
  if (ql == -INFINITY) return;  // the partial saw no key: nothing to add
  float a = 0.0f, b = 1.0f, merged = ql;
  if (pl != -INFINITY) {
    const float m = fmaxf(pl, ql);
    a = expf(pl - m);
    b = expf(ql - m);
    const float s = a + b;
    a /= s;
    b /= s;
    merged = m + logf(s);
  }
  for (int64_t d = lane; d < D; d += 32) {
    const float y = a * static_cast<float>(out[row * D + d]) + b * static_cast<float>(o[row * D + d]);
    out[row * D + d] = static_cast<E>(y);
  }
  if (lane == 0) lse[row] = merged;
}

}  // namespace

template <typename E>
void attention_merge(E* out, float* lse, const E* o, const float* l, int64_t rows, int64_t D,
                     cudaStream_t stream) {
  if (rows == 0) return;
  const int threads = 256;
  const int64_t blocks = (rows * 32 + threads - 1) / threads;
  detail::launch_pdl(merge_kernel<E>, static_cast<unsigned>(blocks), threads, 0, stream, out, lse, o, l, rows,
                     D);
  NDT_CUDA_CHECK_LAUNCH();
}

template void attention_merge<float>(float*, float*, const float*, const float*, int64_t, int64_t,
                                     cudaStream_t);
template void attention_merge<__nv_bfloat16>(__nv_bfloat16*, float*, const __nv_bfloat16*, const float*,
                                             int64_t, int64_t, cudaStream_t);

}  // namespace ndt::cuda
