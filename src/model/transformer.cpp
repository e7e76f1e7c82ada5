#include "model/transformer.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/phase_mark.h"
#include "ops/cpu_ops.h"
#include "ops/ops.h"

namespace ndt {

Transformer::Transformer(const ModelConfig& cfg, StageSpec stage, TpHooks* tp, ParamStore* store, EpHooks* ep)
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
  // q, k and v: the three weights back to back, then their biases (a fused matmul takes the weights as
  // one matrix, Transformer::fused_weight / fused_grad). GPT-2 has no key bias: q.(k + b) shifts all of a
  // query's scores by the same constant, which softmax ignores, so its gradient is exactly zero and Adam
  // would only amplify rounding noise into it. Llama with model.qkv_bias (Qwen2) keeps all three: RoPE
  // rotates the key bias by the key's position, so q . R_j b_k is no longer the same for every key.
  auto qkv = [&](const std::string& pre) {
    const std::pair<const char*, int64_t> parts[] = {
        {"attn.wq", H * D}, {"attn.wk", KV * D}, {"attn.wv", KV * D}};
    for (auto [n, out] : parts)
      params_.add(pre + n + ".weight", {out, C}, InitKind::Normal, std, true, 0, tps, r);
    for (auto [n, out] : parts)
      if ((gpt2 && std::string(n) != "attn.wk") || (!gpt2 && cfg_.qkv_bias))
        params_.add(pre + n + ".bias", {out}, InitKind::Zeros, 0, false, 0, tps, r);
  };
  auto row = [&](const std::string& n, int64_t in, float s) {
    params_.add(n + ".weight", {C, in}, InitKind::Normal, s, true, 1, tps, r);
    if (gpt2) params_.add(n + ".bias", {C}, InitKind::Zeros, 0, false);
  };
  auto mlp = [&](const std::string& prefix, int64_t width) {
    if (gpt2) {
      col(prefix + "fc", width, std);
      row(prefix + "proj", width, proj_std);
    } else {
      col(prefix + "w1", width, std);
      col(prefix + "w3", width, std);
      row(prefix + "w2", width, proj_std);
    }
  };

  if (stage_.has_embedding || (stage_.has_head && cfg_.tied()))
    params_.add("embed.tokens.weight", {V, C}, InitKind::Normal, std, true, 0, tps, r);
  if (stage_.has_embedding && gpt2)
    params_.add("embed.positions.weight", {cfg_.max_seq_len, C}, InitKind::Normal, std, true);
  for (int64_t l = stage_.first_layer; l < stage_.last_layer; ++l) {
    const std::string pre = lp(l);
    norm(pre + "attn_norm");
    qkv(pre);
    row(pre + "attn.wo", H * D, proj_std);
    if (!gpt2 && cfg_.qk_norm) {
      // Qwen3: one (D) weight per projection shared by all heads, replicated over TP; each TP rank's
      // gradient covers its own heads only, so it is a partial sum over TP (the optimizer reduces it).
      for (const char* n : {"attn.q_norm.weight", "attn.k_norm.weight"})
        params_.add(pre + n, {D}, InitKind::Ones, 0, false).tp_partial_grad = true;
    }
    norm(pre + "mlp_norm");
    if (!cfg_.is_moe_layer(l)) {
      mlp(pre + "mlp.", F);
      continue;
    }
    moe_[l] = std::make_unique<MoeLayer>(cfg_, pre + "mlp.", params_, ep);
    // Per-sequence statistics are summed over the ranks holding one sequence's tokens: CP, and TP under SP.
    moe_[l]->set_seq_reduce([this](float* buf, int64_t n) {
      if (!cp_ && !tp_->sequence_parallel()) return;
      // The hooks reduce buffers on the model's device: on a GPU the host counts travel there and back.
      Tensor t;
      float* b = buf;
      if (ps_->device() != Device::CPU) {
        t = Tensor::from_vector(std::vector<float>(buf, buf + n), {n}).to(ps_->device());
        b = t.f32();
      }
      if (cp_) cp_->all_reduce_sum(b, n);
      if (tp_->sequence_parallel()) tp_->all_reduce_sum(b, n);
      if (t.defined()) {
        const std::vector<float> r = t.to_vector<float>();
        std::copy(r.begin(), r.end(), buf);
      }
    });
    if (const int64_t Fs = cfg_.moe.shared_experts * cfg_.expert_ffn_dim(); Fs > 0) {
      NDT_CHECK(Fs % tps == 0, "tp={} must divide the shared experts' width {}", tps, Fs);
      shared_local_ = Fs / tps;
      mlp(pre + "mlp.shared.", Fs);
    }
  }
  if (stage_.has_head) {
    norm("final_norm");
    if (!cfg_.tied()) params_.add("lm_head.weight", {V, C}, InitKind::Normal, std, true, 0, tps, r);
  }
}

