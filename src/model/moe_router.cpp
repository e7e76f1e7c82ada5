#include "model/moe_router.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/check.h"

#ifdef NDT_HAVE_CUDA
#include "cuda/moe_route.h"
#include "cuda/runtime.h"
#endif

namespace ndt {

void route_tokens(const float* logits, const float* bias, int64_t N, const RouterSpec& spec, float* score,
                  int32_t* choice, float* gate, float* lse, float* pnorm) {
  const int64_t E = spec.experts, k = spec.top_k;
  NDT_CHECK(E >= 1 && k >= 1 && k <= E, "router: top_k {} must be in [1, experts {}]", k, E);
  // Tokens are independent: the host loop is spread over the cores.
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) {
    std::vector<int32_t> idx(static_cast<size_t>(E));
    std::vector<float> sel(static_cast<size_t>(E));
    const float* l = logits + t * E;
    float* s = score + t * E;
    const float mx = *std::max_element(l, l + E);
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += std::exp(static_cast<double>(l[e] - mx));
    lse[t] = static_cast<float>(static_cast<double>(mx) + std::log(sum));
    double ssum = 0;
    for (int64_t e = 0; e < E; ++e) {
      s[e] = spec.sigmoid ? static_cast<float>(1.0 / (1.0 + std::exp(-static_cast<double>(l[e]))))
                          : static_cast<float>(std::exp(static_cast<double>(l[e] - mx)) / sum);
      ssum += s[e];
    }
    pnorm[t] = spec.sigmoid ? static_cast<float>(ssum) : 1.0f;
    for (int64_t e = 0; e < E; ++e) sel[static_cast<size_t>(e)] = s[e] + (bias ? bias[e] : 0.0f);
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int32_t a, int32_t b) {
      return sel[static_cast<size_t>(a)] > sel[static_cast<size_t>(b)] ||
             (sel[static_cast<size_t>(a)] == sel[static_cast<size_t>(b)] && a < b);
    });
    double raw_sum = 0;
    for (int64_t j = 0; j < k; ++j) raw_sum += s[idx[static_cast<size_t>(j)]];
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = idx[static_cast<size_t>(j)];
      choice[t * k + j] = e;
      gate[t * k + j] = spec.renormalize ? static_cast<float>(s[e] / raw_sum) : s[e];
    }
  }
}

int64_t expert_capacity(const RouterSpec& spec, int64_t N) {
  if (spec.capacity_factor <= 0) return -1;
  return static_cast<int64_t>(std::ceil(spec.capacity_factor * static_cast<double>(N * spec.top_k) /
                                        static_cast<double>(spec.experts)));
}

Routing route(const float* logits, const float* bias, int64_t N, const RouterSpec& spec) {
  Routing r;
  r.rows = N;
  r.score.resize(static_cast<size_t>(N * spec.experts));
  r.choice.resize(static_cast<size_t>(N * spec.top_k));
  r.gate.resize(static_cast<size_t>(N * spec.top_k));
  r.kept.assign(static_cast<size_t>(N * spec.top_k), 1);
  std::vector<float> lse(static_cast<size_t>(N)), pnorm(static_cast<size_t>(N));
  route_tokens(logits, bias, N, spec, r.score.data(), r.choice.data(), r.gate.data(), lse.data(),
               pnorm.data());
  if (const int64_t cap = expert_capacity(spec, N); cap >= 0) {
    std::vector<int64_t> used(static_cast<size_t>(spec.experts), 0);
    for (int64_t i = 0; i < N * spec.top_k; ++i)
      if (used[static_cast<size_t>(r.choice[static_cast<size_t>(i)])]++ >= cap)
        r.kept[static_cast<size_t>(i)] = 0;
  }
  return r;
}

