#pragma once
// NCCL backend of Communicator: collectives and point-to-point on DEVICE buffers (F32, BF16, I32, I64,
// F64; bf16 is reduced natively by NCCL), bootstrapped over an MPI communicator (rank 0 makes the
// ncclUniqueId, MPI broadcasts it, every rank calls ncclCommInitRank on its device).
//
// Stream contract
// - The communicator owns one CUDA stream, stream(); every NCCL call is enqueued there.
// - The caller's work runs on the compute stream (default: cuda::stream() of cuda/runtime.h, where
//   the engine's kernels run; change it with set_compute_stream()). Each call first records an event on the
//   compute stream and makes the communicator's stream wait for it, so a collective sees everything the
//   caller enqueued before it (no host synchronization needed before the call).
// - Blocking calls (the whole Communicator interface) return after the operation has completed on
//   the device (host synchronization on the communicator's stream): the buffer may be read, written
//   or freed right away, from any stream or the host.
// - Non-blocking calls (all_reduce_async, reduce_scatter_async, reduce_async, all_gather_async,
//   batch_p2p_async) return a CommHandle at once. Until the handle's wait() (the compute stream waits
//   for completion, the host does not block) or synchronize() (the host blocks), the buffers must not be
//   touched. Their use: DP gradient reduction of finished buckets while backward continues on the
//   compute stream; tensor-parallel exchanges beside the matmuls that do not need them. A handle
//   destroyed without either waits like wait().
//
// Host buffers: a call whose buffers are host memory (pageable or pinned) goes over the MPI
// communicator of the same ranks instead (scalars like token counts, loss sums, agree() of statuses),
// so the NCCL communicator is a drop-in for the MPI one. The choice is made per call from the
// pointers: every rank must pass the same kind of memory. agree() thus still goes over MPI.
//
// Point-to-point: NCCL has no tags (the tag argument is ignored); messages between two ranks match in
// the order they are posted. A blocking send() waits for the receiver (NCCL does not buffer), so
// exchanges where both sides send go through batch_p2p(), which posts everything in one NCCL group.
//
// The device: the constructor makes `device` current on the calling thread; every later call expects
// it still to be current (one rank per GPU, as the trainer runs).
#ifdef NDT_HAVE_NCCL

#include <cuda_runtime.h>

#include <memory>

#include "core/tensor.h"
#include "dist/communicator.h"

namespace ndt {

class NcclCommunicator : public Communicator {
 public:
  virtual int device() const = 0;
  // The communicator's own stream (collectives and P2P run here).
  virtual cudaStream_t stream() const = 0;
  // The stream the caller's kernels run on; calls are ordered after work enqueued on it.
  virtual cudaStream_t compute_stream() const = 0;
  virtual void set_compute_stream(cudaStream_t s) = 0;
  // The MPI communicator over the same ranks (host buffers, agree()).
  virtual Communicator& host() = 0;

  // all_reduce_async, reduce_scatter_async, all_gather_async and batch_p2p_async (Communicator) are
  // non-blocking here and need device buffers (all_gather_async: send may be this rank's own block of
  // recv, NCCL's in-place form).
  // Non-blocking in-place reduce to `root`: buf on root becomes the reduction, the others' buf is left as
  // it was. ZeRO-1 reduces each finished gradient range to the rank that owns it.
  virtual std::unique_ptr<CommHandle> reduce_async(void* buf, int64_t count, DType dt, ReduceOp op,
                                                   int root) = 0;
  // Registers [buf, buf + bytes) as a symmetric window of this communicator (ncclCommWindowRegister;
  // collective, the same size on every rank): collectives on buffers inside it run NCCL's symmetric
  // kernels, which read and write the peers' memory directly with fewer SMs than its staged ones. The
  // memory must come from nccl_device_zeros; buffers passed to one collective must lie at the same offset
  // in the window on every rank. The token deregisters when released: release it before the communicator
  // and the memory go.
  virtual std::shared_ptr<void> register_window(void* buf, size_t bytes) = 0;
};

// Zeroed device memory from ncclMemAlloc (CUDA's virtual memory API, on the current device), which
// register_window accepts. Its bytes count in cuda::memory_stats()'s peak as long as it lives.
Tensor nccl_device_zeros(const Shape& shape, DType dt);

// Collective over `mpi_group` (which must be an MPI-backed communicator: it carries the bootstrap and
// the host-buffer calls; the new communicator keeps its own duplicate of it). `device` is this rank's
// CUDA device, typically local_rank % device_count. Subgroups and splits of the result are NCCL
// communicators too (ncclCommSplit, on the same device).
std::unique_ptr<Communicator> make_nccl_communicator(Communicator& mpi_group, int device);

// The NCCL view of a communicator made by make_nccl_communicator (or one of its subgroups); nullptr
// for other backends.
NcclCommunicator* as_nccl(Communicator* c);

}  // namespace ndt

#endif  // NDT_HAVE_NCCL
