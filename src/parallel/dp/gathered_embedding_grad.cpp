#include "parallel/dp/gathered_embedding_grad.h"

#include <algorithm>

#include "core/check.h"
#include "ops/ops.h"

namespace ndt {
namespace {

std::vector<int32_t> host_ids(const Tensor& ids) {
  const Tensor h = ids.device() == Device::CPU ? ids : ids.to(Device::CPU);
  return std::vector<int32_t>(h.i32(), h.i32() + h.numel());
}

}  // namespace

GatheredEmbeddingGrad::~GatheredEmbeddingGrad() {
  // An unfinished step (an error unwound it): let the gathers complete before their buffers go.
  for (Pending& p : pending_) {
    if (p.rows_done) p.rows_done->wait();
    if (p.ids_done) p.ids_done->wait();
  }
}

void GatheredEmbeddingGrad::start_gather(Tensor& dtable, const Tensor& rows, const std::vector<int32_t>& ids,
                                         int64_t vocab_start) {
  const int64_t T = static_cast<int64_t>(ids.size()), C = rows.size(1), cap = capacity_, n = dp_.size();
  NDT_CHECK(T <= cap, "gathered embedding gradient: {} tokens exceed the {} rows each replica sends", T, cap);
  const Device dev = rows.device();
  Pending p;
  p.dtable = dtable;
  p.vocab_start = vocab_start;
  // Padded with id -1, which no vocabulary shard holds (those rows add nothing, so they are never read).
  std::vector<int32_t> padded(static_cast<size_t>(cap), -1);
  std::copy(ids.begin(), ids.end(), padded.begin());
  p.send_ids = Tensor::from_vector(padded, {cap}).to(dev);
  p.send_rows = rows;
  if (T < cap) {
    p.send_rows = Tensor::empty({cap, C}, rows.dtype(), dev);
    p.send_rows.view_at(0, {T, C}).copy_from(rows);
  }
  p.ids = Tensor::empty({n * cap}, DType::I32, dev);
  p.rows = Tensor::empty({n * cap, C}, rows.dtype(), dev);
  // Non-blocking where the backend allows (NCCL: the compute stream goes on; MPI: done on return).
  p.ids_done = dp_.all_gather_async(p.send_ids.data_ptr(), p.ids.data_ptr(), cap, DType::I32);
  p.rows_done = dp_.all_gather_async(p.send_rows.data_ptr(), p.rows.data_ptr(), cap * C, rows.dtype());
  pending_.push_back(std::move(p));
}

void GatheredEmbeddingGrad::backward(Tensor& dtable, const Tensor& dx, const Tensor& ids,
                                     int64_t vocab_start) {
  NDT_CHECK(dx.dim() == 2 && dx.size(0) == ids.numel(),
            "gathered embedding gradient: dx has {} rows for {} ids", dx.size(0), ids.numel());
  if (per_microbatch_) {
    start_gather(dtable, dx, host_ids(ids), vocab_start);
  } else {
    kept_.push_back({dtable, dx, host_ids(ids), vocab_start});
  }
}

void GatheredEmbeddingGrad::finish() {
  if (!kept_.empty()) {  // one gather of the step's rows, back to back
    const Kept& first = kept_.front();
    int64_t T = 0;
    for (const Kept& k : kept_) {
      NDT_CHECK(k.dtable.data_ptr() == first.dtable.data_ptr() && k.vocab_start == first.vocab_start,
                "gathered embedding gradient: the step's microbatches name different tables");
      T += k.dx.size(0);
    }
    Tensor rows = Tensor::empty({T, first.dx.size(1)}, first.dx.dtype(), first.dx.device());
    std::vector<int32_t> ids;
    for (const Kept& k : kept_) {
      rows.view_at(static_cast<int64_t>(ids.size()) * k.dx.size(1), k.dx.shape()).copy_from(k.dx);
      ids.insert(ids.end(), k.ids.begin(), k.ids.end());
    }
    Tensor dtable = first.dtable;
    start_gather(dtable, rows, ids, first.vocab_start);
    kept_.clear();
  }
  for (Pending& p : pending_) {  // all waits first: the last gather orders after the tied table's reduction
    p.ids_done->wait();
    p.rows_done->wait();
  }
  for (Pending& p : pending_) ops::embedding_backward(p.dtable, p.rows, p.ids, p.vocab_start);
  pending_.clear();
}

bool gather_beats_reduction(int64_t n, int64_t m, int64_t rows, int64_t vocab_local, int64_t channels,
                            int64_t dx_bytes, bool zero1) {
  if (n <= 1) return false;
  const double gathered = static_cast<double>(n - 1) * static_cast<double>(m) * static_cast<double>(rows) *
                          static_cast<double>(channels * dx_bytes + 4);
  const double reduced = (zero1 ? 1.0 : 2.0) * static_cast<double>(n - 1) / static_cast<double>(n) *
                         static_cast<double>(vocab_local) * static_cast<double>(channels) * 4.0;
  return gathered <= 0.5 * reduced;
}

}  // namespace ndt
