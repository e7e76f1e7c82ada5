#include "parallel/tp/comm_tp_hooks.h"

namespace ndt {

Tensor CommTpHooks::gather_tokens(const Tensor& local) {
  Shape s = local.shape();
  s[0] *= tp_.size();
  Tensor full = Tensor::empty(s, local.dtype(), local.device());
  tp_.all_gather(local.data_ptr(), full.data_ptr(), local.numel(), local.dtype());
  return full;
}

Tensor CommTpHooks::scatter_reduce_tokens(const Tensor& full) {
  NDT_CHECK(full.size(0) % tp_.size() == 0, "{} tokens not divisible by tp={}", full.size(0), tp_.size());
  Shape s = full.shape();
  s[0] /= tp_.size();
  Tensor local = Tensor::empty(s, full.dtype(), full.device());
  tp_.reduce_scatter(full.data_ptr(), local.data_ptr(), local.numel(), local.dtype(), ReduceOp::Sum);
  return local;
}

Tensor CommTpHooks::all_reduce(const Tensor& t) {
  Tensor out = t;  // fresh buffer owned by the caller: reduce in place
  tp_.all_reduce(out.data_ptr(), out.numel(), out.dtype(), ReduceOp::Sum);
  return out;
}

Tensor CommTpHooks::enter_forward(const Tensor& x) { return sp_ ? gather_tokens(x) : x; }
Tensor CommTpHooks::enter_backward(const Tensor& dx) {
  return sp_ ? scatter_reduce_tokens(dx) : all_reduce(dx);
}
Tensor CommTpHooks::exit_forward(const Tensor& partial) {
  return sp_ ? scatter_reduce_tokens(partial) : all_reduce(partial);
}
Tensor CommTpHooks::exit_backward(const Tensor& dy) { return sp_ ? gather_tokens(dy) : dy; }

}  // namespace ndt
