#pragma once
// Where a microbatch's token-embedding table gradient is accumulated. Without a hook the first stage runs
// ops::embedding_backward on its own rows. Data parallelism may instead gather every replica's rows and
// ids and accumulate all of them on every replica (parallel/dp/gathered_embedding_grad.h), so that the
// table's gradient of that microbatch needs no all-reduce after the backward.
#include <cstdint>

#include "core/tensor.h"

namespace ndt {

class EmbeddingGradHook {
 public:
  virtual ~EmbeddingGradHook() = default;
  // dtable (V_local, C) += the embedding backward of dx (T, C) at ids (T, host or device i32): row
  // ids[t] - vocab_start of dtable gets dx row t; ids outside [vocab_start, vocab_start + V_local) add
  // nothing.
  // An implementation may defer the addition (it keeps what it needs); finish() then completes every
  // deferred one. Called by the hook's owner after the stage's last backward of the step.
  virtual void backward(Tensor& dtable, const Tensor& dx, const Tensor& ids, int64_t vocab_start) = 0;
  virtual void finish() {}
};

}  // namespace ndt
