#include "model/moe.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <numeric>
#include <optional>

#include "core/phase_mark.h"
#include "ops/ops.h"

#ifdef NDT_HAVE_CUDA
#include "cuda/side_streams.h"
#endif

namespace ndt {
namespace {

Tensor as_f32(const Tensor& x) {
  if (x.dtype() == DType::F32) return x;
  Tensor f = Tensor::empty(x.shape(), DType::F32, x.device());
  ops::cast_into(f, x);
  return f;
}

// Side streams the experts' matmuls spread over on a GPU: one expert's few hundred rows leave most of the
// multiprocessors idle, several experts at once do not. NDT_MOE_STREAMS overrides the 4 (1: one stream),
// for measurements (docs/performance.md).
[[maybe_unused]] int expert_streams() {  // (unused in a CPU-only build)
  static const int n = [] {
    const char* v = std::getenv("NDT_MOE_STREAMS");
    const int k = v && *v ? std::atoi(v) : 4;
    return std::clamp(k, 1, 16);
  }();
  return n;
}

// body(e, first row, rows) for every local expert with rows. On a GPU the experts go to side streams,
// largest first, each to the stream with the fewest rows so far (deterministic: it depends on the counts
// only; each expert's arithmetic is the same on any stream).
void for_each_expert(const std::vector<int64_t>& counts, Device dev,
                     const std::function<void(int64_t, int64_t, int64_t)>& body) {
  const auto El = static_cast<int64_t>(counts.size());
  std::vector<int64_t> first(counts.size(), 0);
  for (int64_t e = 1; e < El; ++e)
    first[static_cast<size_t>(e)] = first[static_cast<size_t>(e - 1)] + counts[static_cast<size_t>(e - 1)];
#ifdef NDT_HAVE_CUDA
  const int64_t busy = std::count_if(counts.begin(), counts.end(), [](int64_t n) { return n > 0; });
  const int ns = dev == Device::CUDA ? static_cast<int>(std::min<int64_t>(expert_streams(), busy)) : 0;
#else
  const int ns = 0;
  (void)dev;
#endif
  if (ns < 2) {
    for (int64_t e = 0; e < El; ++e)
      if (counts[static_cast<size_t>(e)] > 0)
        body(e, first[static_cast<size_t>(e)], counts[static_cast<size_t>(e)]);
    return;
  }
#ifdef NDT_HAVE_CUDA
  std::vector<int64_t> order(counts.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return counts[static_cast<size_t>(a)] > counts[static_cast<size_t>(b)];
  });
  std::vector<int64_t> load(static_cast<size_t>(ns), 0);
  cuda::fork_side_streams(ns);
  for (int64_t e : order) {
    const int64_t n = counts[static_cast<size_t>(e)];
    if (n == 0) break;
    const auto st = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    load[st] += n;
    cuda::OnSideStream on(static_cast<int>(st));
    body(e, first[static_cast<size_t>(e)], n);
  }
  cuda::join_side_streams(ns);
#endif
}

// Expert e's part of a stacked expert tensor (El, ...): a matrix (F, C) / (C, F) or a bias vector.
Tensor expert_slice(const Tensor& t, int64_t e) {
  Shape one(t.shape().begin() + 1, t.shape().end());
  const int64_t n = shape_numel(one);
  return t.view_at(e * n, std::move(one));
}

// Rows [row0, row0 + n) of a (rows, width) tensor.
Tensor rows(const Tensor& t, int64_t row0, int64_t n) {
  return t.view_at(row0 * t.size(-1), {n, t.size(-1)});
}

}  // namespace

