#pragma once
// Independent work spread over side streams of the current device, then joined back into stream():
//   fork_side_streams(n);                      // side streams 0..n-1 wait for all work queued so far
//   { OnSideStream on(i); ops...; }            // ops (and allocations, frees) in scope go to side stream i
//   join_side_streams(n);                      // stream() waits for everything queued on them
// Used where one stream leaves the GPU idle: many small matmuls of unequal size (the MoE experts). A tensor
// allocated in a scope and freed in it is ordered on its side stream; tensors from before the fork are
// freed on stream() after the join. fmt-free (usable from .cu files).
#include <cuda_runtime.h>

namespace ndt::cuda {

void fork_side_streams(int n);
void join_side_streams(int n);

// While alive, stream() of this thread is side stream i (created by fork_side_streams).
class OnSideStream {
 public:
  explicit OnSideStream(int i);
  ~OnSideStream();
  OnSideStream(const OnSideStream&) = delete;
  OnSideStream& operator=(const OnSideStream&) = delete;

 private:
  cudaStream_t prev_;
};

}  // namespace ndt::cuda
