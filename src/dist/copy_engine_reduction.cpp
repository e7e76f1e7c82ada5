// Gradient all-reduce by copy engines (copy_engine_reduction.h).
#include "dist/copy_engine_reduction.h"

#ifdef NDT_HAVE_CUDA

#include <cuda.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "core/check.h"
#include "cuda/copy_engine_kernels.h"
#include "cuda/cuda_check.h"
#include "cuda/runtime.h"
#include "dist/stream_handle.h"

namespace ndt {
namespace {

// A CUDA call's failure as a message (setup reports it through agree() instead of throwing alone).
std::string failed(const char* what, cudaError_t e) {
  cudaGetLastError();
  return fmt::format("{}: {}", what, cudaGetErrorString(e));
}

// The stream memory operations, from the driver (no link to libcuda: the runtime hands out its entry
// points).
using WriteValue64 = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
using WaitValue64 = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
struct MemOps {
  WriteValue64 write = nullptr;
  WaitValue64 wait = nullptr;
};
const MemOps& mem_ops() {
  static const MemOps ops = [] {
    MemOps m;
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuStreamWriteValue64", &fn, 12000, cudaEnableDefault, &q) ==
            cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      m.write = reinterpret_cast<WriteValue64>(fn);
    if (cudaGetDriverEntryPointByVersion("cuStreamWaitValue64", &fn, 12000, cudaEnableDefault, &q) ==
            cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      m.wait = reinterpret_cast<WaitValue64>(fn);
    cudaGetLastError();
    return m;
  }();
  return ops;
}

void mem_op_check(CUresult r, const char* what) {
  NDT_CHECK(r == CUDA_SUCCESS, "copy-engine reduction: {} failed (CUresult {})", what, static_cast<int>(r));
}

constexpr int64_t kHandleInts = sizeof(cudaIpcMemHandle_t) / sizeof(int32_t);
static_assert(sizeof(cudaIpcMemHandle_t) % sizeof(int32_t) == 0);

}  // namespace

Tensor ipc_device_zeros(int64_t numel) {
  const size_t bytes = std::max<size_t>(static_cast<size_t>(numel) * sizeof(float), 1);
  void* p = nullptr;
  NDT_CUDA_CHECK(cudaMalloc(&p, bytes));
  return Tensor::adopt(cuda::adopt_external_zeroed(p, bytes, [](void* q) { cudaFree(q); }), {numel},
                       DType::F32, Device::CUDA);
}

std::unique_ptr<CopyEngineReduction> CopyEngineReduction::create(Communicator& group, const Tensor& grads,
                                                                 std::string& why) {
  NDT_CHECK(grads.device() == Device::CUDA && grads.dtype() == DType::F32,
            "copy-engine reduction: needs an fp32 device buffer");
  const int n = group.size(), me = group.rank();
  if (n < 2) {
    why = "one rank";
    return nullptr;
  }
  // One host: every rank's host name equal to rank 0's.
  std::vector<int32_t> name(16, 0), names(16 * static_cast<size_t>(n));
  {
    char host[64] = {0};
    gethostname(host, sizeof(host) - 1);
    std::memcpy(name.data(), host, sizeof(host));
  }
  group.all_gather(name.data(), names.data(), 16, DType::I32);
  for (int q = 1; q < n; ++q)
    if (!std::equal(names.begin(), names.begin() + 16, names.begin() + 16 * q)) {
      why = "the ranks are on more than one host";
      return nullptr;
    }

  std::unique_ptr<CopyEngineReduction> r(new CopyEngineReduction());
  r->rank_ = me;
  r->n_ = n;
  r->grads_ = const_cast<Tensor&>(grads).f32();
  r->numel_ = grads.numel();
  const size_t flag_bytes = sizeof(unsigned long long) * kKinds * kSlots * n;
  NDT_CUDA_CHECK(cudaMalloc(&r->flags_, flag_bytes));
  NDT_CUDA_CHECK(cudaMemset(r->flags_, 0, flag_bytes));
  int lo = 0, hi = 0;
  NDT_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
  // High priority: the sums are short and hold up the transfers after them (measured: low priority, or a
  // quarter of the blocks, was no faster).
  NDT_CUDA_CHECK(cudaStreamCreateWithPriority(&r->stream_, cudaStreamNonBlocking, hi));
  NDT_CUDA_CHECK(cudaStreamCreateWithPriority(&r->push_stream_, cudaStreamNonBlocking, hi));
  for (cudaEvent_t* e : {&r->ready_, &r->summed_, &r->pushed_})
    NDT_CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));