void Transformer::set_moe_context(MoeStepContext* ctx) {
  moe_ctx_ = ctx;
  for (auto& [l, m] : moe_) m->set_context(ctx);
}

const Tensor* Transformer::bias(const std::string& name) {
  Param* b = ps_->find(name);
  return b ? &b->compute_value() : nullptr;
}

void Transformer::norm_forward(const std::string& prefix, const Tensor& x, Tensor& out, Tensor& mean,
                               Tensor& rstd) {
  const int64_t rows = x.size(0);
  out = act(x.shape());
  rstd = stat({rows});
  const float eps = static_cast<float>(cfg_.norm_eps);
  if (cfg_.is_gpt2()) {
    mean = stat({rows});
    ops::layernorm_forward(out, mean, rstd, x, p(prefix + ".weight").compute_value(),
                           p(prefix + ".bias").compute_value(), eps);
  } else {
    ops::rmsnorm_forward(out, rstd, x, p(prefix + ".weight").compute_value(), eps);
  }
}

void Transformer::add_norm_forward(const std::string& prefix, const Tensor& a, const Tensor& b,
                                   const Tensor* rbias, Tensor& h, Tensor& out, Tensor& mean, Tensor& rstd) {
  const int64_t rows = a.size(0);
  out = act(a.shape());
  rstd = stat({rows});
  const float eps = static_cast<float>(cfg_.norm_eps);
  if (cfg_.is_gpt2()) {
    mean = stat({rows});
    ops::add_layernorm_forward(h, out, mean, rstd, a, b, rbias, p(prefix + ".weight").compute_value(),
                               p(prefix + ".bias").compute_value(), eps);
  } else {
    ops::add_rmsnorm_forward(h, out, rstd, a, b, rbias, p(prefix + ".weight").compute_value(), eps);
  }
}

void Transformer::head_norm_forward(const std::string& prefix, const Tensor& raw, Tensor& out, Tensor& rstd) {
  const int64_t rows = raw.size(0) * raw.size(1), D = raw.size(2);
  out = act(raw.shape());
  rstd = stat({rows});
  Tensor out2d = out.view({rows, D});
  ops::rmsnorm_forward(out2d, rstd, raw.view({rows, D}), p(prefix + ".weight").compute_value(),
                       static_cast<float>(cfg_.norm_eps));
}

void Transformer::qkv_bias_grads(const std::string& pre, const Tensor& dqkv) {
  // One column-sum pass over [dq | dk | dv]; each bias takes its block (GPT-2 has no key bias).
  const int64_t hq = heads_local_ * cfg_.head_dim(), hk = kv_local_ * cfg_.head_dim();
  Tensor sums = Tensor::zeros({dqkv.size(1)}, DType::F32, dqkv.device());
  ops::bias_backward(sums, dqkv);
  const std::tuple<const char*, int64_t, int64_t> blocks[] = {
      {"attn.wq", 0, hq}, {"attn.wk", hq, hk}, {"attn.wv", hq + hk, hk}};
  for (auto [name, first, n] : blocks)
    if (Param* b = ps_->find(pre + name + ".bias")) ops::add_(b->grad, sums.view_at(first, {n}));
}

Tensor Transformer::head_norm_backward(const std::string& prefix, const Tensor& dout, const Tensor& raw,
                                       const Tensor& rstd) {
  const int64_t rows = raw.size(0) * raw.size(1), D = raw.size(2);
  Param& w = p(prefix + ".weight");
  Tensor dx = act_zeros(raw.shape());  // rmsnorm_backward adds into it
  Tensor dx2d = dx.view({rows, D});
  ops::rmsnorm_backward(dx2d, w.grad, dout.view({rows, D}), raw.view({rows, D}), w.compute_value(), rstd);
  return dx;
}

void Transformer::norm_backward(const std::string& prefix, Tensor& dx, const Tensor& dout, const Tensor& x,
                                const Tensor& mean, const Tensor& rstd, const Tensor* dres, Param* dx_bias) {
  Param& w = p(prefix + ".weight");
  Tensor* colsum = dx_bias ? &dx_bias->grad : nullptr;
  if (cfg_.is_gpt2()) {
    ops::layernorm_backward(dx, w.grad, p(prefix + ".bias").grad, dout, x, w.compute_value(), mean, rstd,
                            dres, colsum);
  } else {
    ops::rmsnorm_backward(dx, w.grad, dout, x, w.compute_value(), rstd, dres, colsum);
  }
}

Param* Transformer::folded_mlp_bias(int64_t l) {
  if (l < stage_.first_layer || l >= stage_.last_layer || moe_.count(l)) return nullptr;
  if (l + 1 == stage_.last_layer && !stage_.has_head) return nullptr;  // from the next stage
  return ps_->find(lp(l) + "mlp.proj.bias");
}

