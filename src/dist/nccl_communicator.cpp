// NCCL backend of Communicator (contract in dist/nccl_communicator.h). Compiled by the host compiler
// into ndtrain_lib when NCCL is found.
#ifdef NDT_HAVE_NCCL

#include "dist/nccl_communicator.h"

#include <fmt/ranges.h>
#include <nccl.h>

#include <algorithm>
#include <initializer_list>
#include <set>
#include <string>
#include <vector>

#include "core/blocking_wait.h"
#include "core/check.h"
#include "cuda/cuda_check.h"
#include "cuda/runtime.h"
#include "dist/device_communicator.h"
#include "dist/stream_handle.h"
#include "dist/watchdog.h"

namespace ndt {
namespace {

[[noreturn]] void nccl_failed(ncclResult_t r, const char* expr, const char* file, int line) {
  const char* last = ncclGetLastError(nullptr);
  check_failed(file, line, expr,
               fmt::format("NCCL error {} ({}){}{}", static_cast<int>(r), ncclGetErrorString(r),
                           last && *last ? ": " : "", last ? last : ""));
}
#define NDT_NCCL(call)                                                                \
  do {                                                                                \
    ncclResult_t ndt_r_ = (call);                                                     \
    if (ndt_r_ != ncclSuccess) ::ndt::nccl_failed(ndt_r_, #call, __FILE__, __LINE__); \
  } while (0)

ncclDataType_t nccl_type(DType dt) {
  switch (dt) {
    case DType::F32:
      return ncclFloat32;
    case DType::BF16:
      return ncclBfloat16;
    case DType::I32:
      return ncclInt32;
    case DType::I64:
      return ncclInt64;
    case DType::F64:
      return ncclFloat64;
  }
  NDT_FAIL("nccl: unknown dtype {}", static_cast<int>(dt));
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return ncclSum;
    case ReduceOp::Max:
      return ncclMax;
    case ReduceOp::Min:
      return ncclMin;
  }
  NDT_FAIL("nccl: unknown reduce op {}", static_cast<int>(op));
}

const char* at(const void* p, int64_t elems, DType dt) {
  return static_cast<const char*>(p) + elems * static_cast<int64_t>(dtype_size(dt));
}
char* at(void* p, int64_t elems, DType dt) {
  return static_cast<char*>(p) + elems * static_cast<int64_t>(dtype_size(dt));
}

bool overlaps(const void* a, size_t an, const void* b, size_t bn) {
  auto pa = reinterpret_cast<uintptr_t>(a), pb = reinterpret_cast<uintptr_t>(b);
  return an && bn && pa < pb + bn && pb < pa + an;
}

class NcclComm final : public NcclCommunicator {
 public:
  NcclComm(std::unique_ptr<Communicator> host, ncclComm_t comm, int device)
      : host_(std::move(host)), comm_(comm), device_(device) {
    // Non-blocking: the stream must not serialize with the legacy default stream (the default
    // compute stream), or DP reduction could never overlap backward. High priority: communication
    // kernels are few and latency-bound; let them in ahead of compute blocks.
    int lo = 0, hi = 0;
    NDT_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
    NDT_CUDA_CHECK(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, hi));
    NDT_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
    // The engine's kernels run on the runtime's compute stream: order every call after them by default.
    compute_ = cuda::stream();
    int nr = 0, me = 0;
    NDT_NCCL(ncclCommCount(comm_, &nr));
    NDT_NCCL(ncclCommUserRank(comm_, &me));
    NDT_CHECK(nr == host_->size() && me == host_->rank(), "nccl: rank {}/{} differs from MPI's {}/{}", me, nr,
              host_->rank(), host_->size());
    NDT_CUDA_CHECK(cudaEventCreateWithFlags(&issued_, cudaEventDisableTiming));
    if ((watchdog_ = Watchdog::current()))
      hook_ = watchdog_->add_hook([this](Watchdog& w) { on_timeout(w); });
  }
  ~NcclComm() override {
    if (watchdog_) watchdog_->remove_hook(hook_);
    // No checks here: at exit the runtime may already be shutting down.
    if (stream_) cudaStreamSynchronize(stream_);
    if (comm_) ncclCommDestroy(comm_);
    if (ready_) cudaEventDestroy(ready_);
    if (issued_) cudaEventDestroy(issued_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  const std::vector<int>& world_ranks() const override { return host_->world_ranks(); }
  int device() const override { return device_; }
  cudaStream_t stream() const override { return stream_; }
  cudaStream_t compute_stream() const override { return compute_; }
  void set_compute_stream(cudaStream_t s) override { compute_ = s; }
  Communicator& host() override { return *host_; }

  void all_reduce(void* buf, int64_t count, DType dt, ReduceOp op) override {
    if (count == 0) return;
    if (!device_buffers({buf}, "all_reduce")) return host_->all_reduce(buf, count, dt, op);
    begin("all_reduce");
    NDT_NCCL(ncclAllReduce(buf, buf, n(count), nccl_type(dt), nccl_op(op), comm_, stream_));
    end();
  }

  std::unique_ptr<CommHandle> all_reduce_async(void* buf, int64_t count, DType dt, ReduceOp op) override {
    NDT_CHECK(count == 0 || cuda::is_device_pointer(buf), "all_reduce_async: needs a device buffer");
    begin("all_reduce (asynchronous)");
    if (count > 0) NDT_NCCL(ncclAllReduce(buf, buf, n(count), nccl_type(dt), nccl_op(op), comm_, stream_));
    issued();
    return async_handle();
  }

  void all_gather(const void* send, void* recv, int64_t count, DType dt) override {
    if (count == 0) return;
    if (!device_buffers({send, recv}, "all_gather")) return host_->all_gather(send, recv, count, dt);
    // In place (send is our own block of recv) is NCCL's documented in-place form.
    begin("all_gather");
    NDT_NCCL(ncclAllGather(send, recv, n(count), nccl_type(dt), comm_, stream_));
    end();
  }

  void reduce_scatter(const void* send, void* recv, int64_t count, DType dt, ReduceOp op) override {
    if (count == 0) return;
    if (!device_buffers({send, recv}, "reduce_scatter"))
      return host_->reduce_scatter(send, recv, count, dt, op);
    begin("reduce_scatter");
    enqueue_reduce_scatter(send, recv, count, dt, op);
    end();
  }

  std::unique_ptr<CommHandle> reduce_scatter_async(const void* send, void* recv, int64_t count, DType dt,
                                                   ReduceOp op) override {
    NDT_CHECK(count == 0 || (cuda::is_device_pointer(send) && cuda::is_device_pointer(recv)),
              "reduce_scatter_async: needs device buffers");
    begin("reduce_scatter (asynchronous)");
    if (count > 0) enqueue_reduce_scatter(send, recv, count, dt, op);
    issued();
    return async_handle();
  }

  std::unique_ptr<CommHandle> all_gather_async(const void* send, void* recv, int64_t count,
                                               DType dt) override {
    NDT_CHECK(count == 0 || (cuda::is_device_pointer(send) && cuda::is_device_pointer(recv)),
              "all_gather_async: needs device buffers");
    begin("all_gather (asynchronous)");
    if (count > 0) NDT_NCCL(ncclAllGather(send, recv, n(count), nccl_type(dt), comm_, stream_));
    issued();
    return async_handle();
  }

  std::unique_ptr<CommHandle> reduce_async(void* buf, int64_t count, DType dt, ReduceOp op,
                                           int root) override {
    check_peer(root, "reduce root");
    NDT_CHECK(count == 0 || cuda::is_device_pointer(buf), "reduce_async: needs a device buffer");
    begin("reduce (asynchronous)");
    if (count > 0) NDT_NCCL(ncclReduce(buf, buf, n(count), nccl_type(dt), nccl_op(op), root, comm_, stream_));
    issued();
    return async_handle();
  }

  std::shared_ptr<void> register_window(void* buf, size_t bytes) override {
    NDT_CHECK(comm_, "register_window: the communicator was aborted");
    ncclWindow_t win = nullptr;
    NDT_NCCL(ncclCommWindowRegister(comm_, buf, bytes, &win, NCCL_WIN_COLL_SYMMETRIC));
    return std::shared_ptr<void>(win, [this](void* w) {
      if (comm_) ncclCommWindowDeregister(comm_, static_cast<ncclWindow_t>(w));
    });
  }

  void broadcast(void* buf, int64_t count, DType dt, int root) override {
    check_peer(root, "broadcast root");
    if (count == 0) return;
    if (!device_buffers({buf}, "broadcast")) return host_->broadcast(buf, count, dt, root);
    begin("broadcast");
    NDT_NCCL(ncclBroadcast(buf, buf, n(count), nccl_type(dt), root, comm_, stream_));
    end();
  }

  void send(const void* buf, int64_t count, DType dt, int peer, int tag) override {
    check_peer(peer, "send peer");
    if (count == 0) return;  // as in the MPI backend: nothing is posted
    if (!device_buffers({buf}, "send")) return host_->send(buf, count, dt, peer, tag);
    begin("send");
    NDT_NCCL(ncclSend(buf, n(count), nccl_type(dt), peer, comm_, stream_));
    end();
  }

  void recv(void* buf, int64_t count, DType dt, int peer, int tag) override {
    check_peer(peer, "recv peer");
    if (count == 0) return;
    if (!device_buffers({buf}, "recv")) return host_->recv(buf, count, dt, peer, tag);
    begin("recv");
    NDT_NCCL(ncclRecv(buf, n(count), nccl_type(dt), peer, comm_, stream_));
    end();
  }

  void batch_p2p(const std::vector<P2POp>& ops) override {
    const Buffers where = p2p_buffers(ops);
    if (where == Buffers::host) return host_->batch_p2p(ops);
    if (where == Buffers::none) return;
    begin("batch_p2p");
    post_p2p(ops);
    end();
  }

  std::unique_ptr<CommHandle> batch_p2p_async(const std::vector<P2POp>& ops) override {
    if (p2p_buffers(ops) != Buffers::device) return Communicator::batch_p2p_async(ops);  // completed at once
    begin("batch_p2p (asynchronous)");
    post_p2p(ops);
    issued();
    return async_handle();
  }

  void all_to_all_v(const void* send, const std::vector<int64_t>& send_counts,
                    const std::vector<int64_t>& send_offsets, void* recv,
                    const std::vector<int64_t>& recv_counts, const std::vector<int64_t>& recv_offsets,
                    DType dt) override {
    const auto sz = static_cast<size_t>(size());
    NDT_CHECK(send_counts.size() == sz && send_offsets.size() == sz && recv_counts.size() == sz &&
                  recv_offsets.size() == sz,
              "all_to_all_v: counts/offsets must have one entry per rank ({})", size());
    for (size_t i = 0; i < sz; ++i)
      for (int64_t v : {send_counts[i], send_offsets[i], recv_counts[i], recv_offsets[i]})
        NDT_CHECK(v >= 0, "all_to_all_v: negative count/offset {} for rank {}", v, i);
    if (!device_buffers({send, recv}, "all_to_all_v"))
      return host_->all_to_all_v(send, send_counts, send_offsets, recv, recv_counts, recv_offsets, dt);
    // One NCCL group of sends and receives; zero-count pairs are skipped on both sides (the counts agree).
    begin("all_to_all_v");
    grouped([&] {
      const ncclDataType_t t = nccl_type(dt);
      for (int p = 0; p < size(); ++p) {
        const auto i = static_cast<size_t>(p);
        if (send_counts[i] > 0)
          NDT_NCCL(ncclSend(at(send, send_offsets[i], dt), n(send_counts[i]), t, p, comm_, stream_));
        if (recv_counts[i] > 0)
          NDT_NCCL(ncclRecv(at(recv, recv_offsets[i], dt), n(recv_counts[i]), t, p, comm_, stream_));
      }
    });
    end();
  }

  void barrier() override {
    {
      BlockingWait wait("barrier", size());
      NDT_CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
    host_->barrier();
  }

  std::unique_ptr<Communicator> subgroup(const std::vector<int>& members) override {
    std::set<int> seen;
    int position = -1;
    for (size_t i = 0; i < members.size(); ++i) {
      check_peer(members[i], "subgroup member");
      NDT_CHECK(seen.insert(members[i]).second, "subgroup: rank {} listed twice", members[i]);
      if (members[i] == rank()) position = static_cast<int>(i);
    }
    return split(position >= 0 ? 0 : -1, std::max(position, 0));
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    // Both splits order members by key, ties by parent rank, so the two groups have the same ranks.
    std::unique_ptr<Communicator> h = host_->split(color, key);
    {
      BlockingWait wait("communicator split", size());
      NDT_CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
    ncclComm_t out = nullptr;
    NDT_NCCL(ncclCommSplit(comm_, color >= 0 ? color : NCCL_SPLIT_NOCOLOR, key, &out, nullptr));
    if (color < 0) return nullptr;
    NDT_CHECK(h && out, "nccl split: color {} produced no group", color);
    return std::make_unique<NcclComm>(std::move(h), out, device_);
  }

 private:
  // The handle of the call just enqueued on stream_.
  std::unique_ptr<CommHandle> async_handle() {
    return std::make_unique<StreamHandle>(compute_, stream_, "an asynchronous NCCL collective", size());
  }
  static size_t n(int64_t count) { return static_cast<size_t>(count); }

  void check_peer(int peer, const char* what) const {
    NDT_CHECK(peer >= 0 && peer < size(), "{} {} out of range (communicator size {})", what, peer, size());
  }

  // Where the non-empty buffers of `ops` live (none: every count is 0; nothing to do on either side).
  enum class Buffers { none, host, device };
  Buffers p2p_buffers(const std::vector<P2POp>& ops) const {
    bool any_dev = false, any_host = false;
    for (const P2POp& op : ops) {
      check_peer(op.peer, "batch_p2p peer");
      if (op.buf && op.count > 0) (cuda::is_device_pointer(op.buf) ? any_dev : any_host) = true;
    }
    NDT_CHECK(!(any_dev && any_host), "batch_p2p: mixes device and host buffers");
    return any_dev ? Buffers::device : any_host ? Buffers::host : Buffers::none;
  }
  // One NCCL group of the sends and receives, on the communicator's stream.
  void post_p2p(const std::vector<P2POp>& ops) {
    grouped([&] {
      for (const P2POp& op : ops) {
        if (op.count == 0) continue;
        if (op.kind == P2POp::Send)
          NDT_NCCL(ncclSend(op.buf, n(op.count), nccl_type(op.dtype), op.peer, comm_, stream_));
        else
          NDT_NCCL(ncclRecv(op.buf, n(op.count), nccl_type(op.dtype), op.peer, comm_, stream_));
      }
    });
  }

  // The communicator's stream waits for everything enqueued on the compute stream so far.
  void begin(const char* op) {
    NDT_CUDA_CHECK(cudaEventRecord(ready_, compute_));
    NDT_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready_, 0));
    op_ = op;
    op_step_ = watchdog_ ? watchdog_->step() : -1;
  }
  // After the enqueue: what the watchdog's hook asks about (has the last operation completed?).
  void issued() { NDT_CUDA_CHECK(cudaEventRecord(issued_, stream_)); }
  // Blocking calls wait for their operation on the host, a wait the watchdog watches.
  void end() {
    issued();
    BlockingWait wait(op_, size());
    NDT_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  // The watchdog fired (on its thread; the main one is blocked): name the operation still in flight, then
  // abort the communicator so that its kernels stop (the process exits right after).
  void on_timeout(Watchdog& w) {
    if (op_ && cudaEventQuery(issued_) == cudaErrorNotReady)
      w.say(fmt::format(
          "NCCL {} on a group of {} rank(s) (world ranks {}), issued at step {}, has not completed; "
          "aborting the communicator",
          op_, size(), fmt::join(world_ranks(), ","), op_step_));
    ncclCommAbort(comm_);
    comm_ = nullptr;
  }

  // Runs f between ncclGroupStart/End; the group is closed even when f throws.
  template <typename F>
  void grouped(F&& f) {
    NDT_NCCL(ncclGroupStart());
    try {
      f();
    } catch (...) {
      ncclGroupEnd();
      throw;
    }
    NDT_NCCL(ncclGroupEnd());
  }

  void enqueue_reduce_scatter(const void* send, void* recv, int64_t count, DType dt, ReduceOp op) {
    const size_t bytes = dtype_size(dt);
    const bool in_place = recv == at(send, rank() * count, dt);  // NCCL's in-place form
    void* copy = nullptr;
    if (!in_place && overlaps(send, n(size() * count) * bytes, recv, n(count) * bytes)) {
      NDT_CUDA_CHECK(cudaMallocAsync(&copy, n(size() * count) * bytes, stream_));
      NDT_CUDA_CHECK(
          cudaMemcpyAsync(copy, send, n(size() * count) * bytes, cudaMemcpyDeviceToDevice, stream_));
      send = copy;
    }
    NDT_NCCL(ncclReduceScatter(send, recv, n(count), nccl_type(dt), nccl_op(op), comm_, stream_));
    if (copy) NDT_CUDA_CHECK(cudaFreeAsync(copy, stream_));
  }

  std::unique_ptr<Communicator> host_;
  ncclComm_t comm_ = nullptr;
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  cudaStream_t compute_ = nullptr;
  cudaEvent_t ready_ = nullptr;
  cudaEvent_t issued_ = nullptr;  // recorded after each operation's enqueue
  const char* op_ = nullptr;      // the last operation enqueued, and the step it was enqueued at
  int64_t op_step_ = -1;
  Watchdog* watchdog_ = nullptr;
  int hook_ = -1;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(Communicator& mpi_group, int device) {
  // Bootstrap and host calls go over our own duplicate of the MPI group (an NCCL group brings its MPI one).
  Communicator& base = as_nccl(&mpi_group) ? as_nccl(&mpi_group)->host() : mpi_group;
  std::unique_ptr<Communicator> host = base.split(0, base.rank());
  ncclUniqueId id{};
  static_assert(sizeof(id) % 4 == 0, "ncclUniqueId travels as i32 words");
  // Local failures (bad device, no NCCL on rank 0) are agreed first, so that no rank is left waiting
  // in the broadcast or in ncclCommInitRank.
  Status st = Status::ok();
  try {
    int count = 0;
    NDT_CUDA_CHECK(cudaGetDeviceCount(&count));
    NDT_CHECK(device >= 0 && device < count, "nccl: device {} outside [0, {})", device, count);
    NDT_CUDA_CHECK(cudaSetDevice(device));
    if (host->rank() == 0) NDT_NCCL(ncclGetUniqueId(&id));
  } catch (const std::exception& e) {
    st = Status::error(e.what());
  }
  agree(st, *host).throw_if_error();
  host->broadcast(&id, static_cast<int64_t>(sizeof(id) / 4), DType::I32, 0);
  ncclComm_t comm = nullptr;
  NDT_NCCL(ncclCommInitRank(&comm, host->size(), id, host->rank()));
  return std::make_unique<NcclComm>(std::move(host), comm, device);
}

NcclCommunicator* as_nccl(Communicator* c) { return dynamic_cast<NcclCommunicator*>(c); }

Tensor nccl_device_zeros(const Shape& shape, DType dt) {
  const size_t bytes = std::max<size_t>(static_cast<size_t>(shape_numel(shape)) * dtype_size(dt), 1);
  void* p = nullptr;
  NDT_NCCL(ncclMemAlloc(&p, bytes));
  return Tensor::adopt(cuda::adopt_external_zeroed(p, bytes, [](void* q) { ncclMemFree(q); }), shape, dt,
                       Device::CUDA);
}

}  // namespace ndt

#endif  // NDT_HAVE_NCCL