MoeLayer::MoeLayer(const ModelConfig& cfg, const std::string& prefix, ParamStore& ps, EpHooks* ep)
    : cfg_(cfg), ep_(ep ? ep : &default_ep_) {
  const MoeConfig& m = cfg.moe;
  E_ = m.num_experts;
  k_ = m.top_k;
  F_ = cfg.expert_ffn_dim();
  C_ = cfg.d_model;
  const int64_t eps = ep_->size();
  NDT_CHECK(E_ % eps == 0, "model.moe.num_experts ({}) must be divisible by parallel.ep ({})", E_, eps);
  El_ = E_ / eps;
  spec_.experts = E_;
  spec_.top_k = k_;
  spec_.sigmoid = m.router == "sigmoid";
  spec_.renormalize = m.renormalize;
  spec_.capacity_factor = m.capacity_factor;
  const float std = static_cast<float>(cfg.init_std);
  const float proj_std = std / std::sqrt(2.0f * static_cast<float>(cfg.n_layers));
  router_ = &ps.add(prefix + "router.weight", {E_, C_}, InitKind::Normal, std, true);
  if (spec_.sigmoid) bias_ = &ps.add(prefix + "router.expert_bias", {E_}, InitKind::Zeros, 0, false);
  router_->forward_reads_value = true;  // the router runs in fp32 (route_tokens, linear_forward below)
  if (bias_) bias_->forward_reads_value = true;
  auto expert = [&](const std::string& name, Shape shape, InitKind init, float s, bool decay) {
    Param& p = ps.add(prefix + "experts." + name, std::move(shape), init, s, decay, 0, eps, ep_->rank());
    p.expert = true;
    p.tp_replicated = true;  // experts are not split over TP (docs/architecture.md: why)
    return &p;
  };
  if (cfg.is_gpt2()) {
    w_ = {expert("fc.weight", {E_, F_, C_}, InitKind::Normal, std, true),
          expert("proj.weight", {E_, C_, F_}, InitKind::Normal, proj_std, true)};
    b_ = {expert("fc.bias", {E_, F_}, InitKind::Zeros, 0, false),
          expert("proj.bias", {E_, C_}, InitKind::Zeros, 0, false)};
  } else {
    w_ = {expert("w1.weight", {E_, F_, C_}, InitKind::Normal, std, true),
          expert("w3.weight", {E_, F_, C_}, InitKind::Normal, std, true),
          expert("w2.weight", {E_, C_, F_}, InitKind::Normal, proj_std, true)};
  }
  stats_.clear(E_);
}

void MoeLayer::balance_terms(const Microbatch& mb, int64_t tok0, MoeActs& a) {
  const int64_t N = a.logits.size(0), S = mb.nseq;
  const bool record = ctx_ && ctx_->record;
  const double aux_coef = cfg_.moe.aux_loss_coef, z_coef = cfg_.moe.z_loss_coef;
  if (!ctx_ || (!record && aux_coef <= 0 && z_coef <= 0)) return;  // no statistics, no loss terms
  const int32_t* cu = mb.cu_seqlens.i32();
  const int32_t* pos = mb.positions.i32();
  NDT_CHECK(static_cast<int64_t>(mb.seq_real.size()) == S,
            "MoE: microbatch lacks per-sequence real-token counts ({} for {} sequences)", mb.seq_real.size(),
            S);
  // Sequence of each row, -1 for padding.
  std::vector<int32_t> seq(static_cast<size_t>(N), -1);
  for (int64_t t = 0, s = 0; t < N; ++t) {
    const int64_t g = tok0 + t;
    while (s < S && cu[s + 1] <= g) ++s;
    if (s < S && pos[g] < mb.seq_real[static_cast<size_t>(s)])
      seq[static_cast<size_t>(t)] = static_cast<int32_t>(s);
  }
  const Device dev = a.logits.device();
  auto on_dev = [&](Tensor h) { return dev == Device::CPU ? h : h.to(dev); };
  // Uploaded after route_tokens' synchronization (the stream is idle): one short round trip for the stats.
  a.loss.tok_seq = on_dev(Tensor::from_vector(seq, {N}));
  const std::vector<float> st = seq_stats(a.routed, a.loss.tok_seq, S, spec_);
  const float* cnt = st.data();
  const float* psum = st.data() + S * E_;
  if (record) {
    for (int64_t s = 0; s < S; ++s)
      for (int64_t e = 0; e < E_; ++e) stats_.load[static_cast<size_t>(e)] += cnt[s * E_ + e];
    stats_.dropped += st[static_cast<size_t>(2 * S * E_)];
  }
  if (aux_coef > 0) {
    // Slots per (sequence, expert) over the whole sequence: summed over the ranks holding its tokens.
    std::vector<float> count(cnt, cnt + S * E_);
    if (seq_reduce_) seq_reduce_(count.data(), static_cast<int64_t>(count.size()));
    // dP[t, e] = w_s * count[s, e] for the real tokens t of sequence s (moe.h); the value sums dP * P.
    std::vector<float> w(static_cast<size_t>(S), 0.0f);
    double value = 0;
    for (int64_t s = 0; s < S; ++s) {
      const double Ts = mb.seq_real[static_cast<size_t>(s)];
      if (Ts <= 0) continue;
      w[static_cast<size_t>(s)] = static_cast<float>(aux_coef * static_cast<double>(E_) /
                                                     (static_cast<double>(k_) * Ts * Ts * ctx_->seqs));
      for (int64_t e = 0; e < E_; ++e)
        value += static_cast<double>(w[static_cast<size_t>(s)]) * count[static_cast<size_t>(s * E_ + e)] *
                 psum[s * E_ + e];
    }
    if (record) stats_.aux += value;
    a.loss.aux_w = on_dev(Tensor::from_vector(w, {S}));
    a.loss.aux_cnt = on_dev(Tensor::from_vector(count, {S, E_}));
  }
  if (z_coef > 0) {
    a.loss.z_scale = z_coef * 2.0 / ctx_->tokens;
    if (record) stats_.z += z_coef * st[static_cast<size_t>(2 * S * E_ + 1)] / ctx_->tokens;
  }
}