namespace {
// The tensors of(p) of parameters `pre + names`, each a view into `flat`, as one view of it when they lie
// back to back with the same rank (1 or 2) and width: (rows, cols) or (rows); undefined otherwise.
// Contiguity from the views' addresses: no search of the store's offsets on this per-step path.
template <typename Of>
Tensor fused_view(ParamStore& ps, const Tensor& flat, const std::string& pre,
                  std::initializer_list<const char*> names, Of of) {
  if (!flat.defined()) return Tensor();
  const auto* base = static_cast<const char*>(flat.data_ptr());
  const char* next = nullptr;
  int64_t rows = 0, cols = 1, dim = 0;
  for (const char* n : names) {
    const Param* w = ps.find(pre + n);
    if (!w || w->value.dim() < 1 || w->value.dim() > 2) return Tensor();
    const Tensor& t = of(*w);
    const auto* at = static_cast<const char*>(t.data_ptr());
    const int64_t c = t.dim() == 2 ? t.size(1) : 1;
    if (!next) next = at, cols = c, dim = t.dim();
    if (at != next || c != cols || t.dim() != dim) return Tensor();
    next = at + t.nbytes();
    rows += t.size(0);
  }
  const int64_t first = (next - base) / static_cast<int64_t>(dtype_size(flat.dtype())) - rows * cols;
  return dim == 1 ? flat.view_at(first, {rows}) : flat.view_at(first, {rows, cols});
}
}  // namespace

Tensor Transformer::fused_weight(const std::string& pre, std::initializer_list<const char*> names) {
  const Tensor& flat = ps_->compute_dtype() == DType::F32 ? ps_->flat_values() : ps_->flat_compute();
  return fused_view(*ps_, flat, pre, names,
                    [](const Param& w) -> const Tensor& { return w.compute_value(); });
}

Tensor Transformer::fused_grad(const std::string& pre, std::initializer_list<const char*> names) {
  return fused_view(*ps_, ps_->flat_grads(), pre, names,
                    [](const Param& w) -> const Tensor& { return w.grad; });
}

Tensor Transformer::layer_forward(int64_t l, const Microbatch& mb, const Tensor& x, LayerActs& a) {
  const std::string pre = lp(l);
  const int64_t D = cfg_.head_dim(), C = cfg_.d_model;
  const float theta = static_cast<float>(cfg_.rope_theta);
  a.x_in = x;
  norm_forward(pre + "attn_norm", x, a.n1, a.n1_mean, a.n1_rstd);
  const int64_t T = tp_->gathered_rows(a.n1.size(0));
  a.q = act({T, heads_local_, D});
  // On the GPU (training and decode steps), RoPE models without q/k norms or q/k/v biases: one matmul for
  // q, k and v, then one kernel that splits and rotates (the narrow k and v matmuls alone use the GPU
  // poorly, in decode steps most of all).
  const bool fuse_qkv = (kv_ || x.device() == Device::CUDA) && !cfg_.is_gpt2() && !cfg_.qk_norm &&
                        !ps_->find(pre + "attn.wq.bias");
  const Tensor wqkv =
      fuse_qkv ? fused_weight(pre, {"attn.wq.weight", "attn.wk.weight", "attn.wv.weight"}) : Tensor();
  // With a cache that takes them, k and v go straight into it (a.k, a.v stay empty).
  Tensor kc, vc, cache_rows;
  const bool store = wqkv.defined() && kv_ && kv_->store_target(l, kc, vc, cache_rows);
  a.k = store ? Tensor() : act({T, kv_local_, D});
  a.v = store ? Tensor() : act({T, kv_local_, D});
  Tensor qkv = wqkv.defined() ? act({T, (heads_local_ + 2 * kv_local_) * D}) : Tensor();
  // The q/k/v matmuls per block of gathered rows (beside the gather of the next block, under SP).
  a.a_in = tp_->gather_overlapped(a.n1, [&](const Tensor& in, int64_t t0, int64_t n) {
    const Tensor x_rows = in.rows(t0, n);
    if (qkv.defined()) {
      Tensor out = qkv.rows(t0, n);
      ops::linear_forward(out, x_rows, wqkv, nullptr);
      return;
    }
    for (auto [name, t] :
         {std::pair<const char*, Tensor*>{"attn.wq", &a.q}, {"attn.wk", &a.k}, {"attn.wv", &a.v}}) {
      Tensor out = t->rows(t0, n);
      ops::linear_forward(out, x_rows, p(pre + name + ".weight").compute_value(), bias(pre + name + ".bias"));
    }
  });
  if (qkv.defined()) {
    if (store)
      ops::qkv_split_rope(a.q, kc, vc, qkv, mb.positions, theta, &cache_rows);
    else
      ops::qkv_split_rope(a.q, a.k, a.v, qkv, mb.positions, theta);
  } else {
    if (!cfg_.is_gpt2() && cfg_.qk_norm) {  // Qwen3: per-head RMSNorm of q and k, before RoPE
      a.q_raw = a.q;
      a.k_raw = a.k;
      head_norm_forward(pre + "attn.q_norm", a.q_raw, a.q, a.q_rstd);
      head_norm_forward(pre + "attn.k_norm", a.k_raw, a.k, a.k_rstd);
    }
    if (!cfg_.is_gpt2()) {
      ops::rope_forward(a.q, mb.positions, theta);
      ops::rope_forward(a.k, mb.positions, theta);
    }
  }
  a.att = act({T, heads_local_, D});
  a.lse = stat({T, heads_local_});
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  phase_mark(a.q.device(), "attention core");
  if (kv_)
    kv_->attention_forward(l, mb, a.q, a.k, a.v, a.att, a.lse, scale);
  else if (cp_)
    cp_->attention_forward(mb, a.q, a.k, a.v, a.att, a.lse, scale);
  else if (!cfg_.causal)
    ops::attention_forward(a.att, a.lse, a.q, a.k, a.v, mb.cu_seqlens, mb.cu_seqlens, zero_positions(T),
                           zero_positions(T), scale);
  else
    ops::attention_forward(a.att, a.lse, a.q, a.k, a.v, mb.cu_seqlens, scale);
  phase_mark(a.q.device(), "other");
  Tensor o_partial = act({T, C});
  const Tensor att2d = a.att.view({T, heads_local_ * D});
  const Tensor& wo = p(pre + "attn.wo.weight").compute_value();
  Tensor o = tp_->reduce_overlapped(
      o_partial,
      [&](int64_t t0, int64_t n, Tensor& out) { ops::linear_forward(out, att2d.rows(t0, n), wo, nullptr); },
      {});
  // The residual add (with the bias after the TP reduction) and the MLP norm in one pass.
  add_norm_forward(pre + "mlp_norm", x, o, bias(pre + "attn.wo.bias"), a.h, a.n2, a.n2_mean, a.n2_rstd);
  auto it = moe_.find(l);
  if (it == moe_.end()) {
    // One TP rank: the residual add (and the down projection's bias) inside that matmul.
    if (tp_->size() == 1) return mlp_forward(pre + "mlp.", ffn_local_, a, &a.h);
    return ops::add(a.h, mlp_forward(pre + "mlp.", ffn_local_, a), bias(pre + "mlp.proj.bias"));
  }
  // MoE: routed experts on this rank's residual rows (experts are not split over TP), plus shared experts
  // as a TP-parallel dense MLP.
  Tensor routed = it->second->forward(mb, tp_->local_tokens(mb.num_tokens()).first, a.n2, a.moe);
  if (shared_local_ == 0) return ops::add(a.h, routed);
  Tensor shared = mlp_forward(pre + "mlp.shared.", shared_local_, a);
  return ops::add(a.h, ops::add(routed, shared, bias(pre + "mlp.shared.proj.bias")));
}

