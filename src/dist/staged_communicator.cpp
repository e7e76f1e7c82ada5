// train.device_comm: mpi (dist/device_communicator.h): device buffers staged through host memory over MPI.
#ifdef NDT_HAVE_CUDA

#include <algorithm>
#include <initializer_list>
#include <vector>

#include "core/bf16.h"
#include "core/check.h"
#include "cuda/runtime.h"
#include "dist/device_communicator.h"
#ifdef NDT_HAVE_NCCL
#include "dist/nccl_communicator.h"
#endif

namespace ndt {
namespace {

size_t bytes_of(int64_t count, DType dt) { return static_cast<size_t>(count) * dtype_size(dt); }

// A host copy of a device buffer; in() fills it from the device (after the compute stream's earlier
// work), out() writes it back on the compute stream.
struct Stage {
  std::vector<char> host;
  explicit Stage(size_t bytes) : host(bytes) {}
  void in(const void* dev) {
    if (!host.empty()) cuda::copy_d2h(host.data(), dev, host.size());
  }
  void out(void* dev) const {
    if (!host.empty()) cuda::copy_h2d(dev, host.data(), host.size());
  }
  void* data() { return host.data(); }
};

class StagedComm final : public Communicator {
 public:
  explicit StagedComm(std::unique_ptr<Communicator> host) : host_(std::move(host)) {}
  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  const std::vector<int>& world_ranks() const override { return host_->world_ranks(); }
  void set_watchdog(Watchdog* w) override { host_->set_watchdog(w); }

  void all_reduce(void* buf, int64_t count, DType dt, ReduceOp op) override {
    if (count == 0 || !device_buffers({buf}, "all_reduce")) return host_->all_reduce(buf, count, dt, op);
    Stage s(bytes_of(count, dt));
    s.in(buf);
    if (dt == DType::BF16) {
      std::vector<float> f = widen(s, count);  // MPI has no bf16 sum: reduce in f32, round once
      host_->all_reduce(f.data(), count, DType::F32, op);
      narrow(f, s);
    } else {
      host_->all_reduce(s.data(), count, dt, op);
    }
    s.out(buf);
  }

  void all_gather(const void* send, void* recv, int64_t count, DType dt) override {
    if (count == 0 || !device_buffers({send, recv}, "all_gather"))
      return host_->all_gather(send, recv, count, dt);
    Stage in(bytes_of(count, dt)), out(bytes_of(size() * count, dt));
    in.in(send);  // copied first: send may be our own block of recv
    host_->all_gather(in.data(), out.data(), count, dt);
    out.out(recv);
  }

  void reduce_scatter(const void* send, void* recv, int64_t count, DType dt, ReduceOp op) override {
    if (count == 0 || !device_buffers({send, recv}, "reduce_scatter"))
      return host_->reduce_scatter(send, recv, count, dt, op);
    Stage in(bytes_of(size() * count, dt)), out(bytes_of(count, dt));
    in.in(send);
    if (dt == DType::BF16) {
      std::vector<float> f = widen(in, size() * count), r(static_cast<size_t>(count));
      host_->reduce_scatter(f.data(), r.data(), count, DType::F32, op);
      narrow(r, out);
    } else {
      host_->reduce_scatter(in.data(), out.data(), count, dt, op);
    }
    out.out(recv);
  }

  void broadcast(void* buf, int64_t count, DType dt, int root) override {
    if (count == 0 || !device_buffers({buf}, "broadcast")) return host_->broadcast(buf, count, dt, root);
    Stage s(bytes_of(count, dt));
    if (rank() == root) s.in(buf);
    host_->broadcast(s.data(), count, dt, root);
    if (rank() != root) s.out(buf);
  }

  void send(const void* buf, int64_t count, DType dt, int peer, int tag) override {
    if (count == 0 || !device_buffers({buf}, "send")) return host_->send(buf, count, dt, peer, tag);
    Stage s(bytes_of(count, dt));
    s.in(buf);
    host_->send(s.data(), count, dt, peer, tag);
  }

  void recv(void* buf, int64_t count, DType dt, int peer, int tag) override {
    if (count == 0 || !device_buffers({buf}, "recv")) return host_->recv(buf, count, dt, peer, tag);
    Stage s(bytes_of(count, dt));
    host_->recv(s.data(), count, dt, peer, tag);
    s.out(buf);
  }

