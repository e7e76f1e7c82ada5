#pragma once
// Small kernels the Tensor-level ops need beyond the CPU twins of cuda_ops.h (fmt-free; raw device
// pointers, asynchronous on `stream`). E is float or __nv_bfloat16.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace ndt::cuda {

// x(T, C) += bias(C) broadcast over rows (the row-parallel bias added after the TP reduction).
template <typename E>
void add_bias_rows(E* x, const E* bias, int64_t T, int64_t C, cudaStream_t stream);
// dloss[t] = scale * mask[t]
void scale_mask(float* dloss, const float* mask, float scale, int64_t T, cudaStream_t stream);
// *result (device double) += -sum_t logprob[t] * mask[t] over rows with mask != 0; one block, fixed
// order (deterministic).
void masked_loss_sum(double* result, const float* logprob, const float* mask, int64_t T, cudaStream_t stream);

}  // namespace ndt::cuda
