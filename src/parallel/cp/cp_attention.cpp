#include "parallel/cp/cp_attention.h"

#include <cmath>
#include <limits>

#include "ops/cpu_ops.h"
#include "ops/ops.h"
#include "parallel/cp/cp_shard.h"

namespace ndt {
namespace {

constexpr int kTagKv = 11;

// Row i of the full (gathered, sequence-ordered) key set is row full_order[i] of the rank-major gather.
std::vector<int64_t> full_order(const Tensor& local_cu, int64_t cp, int64_t local_rows) {
  const int32_t* cu = local_cu.i32();
  const int64_t nseq = local_cu.numel() - 1;
  std::vector<int64_t> order;
  order.reserve(static_cast<size_t>(cp * local_rows));
  for (int64_t s = 0; s < nseq; ++s) {
    const int64_t c = (cu[s + 1] - cu[s]) / 2;
    for (int64_t j = 0; j < 2 * cp; ++j) {
      const int64_t owner = j < cp ? j : 2 * cp - 1 - j;
      const int64_t off = cu[s] + (j < cp ? 0 : c);
      for (int64_t i = 0; i < c; ++i) order.push_back(owner * local_rows + off + i);
    }
  }
  return order;
}

// Keys of full sequences: segments cp times the local ones, positions 0.. inside each.
void full_key_meta(const Tensor& local_cu, int64_t cp, Tensor& cu_k, Tensor& pos_k) {
  const int64_t nseq = local_cu.numel() - 1;
  cu_k = Tensor::empty({nseq + 1}, DType::I32);
  std::vector<int32_t> pos;
  for (int64_t s = 0; s <= nseq; ++s) cu_k.i32()[s] = static_cast<int32_t>(local_cu.i32()[s] * cp);
  for (int64_t s = 0; s < nseq; ++s)
    for (int32_t i = 0; i < cu_k.i32()[s + 1] - cu_k.i32()[s]; ++i) pos.push_back(i);
  pos_k = Tensor::from_vector(pos, {static_cast<int64_t>(pos.size())});
}

}  // namespace

Tensor CpAttention::all_gather_rows(const Tensor& x) {
  Shape shape = x.shape();
  shape[0] *= cp_.size();
  Tensor out = Tensor::empty(shape, x.dtype(), x.device());
  cp_.all_gather(x.data_ptr(), out.data_ptr(), x.numel(), x.dtype());
  return out;
}

void CpAttention::ring_shift(std::initializer_list<Tensor*> blocks) {
  const int n = cp_.size(), r = cp_.rank();
  std::vector<Tensor> incoming;
  std::vector<P2POp> ops;
  for (Tensor* b : blocks) incoming.push_back(Tensor::empty(b->shape(), b->dtype(), b->device()));
  size_t i = 0;
  for (Tensor* b : blocks) {
    ops.push_back({P2POp::Send, b->data_ptr(), b->numel(), b->dtype(), (r + 1) % n, kTagKv});
    ops.push_back(
        {P2POp::Recv, incoming[i].data_ptr(), incoming[i].numel(), b->dtype(), (r + n - 1) % n, kTagKv});
    ++i;
  }
  cp_.batch_p2p(ops);
  i = 0;
  for (Tensor* b : blocks) *b = std::move(incoming[i++]);
}

void CpAttention::attention_forward(const Microbatch& mb, const Tensor& q, const Tensor& k, const Tensor& v,
                                    Tensor& out, Tensor& lse, float scale) {
  const int64_t n = cp_.size(), r = cp_.rank(), T = q.size(0);
  NDT_CHECK(mb.cu_seqlens.i32()[mb.nseq] == T, "cp attention: microbatch has {} rows, attention {}",
            mb.cu_seqlens.i32()[mb.nseq], T);
  if (mode_ == Mode::AllGather) {
    const std::vector<int64_t> order = full_order(mb.cu_seqlens, n, T);
    Tensor kf = ops::gather_rows(all_gather_rows(k), order), vf = ops::gather_rows(all_gather_rows(v), order);
    Tensor cu_k, pos_k;
    full_key_meta(mb.cu_seqlens, n, cu_k, pos_k);
    ops::attention_forward(out, lse, q, kf, vf, mb.cu_seqlens, cu_k, mb.positions, pos_k, scale);
    return;
  }
  Tensor kb = k.clone(), vb = v.clone();
  Tensor o = Tensor::empty(out.shape(), out.dtype(), out.device()),
         l = Tensor::empty(lse.shape(), DType::F32, lse.device());
  for (int64_t i = 0; i < n; ++i) {
    const int64_t owner = (r - i + n) % n;
    const std::vector<int32_t> p = cp_positions(mb.cu_seqlens, n, owner);
    Tensor pos_k = Tensor::from_vector(p, {static_cast<int64_t>(p.size())});
    Tensor& dst_o = i == 0 ? out : o;
    Tensor& dst_l = i == 0 ? lse : l;
    ops::attention_forward(dst_o, dst_l, q, kb, vb, mb.cu_seqlens, mb.cu_seqlens, mb.positions, pos_k, scale);
    if (i > 0) ops::attention_merge(out, lse, o, l);
    if (i + 1 < n) ring_shift({&kb, &vb});
  }
}

void CpAttention::attention_backward(const Microbatch& mb, const Tensor& dout, const Tensor& q,
                                     const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                                     Tensor& dq, Tensor& dk, Tensor& dv, float scale) {
  const int64_t n = cp_.size(), r = cp_.rank(), T = q.size(0);
  if (mode_ == Mode::AllGather) {
    const std::vector<int64_t> order = full_order(mb.cu_seqlens, n, T);
    Tensor kf = ops::gather_rows(all_gather_rows(k), order), vf = ops::gather_rows(all_gather_rows(v), order);
    Tensor cu_k, pos_k;
    full_key_meta(mb.cu_seqlens, n, cu_k, pos_k);
    Tensor dkf = Tensor::zeros(kf.shape(), kf.dtype(), kf.device()),
           dvf = Tensor::zeros(vf.shape(), vf.dtype(), vf.device());
    ops::attention_backward(dq, dkf, dvf, dout, q, kf, vf, out, lse, mb.cu_seqlens, cu_k, mb.positions, pos_k,
                            scale);
    // Back to rank-major order, then each owner receives the sum of every rank's contribution.
    for (auto [full, local] : {std::pair<Tensor*, Tensor*>{&dkf, &dk}, {&dvf, &dv}}) {
      Shape gshape = full->shape();
      Tensor g = Tensor::zeros(gshape, full->dtype(), full->device());
      ops::scatter_add_rows(g, *full, order);
      Tensor mine = Tensor::empty(local->shape(), local->dtype(), local->device());
      cp_.reduce_scatter(g.data_ptr(), mine.data_ptr(), mine.numel(), mine.dtype(), ReduceOp::Sum);
      ops::add_(*local, mine);
    }
    return;
  }
  Tensor kb = k.clone(), vb = v.clone(), dkb = Tensor::zeros(k.shape(), k.dtype(), k.device()),
         dvb = Tensor::zeros(v.shape(), v.dtype(), v.device());
  for (int64_t i = 0; i < n; ++i) {
    const int64_t owner = (r - i + n) % n;
    const std::vector<int32_t> p = cp_positions(mb.cu_seqlens, n, owner);
    Tensor pos_k = Tensor::from_vector(p, {static_cast<int64_t>(p.size())});
    ops::attention_backward(dq, dkb, dvb, dout, q, kb, vb, out, lse, mb.cu_seqlens, mb.cu_seqlens,
                            mb.positions, pos_k, scale);
    if (i + 1 < n)
      ring_shift({&kb, &vb, &dkb, &dvb});
    else if (n > 1)
      ring_shift({&dkb, &dvb});  // the last hop brings every block's gradients home
  }
  ops::add_(dk, dkb);
  ops::add_(dv, dvb);
}

}  // namespace ndt
