#include "parallel/dp/gathered_embedding_grad.h"

#include <algorithm>

#include "core/check.h"
#include "ops/ops.h"

namespace ndt {

GatheredEmbeddingGrad::~GatheredEmbeddingGrad() {
  // An unfinished step (an error unwound it): let the gathers complete before their buffers go.
  for (Pending& p : pending_) {
    if (p.rows_done) p.rows_done->wait();
    if (p.ids_done) p.ids_done->wait();
  }
}

void GatheredEmbeddingGrad::backward(Tensor& dtable, const Tensor& dx, const Tensor& ids,
                                     int64_t vocab_start) {
  const int64_t T = ids.numel(), C = dx.size(1), cap = capacity_, n = dp_.size();
  NDT_CHECK(dx.dim() == 2 && dx.size(0) == T, "gathered embedding gradient: dx has {} rows for {} ids",
            dx.size(0), T);
  NDT_CHECK(T <= cap,
            "gathered embedding gradient: a microbatch of {} tokens exceeds the capacity of {} rows", T, cap);
  const Device dev = dx.device();
  Pending p;
  p.dtable = dtable;
  p.vocab_start = vocab_start;
  // This replica's ids padded to the capacity with -1, which no vocabulary shard holds (those rows add
  // nothing, so the padded rows of dx are never read).
  std::vector<int32_t> padded(static_cast<size_t>(cap), -1);
  const Tensor host_ids = ids.device() == Device::CPU ? ids : ids.to(Device::CPU);
  std::copy(host_ids.i32(), host_ids.i32() + T, padded.begin());
  p.send_ids = Tensor::from_vector(padded, {cap}).to(dev);
  p.send_rows = dx;
  if (T < cap) {
    p.send_rows = Tensor::empty({cap, C}, dx.dtype(), dev);
    p.send_rows.view_at(0, {T, C}).copy_from(dx);
  }
  p.ids = Tensor::empty({n * cap}, DType::I32, dev);
  p.rows = Tensor::empty({n * cap, C}, dx.dtype(), dev);
  // Non-blocking where the backend allows (NCCL: the compute stream goes on; MPI: done on return).
  p.ids_done = dp_.all_gather_async(p.send_ids.data_ptr(), p.ids.data_ptr(), cap, DType::I32);
  p.rows_done = dp_.all_gather_async(p.send_rows.data_ptr(), p.rows.data_ptr(), cap * C, dx.dtype());
  pending_.push_back(std::move(p));
}

void GatheredEmbeddingGrad::finish() {
  for (Pending& p : pending_) {  // all waits first: the last gather orders after the tied table's reduction
    p.ids_done->wait();
    p.rows_done->wait();
  }
  for (Pending& p : pending_) ops::embedding_backward(p.dtable, p.rows, p.ids, p.vocab_start);
  pending_.clear();
}

bool gather_beats_all_reduce(int64_t n, int64_t m, int64_t rows, int64_t vocab_local, int64_t channels,
                             int64_t dx_bytes) {
  if (n <= 1) return false;
  const double gathered = static_cast<double>(n) * static_cast<double>(m) * static_cast<double>(rows) *
                          static_cast<double>(channels * dx_bytes + 4);
  return gathered <= static_cast<double>(vocab_local) * static_cast<double>(channels) * 4.0;
}

}  // namespace ndt