Tensor Transformer::mlp_forward(const std::string& prefix, int64_t fl, LayerActs& a, Tensor* residual) {
  const int64_t T = tp_->gathered_rows(a.n2.size(0)), C = cfg_.d_model;
  const bool gpt2 = cfg_.is_gpt2();
  // Decode steps: gate and up in one matmul (their rows are kept by nobody).
  const Tensor w13 = !gpt2 && kv_ ? fused_weight(prefix, {"w1.weight", "w3.weight"}) : Tensor();
  Tensor h13 = w13.defined() ? act({T, 2 * fl}) : Tensor();
  a.fc1 = w13.defined() ? Tensor() : act({T, fl});
  a.fc3 = gpt2 || w13.defined() ? Tensor() : act({T, fl});
  a.act = act({T, fl});
  // The up projections and the activation per block of gathered rows (beside the gather, under SP).
  a.m_in = tp_->gather_overlapped(a.n2, [&](const Tensor& in, int64_t t0, int64_t n) {
    const Tensor x_rows = in.rows(t0, n);
    Tensor act_rows = a.act.rows(t0, n);
    if (gpt2) {
      // fc1 = m_in @ W1^T + b1 (kept for backward), act = gelu(fc1): one matmul on CUDA bf16
      Tensor pre = a.fc1.rows(t0, n);
      ops::linear_gelu_forward(act_rows, pre, x_rows, p(prefix + "fc.weight").compute_value(),
                               bias(prefix + "fc.bias"));
    } else if (w13.defined()) {
      Tensor h = h13.rows(t0, n);
      ops::linear_forward(h, x_rows, w13, nullptr);
      ops::swiglu_forward_fused(act_rows, h);
    } else {
      Tensor gate = a.fc1.rows(t0, n), up = a.fc3.rows(t0, n);
      ops::linear_forward(gate, x_rows, p(prefix + "w1.weight").compute_value(), nullptr);
      ops::linear_forward(up, x_rows, p(prefix + "w3.weight").compute_value(), nullptr);
      ops::swiglu_forward(act_rows, gate, up);
    }
  });
  const Tensor& w2 = p(prefix + (gpt2 ? "proj.weight" : "w2.weight")).compute_value();
  if (residual) {  // one TP rank: residual + the product (+ bias) from the matmul's epilogue
    const Tensor* b2 = bias(prefix + "proj.bias");
    if (kv_ && !b2) {  // cached forwards keep h for no backward: the product accumulates into it
      ops::linear_forward(*residual, a.act, w2, nullptr, /*accumulate=*/true);
      return *residual;
    }
    return ops::linear_residual_forward(a.act, w2, b2, *residual);
  }
  Tensor m_partial = act({T, C});
  return tp_->reduce_overlapped(
      m_partial,
      [&](int64_t t0, int64_t n, Tensor& out) { ops::linear_forward(out, a.act.rows(t0, n), w2, nullptr); },
      {});
}