void expert_permutation(const int32_t* choice, const float* gate, int64_t N, int64_t k, int64_t E,
                        int64_t cap, int32_t* slot_pos, float* kept_gate, int32_t* row_token, float* row_gate,
                        int32_t* counts) {
  std::vector<int64_t> seen(static_cast<size_t>(E), 0);
  for (int64_t e = 0; e < E; ++e) counts[e] = 0;
  for (int64_t i = 0; i < N * k; ++i) {
    const int64_t r = seen[static_cast<size_t>(choice[i])]++;
    if (cap < 0 || r < cap) ++counts[choice[i]];
  }
  std::vector<int64_t> next(static_cast<size_t>(E), 0);
  for (int64_t e = 1; e < E; ++e)
    next[static_cast<size_t>(e)] = next[static_cast<size_t>(e - 1)] + counts[e - 1];
  std::fill(seen.begin(), seen.end(), 0);
  for (int64_t i = 0; i < N * k; ++i) {
    const int64_t rank = seen[static_cast<size_t>(choice[i])]++;
    if (cap >= 0 && rank >= cap) {
      slot_pos[i] = -1;
      kept_gate[i] = 0.0f;
      continue;
    }
    const int64_t p = next[static_cast<size_t>(choice[i])]++;
    slot_pos[i] = static_cast<int32_t>(p);
    kept_gate[i] = gate[i];
    row_token[p] = static_cast<int32_t>(i / k);
    row_gate[p] = gate[i];
  }
}

void seq_stats(float* stats, const int32_t* tok_seq, const int32_t* choice, const int32_t* slot_pos,
               const float* score, const float* pnorm, const float* lse, int64_t N, int64_t S, int64_t E,
               int64_t k) {
  std::vector<double> cnt(static_cast<size_t>(S * E), 0.0), psum(static_cast<size_t>(S * E), 0.0);
  double dropped = 0, zsq = 0;
  for (int64_t t = 0; t < N; ++t) {
    const int32_t s = tok_seq[t];
    if (s < 0) continue;
    for (int64_t e = 0; e < E; ++e)
      psum[static_cast<size_t>(s * E + e)] += static_cast<double>(score[t * E + e]) / pnorm[t];
    for (int64_t j = 0; j < k; ++j) {
      cnt[static_cast<size_t>(s * E + choice[t * k + j])] += 1;
      dropped += slot_pos[t * k + j] < 0;
    }
    zsq += static_cast<double>(lse[t]) * lse[t];
  }
  for (int64_t i = 0; i < S * E; ++i) {
    stats[i] = static_cast<float>(cnt[static_cast<size_t>(i)]);
    stats[S * E + i] = static_cast<float>(psum[static_cast<size_t>(i)]);
  }
  stats[2 * S * E] = static_cast<float>(dropped);
  stats[2 * S * E + 1] = static_cast<float>(zsq);
}

std::vector<float> balance_probs(const Routing& r, const RouterSpec& spec) {
  if (!spec.sigmoid) return r.score;
  const int64_t E = spec.experts;
  std::vector<float> P(r.score.size());
  for (int64_t t = 0; t < r.rows; ++t) {
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += r.score[static_cast<size_t>(t * E + e)];
    for (int64_t e = 0; e < E; ++e)
      P[static_cast<size_t>(t * E + e)] = static_cast<float>(r.score[static_cast<size_t>(t * E + e)] / sum);
  }
  return P;
}

