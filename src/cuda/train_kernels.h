#pragma once
// Small kernels the Tensor-level ops need beyond the CPU twins of cuda_ops.h (fmt-free; raw device
// pointers, asynchronous on `stream`).
#include <cuda_runtime.h>

#include <cstdint>

namespace ndt::cuda {

// dloss[t] = scale * mask[t]
void scale_mask(float* dloss, const float* mask, float scale, int64_t T, cudaStream_t stream);
// The same with the scale read from device memory when the kernel runs.
void scale_mask_at(float* dloss, const float* mask, const float* scale, int64_t T, cudaStream_t stream);
// *result (device double) += -sum_t logprob[t] * mask[t] over rows with mask != 0; one block, fixed
// order (deterministic).
void masked_loss_sum(double* result, const float* logprob, const float* mask, int64_t T, cudaStream_t stream);
// Enqueues a kernel that never finishes (fault injection: a GPU stuck, debug.fault gpu_hang). Only the end
// of the process stops it.
void hang_stream(cudaStream_t stream);

}  // namespace ndt::cuda