Tensor MoeLayer::forward(const Microbatch& mb, int64_t tok0, const Tensor& x, MoeActs& a) {
  const int64_t N = x.size(0);
  const Device dev = x.device();
  a = MoeActs();
  a.x = x;
  // Router in fp32 (master weights), routed where the logits live; only the per-expert counts come back
  // to the host (the all-to-all needs them there). The loss terms' uploads follow that synchronization,
  // when the stream is idle.
  phase_mark(dev, "moe router");
  a.xf = as_f32(x);
  a.logits = Tensor::empty({N, E_}, DType::F32, dev);
  if (N > 0) ops::linear_forward(a.logits, a.xf, router_->value, nullptr);
  phase_mark(dev, "moe routing (host sync)");
  a.routed = route_tokens(a.logits, bias_ ? &bias_->value : nullptr, spec_);
  balance_terms(mb, tok0, a);
  phase_mark(dev, "moe permute/dispatch/combine");

  const int64_t R = a.routed.row_token.numel();
  Tensor xp = Tensor::empty({R, C_}, x.dtype(), dev);
  ops::moe_permute(xp, x, a.routed.row_token, nullptr);
  a.plan = ep_->plan(a.routed.counts);
  a.xe = ep_->dispatch(xp, a.plan);
  const int64_t Re = a.xe.size(0);
  a.h1 = Tensor::empty({Re, F_}, x.dtype(), dev);
  if (!cfg_.is_gpt2()) a.h3 = Tensor::empty({Re, F_}, x.dtype(), dev);
  a.act = Tensor::empty({Re, F_}, x.dtype(), dev);
  Tensor ye = Tensor::empty({Re, C_}, x.dtype(), dev);
  phase_mark(dev, "moe experts forward");
  experts_forward(a, ye);
  phase_mark(dev, "moe permute/dispatch/combine");
  a.yp = ep_->combine(ye, a.plan);
  Tensor out = Tensor::empty({N, C_}, x.dtype(), dev);
  ops::moe_unpermute(out, a.yp, a.routed.slot_pos, &a.routed.kept_gate, k_, /*accumulate=*/false);
  phase_mark(dev, "other");
  return out;
}

void MoeLayer::experts_forward(MoeActs& a, Tensor& ye) {
  const std::vector<int64_t>& counts = a.plan.local_counts;
  const Device dev = a.xe.device();
  auto mat = [](Param* p, int64_t e) { return expert_slice(p->compute_value(), e); };
  const bool gpt2 = cfg_.is_gpt2();
  // Matmuls per expert (side streams on a GPU), the activation over all experts' rows in one launch.
  for_each_expert(counts, dev, [&](int64_t e, int64_t row0, int64_t n) {
    Tensor xe = rows(a.xe, row0, n), h1 = rows(a.h1, row0, n);
    if (gpt2) {
      const Tensor b1 = mat(b_[0], e);
      ops::linear_forward(h1, xe, mat(w_[0], e), &b1);
    } else {
      Tensor h3 = rows(a.h3, row0, n);
      ops::linear_forward(h1, xe, mat(w_[0], e), nullptr);
      ops::linear_forward(h3, xe, mat(w_[1], e), nullptr);
    }
  });
  if (gpt2)
    ops::gelu_forward(a.act, a.h1);
  else
    ops::swiglu_forward(a.act, a.h1, a.h3);
  for_each_expert(counts, dev, [&](int64_t e, int64_t row0, int64_t n) {
    Tensor act = rows(a.act, row0, n), y = rows(ye, row0, n);
    if (gpt2) {
      const Tensor b2 = mat(b_[1], e);
      ops::linear_forward(y, act, mat(w_[1], e), &b2);
    } else {
      ops::linear_forward(y, act, mat(w_[2], e), nullptr);
    }
  });
}