void router_backward(float* dlogits, const Routing& r, const RouterSpec& spec, const float* logits,
                     const float* dgate, const float* dP, const float* dz) {
  const int64_t E = spec.experts, k = spec.top_k;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < r.rows; ++t) {
    std::vector<double> ds(static_cast<size_t>(E), 0.0);
    const float* s = r.score.data() + t * E;
    // Gates -> raw scores of the chosen experts.
    const int64_t base = t * k;
    double raw_sum = 0, dot = 0;
    for (int64_t j = 0; j < k; ++j) {
      const size_t i = static_cast<size_t>(base + j);
      raw_sum += s[r.choice[i]];
      if (r.kept[i]) dot += static_cast<double>(dgate[i]) * r.gate[i];
    }
    for (int64_t j = 0; j < k; ++j) {
      const size_t i = static_cast<size_t>(base + j);
      const double dg = r.kept[i] ? dgate[i] : 0.0;
      ds[static_cast<size_t>(r.choice[i])] += spec.renormalize ? (dg - dot) / raw_sum : dg;
    }
    // Balancing probabilities: P = p (softmax) or s / sum(s) (sigmoid).
    if (dP) {
      const float* dp = dP + t * E;
      if (spec.sigmoid) {
        double sum = 0, pdot = 0;
        for (int64_t e = 0; e < E; ++e) sum += s[e];
        for (int64_t e = 0; e < E; ++e) pdot += static_cast<double>(dp[e]) * s[e] / sum;
        for (int64_t e = 0; e < E; ++e) ds[static_cast<size_t>(e)] += (dp[e] - pdot) / sum;
      } else {
        for (int64_t e = 0; e < E; ++e) ds[static_cast<size_t>(e)] += dp[e];
      }
    }
    float* dl = dlogits + t * E;
    if (spec.sigmoid) {
      for (int64_t e = 0; e < E; ++e)
        dl[e] = static_cast<float>(ds[static_cast<size_t>(e)] * s[e] * (1.0 - s[e]));
    } else {
      double pdot = 0;
      for (int64_t e = 0; e < E; ++e) pdot += ds[static_cast<size_t>(e)] * s[e];
      for (int64_t e = 0; e < E; ++e) dl[e] = static_cast<float>(s[e] * (ds[static_cast<size_t>(e)] - pdot));
    }
    // z = logsumexp(l): dz/dl = softmax(l).
    if (dz && dz[t] != 0.0f) {
      const float* l = logits + t * E;
      const float mx = *std::max_element(l, l + E);
      double sum = 0;
      for (int64_t e = 0; e < E; ++e) sum += std::exp(static_cast<double>(l[e] - mx));
      for (int64_t e = 0; e < E; ++e)
        dl[e] += static_cast<float>(dz[t] * std::exp(static_cast<double>(l[e] - mx)) / sum);
    }
  }
}

RoutedTokens route_tokens(const Tensor& logits, const Tensor* bias, const RouterSpec& spec) {
  const int64_t N = logits.size(0), E = spec.experts, k = spec.top_k;
  NDT_CHECK(logits.dtype() == DType::F32 && logits.size(-1) == E, "router: logits must be f32 (N, {})", E);
  NDT_CHECK(k >= 1 && k <= E, "router: top_k {} must be in [1, experts {}]", k, E);
  const Device dev = logits.device();
  const int64_t cap = expert_capacity(spec, N);
  RoutedTokens r;
  r.score = Tensor::empty({N, E}, DType::F32, dev);
  r.choice = Tensor::empty({N * k}, DType::I32, dev);
  r.gate = Tensor::empty({N * k}, DType::F32, dev);
  r.lse = Tensor::empty({N}, DType::F32, dev);
  r.pnorm = Tensor::empty({N}, DType::F32, dev);
  r.slot_pos = Tensor::empty({N * k}, DType::I32, dev);
  r.kept_gate = Tensor::empty({N * k}, DType::F32, dev);
  Tensor row_token = Tensor::empty({N * k}, DType::I32, dev),
         row_gate = Tensor::empty({N * k}, DType::F32, dev);
  Tensor counts = Tensor::empty({E}, DType::I32, dev);
  const float* b = bias ? bias->f32() : nullptr;
  if (bias)
    NDT_CHECK(bias->device() == dev && bias->numel() == E, "router: bias must be ({}) on the logits' device",
              E);
  if (dev == Device::CPU) {
    route_tokens(logits.f32(), b, N, spec, r.score.f32(), r.choice.i32(), r.gate.f32(), r.lse.f32(),
                 r.pnorm.f32());
    expert_permutation(r.choice.i32(), r.gate.f32(), N, k, E, cap, r.slot_pos.i32(), r.kept_gate.f32(),
                       row_token.i32(), row_gate.f32(), counts.i32());
  } else {
#ifdef NDT_HAVE_CUDA
    cuda::moe_route(r.score.f32(), r.choice.i32(), r.gate.f32(), r.lse.f32(), r.pnorm.f32(), logits.f32(), b,
                    N, E, k, spec.sigmoid, spec.renormalize, cuda::stream());
    cuda::moe_permutation(r.slot_pos.i32(), r.kept_gate.f32(), row_token.i32(), row_gate.f32(), counts.i32(),
                          r.choice.i32(), r.gate.f32(), N, k, E, cap, cuda::stream());
#else
    NDT_FAIL("router: logits on {} in a build without CUDA", device_name(dev));
#endif
  }
  int64_t R = 0;
  for (int32_t c : counts.to_vector<int32_t>()) {
    r.counts.push_back(c);
    R += c;
  }
  r.row_token = row_token.view_at(0, {R});
  r.row_gate = row_gate.view_at(0, {R});
  return r;
}

