#include "parallel/tp/comm_tp_hooks.h"

#include "ops/ops.h"
#ifdef NDT_HAVE_CUDA
#include "cuda/runtime.h"
#endif

namespace ndt {

namespace {
P2POp p2p(P2POp::Kind kind, Tensor& t, int peer) { return {kind, t.data_ptr(), t.numel(), t.dtype(), peer}; }
}  // namespace

// Each collective is started non-blocking and waited for on the compute stream (NCCL); other backends
// complete it in the call.
Tensor CommTpHooks::gather_tokens(const Tensor& local) {
  Shape s = local.shape();
  s[0] *= tp_.size();
  Tensor full = Tensor::empty(s, local.dtype(), local.device());
  tp_.all_gather_async(local.data_ptr(), full.data_ptr(), local.numel(), local.dtype())->wait();
  return full;
}

Tensor CommTpHooks::scatter_reduce_tokens(const Tensor& full) {
  NDT_CHECK(full.size(0) % tp_.size() == 0, "{} tokens not divisible by tp={}", full.size(0), tp_.size());
  Shape s = full.shape();
  s[0] /= tp_.size();
  Tensor local = Tensor::empty(s, full.dtype(), full.device());
  tp_.reduce_scatter_async(full.data_ptr(), local.data_ptr(), local.numel(), local.dtype(), ReduceOp::Sum)
      ->wait();
  return local;
}

Tensor CommTpHooks::all_reduce(const Tensor& t) {
  Tensor out = t;  // fresh buffer owned by the caller: reduce in place
  tp_.all_reduce_async(out.data_ptr(), out.numel(), out.dtype(), ReduceOp::Sum)->wait();
  return out;
}

void CommTpHooks::reduce_in_place(float* buf, int64_t n, ReduceOp op) {
#ifdef NDT_HAVE_CUDA
  if (n > 0 && cuda::is_device_pointer(buf)) {
    tp_.all_reduce_async(buf, n, DType::F32, op)->wait();
    return;
  }
#endif
  tp_.all_reduce(buf, n, DType::F32, op);
}

Tensor CommTpHooks::enter_forward(const Tensor& x) { return sp_ ? gather_tokens(x) : x; }
Tensor CommTpHooks::enter_backward(const Tensor& dx) {
  return sp_ ? scatter_reduce_tokens(dx) : all_reduce(dx);
}
Tensor CommTpHooks::exit_forward(const Tensor& partial) {
  return sp_ ? scatter_reduce_tokens(partial) : all_reduce(partial);
}
Tensor CommTpHooks::exit_backward(const Tensor& dy) { return sp_ ? gather_tokens(dy) : dy; }

Tensor CommTpHooks::gather_overlapped(const Tensor& x, const ConsumeRows& consume) {
  const int P = tp_.size(), r = tp_.rank();
  if (!overlap_ || !sp_ || P == 1) return TpHooks::gather_overlapped(x, consume);
  const int64_t Tl = x.size(0);
  Shape s = x.shape();
  s[0] *= P;
  Tensor full = Tensor::empty(s, x.dtype(), x.device());
  full.rows(r * Tl, Tl).copy_from(x);
  const int next = (r + 1) % P, prev = (r + P - 1) % P;
  for (int k = 1; k < P; ++k) {
    const int send_b = (r - k + 1 + P) % P, recv_b = (r - k + P) % P;
    Tensor out = full.rows(send_b * Tl, Tl), in = full.rows(recv_b * Tl, Tl);
    std::unique_ptr<CommHandle> h =
        tp_.batch_p2p_async({p2p(P2POp::Send, out, next), p2p(P2POp::Recv, in, prev)});
    consume(full, send_b * Tl, Tl);
    h->wait();
  }
  consume(full, static_cast<int64_t>(next) * Tl, Tl);
  return full;
}

Tensor CommTpHooks::reduce_overlapped(Tensor& partial, const ProduceRows& produce,
                                      const std::function<void()>& meanwhile) {
  const int P = tp_.size(), r = tp_.rank();
  if (!overlap_ || P == 1) return TpHooks::reduce_overlapped(partial, produce, meanwhile);
  if (!sp_) {  // an all-reduce of the whole: nothing to split, the transfer runs beside `meanwhile`
    produce(0, partial.size(0), partial);
    std::unique_ptr<CommHandle> h =
        tp_.all_reduce_async(partial.data_ptr(), partial.numel(), partial.dtype(), ReduceOp::Sum);
    if (meanwhile) meanwhile();
    h->wait();
    return partial;
  }
  NDT_CHECK(partial.size(0) % P == 0, "{} tokens not divisible by tp={}", partial.size(0), P);
  const int64_t Tl = partial.size(0) / P;
  const int next = (r + 1) % P, prev = (r + P - 1) % P;
  Tensor acc = Tensor::empty(partial.rows(0, Tl).shape(), partial.dtype(), partial.device());
  std::unique_ptr<CommHandle> h;
  for (int k = 0;; ++k) {
    const int b = ((r - 1 - k) % P + P) % P;
    Tensor mine = partial.rows(b * Tl, Tl);
    produce(b * Tl, Tl, mine);
    if (k == P - 1) {  // b == r: this rank's block, once the sum of the others has arrived
      if (meanwhile) meanwhile();
      h->wait();
      return ops::add(mine, acc);
    }
    if (k > 0) {
      h->wait();
      ops::add_(mine, acc);
    }
    h = tp_.batch_p2p_async({p2p(P2POp::Send, mine, next), p2p(P2POp::Recv, acc, prev)});
  }
}

}  // namespace ndt