Tensor Transformer::mlp_backward(const std::string& prefix, int64_t fl, const Tensor& dout, LayerActs& a,
                                 bool out_bias_done) {
  const int64_t C = cfg_.d_model, T = a.m_in.size(0);
  const bool gpt2 = cfg_.is_gpt2();
  if (Param* b = ps_->find(prefix + "proj.bias"); b && !out_bias_done) ops::bias_backward(b->grad, dout);
  Param& w1 = p(prefix + (gpt2 ? "fc.weight" : "w1.weight"));
  Param& w2 = p(prefix + (gpt2 ? "proj.weight" : "w2.weight"));
  Param* w3 = gpt2 ? nullptr : &p(prefix + "w3.weight");
  Param* b1 = ps_->find(prefix + "fc.bias");
  Tensor none;  // no weight gradient: input gradients alone, per row block
  // Activation gradients start uninitialized: their first op overwrites (accumulate = false), the rest add.
  Tensor dfc1 = act({T, fl});
  Tensor dfc3 = gpt2 ? Tensor() : act({T, fl});
  // dfc1 (dfc3) per block of dm = gather(dout), beside the gather of the next block under SP.
  const Tensor dm = tp_->gather_overlapped(dout, [&](const Tensor& full, int64_t t0, int64_t n) {
    const Tensor d = full.rows(t0, n);
    Tensor g1 = dfc1.rows(t0, n);
    if (gpt2) {
      // dfc1 = gelu'(fc1) * (dm @ W2) (on CUDA bf16 without the dact in between)
      ops::linear_dgelu_backward(g1, none, d, a.act.rows(t0, n), w2.compute_value(), a.fc1.rows(t0, n));
    } else {
      Tensor dact = act({n, fl});
      ops::linear_backward(&dact, none, nullptr, d, a.act.rows(t0, n), w2.compute_value(),
                           /*accumulate_dinp=*/false);
      Tensor g3 = dfc3.rows(t0, n);
      ops::swiglu_backward(g1, g3, dact, a.fc1.rows(t0, n), a.fc3.rows(t0, n), /*accumulate=*/false);
    }
  });
  // The input gradient per row block, reduced over TP while the weight gradients are computed.
  Tensor dm_in = act({T, C});
  return tp_->reduce_overlapped(
      dm_in,
      [&](int64_t t0, int64_t n, Tensor& out) {
        const Tensor x_rows = a.m_in.rows(t0, n);
        ops::linear_backward(&out, none, nullptr, dfc1.rows(t0, n), x_rows, w1.compute_value(),
                             /*accumulate_dinp=*/false);
        if (w3) ops::linear_backward(&out, none, nullptr, dfc3.rows(t0, n), x_rows, w3->compute_value());
      },
      [&] {
        ops::linear_backward(nullptr, w2.grad, nullptr, dm, a.act, w2.compute_value());
        ops::linear_backward(nullptr, w1.grad, b1 ? &b1->grad : nullptr, dfc1, a.m_in, w1.compute_value());
        if (w3) ops::linear_backward(nullptr, w3->grad, nullptr, dfc3, a.m_in, w3->compute_value());
      });
}

