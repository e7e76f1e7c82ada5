#pragma once
// Tensor-parallel communication for the transformer (Megatron f/g operators), over a TP communicator.
// See model/tp_hooks.h for what each hook does with and without sequence parallelism. Over NCCL the
// collectives are non-blocking: the compute stream waits for them, the host does not. The tensors passed
// in are fresh buffers the model owns, so all-reduces run in place.
//
// With `overlap` (parallel.tp_comm_overlap) the overlapped hooks split the sequence-parallel gather and
// reduce-scatter into a ring of one-block exchanges, each beside the matmul of another block:
//   gather:  step k = 1..P-1 passes block r-k+1 on to rank r+1 and takes block r-k from rank r-1 while
//            block r-k+1 is consumed; the last block (r+1) is consumed after the last step.
//   reduce:  block b's partial sums travel b+1 -> b+2 -> ... -> b (its owner), each rank adding its own;
//            at step k this rank produces block r-1-k (beside the transfer of step k-1), adds what came
//            from rank r-1 and passes it on; at the last step its own block r is finished.
// Without sequence parallelism the all-reduce runs beside the caller's `meanwhile` work.
#include "dist/communicator.h"
#include "model/tp_hooks.h"

namespace ndt {

class CommTpHooks : public TpHooks {
 public:
  CommTpHooks(Communicator& tp, bool sequence_parallel, bool overlap = true)
      : tp_(tp), sp_(sequence_parallel), overlap_(overlap) {}
  int size() const override { return tp_.size(); }
  int rank() const override { return tp_.rank(); }
  bool sequence_parallel() const override { return sp_; }
  Tensor enter_forward(const Tensor& x) override;
  Tensor enter_backward(const Tensor& dx) override;
  Tensor exit_forward(const Tensor& partial) override;
  Tensor exit_backward(const Tensor& dy) override;
  Tensor gather_overlapped(const Tensor& x, const ConsumeRows& consume) override;
  Tensor reduce_overlapped(Tensor& partial, const ProduceRows& produce,
                           const std::function<void()>& meanwhile) override;
  void all_reduce_sum(float* buf, int64_t n) override { reduce_in_place(buf, n, ReduceOp::Sum); }
  void all_reduce_max(float* buf, int64_t n) override { reduce_in_place(buf, n, ReduceOp::Max); }

 private:
  Tensor gather_tokens(const Tensor& local);         // (Tl, C) -> (T, C)
  Tensor scatter_reduce_tokens(const Tensor& full);  // (T, C) partial sums -> (Tl, C) reduced
  Tensor all_reduce(const Tensor& t);
  // Device buffers (the vocab-parallel softmax statistics): non-blocking, the compute stream waits.
  void reduce_in_place(float* buf, int64_t n, ReduceOp op);

  Communicator& tp_;
  bool sp_;
  bool overlap_;
};

}  // namespace ndt
