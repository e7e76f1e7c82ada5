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
//
// gather_overlapped / reduce_overlapped are the same two communications together with the matmuls next to
// them, so that an implementation can run the transfer of one block of rows beside the matmul of another
// (Megatron's TP communication overlap). "gather" is enter_forward and exit_backward (the same operation),
// "reduce" is exit_forward and enter_backward.
#include <cstdint>
#include <functional>
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
  // Rows between TP regions (the full token stream) for `local` rows held here.
  int64_t gathered_rows(int64_t local) const { return sequence_parallel() ? local * size() : local; }
  virtual Tensor enter_forward(const Tensor& x) { return x; }
  virtual Tensor enter_backward(const Tensor& dx) { return dx; }
  virtual Tensor exit_forward(const Tensor& partial) { return partial; }
  virtual Tensor exit_backward(const Tensor& dy) { return dy; }

  // gather(x), calling consume(full, first, count) for blocks of the gathered tensor's rows as soon as
  // each block is there; the blocks cover every row once, in an order of the implementation's choosing.
  // Returns the gathered tensor. Default: gather, then consume it whole.
  using ConsumeRows = std::function<void(const Tensor& full, int64_t first, int64_t count)>;
  virtual Tensor gather_overlapped(const Tensor& x, const ConsumeRows& consume) {
    Tensor full = enter_forward(x);
    consume(full, 0, full.size(0));
    return full;
  }
  // reduce(partial), where produce(first, count, rows) writes the partial sums of rows [first, first +
  // count) into `rows` (a view of those rows of `partial`, the caller's (T, ...) buffer; it may also serve
  // as scratch). Each row block is produced once. meanwhile (may be empty) is work that needs neither
  // partial nor the result: it runs while the last transfer is in flight. Returns what reduce(partial)
  // returns. Default: produce it whole, run meanwhile, reduce.
  using ProduceRows = std::function<void(int64_t first, int64_t count, Tensor& rows)>;
  virtual Tensor reduce_overlapped(Tensor& partial, const ProduceRows& produce,
                                   const std::function<void()>& meanwhile) {
    produce(0, partial.size(0), partial);
    if (meanwhile) meanwhile();
    return exit_forward(partial);
  }
  // Reductions over the TP group (vocab-parallel softmax, argmax).
  virtual void all_reduce_sum(float* buf, int64_t n) {}
  virtual void all_reduce_max(float* buf, int64_t n) {}
};

}  // namespace ndt
