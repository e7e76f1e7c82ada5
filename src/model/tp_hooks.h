#pragma once
// The communication points of a tensor-parallel transformer, as an interface the model calls and
// parallel/tp implements (so model/ never depends on dist/). The default is one rank: every hook is
// the identity. Megatron's names: `enter` is "f" (before column-parallel linears), `exit` is "g"
// (after row-parallel linears).
//
//                    forward                          backward
//   enter   no SP:   identity                         all-reduce over TP
//           SP:      all-gather tokens (T/tp -> T)    reduce-scatter tokens
//   exit    no SP:   all-reduce (partial -> full)     identity
//           SP:      reduce-scatter (T -> T/tp)       all-gather tokens
#include <cstdint>
#include <utility>

#include "core/tensor.h"

namespace ndt {

class TpHooks {
 public:
  virtual ~TpHooks() = default;
  virtual int size() const { return 1; }
  virtual int rank() const { return 0; }
  virtual bool sequence_parallel() const { return false; }
  // Tokens [first, first + count) of a T-token stream that this rank holds between regions.
  std::pair<int64_t, int64_t> local_tokens(int64_t T) const {
    if (!sequence_parallel()) return {0, T};
    return {rank() * (T / size()), T / size()};
  }
  virtual Tensor enter_forward(const Tensor& x) { return x; }
  virtual Tensor enter_backward(const Tensor& dx) { return dx; }
  virtual Tensor exit_forward(const Tensor& partial) { return partial; }
  virtual Tensor exit_backward(const Tensor& dy) { return dy; }
  // Reductions over the TP group (vocab-parallel softmax, argmax).
  virtual void all_reduce_sum(float* buf, int64_t n) {}
  virtual void all_reduce_max(float* buf, int64_t n) {}
};

}  // namespace ndt
