#include "parallel/cp/cp_attention.h"

#include <cmath>
#include <limits>

#include "ops/cpu_ops.h"
#include "ops/ops.h"
#include "parallel/cp/cp_shard.h"

#ifdef NDT_HAVE_CUDA
#include <cuda_bf16.h>

#include "cuda/cudnn_attention.h"
#include "cuda/runtime.h"
#endif

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

// ---- the ring's steps through cuDNN's fused attention ----
// Where every sequence of the microbatch holds 2c local rows (equal blocks) in bf16 on the GPU. Each
// sequence's local rows are its chunks r and 2cp-1-r, in order; the keys of owner o its chunks o and
// 2cp-1-o. So step 0 (o = r) is causal attention over the local rows; a later step sees whole chunks: when
// o < r every query row sees the owner's first chunk and nothing of its second; when o > r only the second
// chunk's queries see keys, all of the owner's.
struct RingBlock {
  int64_t q_off = 0, k_off = 0;  // the first block's query and key rows
#ifdef NDT_HAVE_CUDA
  cuda::AttentionBlocks b{};
  bool causal() const { return b.causal; }
#else
  bool causal() const { return false; }
#endif
};

// The chunk length c, or 0 where the cuDNN form does not apply (unequal or odd local lengths).
int64_t cudnn_ring_chunk(const Microbatch& mb, const Tensor& q) {
  const auto [nseq, len] = ops::cudnn_equal_segments(q, mb.cu_seqlens);
  return nseq > 0 && len % 2 == 0 ? len / 2 : 0;
}

// All-gather CP's blocks for cuDNN: each local chunk a (rank r's chunks r and 2cp-1-r, query rows 0 and c of
// a sequence's 2c) sees the full sequence's keys (cp * 2c rows, in order) before its own chunk, all of them
// (unmasked), and its own chunk's keys causally. The causal blocks come first: their query rows are
// disjoint, so they write the output; the unmasked ones then merge into it.
std::vector<RingBlock> allgather_blocks(int64_t nseq, int64_t c, int64_t cp, int64_t r) {
  std::vector<RingBlock> diag, before;
#ifdef NDT_HAVE_CUDA
  const int64_t L = 2 * cp * c;
  for (auto [q_off, a] : {std::pair<int64_t, int64_t>{0, r}, {c, 2 * cp - 1 - r}}) {
    RingBlock d;
    d.b = {nseq, c, c, 2 * c, L, true}, d.q_off = q_off, d.k_off = a * c;
    diag.push_back(d);
    if (a == 0) continue;
    RingBlock u;
    u.b = {nseq, c, a * c, 2 * c, L, false}, u.q_off = q_off, u.k_off = 0;
    before.push_back(u);
  }
#else
  (void)nseq, (void)c, (void)cp, (void)r;
#endif
  diag.insert(diag.end(), before.begin(), before.end());
  return diag;
}

RingBlock ring_block(int64_t nseq, int64_t c, int64_t r, int64_t owner) {
  RingBlock rb;
#ifdef NDT_HAVE_CUDA
  if (owner == r)
    rb.b = {nseq, 2 * c, 2 * c, 2 * c, 2 * c, true};
  else if (owner < r)
    rb.b = {nseq, 2 * c, c, 2 * c, 2 * c, false};
  else
    rb.b = {nseq, c, 2 * c, 2 * c, 2 * c, false}, rb.q_off = c;
#else
  (void)nseq, (void)c, (void)r, (void)owner;
#endif
  return rb;
}

#ifdef NDT_HAVE_CUDA
// Row `row` of t (bf16 activations, or E = float for the lse).
template <typename E = __nv_bfloat16>
E* rows_of(const Tensor& t, int64_t row) {
  return static_cast<E*>(const_cast<void*>(t.data_ptr())) + row * (t.numel() / t.size(0));
}
#endif

// o, l = attention of q's block rows over the block's keys (other rows untouched); false where cuDNN refuses.
bool cudnn_ring_forward(Tensor& o, Tensor& l, const Tensor& q, const Tensor& k, const Tensor& v,
                        const RingBlock& rb, float scale) {
#ifdef NDT_HAVE_CUDA
  return cuda::cudnn_attention_forward_blocks(
      rows_of(o, rb.q_off), rows_of<float>(l, rb.q_off), rows_of(q, rb.q_off), rows_of(k, rb.k_off),
      rows_of(v, rb.k_off), rb.b, q.size(1), k.size(1), q.size(2), scale, cuda::stream());
#else
  (void)o, (void)l, (void)q, (void)k, (void)v, (void)rb, (void)scale;
  return false;
#endif
}

// dq, dk, dv += the block's gradients (through zeroed scratch: cuDNN overwrites); false where it refuses.
bool cudnn_ring_backward(Tensor& dq, Tensor& dk, Tensor& dv, const Tensor& dout, const Tensor& q,
                         const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                         const RingBlock& rb, float scale) {
#ifdef NDT_HAVE_CUDA
  Tensor gq = Tensor::zeros(dq.shape(), dq.dtype(), dq.device()),
         gk = Tensor::zeros(dk.shape(), dk.dtype(), dk.device()),
         gv = Tensor::zeros(dv.shape(), dv.dtype(), dv.device());
  if (!cuda::cudnn_attention_backward_blocks(
          rows_of(gq, rb.q_off), rows_of(gk, rb.k_off), rows_of(gv, rb.k_off), rows_of(dout, rb.q_off),
          rows_of(q, rb.q_off), rows_of(k, rb.k_off), rows_of(v, rb.k_off), rows_of(out, rb.q_off),
          rows_of<float>(lse, rb.q_off), rb.b, q.size(1), k.size(1), q.size(2), scale, cuda::stream()))
    return false;
  ops::add_(dq, gq);
  ops::add_(dk, gk);
  ops::add_(dv, gv);
  return true;
#else
  (void)dq, (void)dk, (void)dv, (void)dout, (void)q, (void)k, (void)v, (void)out, (void)lse, (void)rb,
      (void)scale;
  return false;
#endif
}