  // Export both buffers, gather every rank's handles, map the peers' (each failure agreed over the group).
  std::string err;
  int dev = 0;
  NDT_CUDA_CHECK(cudaGetDevice(&dev));
  std::vector<int32_t> mine(2 * kHandleInts, 0), all(2 * kHandleInts * static_cast<size_t>(n));
  cudaIpcMemHandle_t hg{}, hf{};
  if (!mem_ops().write || !mem_ops().wait)
    err = "the driver offers no stream memory operations";
  else if (cudaError_t e = cudaIpcGetMemHandle(&hg, r->grads_); e != cudaSuccess)
    err = failed("cudaIpcGetMemHandle (gradients)", e);
  else if (cudaError_t e2 = cudaIpcGetMemHandle(&hf, r->flags_); e2 != cudaSuccess)
    err = failed("cudaIpcGetMemHandle (flags)", e2);
  std::memcpy(mine.data(), &hg, sizeof(hg));
  std::memcpy(mine.data() + kHandleInts, &hf, sizeof(hf));
  group.all_gather(mine.data(), all.data(), 2 * kHandleInts, DType::I32);
  r->peer_grads_.assign(n, nullptr);
  r->peer_flags_.assign(n, nullptr);
  r->peer_grads_[me] = r->grads_;
  r->peer_flags_[me] = r->flags_;
  for (int q = 0; q < n && err.empty(); ++q) {
    if (q == me) continue;
    cudaIpcMemHandle_t h{};
    void* p = nullptr;
    std::memcpy(&h, all.data() + 2 * kHandleInts * q, sizeof(h));
    if (cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess); e != cudaSuccess) {
      err = failed(fmt::format("mapping rank {}'s gradients (cudaIpcOpenMemHandle)", q).c_str(), e);
      break;
    }
    r->peer_grads_[q] = static_cast<float*>(p);
    std::memcpy(&h, all.data() + 2 * kHandleInts * q + kHandleInts, sizeof(h));
    if (cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess); e != cudaSuccess) {
      err = failed(fmt::format("mapping rank {}'s flags (cudaIpcOpenMemHandle)", q).c_str(), e);
      break;
    }
    r->peer_flags_[q] = static_cast<unsigned long long*>(p);
    // Copies between GPUs without peer access would be staged through the host: not worth it.
    cudaPointerAttributes attr{};
    int can = 0;
    if (cudaPointerGetAttributes(&attr, r->peer_grads_[q]) != cudaSuccess ||
        cudaDeviceCanAccessPeer(&can, dev, attr.device) != cudaSuccess || (!can && attr.device != dev)) {
      cudaGetLastError();
      err = fmt::format("GPU {} has no peer access to rank {}'s GPU", dev, q);
    }
  }
  const Status st = agree(err.empty() ? Status::ok() : Status::error(err), group);
  if (!st.is_ok()) {
    why = st.message();
    return nullptr;  // (the destructor closes what was mapped)
  }
  r->scratch_ = Tensor::empty({(n - 1) * kPieceElems}, DType::F32, Device::CUDA);
  NDT_CUDA_CHECK(cudaDeviceSynchronize());  // the zeroed flags before any peer reads them
  group.barrier();
  return r;
}

CopyEngineReduction::~CopyEngineReduction() {
  if (stream_) cudaStreamSynchronize(stream_);
  if (push_stream_) cudaStreamSynchronize(push_stream_);
  for (int q = 0; q < n_; ++q) {
    if (q == rank_) continue;
    if (q < static_cast<int>(peer_grads_.size()) && peer_grads_[q]) cudaIpcCloseMemHandle(peer_grads_[q]);
    if (q < static_cast<int>(peer_flags_.size()) && peer_flags_[q]) cudaIpcCloseMemHandle(peer_flags_[q]);
  }
  if (flags_) cudaFree(flags_);
  for (cudaEvent_t e : {ready_, summed_, pushed_})
    if (e) cudaEventDestroy(e);
  if (push_stream_) cudaStreamDestroy(push_stream_);
  if (stream_) cudaStreamDestroy(stream_);
  cudaGetLastError();
}

int64_t CopyEngineReduction::slot_of(int64_t offset, int64_t count) {
  auto it = slots_.find({offset, count});
  if (it != slots_.end()) return it->second;
  NDT_CHECK(static_cast<int64_t>(slots_.size()) < kSlots,
            "copy-engine reduction: more than {} distinct ranges", kSlots);
  const int64_t s = static_cast<int64_t>(slots_.size());
  slots_.emplace(std::make_pair(offset, count), s);
  return s;
}