Tensor Transformer::layer_backward(int64_t l, const Microbatch& mb, const Tensor& dout, LayerActs& a) {
  const std::string pre = lp(l);
  const int64_t D = cfg_.head_dim(), C = cfg_.d_model, T = a.a_in.size(0);
  const float theta = static_cast<float>(cfg_.rope_theta);
  // MLP branch: out = h + exit(act @ W2^T) (+ bias) [+ routed experts].
  Tensor dh = act(dout.shape());  // = dout + the MLP norm's input gradient (written by norm_backward)
  Tensor dn2;
  if (auto it = moe_.find(l); it == moe_.end()) {
    dn2 = mlp_backward(pre + "mlp.", ffn_local_, dout, a, /*out_bias_done=*/folded_mlp_bias(l) != nullptr);
  } else {
    dn2 = it->second->backward(dout, a.moe);
    if (shared_local_ > 0) ops::add_(dn2, mlp_backward(pre + "mlp.shared.", shared_local_, dout, a));
  }
  // The attention output bias's gradient is dh's column sums: summed in the norm's pass.
  norm_backward(pre + "mlp_norm", dh, dn2, a.h, a.n2_mean, a.n2_rstd, &dout, ps_->find(pre + "attn.wo.bias"));

  // Attention branch: h = x + exit(att @ Wo^T) (+ bias).
  Tensor dx = act(dh.shape());  // = dh + the attention norm's input gradient
  Tensor datt = act({T, heads_local_, D});
  Param& wo = p(pre + "attn.wo.weight");
  const Tensor datt2d = datt.view({T, heads_local_ * D}), att2d = a.att.view({T, heads_local_ * D});
  Tensor none;  // no weight gradient: input gradients alone, per row block
  // datt per block of do_full = gather(dh), beside the gather of the next block under SP.
  const Tensor do_full = tp_->gather_overlapped(dh, [&](const Tensor& full, int64_t t0, int64_t n) {
    Tensor d = datt2d.rows(t0, n);
    ops::linear_backward(&d, none, nullptr, full.rows(t0, n), att2d.rows(t0, n), wo.compute_value(),
                         /*accumulate_dinp=*/false);
  });
  // On the GPU, with q/k/v weights (and biases) back to back in the store: one matmul for the input
  // gradient and one for the weight gradients over [dq | dk | dv], instead of three narrow ones each.
  const bool biased = ps_->find(pre + "attn.wq.bias") != nullptr;
  Tensor wqkv, gqkv, gbqkv, dqkv;
  if (a.a_in.device() == Device::CUDA &&
      (wqkv = fused_weight(pre, {"attn.wq.weight", "attn.wk.weight", "attn.wv.weight"})).defined()) {
    gqkv = fused_grad(pre, {"attn.wq.weight", "attn.wk.weight", "attn.wv.weight"});
    if (biased) gbqkv = fused_grad(pre, {"attn.wq.bias", "attn.wk.bias", "attn.wv.bias"});
  }
  if (gqkv.defined()) dqkv = act({T, (heads_local_ + 2 * kv_local_) * D});
  // The plain causal form overwrites dq/dk/dv (so it may run on cuDNN); the others add into zeros. Without
  // RoPE it writes [dq | dk | dv] straight into the fused gradient (dq, dk, dv stay empty).
  const bool plain = !cp_ && cfg_.causal, rope = !cfg_.is_gpt2();
  const bool direct = dqkv.defined() && plain && !rope;
  Tensor dq, dk, dv;
  if (!direct) {
    dq = plain ? act(a.q.shape()) : act_zeros(a.q.shape());
    dk = plain ? act(a.k.shape()) : act_zeros(a.k.shape());
    dv = plain ? act(a.v.shape()) : act_zeros(a.v.shape());
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  phase_mark(a.q.device(), "attention core");
  if (direct)
    ops::attention_backward_qkv(dqkv, datt, a.q, a.k, a.v, a.att, a.lse, mb.cu_seqlens, scale);
  else if (cp_)
    cp_->attention_backward(mb, datt, a.q, a.k, a.v, a.att, a.lse, dq, dk, dv, scale);
  else if (!cfg_.causal)
    ops::attention_backward(dq, dk, dv, datt, a.q, a.k, a.v, a.att, a.lse, mb.cu_seqlens, mb.cu_seqlens,
                            zero_positions(T), zero_positions(T), scale);
  else
    ops::attention_backward(dq, dk, dv, datt, a.q, a.k, a.v, a.att, a.lse, mb.cu_seqlens, scale,
                            /*accumulate=*/false);
  phase_mark(a.q.device(), "other");
  // RoPE models without q/k norms: the inverse rotation happens while [dq | dk | dv] is assembled (dq and dk
  // themselves stay unrotated, so nothing may read them after: no per-tensor biases then).
  const bool merge_rope = dqkv.defined() && rope && !cfg_.qk_norm && (!biased || gbqkv.defined());
  if (rope && !merge_rope) {
    ops::rope_backward(dq, mb.positions, theta);
    ops::rope_backward(dk, mb.positions, theta);
  }
  if (rope && cfg_.qk_norm) {
    dq = head_norm_backward(pre + "attn.q_norm", dq, a.q_raw, a.q_rstd);
    dk = head_norm_backward(pre + "attn.k_norm", dk, a.k_raw, a.k_rstd);
  }
  if (merge_rope)
    ops::qkv_merge_rope_backward(dqkv, dq, dk, dv, mb.positions, theta);
  else if (dqkv.defined() && !direct)
    ops::qkv_merge(dqkv, dq, dk, dv);
  const std::pair<const char*, Tensor*> qkv_grads[] = {{"attn.wq", &dq}, {"attn.wk", &dk}, {"attn.wv", &dv}};
  // The input gradient per row block, reduced over TP while the weight gradients are computed.
  Tensor da_in = act({T, C});
  Tensor dn1 = tp_->reduce_overlapped(
      da_in,
      [&](int64_t t0, int64_t n, Tensor& out) {
        const Tensor x_rows = a.a_in.rows(t0, n);
        if (dqkv.defined()) {
          ops::linear_backward(&out, none, nullptr, dqkv.rows(t0, n), x_rows, wqkv,
                               /*accumulate_dinp=*/false);
          return;
        }
        bool first = true;
        for (auto [name, d] : qkv_grads) {
          ops::linear_backward(&out, none, nullptr, d->rows(t0, n), x_rows,
                               p(pre + name + ".weight").compute_value(),
                               /*accumulate_dinp=*/!first);
          first = false;
        }
      },
      [&] {
        ops::linear_backward(nullptr, wo.grad, nullptr, do_full, att2d, wo.compute_value());
        if (dqkv.defined()) {
          ops::linear_backward(nullptr, gqkv, gbqkv.defined() ? &gbqkv : nullptr, dqkv, a.a_in, wqkv);
          if (biased && !gbqkv.defined()) qkv_bias_grads(pre, dqkv);  // GPT-2: q and v biases, no key bias
          return;
        }
        for (auto [name, d] : qkv_grads) {
          Param& w = p(pre + name + ".weight");
          Param* b = ps_->find(pre + name + ".bias");
          ops::linear_backward(nullptr, w.grad, b ? &b->grad : nullptr, *d, a.a_in, w.compute_value());
        }
      });
  norm_backward(pre + "attn_norm", dx, dn1, a.x_in, a.n1_mean, a.n1_rstd, &dh, folded_mlp_bias(l - 1));
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
    Tensor partial = act({T, C});
    ops::embedding_forward(partial, mb.tokens, p("embed.tokens.weight").compute_value(), vocab_start_);
    x = tp_->exit_forward(partial);
    if (embeds_) embeds_->inject(mb, tok0, x);
    if (cfg_.is_gpt2()) {
      Tensor pos = ops::slice_rows(mb.positions, tok0, Tl);
      ops::add_position_embedding_forward(x, pos, p("embed.positions.weight").compute_value());
    }
  } else {
    NDT_CHECK(x_in.defined() && x_in.size(0) == Tl && x_in.size(1) == C,
              "stage input must be ({}, {}), got {}", Tl, C,
              x_in.defined() ? shape_str(x_in.shape()) : "undefined");
    x = x_in;
  }
  acts.layers.resize(static_cast<size_t>(stage_.last_layer - stage_.first_layer));
  for (int64_t l = stage_.first_layer; l < stage_.last_layer; ++l) {
    LayerActs& a = acts.layers[static_cast<size_t>(l - stage_.first_layer)];
    if (recompute_) {  // keep only the layer input; backward recomputes the rest
      LayerActs scratch;
      Tensor y = layer_forward(l, mb, x, scratch);
      a = LayerActs();
      a.x_in = x;
      x = y;
    } else {
      x = layer_forward(l, mb, x, a);
    }
  }
  // The vocab-parallel statistics (TP) need the forward; only the head's stage takes a loss.
  if (!stage_.has_head || tp_->size() > 1) acts.loss_in_backward = false;
  if (!stage_.has_head) return x;

  acts.x_final = x;
  phase_mark(x.device(), "head + loss");
  norm_forward("final_norm", x, acts.fn, acts.fn_mean, acts.fn_rstd);
  acts.head_in = tp_->enter_forward(acts.fn);
  const Tensor& w =
      cfg_.tied() ? p("embed.tokens.weight").compute_value() : p("lm_head.weight").compute_value();
  acts.logits = act({T, vocab_local_});
  ops::linear_forward(acts.logits, acts.head_in, w, nullptr);
  if (acts.loss_in_backward) {
    phase_mark(x.device(), "other");
    return x;
  }
  // Vocab-parallel softmax: the full logits never exist on one rank; three reductions over TP.
  acts.rowmax = stat({T});
  acts.sumexp = stat({T});
  Tensor target_logit = stat({T});
  acts.logprob = stat({T});
  // (The hooks reduce in place over raw pointers: device pointers when the model runs on a GPU.)
  if (tp_->size() == 1) {
    ops::xent_rowmax_sumexp(acts.rowmax, acts.sumexp, acts.logits);  // one pass over the logits on a GPU
  } else {
    ops::xent_rowmax(acts.rowmax, acts.logits);
    tp_->all_reduce_max(acts.rowmax.f32(), T);
    ops::xent_sumexp(acts.sumexp, acts.logits, acts.rowmax);
    tp_->all_reduce_sum(acts.sumexp.f32(), T);
  }
  ops::xent_target_logit(target_logit, acts.logits, mb.targets, vocab_start_);
  tp_->all_reduce_sum(target_logit.f32(), T);
  ops::xent_logprob(acts.logprob, target_logit, acts.rowmax, acts.sumexp);
  phase_mark(x.device(), "other");
  return x;
}