// Merges a step's (o, l) into (out, lse) over the step's query rows (the block's rows of every sequence).
void merge_block_rows(Tensor& out, Tensor& lse, const Tensor& o, const Tensor& l, const RingBlock& rb,
                      int64_t nseq, int64_t c) {
#ifdef NDT_HAVE_CUDA
  if (rb.b.Sq == 2 * c) {
    ops::attention_merge(out, lse, o, l);
    return;
  }
  for (int64_t s = 0; s < nseq; ++s) {
    const int64_t first = s * 2 * c + rb.q_off, n = rb.b.Sq;
    Tensor od = out.rows(first, n), ld = lse.rows(first, n);
    ops::attention_merge(od, ld, o.rows(first, n), l.rows(first, n));
  }
#else
  (void)out, (void)lse, (void)o, (void)l, (void)rb, (void)nseq, (void)c;
#endif
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
    if (const int64_t c = cudnn_ring_chunk(mb, q); c > 0) {
      Tensor o = Tensor::empty(out.shape(), out.dtype(), out.device()),
             l = Tensor::empty(lse.shape(), DType::F32, lse.device());
      bool ok = true;
      for (const RingBlock& rb : allgather_blocks(mb.nseq, c, n, r)) {
        if (!(ok = cudnn_ring_forward(rb.causal() ? out : o, rb.causal() ? lse : l, q, kf, vf, rb, scale)))
          break;
        if (!rb.causal()) merge_block_rows(out, lse, o, l, rb, mb.nseq, c);
      }
      if (ok) return;
    }
    Tensor cu_k, pos_k;
    full_key_meta(mb.cu_seqlens, n, cu_k, pos_k);
    ops::attention_forward(out, lse, q, kf, vf, mb.cu_seqlens, cu_k, mb.positions, pos_k, scale);
    return;
  }
  Tensor kb = k.clone(), vb = v.clone();
  Tensor o = Tensor::empty(out.shape(), out.dtype(), out.device()),
         l = Tensor::empty(lse.shape(), DType::F32, lse.device());
  const int64_t c = cudnn_ring_chunk(mb, q);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t owner = (r - i + n) % n;
    Tensor& dst_o = i == 0 ? out : o;
    Tensor& dst_l = i == 0 ? lse : l;
    const RingBlock rb = ring_block(mb.nseq, c, r, owner);
    if (c > 0 && cudnn_ring_forward(dst_o, dst_l, q, kb, vb, rb, scale)) {
      if (i > 0) merge_block_rows(out, lse, o, l, rb, mb.nseq, c);
    } else {
      const std::vector<int32_t> p = cp_positions(mb.cu_seqlens, n, owner);
      Tensor pos_k = Tensor::from_vector(p, {static_cast<int64_t>(p.size())});
      ops::attention_forward(dst_o, dst_l, q, kb, vb, mb.cu_seqlens, mb.cu_seqlens, mb.positions, pos_k,
                             scale);
      if (i > 0) ops::attention_merge(out, lse, o, l);
    }
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
    bool done = false;
    if (const int64_t c = cudnn_ring_chunk(mb, q); c > 0) {
      Tensor dq_c =
          Tensor::zeros(dq.shape(), dq.dtype(), dq.device());  // added to dq only if every block ran
      done = true;
      for (const RingBlock& rb : allgather_blocks(mb.nseq, c, n, r))
        if (!(done = cudnn_ring_backward(dq_c, dkf, dvf, dout, q, kf, vf, out, lse, rb, scale))) break;
      if (done)
        ops::add_(dq, dq_c);
      else
        dkf.zero_(), dvf.zero_();
    }
    if (!done)
      ops::attention_backward(dq, dkf, dvf, dout, q, kf, vf, out, lse, mb.cu_seqlens, cu_k, mb.positions,
                              pos_k, scale);
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
  const int64_t c = cudnn_ring_chunk(mb, q);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t owner = (r - i + n) % n;
    if (c == 0 || !cudnn_ring_backward(dq, dkb, dvb, dout, q, kb, vb, out, lse,
                                       ring_block(mb.nseq, c, r, owner), scale)) {
      const std::vector<int32_t> p = cp_positions(mb.cu_seqlens, n, owner);
      Tensor pos_k = Tensor::from_vector(p, {static_cast<int64_t>(p.size())});
      ops::attention_backward(dq, dkb, dvb, dout, q, kb, vb, out, lse, mb.cu_seqlens, mb.cu_seqlens,
                              mb.positions, pos_k, scale);
    }
    if (i + 1 < n)
      ring_shift({&kb, &vb, &dkb, &dvb});
    else if (n > 1)
      ring_shift({&dkb, &dvb});  // the last hop brings every block's gradients home
  }
  ops::add_(dk, dkb);
  ops::add_(dv, dvb);
}

}  // namespace ndt