void CopyEngineReduction::signal_and_wait(Kind kind, int64_t slot) {
  const auto at = [](unsigned long long* p) {
    return static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(p));
  };
  const auto cs = static_cast<CUstream>(stream_);
  const int64_t mine = flag_index(kind, slot, rank_);
  // The default write orders every write before it (the range, the sums) ahead of the flag.
  for (int q = 0; q < n_; ++q)
    if (q != rank_)
      mem_op_check(mem_ops().write(cs, at(peer_flags_[q] + mine), 1, CU_STREAM_WRITE_VALUE_DEFAULT),
                   "cuStreamWriteValue64");
  for (int q = 0; q < n_; ++q) {
    if (q == rank_) continue;
    unsigned long long* f = flags_ + flag_index(kind, slot, q);
    mem_op_check(mem_ops().wait(cs, at(f), 1, CU_STREAM_WAIT_VALUE_EQ), "cuStreamWaitValue64");
    mem_op_check(mem_ops().write(cs, at(f), 0, CU_STREAM_WRITE_VALUE_DEFAULT), "cuStreamWriteValue64");
  }
}

void CopyEngineReduction::pull_and_sum(float* buf, int64_t offset, int64_t lo, int64_t hi, bool push) {
  float* scratch = scratch_.f32();
  for (int64_t at = lo; at < hi; at += kPieceElems) {
    const int64_t len = std::min(kPieceElems, hi - at);
    int k = 0;
    for (int q = 0; q < n_; ++q)
      if (q != rank_)
        NDT_CUDA_CHECK(cudaMemcpyAsync(scratch + (k++) * len, peer_grads_[q] + offset + at,
                                       sizeof(float) * len, cudaMemcpyDefault, stream_));
    cuda::ce_sum_in_rank_order(buf + at, scratch, len, n_, rank_, stream_);
    if (!push) continue;
    NDT_CUDA_CHECK(cudaEventRecord(summed_, stream_));
    NDT_CUDA_CHECK(cudaStreamWaitEvent(push_stream_, summed_, 0));
    for (int q = 0; q < n_; ++q)
      if (q != rank_)
        NDT_CUDA_CHECK(cudaMemcpyAsync(peer_grads_[q] + offset + at, buf + at, sizeof(float) * len,
                                       cudaMemcpyDefault, push_stream_));
  }
  if (!push) return;
  NDT_CUDA_CHECK(cudaEventRecord(pushed_, push_stream_));
  NDT_CUDA_CHECK(cudaStreamWaitEvent(stream_, pushed_, 0));
}

std::unique_ptr<CommHandle> CopyEngineReduction::reduce_range(float* buf, int64_t count, int64_t lo,
                                                              int64_t hi, bool push) {
  const int64_t offset = buf - grads_;
  const int64_t slot = slot_of(offset, count);
  const cudaStream_t compute = cuda::stream();
  NDT_CUDA_CHECK(cudaEventRecord(ready_, compute));
  NDT_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready_, 0));
  signal_and_wait(kReady, slot);  // every rank's range is final
  pull_and_sum(buf, offset, lo, hi, push);
  // Pushed: every part pushed everywhere (after its owner's pulls from there). Not pushed: every owner done
  // pulling from this rank's range (which the next step zeroes), ours from theirs.
  signal_and_wait(kReduced, slot);
  return std::make_unique<StreamHandle>(compute, stream_, "an asynchronous copy-engine reduction", n_);
}

std::unique_ptr<CommHandle> CopyEngineReduction::all_reduce_async(float* buf, int64_t count) {
  const int64_t offset = buf - grads_;
  NDT_CHECK(count > 0 && offset >= 0 && offset + count <= numel_,
            "copy-engine reduction: [{}, {}) is not inside the registered gradients ({} elements)", offset,
            offset + count, numel_);
  const int64_t part = (count + n_ - 1) / n_;
  const int64_t lo = std::min<int64_t>(rank_ * part, count), hi = std::min<int64_t>(lo + part, count);
  return reduce_range(buf, count, lo, hi, /*push=*/true);
}

std::unique_ptr<CommHandle> CopyEngineReduction::reduce_to_owner_async(float* buf, int64_t count,
                                                                       int64_t own_begin, int64_t own_end) {
  const int64_t offset = buf - grads_;
  NDT_CHECK(count > 0 && offset >= 0 && offset + count <= numel_ && own_begin <= own_end,
            "copy-engine reduction to owners: [{}, {}) (own part [{}, {})) is not inside the registered "
            "gradients ({} elements)",
            offset, offset + count, own_begin, own_end, numel_);
  const int64_t lo = std::clamp(own_begin - offset, int64_t{0}, count);
  return reduce_range(buf, count, lo, std::clamp(own_end - offset, lo, count), /*push=*/false);
}

}  // namespace ndt

#endif  // NDT_HAVE_CUDA
