#include "model/transformer.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "ops/cpu_ops.h"
#include "ops/ops.h"

namespace ndt {

Transformer::Transformer(const ModelConfig& cfg, StageSpec stage, TpHooks* tp, ParamStore* store)
    : cfg_(cfg), stage_(stage), tp_(tp ? tp : &default_tp_), ps_(store ? store : &own_params_) {
  ParamStore& params_ = *ps_;
  if (stage_.last_layer < 0) stage_.last_layer = cfg_.n_layers;
  const int64_t tps = tp_->size(), r = tp_->rank();
  const int64_t C = cfg_.d_model, D = cfg_.head_dim(), H = cfg_.n_heads, KV = cfg_.kv_heads(),
                F = cfg_.ffn_dim(), V = cfg_.vocab_size;
  NDT_CHECK(H % tps == 0 && KV % tps == 0 && F % tps == 0 && V % tps == 0,
            "tp={} must divide heads {}, kv heads {}, d_ff {}, vocab {}", tps, H, KV, F, V);
  heads_local_ = H / tps;
  kv_local_ = KV / tps;
  ffn_local_ = F / tps;
  vocab_local_ = V / tps;
  vocab_start_ = vocab_local_ * r;

  const bool gpt2 = cfg_.is_gpt2();
  const float std = static_cast<float>(cfg_.init_std);
  // Residual output projections are scaled down with depth (GPT-2).
  const float proj_std = std / std::sqrt(2.0f * static_cast<float>(cfg_.n_layers));
  auto norm = [&](const std::string& n) {
    params_.add(n + ".weight", {C}, InitKind::Ones, 0, false);
    if (gpt2) params_.add(n + ".bias", {C}, InitKind::Zeros, 0, false);
  };
  // Column-parallel: output features split (dim 0). Row-parallel: input features split (dim 1).
  auto col = [&](const std::string& n, int64_t out, float s, bool with_bias = true) {
    params_.add(n + ".weight", {out, C}, InitKind::Normal, s, true, 0, tps, r);
    if (gpt2 && with_bias) params_.add(n + ".bias", {out}, InitKind::Zeros, 0, false, 0, tps, r);
  };
  auto row = [&](const std::string& n, int64_t in, float s) {
    params_.add(n + ".weight", {C, in}, InitKind::Normal, s, true, 1, tps, r);
    if (gpt2) params_.add(n + ".bias", {C}, InitKind::Zeros, 0, false);
  };

  if (stage_.has_embedding || (stage_.has_head && cfg_.tied()))
    params_.add("embed.tokens.weight", {V, C}, InitKind::Normal, std, true, 0, tps, r);
  if (stage_.has_embedding && gpt2)
    params_.add("embed.positions.weight", {cfg_.max_seq_len, C}, InitKind::Normal, std, true);
  for (int64_t l = stage_.first_layer; l < stage_.last_layer; ++l) {
    const std::string pre = lp(l);
    norm(pre + "attn_norm");
    col(pre + "attn.wq", H * D, std);
    // No key bias: q.(k + b) shifts all of a query's scores by the same constant, which softmax
    // ignores, so its gradient is exactly zero and Adam would only amplify rounding noise into it.
    col(pre + "attn.wk", KV * D, std, /*with_bias=*/false);
    col(pre + "attn.wv", KV * D, std);
    row(pre + "attn.wo", H * D, proj_std);
    norm(pre + "mlp_norm");
    if (gpt2) {
      col(pre + "mlp.fc", F, std);
      row(pre + "mlp.proj", F, proj_std);
    } else {
      col(pre + "mlp.w1", F, std);
      col(pre + "mlp.w3", F, std);
      row(pre + "mlp.w2", F, proj_std);
    }
  }
  if (stage_.has_head) {
    norm("final_norm");
    if (!cfg_.tied()) params_.add("lm_head.weight", {V, C}, InitKind::Normal, std, true, 0, tps, r);
  }
}

const Tensor* Transformer::bias(const std::string& name) {
  Param* b = ps_->find(name);
  return b ? &b->value : nullptr;
}

void Transformer::norm_forward(const std::string& prefix, const Tensor& x, Tensor& out, Tensor& mean,
                               Tensor& rstd) {
  const int64_t rows = x.size(0);
  out = Tensor::empty(x.shape());
  rstd = Tensor::empty({rows});
  const float eps = static_cast<float>(cfg_.norm_eps);
  if (cfg_.is_gpt2()) {
    mean = Tensor::empty({rows});
    ops::layernorm_forward(out, mean, rstd, x, p(prefix + ".weight").value, p(prefix + ".bias").value, eps);
  } else {
    ops::rmsnorm_forward(out, rstd, x, p(prefix + ".weight").value, eps);
  }
}

void Transformer::norm_backward(const std::string& prefix, Tensor& dx, const Tensor& dout, const Tensor& x,
                                const Tensor& mean, const Tensor& rstd) {
  Param& w = p(prefix + ".weight");
  if (cfg_.is_gpt2()) {
    ops::layernorm_backward(dx, w.grad, p(prefix + ".bias").grad, dout, x, w.value, mean, rstd);
  } else {
    ops::rmsnorm_backward(dx, w.grad, dout, x, w.value, rstd);
  }
}

Tensor Transformer::layer_forward(int64_t l, const Microbatch& mb, const Tensor& x, LayerActs& a) {
  const std::string pre = lp(l);
  const int64_t D = cfg_.head_dim(), C = cfg_.d_model;
  const float theta = static_cast<float>(cfg_.rope_theta);
  a.x_in = x;
  norm_forward(pre + "attn_norm", x, a.n1, a.n1_mean, a.n1_rstd);
  a.a_in = tp_->enter_forward(a.n1);
  const int64_t T = a.a_in.size(0);
  a.q = Tensor::empty({T, heads_local_, D});
  a.k = Tensor::empty({T, kv_local_, D});
  a.v = Tensor::empty({T, kv_local_, D});
  ops::linear_forward(a.q, a.a_in, p(pre + "attn.wq.weight").value, bias(pre + "attn.wq.bias"));
  ops::linear_forward(a.k, a.a_in, p(pre + "attn.wk.weight").value, bias(pre + "attn.wk.bias"));
  ops::linear_forward(a.v, a.a_in, p(pre + "attn.wv.weight").value, bias(pre + "attn.wv.bias"));
  if (!cfg_.is_gpt2()) {
    ops::rope_forward(a.q, mb.positions, theta);
    ops::rope_forward(a.k, mb.positions, theta);
  }
  a.att = Tensor::empty({T, heads_local_, D});
  a.lse = Tensor::empty({T, heads_local_});
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  if (cp_)
    cp_->attention_forward(mb, a.q, a.k, a.v, a.att, a.lse, scale);
  else
    ops::attention_forward(a.att, a.lse, a.q, a.k, a.v, mb.cu_seqlens, scale);
  Tensor o_partial = Tensor::empty({T, C});
  ops::linear_forward(o_partial, a.att.view({T, heads_local_ * D}), p(pre + "attn.wo.weight").value, nullptr);
  Tensor o = tp_->exit_forward(o_partial);
  if (const Tensor* b = bias(pre + "attn.wo.bias")) ops::add_bias(o, *b);
  a.h = x.clone();
  ops::add_(a.h, o);

  norm_forward(pre + "mlp_norm", a.h, a.n2, a.n2_mean, a.n2_rstd);
  a.m_in = tp_->enter_forward(a.n2);
  a.fc1 = Tensor::empty({T, ffn_local_});
  a.act = Tensor::empty({T, ffn_local_});
  Tensor m_partial = Tensor::empty({T, C});
  if (cfg_.is_gpt2()) {
    ops::linear_forward(a.fc1, a.m_in, p(pre + "mlp.fc.weight").value, bias(pre + "mlp.fc.bias"));
    ops::gelu_forward(a.act, a.fc1);
    ops::linear_forward(m_partial, a.act, p(pre + "mlp.proj.weight").value, nullptr);
  } else {
    a.fc3 = Tensor::empty({T, ffn_local_});
    ops::linear_forward(a.fc1, a.m_in, p(pre + "mlp.w1.weight").value, nullptr);
    ops::linear_forward(a.fc3, a.m_in, p(pre + "mlp.w3.weight").value, nullptr);
    ops::swiglu_forward(a.act, a.fc1, a.fc3);
    ops::linear_forward(m_partial, a.act, p(pre + "mlp.w2.weight").value, nullptr);
  }
  Tensor m = tp_->exit_forward(m_partial);
  if (const Tensor* b = bias(pre + "mlp.proj.bias")) ops::add_bias(m, *b);
  Tensor out = a.h.clone();
  ops::add_(out, m);
  return out;
}

Tensor Transformer::layer_backward(int64_t l, const Microbatch& mb, const Tensor& dout, LayerActs& a) {
  const std::string pre = lp(l);
  const int64_t D = cfg_.head_dim(), C = cfg_.d_model, T = a.a_in.size(0);
  const float theta = static_cast<float>(cfg_.rope_theta);
  // MLP branch: out = h + exit(act @ W2^T) (+ bias).
  Tensor dh = dout.clone();
  if (Param* b = ps_->find(pre + "mlp.proj.bias")) ops::bias_backward(b->grad, dout);
  Tensor dm = tp_->exit_backward(dout);  // (T, C)
  Tensor dact = Tensor::zeros({T, ffn_local_});
  Tensor dm_in = Tensor::zeros({T, C});
  Tensor dfc1 = Tensor::zeros({T, ffn_local_});
  if (cfg_.is_gpt2()) {
    Param& w2 = p(pre + "mlp.proj.weight");
    ops::linear_backward(&dact, w2.grad, nullptr, dm, a.act, w2.value);
    ops::gelu_backward(dfc1, dact, a.fc1);
    Param& w1 = p(pre + "mlp.fc.weight");
    ops::linear_backward(&dm_in, w1.grad, &p(pre + "mlp.fc.bias").grad, dfc1, a.m_in, w1.value);
  } else {
    Param& w2 = p(pre + "mlp.w2.weight");
    ops::linear_backward(&dact, w2.grad, nullptr, dm, a.act, w2.value);
    Tensor dfc3 = Tensor::zeros({T, ffn_local_});
    ops::swiglu_backward(dfc1, dfc3, dact, a.fc1, a.fc3);
    Param& w1 = p(pre + "mlp.w1.weight");
    Param& w3 = p(pre + "mlp.w3.weight");
    ops::linear_backward(&dm_in, w1.grad, nullptr, dfc1, a.m_in, w1.value);
    ops::linear_backward(&dm_in, w3.grad, nullptr, dfc3, a.m_in, w3.value);
  }
  Tensor dn2 = tp_->enter_backward(dm_in);
  norm_backward(pre + "mlp_norm", dh, dn2, a.h, a.n2_mean, a.n2_rstd);

  // Attention branch: h = x + exit(att @ Wo^T) (+ bias).
  Tensor dx = dh.clone();
  if (Param* b = ps_->find(pre + "attn.wo.bias")) ops::bias_backward(b->grad, dh);
  Tensor do_full = tp_->exit_backward(dh);
  Tensor datt = Tensor::zeros({T, heads_local_, D});
  Param& wo = p(pre + "attn.wo.weight");
  Tensor datt2d = datt.view({T, heads_local_ * D});
  ops::linear_backward(&datt2d, wo.grad, nullptr, do_full, a.att.view({T, heads_local_ * D}), wo.value);
  Tensor dq = Tensor::zeros(a.q.shape()), dk = Tensor::zeros(a.k.shape()), dv = Tensor::zeros(a.v.shape());
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  if (cp_)
    cp_->attention_backward(mb, datt, a.q, a.k, a.v, a.att, a.lse, dq, dk, dv, scale);
  else
    ops::attention_backward(dq, dk, dv, datt, a.q, a.k, a.v, a.att, a.lse, mb.cu_seqlens, scale);
  if (!cfg_.is_gpt2()) {
    ops::rope_backward(dq, mb.positions, theta);
    ops::rope_backward(dk, mb.positions, theta);
  }
  Tensor da_in = Tensor::zeros({T, C});
  for (auto [name, d] :
       {std::pair<const char*, Tensor*>{"attn.wq", &dq}, {"attn.wk", &dk}, {"attn.wv", &dv}}) {
    Param& w = p(pre + name + ".weight");
    Param* b = ps_->find(pre + name + ".bias");
    ops::linear_backward(&da_in, w.grad, b ? &b->grad : nullptr, *d, a.a_in, w.value);
  }
  Tensor dn1 = tp_->enter_backward(da_in);
  norm_backward(pre + "attn_norm", dx, dn1, a.x_in, a.n1_mean, a.n1_rstd);
  return dx;
}

Tensor Transformer::forward(const Microbatch& mb, const Tensor& x_in, Activations& acts) {
  const int64_t T = mb.num_tokens(), C = cfg_.d_model;
  auto [tok0, Tl] = tp_->local_tokens(T);
  NDT_CHECK(!tp_->sequence_parallel() || T % tp_->size() == 0,
            "sequence parallel needs the token count {} to be divisible by tp={}", T, tp_->size());
  NDT_CHECK(mb.max_seqlen <= cfg_.max_seq_len, "sequence of {} tokens exceeds model.max_seq_len={}",
            mb.max_seqlen, cfg_.max_seq_len);
  Tensor x;
  if (stage_.has_embedding) {
    Tensor partial = Tensor::empty({T, C});
    ops::embedding_forward(partial, mb.tokens, p("embed.tokens.weight").value, vocab_start_);
    x = tp_->exit_forward(partial);
    if (cfg_.is_gpt2()) {
      Tensor pos = ops::slice_rows(mb.positions, tok0, Tl);
      ops::add_position_embedding_forward(x, pos, p("embed.positions.weight").value);
    }
  } else {
    NDT_CHECK(x_in.defined() && x_in.size(0) == Tl && x_in.size(1) == C,
              "stage input must be ({}, {}), got {}", Tl, C,
              x_in.defined() ? shape_str(x_in.shape()) : "undefined");
    x = x_in;
  }
  acts.layers.resize(static_cast<size_t>(stage_.last_layer - stage_.first_layer));
  for (int64_t l = stage_.first_layer; l < stage_.last_layer; ++l)
    x = layer_forward(l, mb, x, acts.layers[static_cast<size_t>(l - stage_.first_layer)]);
  if (!stage_.has_head) return x;

  acts.x_final = x;
  norm_forward("final_norm", x, acts.fn, acts.fn_mean, acts.fn_rstd);
  acts.head_in = tp_->enter_forward(acts.fn);
  const Tensor& w = cfg_.tied() ? p("embed.tokens.weight").value : p("lm_head.weight").value;
  acts.logits = Tensor::empty({T, vocab_local_});
  ops::linear_forward(acts.logits, acts.head_in, w, nullptr);
  // Vocab-parallel softmax: the full logits never exist on one rank; three reductions over TP.
  acts.rowmax = Tensor::empty({T});
  acts.sumexp = Tensor::empty({T});
  Tensor target_logit = Tensor::empty({T});
  acts.logprob = Tensor::empty({T});
  cpu::xent_rowmax(acts.rowmax.f32(), acts.logits.f32(), T, vocab_local_);
  tp_->all_reduce_max(acts.rowmax.f32(), T);
  cpu::xent_sumexp(acts.sumexp.f32(), acts.logits.f32(), acts.rowmax.f32(), T, vocab_local_);
  tp_->all_reduce_sum(acts.sumexp.f32(), T);
  cpu::xent_target_logit(target_logit.f32(), acts.logits.f32(), mb.targets.i32(), T, vocab_local_,
                         vocab_start_);
  tp_->all_reduce_sum(target_logit.f32(), T);
  cpu::xent_logprob(acts.logprob.f32(), target_logit.f32(), acts.rowmax.f32(), acts.sumexp.f32(), T);
  return x;
}

double Transformer::loss_sum(const Microbatch& mb, const Activations& acts) const {
  const float* lp = acts.logprob.f32();
  const float* mask = mb.loss_mask.f32();
  double s = 0;
  for (int64_t t = 0; t < mb.num_tokens(); ++t)
    if (mask[t] != 0.0f) s -= static_cast<double>(lp[t]) * mask[t];
  return s;
}

Tensor Transformer::backward(const Microbatch& mb, const Tensor& dy, float loss_scale, Activations& acts) {
  const int64_t T = mb.num_tokens(), C = cfg_.d_model;
  auto [tok0, Tl] = tp_->local_tokens(T);
  Tensor dx;
  if (stage_.has_head) {
    Tensor dloss = Tensor::empty({T});
    const float* mask = mb.loss_mask.f32();
    for (int64_t t = 0; t < T; ++t) dloss.f32()[t] = loss_scale * mask[t];
    Tensor dlogits = Tensor::zeros({T, vocab_local_});
    cpu::xent_backward(dlogits.f32(), acts.logits.f32(), acts.rowmax.f32(), acts.sumexp.f32(),
                       mb.targets.i32(), dloss.f32(), T, vocab_local_, vocab_start_);
    Param& w = cfg_.tied() ? p("embed.tokens.weight") : p("lm_head.weight");
    Tensor dhead_in = Tensor::zeros({T, C});
    ops::linear_backward(&dhead_in, w.grad, nullptr, dlogits, acts.head_in, w.value);
    Tensor dfn = tp_->enter_backward(dhead_in);
    dx = Tensor::zeros({Tl, C});
    norm_backward("final_norm", dx, dfn, acts.x_final, acts.fn_mean, acts.fn_rstd);
  } else {
    NDT_CHECK(dy.defined() && dy.size(0) == Tl, "stage output gradient must have {} rows", Tl);
    dx = dy;
  }
  for (int64_t l = stage_.last_layer - 1; l >= stage_.first_layer; --l)
    dx = layer_backward(l, mb, dx, acts.layers[static_cast<size_t>(l - stage_.first_layer)]);
  if (!stage_.has_embedding) return dx;
  if (cfg_.is_gpt2()) {
    Tensor pos = ops::slice_rows(mb.positions, tok0, Tl);
    ops::add_position_embedding_backward(p("embed.positions.weight").grad, dx, pos);
  }
  Tensor dfull = tp_->exit_backward(dx);
  ops::embedding_backward(p("embed.tokens.weight").grad, dfull, mb.tokens, vocab_start_);
  return Tensor();
}

std::vector<int32_t> Transformer::argmax_rows(const Activations& acts,
                                              const std::vector<int64_t>& rows) const {
  const int64_t n = static_cast<int64_t>(rows.size());
  std::vector<float> best(static_cast<size_t>(n)), neg_idx(static_cast<size_t>(n));
  const float* lg = acts.logits.f32();
  for (int64_t i = 0; i < n; ++i) {
    const float* row = lg + rows[static_cast<size_t>(i)] * vocab_local_;
    int64_t arg = 0;
    for (int64_t j = 1; j < vocab_local_; ++j)
      if (row[j] > row[arg]) arg = j;
    best[static_cast<size_t>(i)] = row[arg];
    neg_idx[static_cast<size_t>(i)] = -static_cast<float>(arg + vocab_start_);
  }
  // Global argmax over vocab shards: max value, then the smallest index holding it (ids < 2^24 are exact).
  std::vector<float> gbest = best;
  tp_->all_reduce_max(gbest.data(), n);
  for (int64_t i = 0; i < n; ++i)
    if (best[static_cast<size_t>(i)] < gbest[static_cast<size_t>(i)])
      neg_idx[static_cast<size_t>(i)] = -std::numeric_limits<float>::max();
  tp_->all_reduce_max(neg_idx.data(), n);
  std::vector<int32_t> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    out[static_cast<size_t>(i)] = static_cast<int32_t>(-neg_idx[static_cast<size_t>(i)]);
  return out;
}

void Transformer::topk_rows(const Activations& acts, int64_t k, std::vector<float>& values,
                            std::vector<int32_t>& ids) const {
  NDT_CHECK(k >= 1 && k <= cfg_.vocab_size, "top-k: k = {} must be in [1, vocab {}]", k, cfg_.vocab_size);
  const int64_t T = acts.logits.size(0), kl = std::min(k, vocab_local_), tps = tp_->size();
  // Every TP rank proposes its shard's top kl per row into its own slot; a sum over TP gathers them.
  std::vector<float> cand_v(static_cast<size_t>(tps * T * kl), 0.0f), cand_i(cand_v.size(), 0.0f);
  const float* lg = acts.logits.f32();
  std::vector<int64_t> idx(static_cast<size_t>(vocab_local_));
  for (int64_t t = 0; t < T; ++t) {
    const float* row = lg + t * vocab_local_;
    for (int64_t j = 0; j < vocab_local_; ++j) idx[static_cast<size_t>(j)] = j;
    std::partial_sort(idx.begin(), idx.begin() + kl, idx.end(), [&](int64_t a, int64_t b) {
      return row[a] > row[b] || (row[a] == row[b] && a < b);
    });
    const size_t base = static_cast<size_t>((tp_->rank() * T + t) * kl);
    for (int64_t j = 0; j < kl; ++j) {
      cand_v[base + static_cast<size_t>(j)] = row[idx[static_cast<size_t>(j)]];
      cand_i[base + static_cast<size_t>(j)] = static_cast<float>(idx[static_cast<size_t>(j)] + vocab_start_);
    }
  }
  tp_->all_reduce_sum(cand_v.data(), static_cast<int64_t>(cand_v.size()));
  tp_->all_reduce_sum(cand_i.data(), static_cast<int64_t>(cand_i.size()));
  values.assign(static_cast<size_t>(T * k), 0.0f);
  ids.assign(static_cast<size_t>(T * k), 0);
  std::vector<std::pair<float, int32_t>> c(static_cast<size_t>(tps * kl));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t r = 0; r < tps; ++r)
      for (int64_t j = 0; j < kl; ++j) {
        const size_t src = static_cast<size_t>((r * T + t) * kl + j);
        c[static_cast<size_t>(r * kl + j)] = {cand_v[src], static_cast<int32_t>(cand_i[src])};
      }
    std::sort(c.begin(), c.end(), [](const auto& a, const auto& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    });
    for (int64_t j = 0; j < k; ++j) {
      values[static_cast<size_t>(t * k + j)] = c[static_cast<size_t>(j)].first;
      ids[static_cast<size_t>(t * k + j)] = c[static_cast<size_t>(j)].second;
    }
  }
}

}  // namespace ndt
