#pragma once
// Gradient all-reduce by the GPUs' copy engines, for a group whose ranks share one host with peer access
// (parallel.dp_reduction; docs/parallelism.md, "Where the gradients live").
//
// NCCL reduces with kernels, and under the backward its CTAs take SMs from the matmuls beside them. Here
// each rank maps its peers' gradient buffers (CUDA IPC) and the copy engines move the data: for a range
// split into n parts, rank r pulls part r from every peer (cudaMemcpyAsync: a copy engine, no SMs), adds
// them in rank order (one short kernel), and pushes the sum into every peer's buffer, piece by piece, so
// that one piece's push (outgoing) runs beside the next one's pull (incoming). The ranks order this through
// flags set in each other's memory and waited on with stream memory operations (cuStreamWriteValue64 /
// cuStreamWaitValue64: no SMs either): a rank pulls from a peer's range only after the peer signalled it
// final, and a rank uses its range again (clipping, the next step) only after every peer signalled that it
// pushed its part there, which it does after its pulls from there.
//
// The sum of every element is v_0 + v_1 + ... + v_{n-1} from the left, computed once by the part's owner
// and copied, so every rank holds the same bits, on any topology. The calls are enqueued on the
// reduction's own streams after the work already on the compute stream (cuda::stream()), and can be
// captured in a CUDA graph (no host decision depends on the data; a waiter clears the flags it waited for,
// so the same values serve every step).
#ifdef NDT_HAVE_CUDA

#include <cuda_runtime.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "dist/communicator.h"

namespace ndt {

class CopyEngineReduction {
 public:
  // Collective over `group`. grads: this rank's flat fp32 buffer from ipc_device_zeros, the same length on
  // every rank. Returns nullptr on every rank alike, with `why`, where the copy engines cannot serve the
  // group: one rank, ranks on different hosts, or no peer mapping between some pair of GPUs.
  static std::unique_ptr<CopyEngineReduction> create(Communicator& group, const Tensor& grads,
                                                     std::string& why);
  ~CopyEngineReduction();
  CopyEngineReduction(const CopyEngineReduction&) = delete;
  CopyEngineReduction& operator=(const CopyEngineReduction&) = delete;

  // Non-blocking in-place sum over the group of grads[offset, offset + count) (buf = its start), in the
  // same order of calls on every rank. The handle's wait() makes the compute stream wait for the result
  // (every peer done with this rank's range); synchronize() blocks the host.
  std::unique_ptr<CommHandle> all_reduce_async(float* buf, int64_t count);
  // ZeRO-1's reduction to the owners: the part of grads[offset, offset + count) inside this rank's own part
  // grads[own_begin, own_end) becomes its sum over the group (pulled from every peer, added in rank order);
  // the rest of this rank's range is left as it was. The same calls in the same order on every rank (each
  // passing its own part). wait(): the compute stream waits until the sum is in place and every peer is done
  // pulling from this rank's range.
  std::unique_ptr<CommHandle> reduce_to_owner_async(float* buf, int64_t count, int64_t own_begin,
                                                    int64_t own_end);

  // Elements each part is pulled, added and pushed in at most (the scratch holds n - 1 such pieces).
  static constexpr int64_t kPieceElems = int64_t{1} << 21;

 private:
  CopyEngineReduction() = default;
  enum Kind : int { kReady = 0, kReduced = 1, kKinds = 2 };
  static constexpr int64_t kSlots = 1024;  // distinct ranges per buffer
  int64_t slot_of(int64_t offset, int64_t count);
  // Pulls [lo, hi) of every peer's buffer in pieces, adds them in rank order into buf + lo (`offset`: buf's
  // place in grads); with push, sends each piece's sum back into every peer.
  void pull_and_sum(float* buf, int64_t offset, int64_t lo, int64_t hi, bool push);
  // One range's reduction on the reduction's streams, after the compute stream's work so far: every rank
  // flags the range final, this rank pulls and sums [lo, hi) of it (pushing the sums with push), and every
  // rank flags that it is done with the others' memory. Returns the compute stream's handle.
  std::unique_ptr<CommHandle> reduce_range(float* buf, int64_t count, int64_t lo, int64_t hi, bool push);
  // Flag of (kind, slot) that rank `from` sets in the memory of the rank waiting for it.
  int64_t flag_index(Kind kind, int64_t slot, int from) const { return (kind * kSlots + slot) * n_ + from; }
  // Sets this rank's flag (kind, slot) in every peer's memory, then waits until every peer has set theirs
  // in ours, and clears them. A peer sets it again only a step later, after this rank passed the barrier.
  void signal_and_wait(Kind kind, int64_t slot);

  int rank_ = 0, n_ = 0;
  float* grads_ = nullptr;
  int64_t numel_ = 0;
  std::vector<float*> peer_grads_;               // rank q's buffer, mapped here (ours at q == rank_)
  std::vector<unsigned long long*> peer_flags_;  // rank q's flags, mapped here (ours at q == rank_)
  unsigned long long* flags_ = nullptr;          // ours: kKinds x kSlots x n, set by the peers
  Tensor scratch_;                               // (n - 1) x kPieceElems
  cudaStream_t stream_ = nullptr;                // flags, pulls, sums
  cudaStream_t push_stream_ = nullptr;           // pushes of the sums, beside the next piece's pulls
  cudaEvent_t ready_ = nullptr, summed_ = nullptr, pushed_ = nullptr;  // (recorded and waited for at once)
  std::map<std::pair<int64_t, int64_t>, int64_t> slots_;
};

// Zeroed fp32 device memory of its own cudaMalloc (what CUDA IPC can export), counted in
// cuda::memory_stats() while it lives.
Tensor ipc_device_zeros(int64_t numel);

}  // namespace ndt

#endif  // NDT_HAVE_CUDA
