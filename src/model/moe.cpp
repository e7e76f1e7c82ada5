#include "model/moe.h"

#include <algorithm>
#include <cmath>

#include "ops/ops.h"

namespace ndt {
namespace {

Tensor as_f32(const Tensor& x) {
  if (x.dtype() == DType::F32) return x;
  Tensor f = Tensor::empty(x.shape(), DType::F32, x.device());
  ops::cast_into(f, x);
  return f;
}

// Host vector -> tensor on `dev` (the ops upload host metadata themselves; f32 data used in matmuls moves).
Tensor on_device(const std::vector<float>& v, Shape shape, Device dev) {
  Tensor h = Tensor::from_vector(v, std::move(shape));
  return dev == Device::CPU ? h : h.to(dev);
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
  const int64_t N = a.routing.rows;
  const int32_t* cu = mb.cu_seqlens.i32();
  const int32_t* pos = mb.positions.i32();
  NDT_CHECK(static_cast<int64_t>(mb.seq_real.size()) == mb.nseq,
            "MoE: microbatch lacks per-sequence real-token counts ({} for {} sequences)", mb.seq_real.size(),
            mb.nseq);
  // Sequence of each row, -1 for padding.
  std::vector<int64_t> seq(static_cast<size_t>(N), -1);
  for (int64_t t = 0, s = 0; t < N; ++t) {
    const int64_t g = tok0 + t;
    while (s < mb.nseq && cu[s + 1] <= g) ++s;
    if (s < mb.nseq && pos[g] < mb.seq_real[static_cast<size_t>(s)]) seq[static_cast<size_t>(t)] = s;
  }
  const double aux_coef = cfg_.moe.aux_loss_coef, z_coef = cfg_.moe.z_loss_coef;
  const bool record = ctx_ && ctx_->record;
  if (record)
    for (int64_t i = 0; i < N * k_; ++i) {
      if (seq[static_cast<size_t>(i / k_)] >= 0)
        stats_.load[static_cast<size_t>(a.routing.choice[static_cast<size_t>(i)])] += 1;
      stats_.dropped += seq[static_cast<size_t>(i / k_)] >= 0 && a.routing.kept[static_cast<size_t>(i)] == 0;
    }
  if (!ctx_) return;
  if (aux_coef > 0) {
    // Slots per (sequence, expert) over the whole sequence: summed over the ranks holding its tokens.
    std::vector<float> count(static_cast<size_t>(mb.nseq * E_), 0.0f);
    for (int64_t i = 0; i < N * k_; ++i)
      if (const int64_t s = seq[static_cast<size_t>(i / k_)]; s >= 0)
        count[static_cast<size_t>(s * E_ + a.routing.choice[static_cast<size_t>(i)])] += 1.0f;
    if (seq_reduce_) seq_reduce_(count.data(), static_cast<int64_t>(count.size()));
    const std::vector<float> P = balance_probs(a.routing, spec_);
    a.dP.assign(static_cast<size_t>(N * E_), 0.0f);
    double value = 0;
    for (int64_t t = 0; t < N; ++t) {
      const int64_t s = seq[static_cast<size_t>(t)];
      if (s < 0) continue;
      const double Ts = mb.seq_real[static_cast<size_t>(s)];
      const double w = aux_coef * static_cast<double>(E_) / (static_cast<double>(k_) * Ts * Ts * ctx_->seqs);
      for (int64_t e = 0; e < E_; ++e) {
        const double d = w * count[static_cast<size_t>(s * E_ + e)];
        a.dP[static_cast<size_t>(t * E_ + e)] = static_cast<float>(d);
        value += d * P[static_cast<size_t>(t * E_ + e)];
      }
    }
    if (record) stats_.aux += value;
  }
  if (z_coef > 0) {
    a.dz.assign(static_cast<size_t>(N), 0.0f);
    double value = 0;
    for (int64_t t = 0; t < N; ++t) {
      if (seq[static_cast<size_t>(t)] < 0) continue;
      const float* l = a.logits.data() + t * E_;
      const float mx = *std::max_element(l, l + E_);
      double sum = 0;
      for (int64_t e = 0; e < E_; ++e) sum += std::exp(static_cast<double>(l[e] - mx));
      const double z = mx + std::log(sum);
      a.dz[static_cast<size_t>(t)] = static_cast<float>(z_coef * 2.0 * z / ctx_->tokens);
      value += z_coef * z * z / ctx_->tokens;
    }
    if (record) stats_.z += value;
  }
}

Tensor MoeLayer::forward(const Microbatch& mb, int64_t tok0, const Tensor& x, MoeActs& a) {
  const int64_t N = x.size(0);
  const Device dev = x.device();
  a = MoeActs();
  a.x = x;
  // Router in fp32 (master weights), then routing on the host: the all-to-all needs the counts there anyway.
  a.xf = as_f32(x);
  Tensor logits = Tensor::empty({N, E_}, DType::F32, dev);
  if (N > 0) ops::linear_forward(logits, a.xf, router_->value, nullptr);
  a.logits = logits.to_vector<float>();
  const std::vector<float> bias = bias_ ? bias_->value.to_vector<float>() : std::vector<float>();
  a.routing = route(a.logits.data(), bias_ ? bias.data() : nullptr, N, spec_);
  balance_terms(mb, tok0, a);

  // Permutation: kept slots sorted by (expert, token, slot).
  std::vector<int64_t> counts(static_cast<size_t>(E_), 0);
  for (int64_t i = 0; i < N * k_; ++i)
    if (a.routing.kept[static_cast<size_t>(i)])
      ++counts[static_cast<size_t>(a.routing.choice[static_cast<size_t>(i)])];
  std::vector<int64_t> next(static_cast<size_t>(E_), 0);
  for (int64_t e = 1; e < E_; ++e)
    next[static_cast<size_t>(e)] = next[static_cast<size_t>(e - 1)] + counts[static_cast<size_t>(e - 1)];
  const int64_t R = next.back() + counts.back();
  a.slot_pos = Tensor::empty({N * k_}, DType::I32);
  a.gates = Tensor::empty({N * k_}, DType::F32);
  a.row_token = Tensor::empty({R}, DType::I32);
  a.row_gate = Tensor::empty({R}, DType::F32);
  for (int64_t i = 0; i < N * k_; ++i) {
    const bool kept = a.routing.kept[static_cast<size_t>(i)];
    a.gates.f32()[i] = kept ? a.routing.gate[static_cast<size_t>(i)] : 0.0f;
    if (!kept) {
      a.slot_pos.i32()[i] = -1;
      continue;
    }
    const int64_t r = next[static_cast<size_t>(a.routing.choice[static_cast<size_t>(i)])]++;
    a.slot_pos.i32()[i] = static_cast<int32_t>(r);
    a.row_token.i32()[r] = static_cast<int32_t>(i / k_);
    a.row_gate.f32()[r] = a.routing.gate[static_cast<size_t>(i)];
  }
  if (dev != Device::CPU) {
    // Uploaded once, right after the logits' copy (the stream is idle then); forward and backward ops
    // then read them on the device instead of each uploading them behind queued kernels.
    for (Tensor* t : {&a.slot_pos, &a.gates, &a.row_token, &a.row_gate}) *t = t->to(dev);
  }
  Tensor xp = Tensor::empty({R, C_}, x.dtype(), dev);
  ops::moe_permute(xp, x, a.row_token, nullptr);
  a.plan = ep_->plan(counts);
  a.xe = ep_->dispatch(xp, a.plan);
  const int64_t Re = a.xe.size(0);
  a.h1 = Tensor::empty({Re, F_}, x.dtype(), dev);
  if (!cfg_.is_gpt2()) a.h3 = Tensor::empty({Re, F_}, x.dtype(), dev);
  a.act = Tensor::empty({Re, F_}, x.dtype(), dev);
  Tensor ye = Tensor::empty({Re, C_}, x.dtype(), dev);
  for (int64_t e = 0, row = 0; e < El_; ++e) {
    const int64_t n = a.plan.local_counts[static_cast<size_t>(e)];
    if (n > 0) expert_forward(e, row, n, a, ye);
    row += n;
  }
  a.yp = ep_->combine(ye, a.plan);
  Tensor out = Tensor::empty({N, C_}, x.dtype(), dev);
  ops::moe_unpermute(out, a.yp, a.slot_pos, &a.gates, k_, /*accumulate=*/false);
  return out;
}

void MoeLayer::expert_forward(int64_t e, int64_t row0, int64_t n, MoeActs& a, Tensor& ye) {
  auto rows = [&](const Tensor& t, int64_t width) { return t.view_at(row0 * width, {n, width}); };
  auto mat = [&](Param* p, int64_t r, int64_t c) { return p->compute_value().view_at(e * r * c, {r, c}); };
  auto vec = [&](Param* p, int64_t c) { return p->compute_value().view_at(e * c, {c}); };
  Tensor xe = rows(a.xe, C_), h1 = rows(a.h1, F_), act = rows(a.act, F_), y = rows(ye, C_);
  if (cfg_.is_gpt2()) {
    const Tensor b1 = vec(b_[0], F_), b2 = vec(b_[1], C_);
    ops::linear_forward(h1, xe, mat(w_[0], F_, C_), &b1);
    ops::gelu_forward(act, h1);
    ops::linear_forward(y, act, mat(w_[1], C_, F_), &b2);
  } else {
    Tensor h3 = rows(a.h3, F_);
    ops::linear_forward(h1, xe, mat(w_[0], F_, C_), nullptr);
    ops::linear_forward(h3, xe, mat(w_[1], F_, C_), nullptr);
    ops::swiglu_forward(act, h1, h3);
    ops::linear_forward(y, act, mat(w_[2], C_, F_), nullptr);
  }
}

void MoeLayer::expert_backward(int64_t e, int64_t row0, int64_t n, MoeActs& a, const Tensor& dye,
                               Tensor& dxe) {
  auto rows = [&](const Tensor& t, int64_t width) { return t.view_at(row0 * width, {n, width}); };
  auto mat = [&](Param* p, int64_t r, int64_t c) { return p->compute_value().view_at(e * r * c, {r, c}); };
  auto dmat = [&](Param* p, int64_t r, int64_t c) { return p->grad.view_at(e * r * c, {r, c}); };
  auto dvec = [&](Param* p, int64_t c) { return p->grad.view_at(e * c, {c}); };
  const Device dev = a.xe.device();
  const DType dt = a.xe.dtype();
  Tensor xe = rows(a.xe, C_), h1 = rows(a.h1, F_), act = rows(a.act, F_), dy = rows(dye, C_),
         dx = rows(dxe, C_);
  Tensor dact = Tensor::empty({n, F_}, dt, dev), dh1 = Tensor::empty({n, F_}, dt, dev);
  if (cfg_.is_gpt2()) {
    Tensor gw2 = dmat(w_[1], C_, F_), gb2 = dvec(b_[1], C_), gw1 = dmat(w_[0], F_, C_), gb1 = dvec(b_[0], F_);
    ops::linear_backward(&dact, gw2, &gb2, dy, act, mat(w_[1], C_, F_), /*accumulate_dinp=*/false);
    ops::gelu_backward(dh1, dact, h1, /*accumulate=*/false);
    ops::linear_backward(&dx, gw1, &gb1, dh1, xe, mat(w_[0], F_, C_), /*accumulate_dinp=*/false);
  } else {
    Tensor h3 = rows(a.h3, F_), dh3 = Tensor::empty({n, F_}, dt, dev);
    Tensor gw1 = dmat(w_[0], F_, C_), gw3 = dmat(w_[1], F_, C_), gw2 = dmat(w_[2], C_, F_);
    ops::linear_backward(&dact, gw2, nullptr, dy, act, mat(w_[2], C_, F_), /*accumulate_dinp=*/false);
    ops::swiglu_backward(dh1, dh3, dact, h1, h3, /*accumulate=*/false);
    ops::linear_backward(&dx, gw1, nullptr, dh1, xe, mat(w_[0], F_, C_), /*accumulate_dinp=*/false);
    ops::linear_backward(&dx, gw3, nullptr, dh3, xe, mat(w_[1], F_, C_));
  }
}

Tensor MoeLayer::backward(const Tensor& dy, MoeActs& a) {
  const int64_t N = dy.size(0);
  const Device dev = dy.device();
  // Gates: dg_tj = dy_t . y_tj; expert rows: dy_t * g_tj.
  Tensor dgates = Tensor::empty({N * k_}, DType::F32, dev);
  ops::moe_gate_grad(dgates, dy, a.yp, a.slot_pos, k_);
  const std::vector<float> dg = dgates.to_vector<float>();
  const int64_t R = a.row_token.numel();
  Tensor dyp = Tensor::empty({R, C_}, dy.dtype(), dev);
  ops::moe_permute(dyp, dy, a.row_token, &a.row_gate);
  Tensor dye = ep_->dispatch(dyp, a.plan);
  Tensor dxe = Tensor::empty({a.xe.size(0), C_}, dy.dtype(), dev);
  for (int64_t e = 0, row = 0; e < El_; ++e) {
    const int64_t n = a.plan.local_counts[static_cast<size_t>(e)];
    if (n > 0) expert_backward(e, row, n, a, dye, dxe);
    row += n;
  }
  Tensor dxp = ep_->combine(dxe, a.plan);
  Tensor dx = Tensor::empty({N, C_}, dy.dtype(), dev);
  ops::moe_unpermute(dx, dxp, a.slot_pos, nullptr, k_, /*accumulate=*/false);
  // Router: gates, balancing probabilities and z-loss -> logits -> router weight and input.
  std::vector<float> dlogits(static_cast<size_t>(N * E_));
  router_backward(dlogits.data(), a.routing, spec_, a.logits.data(), dg.data(),
                  a.dP.empty() ? nullptr : a.dP.data(), a.dz.empty() ? nullptr : a.dz.data());
  if (N > 0) {
    const Tensor dl = on_device(dlogits, {N, E_}, dev);
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
