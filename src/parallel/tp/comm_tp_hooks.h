#pragma once
// Tensor-parallel communication for the transformer (Megatron f/g operators), over a TP communicator.
// See model/tp_hooks.h for what each hook does with and without sequence parallelism. Blocking; the
// tensors passed in are fresh buffers the model owns, so all-reduces run in place.
#include "dist/communicator.h"
#include "model/tp_hooks.h"

namespace ndt {

class CommTpHooks : public TpHooks {
 public:
  CommTpHooks(Communicator& tp, bool sequence_parallel) : tp_(tp), sp_(sequence_parallel) {}
  int size() const override { return tp_.size(); }
  int rank() const override { return tp_.rank(); }
  bool sequence_parallel() const override { return sp_; }
  Tensor enter_forward(const Tensor& x) override;
  Tensor enter_backward(const Tensor& dx) override;
  Tensor exit_forward(const Tensor& partial) override;
  Tensor exit_backward(const Tensor& dy) override;
  void all_reduce_sum(float* buf, int64_t n) override { tp_.all_reduce(buf, n, DType::F32, ReduceOp::Sum); }
  void all_reduce_max(float* buf, int64_t n) override { tp_.all_reduce(buf, n, DType::F32, ReduceOp::Max); }

 private:
  Tensor gather_tokens(const Tensor& local);         // (Tl, C) -> (T, C)
  Tensor scatter_reduce_tokens(const Tensor& full);  // (T, C) partial sums -> (Tl, C) reduced
  Tensor all_reduce(const Tensor& t);

  Communicator& tp_;
  bool sp_;
};

}  // namespace ndt
