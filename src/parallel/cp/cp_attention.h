#pragma once
// Context-parallel attention over a CP group (see model/cp_hooks.h for the contract and cp_shard.h for
// the chunk layout). Two implementations, selected by parallel.cp_attention:
//  - allgather: gather every rank's K/V rows, reorder them into full sequences and attend with the
//    positional causal mask; backward re-gathers K/V and returns dK/dV to their owners with a
//    reduce-scatter (the adjoint of the all-gather).
//  - ring: cp steps; at step i a rank attends to the K/V block of rank (r − i) mod cp and passes the
//    block on (batched P2P to r+1, from r−1); partial outputs merge by log-sum-exp (online softmax).
//    Backward walks the same ring with the final out/lse; dK/dV accumulators travel with their block
//    and one last hop returns them to the owner.
#include <memory>

#include "dist/communicator.h"
#include "model/cp_hooks.h"

namespace ndt {

class CpAttention final : public CpHooks {
 public:
  enum class Mode { AllGather, Ring };
  // `cp` is not owned and must outlive this object.
  CpAttention(Communicator& cp, Mode mode) : cp_(cp), mode_(mode) {}
  int size() const override { return cp_.size(); }
  void all_reduce_sum(float* buf, int64_t n) override { cp_.all_reduce(buf, n, DType::F32, ReduceOp::Sum); }
  void attention_forward(const Microbatch& mb, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                         Tensor& lse, float scale) override;
  void attention_backward(const Microbatch& mb, const Tensor& dout, const Tensor& q, const Tensor& k,
                          const Tensor& v, const Tensor& out, const Tensor& lse, Tensor& dq, Tensor& dk,
                          Tensor& dv, float scale) override;

 private:
  Tensor all_gather_rows(const Tensor& x);
  // Sends blocks to rank r+1 and receives the same shapes from r−1 (in place).
  void ring_shift(std::initializer_list<Tensor*> blocks);

  Communicator& cp_;
  Mode mode_;
};

}  // namespace ndt
