#pragma once
// Incremental (cached) attention enters the model only through this interface, as context parallelism
// does through CpHooks: generation (src/generate) implements it with a KV cache. With a cache set, the
// microbatch holds only the NEW tokens of each sequence, at their absolute positions; the hook stores
// their keys/values and attends the new queries to every cached key of the same sequence (causal by
// position). Forward only: a cached forward has no backward.
//
// layer: the global layer index. q(T, Hl, D), k/v(T, KVl, D) after RoPE; out(T, Hl, D), lse(T, Hl).
#include <cstdint>

#include "core/tensor.h"
#include "data/dataset.h"

namespace ndt {

class KvHooks {
 public:
  virtual ~KvHooks() = default;
  // k and v undefined: this forward's keys/values are in the cache already, written by the model at the
  // rows store_target gave.
  virtual void attention_forward(int64_t layer, const Microbatch& mb, const Tensor& q, const Tensor& k,
                                 const Tensor& v, Tensor& out, Tensor& lse, float scale) = 0;
  // Where this forward's keys/values of `layer` go, so the model can write them there directly (the q/k/v
  // split writes rows[t] of K and V for token t) instead of handing them to attention_forward: false when
  // the hook stores them itself.
  virtual bool store_target(int64_t /*layer*/, Tensor& /*K*/, Tensor& /*V*/, Tensor& /*rows*/) {
    return false;
  }
};

}  // namespace ndt