  void batch_p2p(const std::vector<P2POp>& ops) override {
    bool any_dev = false, any_host = false;
    for (const P2POp& op : ops)
      if (op.buf && op.count > 0) (cuda::is_device_pointer(op.buf) ? any_dev : any_host) = true;
    NDT_CHECK(!(any_dev && any_host), "batch_p2p: mixes device and host buffers");
    if (!any_dev) return host_->batch_p2p(ops);
    std::vector<Stage> stages;
    stages.reserve(ops.size());
    std::vector<P2POp> staged = ops;
    for (size_t i = 0; i < ops.size(); ++i) {
      stages.emplace_back(ops[i].count > 0 ? bytes_of(ops[i].count, ops[i].dtype) : 0);
      if (ops[i].kind == P2POp::Send) stages.back().in(ops[i].buf);
      staged[i].buf = stages.back().data();
    }
    host_->batch_p2p(staged);
    for (size_t i = 0; i < ops.size(); ++i)
      if (ops[i].kind == P2POp::Recv) stages[i].out(ops[i].buf);
  }

  void all_to_all_v(const void* send, const std::vector<int64_t>& send_counts,
                    const std::vector<int64_t>& send_offsets, void* recv,
                    const std::vector<int64_t>& recv_counts, const std::vector<int64_t>& recv_offsets,
                    DType dt) override {
    if (!device_buffers({send, recv}, "all_to_all_v"))
      return host_->all_to_all_v(send, send_counts, send_offsets, recv, recv_counts, recv_offsets, dt);
    // The spans the counts and offsets cover (each rank's block is contiguous from its offset).
    auto span = [](const std::vector<int64_t>& counts, const std::vector<int64_t>& offsets) {
      int64_t end = 0;
      for (size_t i = 0; i < counts.size() && i < offsets.size(); ++i)
        if (counts[i] > 0) end = std::max(end, offsets[i] + counts[i]);
      return end;
    };
    Stage in(bytes_of(span(send_counts, send_offsets), dt)),
        out(bytes_of(span(recv_counts, recv_offsets), dt));
    in.in(send);
    host_->all_to_all_v(in.data(), send_counts, send_offsets, out.data(), recv_counts, recv_offsets, dt);
    out.out(recv);
  }

  void barrier() override {
    cuda::synchronize();
    host_->barrier();
  }

  std::unique_ptr<Communicator> subgroup(const std::vector<int>& members) override {
    return wrap(host_->subgroup(members));
  }
  std::unique_ptr<Communicator> split(int color, int key) override { return wrap(host_->split(color, key)); }

  Communicator& host() { return *host_; }

 private:
  static std::unique_ptr<Communicator> wrap(std::unique_ptr<Communicator> c) {
    return c ? std::make_unique<StagedComm>(std::move(c)) : nullptr;
  }
  static std::vector<float> widen(Stage& s, int64_t count) {
    std::vector<float> f(static_cast<size_t>(count));
    const auto* h = reinterpret_cast<const uint16_t*>(s.data());
    for (size_t i = 0; i < f.size(); ++i) f[i] = bf16_to_f32(h[i]);
    return f;
  }
  static void narrow(const std::vector<float>& f, Stage& s) {
    auto* h = reinterpret_cast<uint16_t*>(s.data());
    for (size_t i = 0; i < f.size(); ++i) h[i] = f32_to_bf16(f[i]);
  }

  std::unique_ptr<Communicator> host_;
};

}  // namespace

bool device_buffers(std::initializer_list<const void*> ptrs, const char* what) {
  bool any_dev = false, any_host = false;
  for (const void* p : ptrs)
    if (p) (cuda::is_device_pointer(p) ? any_dev : any_host) = true;
  NDT_CHECK(!(any_dev && any_host), "{}: mixes device and host buffers", what);
  return any_dev;
}

std::unique_ptr<Communicator> make_device_communicator(Communicator& mpi_group, int device,
                                                       const std::string& kind) {
  if (kind == "nccl") {
#ifdef NDT_HAVE_NCCL
    return make_nccl_communicator(mpi_group, device);
#else
    NDT_FAIL(
        "train.device_comm is nccl but this ndtrain was built without NCCL (train.device_comm: mpi works)");
#endif
  }
  NDT_CHECK(kind == "mpi", "train.device_comm must be nccl or mpi, got '{}'", kind);
  (void)device;  // the caller made it current (cuda::select_device)
  Communicator* base = &mpi_group;
  if (auto* staged = dynamic_cast<StagedComm*>(base)) base = &staged->host();
#ifdef NDT_HAVE_NCCL
  if (NcclCommunicator* nccl = as_nccl(base)) base = &nccl->host();
#endif
  return std::make_unique<StagedComm>(base->split(0, base->rank()));
}

}  // namespace ndt

#endif  // NDT_HAVE_CUDA
