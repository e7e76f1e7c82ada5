#include "generate/kv_cache.h"

#include <limits>

#include "core/check.h"
#include "ops/ops.h"

namespace ndt {

namespace {
// Position of a row no query may see (beyond any real position; sorted after them).
constexpr int32_t kUnseen = std::numeric_limits<int32_t>::max() / 2;
}  // namespace

KvCache::KvCache(int64_t layers, int64_t slots, int64_t max_len, int64_t kv_heads, int64_t head_dim, DType dt,
                 Device dev)
    : slots_(slots), max_len_(max_len), dev_(dev), len_(static_cast<size_t>(slots), 0) {
  NDT_CHECK(slots >= 1 && max_len >= 1 && max_len < kUnseen, "KV cache: bad size {} slots x {} rows", slots,
            max_len);
  // Zeroed: a masked row inside a partially visible key tile still enters P.V with weight 0, which must
  // not meet NaN garbage.
  for (int64_t l = 0; l < layers; ++l) {
    k_.push_back(Tensor::zeros({slots * max_len, kv_heads, head_dim}, dt, dev));
    v_.push_back(Tensor::zeros({slots * max_len, kv_heads, head_dim}, dt, dev));
  }
}

void KvCache::begin(const Microbatch& mb, const std::vector<int64_t>& slots) {
  NDT_CHECK(static_cast<int64_t>(slots.size()) == mb.nseq && mb.nseq >= 1,
            "KV cache: {} slots for a forward of {} sequences", slots.size(), mb.nseq);
  const int32_t* cu = mb.cu_seqlens.i32();
  const int32_t* pos = mb.positions.i32();
  decode_ = true;
  std::vector<int32_t> dst_rows;
  std::vector<int32_t> cu_k(static_cast<size_t>(mb.nseq + 1));
  for (int64_t s = 0; s < mb.nseq; ++s) {
    const int64_t b = slots[static_cast<size_t>(s)], n = cu[s + 1] - cu[s];
    NDT_CHECK(b >= 0 && b < slots_ && (s == 0 || b > slots[static_cast<size_t>(s - 1)]),
              "KV cache: slots must be increasing and in [0, {}), got {} at sequence {}", slots_, b, s);
    int64_t& len = len_[static_cast<size_t>(b)];
    NDT_CHECK(n >= 1 && len + n <= max_len_, "KV cache: slot {} holds {} of {} rows, {} more do not fit", b,
              len, max_len_, n);
    for (int64_t t = 0; t < n; ++t)
      NDT_CHECK(pos[cu[s] + t] == len + t, "KV cache: slot {} expects position {}, the forward has {}", b,
                len + t, pos[cu[s] + t]);
    for (int64_t t = 0; t < n; ++t) dst_rows.push_back(static_cast<int32_t>(b * max_len_ + len + t));
    decode_ = decode_ && n == 1;
    len += n;
    cu_k[static_cast<size_t>(s)] = static_cast<int32_t>(b * max_len_);
  }
  cu_k[static_cast<size_t>(mb.nseq)] = static_cast<int32_t>((slots.back() + 1) * max_len_);
  // Key positions of this forward: its slots' filled rows; everything else unseen.
  std::vector<int32_t> pos_k(static_cast<size_t>(slots_ * max_len_), kUnseen);
  for (int64_t b : slots)
    for (int64_t j = 0; j < len_[static_cast<size_t>(b)]; ++j)
      pos_k[static_cast<size_t>(b * max_len_ + j)] = static_cast<int32_t>(j);
  // Uploaded once per forward (the ops would otherwise upload host metadata once per layer). A decode
  // forward writes into buffers allocated once per cache, so its metadata keeps its device addresses from
  // step to step (what a CUDA graph of the decode step needs).
  slots_now_ = slots;
  if (decode_) {
    const int64_t n = mb.nseq;
    if (!dec_pos_k_.defined()) {
      dec_rows_ = Tensor::empty({slots_}, DType::I32, dev_);
      dec_cu_k_ = Tensor::empty({slots_ + 1}, DType::I32, dev_);
      dec_pos_q_ = Tensor::empty({slots_}, DType::I32, dev_);
      dec_pos_k_ = Tensor::empty({slots_ * max_len_}, DType::I32, dev_);
    }
    (dst_rows_ = dec_rows_.view_at(0, {n})).copy_from(Tensor::from_vector(dst_rows, {n}));
    (cu_k_ = dec_cu_k_.view_at(0, {n + 1})).copy_from(Tensor::from_vector(cu_k, {n + 1}));
    (pos_q_ = dec_pos_q_.view_at(0, {n})).copy_from(mb.positions);
    (pos_k_ = dec_pos_k_).copy_from(Tensor::from_vector(pos_k, {slots_ * max_len_}));
    cu_q_ = Tensor();
    return;
  }
  cu_k_ = Tensor::from_vector(cu_k, {mb.nseq + 1}).to(dev_);
  pos_k_ = Tensor::from_vector(pos_k, {slots_ * max_len_}).to(dev_);
  dst_rows_ = Tensor::from_vector(dst_rows, {mb.num_tokens()}).to(dev_);
  cu_q_ = mb.cu_seqlens.to(dev_);
  pos_q_ = mb.positions.to(dev_);
}

void KvCache::advance(Tensor& tokens, Tensor& positions, const Tensor& sampled) {
  NDT_CHECK(decode_ && tokens.numel() == static_cast<int64_t>(slots_now_.size()),
            "KV cache: advance() needs a decode forward of {} sequences, this one has {}", tokens.numel(),
            slots_now_.size());
  ops::decode_advance(tokens, positions, sampled, dst_rows_, pos_q_, pos_k_);
}

void KvCache::begin_ahead(const std::vector<int64_t>& slots) {
  NDT_CHECK(decode_ && slots == slots_now_,
            "KV cache: begin_ahead() continues the last decode forward's slots; begin() is needed here");
  for (int64_t b : slots) {
    int64_t& len = len_[static_cast<size_t>(b)];
    NDT_CHECK(len + 1 <= max_len_, "KV cache: slot {} holds {} of {} rows, 1 more does not fit", b, len,
              max_len_);
    ++len;
  }
}

bool KvCache::store_target(int64_t layer, Tensor& K, Tensor& V, Tensor& rows) {
  NDT_CHECK(dst_rows_.defined(), "KV cache: begin() was not called for this forward");
  K = k_.at(static_cast<size_t>(layer));
  V = v_.at(static_cast<size_t>(layer));
  rows = dst_rows_;
  return true;
}

void KvCache::attention_forward(int64_t layer, const Microbatch& mb, const Tensor& q, const Tensor& k,
                                const Tensor& v, Tensor& out, Tensor& lse, float scale) {
  Tensor& K = k_.at(static_cast<size_t>(layer));
  Tensor& V = v_.at(static_cast<size_t>(layer));
  NDT_CHECK(dst_rows_.defined() && dst_rows_.numel() == mb.num_tokens(),
            "KV cache: begin() was not called for this forward");
  if (k.defined()) {  // otherwise the model wrote them at store_target's rows
    NDT_CHECK(
        k.dtype() == K.dtype() && k.device() == K.device() && k.numel() / k.size(0) == K.numel() / K.size(0),
        "KV cache: layer {} keys {} {} do not match the cache", layer, shape_str(k.shape()),
        dtype_name(k.dtype()));
    ops::scatter_rows(K, dst_rows_, k);  // one launch per tensor, whatever the number of sequences
    ops::scatter_rows(V, dst_rows_, v);
  }
  if (decode_)  // one new row per sequence: the decode kernel reads each cached row once per kv head
    ops::attention_decode(out, lse, q, K, V, cu_k_, pos_q_, pos_k_, scale);
  else
    ops::attention_forward(out, lse, q, K, V, cu_q_, cu_k_, pos_q_, pos_k_, scale);
}

}  // namespace ndt
