#include "parallel/dp/gathered_embedding_grad.h"

#include <algorithm>

#include "core/check.h"
#include "ops/ops.h"

#ifdef NDT_HAVE_CUDA
#include <cuda_runtime.h>

#include "cuda/cuda_check.h"
#include "cuda/runtime.h"
#endif

namespace ndt {
namespace {

// ids (i32) that no vocabulary shard holds: their rows add nothing, so they are never read.
void fill_minus_one(Tensor& ids) {
  if (ids.device() == Device::CPU) {
    std::fill(ids.i32(), ids.i32() + ids.numel(), -1);
    return;
  }
#ifdef NDT_HAVE_CUDA
  NDT_CUDA_CHECK(cudaMemsetAsync(ids.data_ptr(), 0xFF, ids.nbytes(), cuda::stream()));  // (-1 in every i32)
#endif
}

}  // namespace

GatheredEmbeddingGrad::~GatheredEmbeddingGrad() {
  // An unfinished step (an error unwound it): let the gathers complete before their buffers go.
  for (Pending& p : pending_) {
    if (p.rows_done) p.rows_done->wait();
    if (p.ids_done) p.ids_done->wait();
  }
}

void GatheredEmbeddingGrad::start_gather(Tensor& dtable, const Tensor& rows, const std::vector<Tensor>& ids,
                                         int64_t vocab_start) {
  const int64_t T = rows.size(0), C = rows.size(1), cap = capacity_, n = dp_.size();
  NDT_CHECK(T <= cap, "gathered embedding gradient: {} tokens exceed the {} rows each replica sends", T, cap);
  const Device dev = rows.device();
  Pending p;
  p.dtable = dtable;
  p.vocab_start = vocab_start;
  p.send_ids = Tensor::empty({cap}, DType::I32, dev);
  fill_minus_one(p.send_ids);
  int64_t at = 0;
  for (const Tensor& piece : ids) {
    p.send_ids.view_at(at, {piece.numel()}).copy_from(piece);
    at += piece.numel();
  }
  NDT_CHECK(at == T, "gathered embedding gradient: {} ids for {} rows", at, T);
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
    start_gather(dtable, dx, {ids}, vocab_start);
  } else {
    kept_.push_back({dtable, dx, ids, vocab_start});
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
    const int64_t C = first.dx.size(1);
    Tensor rows = Tensor::empty({T, C}, first.dx.dtype(), first.dx.device());
    std::vector<Tensor> ids;
    int64_t at = 0;
    for (const Kept& k : kept_) {
      rows.view_at(at * C, k.dx.shape()).copy_from(k.dx);
      ids.push_back(k.ids);
      at += k.dx.size(0);
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
