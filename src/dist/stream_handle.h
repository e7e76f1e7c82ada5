#pragma once
// The CommHandle of work enqueued on a communication stream (NCCL's, the copy-engine reduction's): an event
// recorded there when the handle is made. wait() makes the compute stream wait for it (the host goes on);
// synchronize() blocks the host, marked as a blocking wait on `group` ranks for the watchdog; a handle
// dropped without either waits like wait().
#ifdef NDT_HAVE_CUDA

#include <cuda_runtime.h>

#include "core/blocking_wait.h"
#include "cuda/cuda_check.h"
#include "dist/communicator.h"

namespace ndt {

class StreamHandle final : public CommHandle {
 public:
  // what: a string literal naming the operation in the watchdog's message.
  StreamHandle(cudaStream_t compute, cudaStream_t comm, const char* what, int group)
      : compute_(compute), what_(what), group_(group) {
    NDT_CUDA_CHECK(cudaEventCreateWithFlags(&ev_, cudaEventDisableTiming));
    NDT_CUDA_CHECK(cudaEventRecord(ev_, comm));
  }
  ~StreamHandle() override {
    if (!finished_) cudaStreamWaitEvent(compute_, ev_, 0);  // no throw from a destructor
    cudaEventDestroy(ev_);  // released by the runtime once the event completes
  }
  StreamHandle(const StreamHandle&) = delete;
  StreamHandle& operator=(const StreamHandle&) = delete;
  void wait() override {
    if (finished_) return;
    NDT_CUDA_CHECK(cudaStreamWaitEvent(compute_, ev_, 0));
    finished_ = true;
  }
  void synchronize() override {
    BlockingWait wait(what_, group_);
    NDT_CUDA_CHECK(cudaEventSynchronize(ev_));
    finished_ = true;
  }
  bool done() override {
    const cudaError_t e = cudaEventQuery(ev_);
    if (e == cudaErrorNotReady) {
      cudaGetLastError();
      return false;
    }
    NDT_CUDA_CHECK(e);
    return true;
  }

 private:
  cudaStream_t compute_;
  cudaEvent_t ev_ = nullptr;
  bool finished_ = false;
  const char* what_;
  int group_;  // ranks the operation waits on (for the watchdog's message)
};

}  // namespace ndt

#endif  // NDT_HAVE_CUDA