std::vector<float> seq_stats(const RoutedTokens& r, const Tensor& tok_seq, int64_t S,
                             const RouterSpec& spec) {
  const int64_t N = r.lse.numel(), E = spec.experts, k = spec.top_k;
  NDT_CHECK(tok_seq.numel() == N && tok_seq.device() == r.lse.device(),
            "seq_stats: tok_seq ({}) on the routing's device", N);
  Tensor stats = Tensor::empty({2 * S * E + 2}, DType::F32, r.lse.device());
  if (r.lse.device() == Device::CPU) {
    seq_stats(stats.f32(), tok_seq.i32(), r.choice.i32(), r.slot_pos.i32(), r.score.f32(), r.pnorm.f32(),
              r.lse.f32(), N, S, E, k);
  } else {
#ifdef NDT_HAVE_CUDA
    cuda::moe_seq_stats(stats.f32(), tok_seq.i32(), r.choice.i32(), r.slot_pos.i32(), r.score.f32(),
                        r.pnorm.f32(), r.lse.f32(), N, S, E, k, cuda::stream());
#endif
  }
  return stats.to_vector<float>();
}

void router_backward(Tensor& dlogits, const RoutedTokens& r, const RouterSpec& spec, const Tensor& logits,
                     const Tensor& dgate, const RouterLossGrad* loss) {
  const int64_t N = logits.size(0), E = spec.experts, k = spec.top_k;
  NDT_CHECK(dlogits.shape() == logits.shape() && dgate.numel() == N * k, "router_backward: shapes");
  const bool has_seq = loss && loss->tok_seq.defined();
  const bool has_aux = has_seq && loss->aux_w.defined();
  const double z_scale = has_seq ? loss->z_scale : 0.0;
  if (logits.device() == Device::CPU) {
    Routing h;
    h.rows = N;
    h.score = r.score.to_vector<float>();
    h.choice = r.choice.to_vector<int32_t>();
    h.gate = r.gate.to_vector<float>();
    h.kept.resize(static_cast<size_t>(N * k));
    for (int64_t i = 0; i < N * k; ++i) h.kept[static_cast<size_t>(i)] = r.slot_pos.i32()[i] >= 0;
    std::vector<float> dP, dz;
    if (has_aux) dP.assign(static_cast<size_t>(N * E), 0.0f);
    if (z_scale != 0) dz.assign(static_cast<size_t>(N), 0.0f);
    for (int64_t t = 0; has_seq && t < N; ++t) {
      const int32_t s = loss->tok_seq.i32()[t];
      if (s < 0) continue;
      if (has_aux)
        for (int64_t e = 0; e < E; ++e)
          dP[static_cast<size_t>(t * E + e)] =
              static_cast<float>(static_cast<double>(loss->aux_w.f32()[s]) * loss->aux_cnt.f32()[s * E + e]);
      if (z_scale != 0) dz[static_cast<size_t>(t)] = static_cast<float>(z_scale * r.lse.f32()[t]);
    }
    router_backward(dlogits.f32(), h, spec, logits.f32(), dgate.f32(), has_aux ? dP.data() : nullptr,
                    z_scale != 0 ? dz.data() : nullptr);
    return;
  }
#ifdef NDT_HAVE_CUDA
  cuda::moe_router_backward(dlogits.f32(), r.score.f32(), r.choice.i32(), r.gate.f32(), r.slot_pos.i32(),
                            logits.f32(), r.lse.f32(), dgate.f32(), has_seq ? loss->tok_seq.i32() : nullptr,
                            has_aux ? loss->aux_w.f32() : nullptr, has_aux ? loss->aux_cnt.f32() : nullptr,
                            z_scale, N, E, k, spec.sigmoid, spec.renormalize, cuda::stream());
#else
  NDT_FAIL("router_backward: logits on {} in a build without CUDA", device_name(logits.device()));
#endif
}

}  // namespace ndt
