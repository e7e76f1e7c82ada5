#pragma once
// Context parallelism enters the model only through attention, as an interface the model calls and
// parallel/cp implements (model/ never depends on dist/). Everything else a CP rank computes is local:
// its microbatch already holds its two chunks of every sequence, with global positions (RoPE, learned
// positions and causal masks all use them) and its own loss mask.
//
// q(T, Hl, D), k/v(T, KVl, D), out(T, Hl, D), lse(T, Hl) are this rank's rows of the microbatch mb.
// backward accumulates (+=) into dq, dk, dv (dk/dv of this rank's own key rows: contributions computed
// on other CP ranks are returned to their owner).
#include "core/tensor.h"
#include "data/dataset.h"

namespace ndt {

class CpHooks {
 public:
  virtual ~CpHooks() = default;
  virtual int size() const = 0;
  // Sum over the CP group, in place (buffers on the model's device): per-sequence statistics whose
  // tokens are spread over the CP ranks (MoE load balancing).
  virtual void all_reduce_sum(float* buf, int64_t n) = 0;
  virtual void attention_forward(const Microbatch& mb, const Tensor& q, const Tensor& k, const Tensor& v,
                                 Tensor& out, Tensor& lse, float scale) = 0;
  virtual void attention_backward(const Microbatch& mb, const Tensor& dout, const Tensor& q, const Tensor& k,
                                  const Tensor& v, const Tensor& out, const Tensor& lse, Tensor& dq,
                                  Tensor& dk, Tensor& dv, float scale) = 0;
};

}  // namespace ndt