void MoeLayer::experts_backward(MoeActs& a, const Tensor& dye, Tensor& dxe) {
  const std::vector<int64_t>& counts = a.plan.local_counts;
  const Device dev = a.xe.device();
  const DType dt = a.xe.dtype();
  const int64_t Re = a.xe.size(0);
  auto mat = [](Param* p, int64_t e) { return expert_slice(p->compute_value(), e); };
  auto dmat = [](Param* p, int64_t e) { return expert_slice(p->grad, e); };
  const bool gpt2 = cfg_.is_gpt2();
  Param* w_out = gpt2 ? w_[1] : w_[2];
  Tensor dact = Tensor::empty({Re, F_}, dt, dev), dh1 = Tensor::empty({Re, F_}, dt, dev);
  for_each_expert(counts, dev, [&](int64_t e, int64_t row0, int64_t n) {
    Tensor da = rows(dact, row0, n), gw = dmat(w_out, e);
    Tensor gb = gpt2 ? dmat(b_[1], e) : Tensor();
    ops::linear_backward(&da, gw, gpt2 ? &gb : nullptr, rows(dye, row0, n), rows(a.act, row0, n),
                         mat(w_out, e),
                         /*accumulate_dinp=*/false);
  });
  Tensor dh3 = gpt2 ? Tensor() : Tensor::empty({Re, F_}, dt, dev);
  if (gpt2)
    ops::gelu_backward(dh1, dact, a.h1, /*accumulate=*/false);
  else
    ops::swiglu_backward(dh1, dh3, dact, a.h1, a.h3, /*accumulate=*/false);
  dact = Tensor();
  for_each_expert(counts, dev, [&](int64_t e, int64_t row0, int64_t n) {
    Tensor dx = rows(dxe, row0, n), xe = rows(a.xe, row0, n), gw1 = dmat(w_[0], e);
    Tensor gb1 = gpt2 ? dmat(b_[0], e) : Tensor();
    ops::linear_backward(&dx, gw1, gpt2 ? &gb1 : nullptr, rows(dh1, row0, n), xe, mat(w_[0], e),
                         /*accumulate_dinp=*/false);
    if (!gpt2) {
      Tensor gw3 = dmat(w_[1], e);
      ops::linear_backward(&dx, gw3, nullptr, rows(dh3, row0, n), xe, mat(w_[1], e));
    }
  });
}

Tensor MoeLayer::backward(const Tensor& dy, MoeActs& a) {
  const int64_t N = dy.size(0);
  const Device dev = dy.device();
  const RoutedTokens& r = a.routed;
  phase_mark(dev, "moe permute/dispatch/combine");
  // Gates: dg_tj = dy_t . y_tj; expert rows: dy_t * g_tj.
  Tensor dgates = Tensor::empty({N * k_}, DType::F32, dev);
  ops::moe_gate_grad(dgates, dy, a.yp, r.slot_pos, k_);
  const int64_t R = r.row_token.numel();
  Tensor dyp = Tensor::empty({R, C_}, dy.dtype(), dev);
  ops::moe_permute(dyp, dy, r.row_token, &r.row_gate);
  Tensor dye = ep_->dispatch(dyp, a.plan);
  Tensor dxe = Tensor::empty({a.xe.size(0), C_}, dy.dtype(), dev);
  phase_mark(dev, "moe experts backward");
  experts_backward(a, dye, dxe);
  phase_mark(dev, "moe permute/dispatch/combine");
  Tensor dxp = ep_->combine(dxe, a.plan);
  Tensor dx = Tensor::empty({N, C_}, dy.dtype(), dev);
  ops::moe_unpermute(dx, dxp, r.slot_pos, nullptr, k_, /*accumulate=*/false);
  // Router: gates, balancing probabilities and z-loss -> logits -> router weight and input.
  phase_mark(dev, "moe router");
  if (N > 0) {
    Tensor dl = Tensor::empty({N, E_}, DType::F32, dev);
    router_backward(dl, r, spec_, a.logits, dgates, &a.loss);
    Tensor dxf = Tensor::empty({N, C_}, DType::F32, dev);
    ops::linear_backward(&dxf, router_->grad, nullptr, dl, a.xf, router_->value, /*accumulate_dinp=*/false);
    if (dx.dtype() == DType::F32) {
      ops::add_(dx, dxf);
    } else {
      Tensor d = Tensor::empty(dx.shape(), dx.dtype(), dev);
      ops::cast_into(d, dxf);
      ops::add_(dx, d);
    }
  }
  a = MoeActs();
  phase_mark(dev, "other");
  return dx;
}

void MoeLayer::update_expert_bias(const std::vector<double>& global_load) {
  const double rate = cfg_.moe.bias_update_rate;
  if (!bias_ || rate <= 0) return;
  double mean = 0;
  for (double l : global_load) mean += l / static_cast<double>(E_);
  std::vector<float> b = bias_->value.to_vector<float>();
  for (int64_t e = 0; e < E_; ++e) {
    const double l = global_load[static_cast<size_t>(e)];
    b[static_cast<size_t>(e)] += static_cast<float>(rate * (l < mean ? 1.0 : (l > mean ? -1.0 : 0.0)));
  }
  bias_->value.copy_from(Tensor::from_vector(b, {E_}));
  if (bias_->compute.defined()) ops::cast_into(bias_->compute, bias_->value);
}

}  // namespace ndt
