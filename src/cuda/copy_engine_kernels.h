#pragma once
// The kernel of the copy-engine gradient reduction (dist/copy_engine_reduction.h): its data moves by
// cudaMemcpyAsync between peers (copy engines, no SMs) and its ranks wait on each other with stream memory
// operations (no SMs either); this adds the pulled pieces.
#include <cuda_runtime.h>

#include <cstdint>

namespace ndt::cuda {

// dst[i] = v_0 + v_1 + ... + v_{n-1}, summed in rank order from the left, where v_self = dst[i] and the
// other ranks' values are pulled[k * count + i], k counting the other ranks in rank order. Every rank
// reduces its own part, so the same order on every machine gives the same bits whatever the copies.
void ce_sum_in_rank_order(float* dst, const float* pulled, int64_t count, int n, int self,
                          cudaStream_t stream);

}  // namespace ndt::cuda