double Transformer::loss_sum(const Microbatch& mb, const Activations& acts) const {
  return ops::masked_loss_sum(acts.logprob, mb.loss_mask);
}

void Transformer::add_loss_sum(Tensor& acc, const Microbatch& mb, const Activations& acts) const {
  ops::masked_loss_sum_into(acc, acts.logprob, mb.loss_mask);
}

Tensor Transformer::backward(const Microbatch& mb, const Tensor& dy, float loss_scale, Activations& acts,
                             const Tensor* seed) {
  const int64_t T = mb.num_tokens(), C = cfg_.d_model;
  auto [tok0, Tl] = tp_->local_tokens(T);
  Tensor dx;
  if (stage_.has_head) {
    phase_mark(acts.x_final.device(), "head + loss");
    Tensor dloss = stat({T});
    if (seed) {
      NDT_CHECK(seed->numel() == T, "loss seed has {} rows, the microbatch {}", seed->numel(), T);
      ops::fill_dloss(dloss, *seed, 1.0f);
    } else {
      if (mb.loss_scale.defined())
        ops::fill_dloss(dloss, mb.loss_mask, mb.loss_scale);
      else
        ops::fill_dloss(dloss, mb.loss_mask, loss_scale);
    }
    // The logits die here: their buffer becomes dlogits (saves a (T, V) tensor, the largest of the step).
    if (acts.loss_in_backward) {
      NDT_CHECK(!seed, "a loss seed needs the log-probabilities before backward (loss_in_backward unset)");
      acts.logprob = stat({T});
      ops::xent_loss_backward_inplace(acts.logits, acts.logprob, mb.targets, dloss);
    } else {
      ops::xent_backward_inplace(acts.logits, acts.rowmax, acts.sumexp, mb.targets, dloss, vocab_start_);
    }
    Tensor dlogits = acts.logits;
    acts.logits = Tensor();
    Param& w = cfg_.tied() ? p("embed.tokens.weight") : p("lm_head.weight");
    Tensor dhead_in = act_zeros({T, C});
    ops::linear_backward(&dhead_in, w.grad, nullptr, dlogits, acts.head_in, w.compute_value());
    Tensor dfn = tp_->enter_backward(dhead_in);
    dx = act_zeros({Tl, C});
    norm_backward("final_norm", dx, dfn, acts.x_final, acts.fn_mean, acts.fn_rstd, nullptr,
                  folded_mlp_bias(stage_.last_layer - 1));
    if (head_done_) head_done_();
    phase_mark(dx.device(), "other");
  } else {
    NDT_CHECK(dy.defined() && dy.size(0) == Tl, "stage output gradient must have {} rows", Tl);
    dx = dy;
  }
  for (int64_t l = stage_.last_layer - 1; l >= stage_.first_layer; --l) {
    LayerActs& a = acts.layers[static_cast<size_t>(l - stage_.first_layer)];
    if (recompute_) {
      const Tensor x = a.x_in;
      // The same computation as in forward, so the same values; MoE statistics were counted then.
      const bool record = moe_ctx_ && moe_ctx_->record;
      if (record) moe_ctx_->record = false;
      layer_forward(l, mb, x, a);
      if (record) moe_ctx_->record = true;
    }
    dx = layer_backward(l, mb, dx, a);
    a = LayerActs();  // this layer's activations are dead: free them before the next layer's backward
    if (layer_done_) layer_done_(l);
  }
  if (!stage_.has_embedding) return dx;
  if (cfg_.is_gpt2()) {
    Tensor pos = ops::slice_rows(mb.positions, tok0, Tl);
    ops::add_position_embedding_backward(p("embed.positions.weight").grad, dx, pos);
  }
  if (embeds_) embeds_->take_grad(mb, tok0, dx);
  Tensor dfull = tp_->exit_backward(dx);
  if (embedding_grad_)
    embedding_grad_->backward(p("embed.tokens.weight").grad, dfull, mb.tokens, vocab_start_);
  else
    ops::embedding_backward(p("embed.tokens.weight").grad, dfull, mb.tokens, vocab_start_);
  return Tensor();
}

std::vector<int32_t> Transformer::argmax_rows(const Activations& acts,
                                              const std::vector<int64_t>& rows) const {
  const int64_t n = static_cast<int64_t>(rows.size());
  std::vector<float> best(static_cast<size_t>(n)), neg_idx(static_cast<size_t>(n));
  const Tensor host_logits = ops::to_host_f32(acts.logits);
  const float* lg = host_logits.f32();
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
  const Tensor host_logits = ops::to_host_f32(acts.logits);
  const float* lg = host_logits.f32();
  std::vector<int64_t> idx(static_cast<size_t>(vocab_local_));
  for (int64_t t = 0; t < T; ++t) {
    const float* row = lg + t * vocab_local_;
    for (int64_t j = 0; j < vocab_local_; ++j) idx[static_cast<size_t>(j)] = j;
    std::partial_sort(idx.begin(), idx.begin() + kl, idx.end(),
                      [&](int64_t a, int64_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
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
