#pragma once
// Communicator: the collective and point-to-point operations the parallel code uses. Backends: MPI
// (CPU tensors, this file's make_mpi_world) and NCCL (GPU tensors, with the CUDA backend), behind one
// interface. Every call is blocking unless it returns a request; buffers are raw contiguous memory
// described by (pointer, count, dtype) so that Tensor views and std::vectors both fit.
// Process groups are values: nothing here is global; a Grid hands out sub-communicators.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"

namespace ndt {

enum class ReduceOp { Sum, Max, Min };
class Watchdog;

// One entry of a batched non-blocking point-to-point exchange (like torch.distributed.batch_isend_irecv).
struct P2POp {
  enum Kind { Send, Recv } kind;
  void* buf;
  int64_t count;
  DType dtype;
  int peer;  // rank in this communicator
  int tag = 0;
};

// A non-blocking operation in flight. Backends without device streams (MPI, the staged one) complete the
// operation before handing out its handle; NCCL's contract is in dist/nccl_communicator.h.
class CommHandle {
 public:
  virtual ~CommHandle() = default;
  // The compute stream (as set when the operation was started) waits for completion; the host
  // does not block. Idempotent.
  virtual void wait() = 0;
  // The host blocks until the operation has completed. Idempotent.
  virtual void synchronize() = 0;
  // True once the operation has completed on the device (does not block).
  virtual bool done() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // World ranks of this group's members, in group-rank order.
  virtual const std::vector<int>& world_ranks() const = 0;

  virtual void all_reduce(void* buf, int64_t count, DType dt, ReduceOp op) = 0;  // in place
  // recv holds size() * count elements, rank i's block at i * count.
  virtual void all_gather(const void* send, void* recv, int64_t count, DType dt) = 0;
  // send holds size() * count elements; rank i receives the reduced block i (count elements).
  virtual void reduce_scatter(const void* send, void* recv, int64_t count, DType dt, ReduceOp op) = 0;
  virtual void broadcast(void* buf, int64_t count, DType dt, int root) = 0;
  virtual void send(const void* buf, int64_t count, DType dt, int peer, int tag = 0) = 0;
  virtual void recv(void* buf, int64_t count, DType dt, int peer, int tag = 0) = 0;
  // Posts all operations, then waits for all of them (no ordering hazard between the entries).
  virtual void batch_p2p(const std::vector<P2POp>& ops) = 0;
  // Non-blocking forms where the backend has them (NCCL: enqueued on its stream, see its stream contract;
  // the buffers must not be touched until the handle's wait()). The defaults run the blocking call and
  // hand back a completed operation.
  virtual std::unique_ptr<CommHandle> all_reduce_async(void* buf, int64_t count, DType dt, ReduceOp op);
  virtual std::unique_ptr<CommHandle> all_gather_async(const void* send, void* recv, int64_t count, DType dt);
  virtual std::unique_ptr<CommHandle> reduce_scatter_async(const void* send, void* recv, int64_t count,
                                                           DType dt, ReduceOp op);
  virtual std::unique_ptr<CommHandle> batch_p2p_async(const std::vector<P2POp>& ops);
  // Variable all-to-all: send_counts[i] elements go to rank i, starting at send_offsets[i].
  virtual void all_to_all_v(const void* send, const std::vector<int64_t>& send_counts,
                            const std::vector<int64_t>& send_offsets, void* recv,
                            const std::vector<int64_t>& recv_counts, const std::vector<int64_t>& recv_offsets,
                            DType dt) = 0;
  virtual void barrier() = 0;
  // A communicator over a subset of this one's ranks (given as ranks of this communicator, in the
  // order they take in the new group). Collective over ALL ranks of this communicator; ranks not in
  // `members` get nullptr.
  virtual std::unique_ptr<Communicator> subgroup(const std::vector<int>& members) = 0;
  // Partitions this communicator in ONE collective call (like MPI_Comm_split): ranks passing the same
  // color >= 0 form a group, ordered by key (ties by rank); color < 0 gets nullptr. The default
  // implementation all-gathers (color, key) and calls subgroup() once per color; backends override it.
  virtual std::unique_ptr<Communicator> split(int color, int key);

  // The collective watchdog (dist/watchdog.h) this communicator's blocking calls report to, and every
  // group split off it afterwards (not owned; null = none). The default ignores it (one-rank, NCCL).
  virtual void set_watchdog(Watchdog* w) {}

  // Strings (names, messages) travel as i32 words: a length, then the characters.
  void send_string(const std::string& s, int peer, int tag = 0);
  std::string recv_string(int peer, int tag = 0);

  // Typed conveniences.
  void all_reduce_sum(float* buf, int64_t count) { all_reduce(buf, count, DType::F32, ReduceOp::Sum); }
  void all_reduce_max(float* buf, int64_t count) { all_reduce(buf, count, DType::F32, ReduceOp::Max); }
  void all_reduce(Tensor& t, ReduceOp op = ReduceOp::Sum) {
    all_reduce(t.data_ptr(), t.numel(), t.dtype(), op);
  }
};

// A one-rank communicator (every collective is the identity): lets single-process code use the same
// paths as parallel code.
std::unique_ptr<Communicator> make_self_communicator();

// MPI_COMM_WORLD (MPI must be initialized; see MpiSession).
std::unique_ptr<Communicator> make_mpi_world();

// RAII MPI_Init_thread / MPI_Finalize. Safe to construct when launched without mpirun (one rank).
class MpiSession {
 public:
  MpiSession(int* argc, char*** argv);
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
  static bool initialized();
  // Ends every rank of the job (used when one rank hits a fatal error outside a collective agreement).
  [[noreturn]] static void abort(int code);
};

// Error agreement at boundaries: every rank passes its local status; all ranks get back the same
// status (the error of the lowest failing rank, message prefixed with "rank N: "), so that all of
// them stop together instead of leaving some waiting in a collective. On a one-rank communicator the
// status comes back unchanged (no prefix).
Status agree(const Status& local, Communicator& comm);

}  // namespace ndt
