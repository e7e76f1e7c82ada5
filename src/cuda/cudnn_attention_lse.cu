// lse layout conversions for cudnn_attention.cpp (when the engine wants packed (B, H, S) statistics).
#include "cuda/cuda_check.h"
#include "cuda/cuda_kernel_utils.cuh"
#include "cuda/cudnn_attention.h"

namespace ndt::cuda {
namespace {

// rows (B*S, H) -> (B, H, S) when to_bhs, else back. One thread per element; tiny (B*S*H floats).
__global__ void lse_layout_kernel(float* dst, const float* src, int64_t B, int64_t S, int64_t H,
                                  bool to_bhs) {
  detail::pdl_prologue();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= B * S * H) return;
  const int64_t b = i / (S * H), s = (i / H) % S, h = i % H;  // i indexes the rows layout
  const int64_t j = (b * H + h) * S + s;
  if (to_bhs)
    dst[j] = src[i];
  else
    dst[i] = src[j];
}

void launch(float* dst, const float* src, int64_t B, int64_t S, int64_t H, bool to_bhs, cudaStream_t stream) {
  const int64_t n = B * S * H;
  if (n == 0) return;
  detail::launch_pdl(lse_layout_kernel, static_cast<unsigned>((n + 255) / 256), 256, 0, stream, dst, src, B,
                     S, H, to_bhs);
  NDT_CUDA_CHECK_LAUNCH();
}

}  // namespace

void lse_rows_to_bhs(float* dst, const float* src, int64_t B, int64_t S, int64_t H, cudaStream_t stream) {
  launch(dst, src, B, S, H, true, stream);
}
void lse_bhs_to_rows(float* dst, const float* src, int64_t B, int64_t S, int64_t H, cudaStream_t stream) {
  launch(dst, src, B, S, H, false, stream);
}

}  // namespace ndt::cuda
