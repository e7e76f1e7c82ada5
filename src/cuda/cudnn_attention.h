#pragma once
// Causal attention through cuDNN's fused flash-attention engines (cuDNN 9 backend graph API), for the
// training hot path: bf16, `B` sequences of equal length `S` packed back to back (THD rows, t = b*S + s),
// no explicit positions (CP's chunks take the block form below). Same layouts and semantics as
// cuda::attention_forward/backward (flash_attention.h): q/out (B*S, H, D), k/v (B*S, KV, D), lse (B*S, H)
// fp32 natural-log sum-exp of the scaled scores, so either kernel's forward feeds the other's backward.
//
// Backward here OVERWRITES dq, dk, dv (the caller asks for it; cuDNN has no accumulating form). dq_row /
// dkv_row (0: H * D / KV * D) are the elements from one token's row of dq / of dk and dv to the next: the
// backward can write straight into the column blocks of a fused [dq | dk | dv] gradient.
//
// cuDNN is loaded at run time (dlopen of libcudnn.so.9, or $NDT_CUDNN_LIB): a binary built here runs on a
// machine without cuDNN and uses the built-in kernels there. Each call returns false, launching nothing,
// when cuDNN is missing, disabled ($NDT_ATTENTION=native) or refuses the shape; the first refusal per
// shape is printed once to stderr with cuDNN's reason. Plans are built once per shape and cached.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace ndt::cuda {

// True when cuDNN loaded and attention through it is enabled ($NDT_ATTENTION unset, "auto" or "cudnn").
bool cudnn_attention_enabled();
// "cuDNN 9.x.y" or why it is not used (for logs and benchmarks).
std::string cudnn_attention_status();
// Turns the cuDNN path off (or back on) in this process; tests use it to compare both kernels.
void set_cudnn_attention_enabled(bool on);

bool cudnn_attention_forward(__nv_bfloat16* out, float* lse, const __nv_bfloat16* q, const __nv_bfloat16* k,
                             const __nv_bfloat16* v, int64_t B, int64_t S, int64_t H, int64_t KV, int64_t D,
                             float scale, cudaStream_t stream);

bool cudnn_attention_backward(__nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv,
                              const __nv_bfloat16* dout, const __nv_bfloat16* q, const __nv_bfloat16* k,
                              const __nv_bfloat16* v, const __nv_bfloat16* out, const float* lse, int64_t B,
                              int64_t S, int64_t H, int64_t KV, int64_t D, float scale, cudaStream_t stream,
                              int64_t dq_row = 0, int64_t dkv_row = 0);

// Blocks of rows (context parallelism's chunks; the calls above are B blocks of S rows back to back, causal):
// block b's Sq query rows start at row b * q_stride of q, out, dout, lse and dq, its Sk key rows at row
// b * k_stride of k, v, dk and dv. causal: query i sees keys j <= i of its block (needs Sq == Sk); else every
// key of its block. Same contracts otherwise (the backward overwrites dq, dk, dv; rows outside the blocks are
// neither read nor written).
struct AttentionBlocks {
  int64_t B, Sq, Sk, q_stride, k_stride;
  bool causal;
};
bool cudnn_attention_forward_blocks(__nv_bfloat16* out, float* lse, const __nv_bfloat16* q,
                                    const __nv_bfloat16* k, const __nv_bfloat16* v, const AttentionBlocks& b,
                                    int64_t H, int64_t KV, int64_t D, float scale, cudaStream_t stream);
bool cudnn_attention_backward_blocks(__nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv,
                                     const __nv_bfloat16* dout, const __nv_bfloat16* q,
                                     const __nv_bfloat16* k, const __nv_bfloat16* v, const __nv_bfloat16* out,
                                     const float* lse, const AttentionBlocks& b, int64_t H, int64_t KV,
                                     int64_t D, float scale, cudaStream_t stream, int64_t dq_row = 0,
                                     int64_t dkv_row = 0);

// lse layout conversions for the cuDNN statistics tensor: (B*S, H) rows <-> (B, H, S) packed.
void lse_rows_to_bhs(float* dst, const float* src, int64_t B, int64_t S, int64_t H, cudaStream_t stream);
void lse_bhs_to_rows(float* dst, const float* src, int64_t B, int64_t S, int64_t H, cudaStream_t stream);

}  // namespace ndt::cuda
