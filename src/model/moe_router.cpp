#include "model/moe_router.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/check.h"

namespace ndt {

Routing route(const float* logits, const float* bias, int64_t N, const RouterSpec& spec) {
  const int64_t E = spec.experts, k = spec.top_k;
  NDT_CHECK(E >= 1 && k >= 1 && k <= E, "router: top_k {} must be in [1, experts {}]", k, E);
  Routing r;
  r.rows = N;
  r.score.resize(static_cast<size_t>(N * E));
  r.choice.resize(static_cast<size_t>(N * k));
  r.gate.resize(static_cast<size_t>(N * k));
  r.kept.assign(static_cast<size_t>(N * k), 1);
  // Tokens are independent: the host loop is spread over the cores (it sits between GPU kernels).
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) {
    std::vector<int32_t> idx(static_cast<size_t>(E));
    std::vector<float> sel(static_cast<size_t>(E));
    const float* l = logits + t * E;
    float* s = r.score.data() + t * E;
    if (spec.sigmoid) {
      for (int64_t e = 0; e < E; ++e) s[e] = 1.0f / (1.0f + std::exp(-l[e]));
    } else {
      const float mx = *std::max_element(l, l + E);
      double sum = 0;
      for (int64_t e = 0; e < E; ++e) sum += std::exp(static_cast<double>(l[e] - mx));
      for (int64_t e = 0; e < E; ++e)
        s[e] = static_cast<float>(std::exp(static_cast<double>(l[e] - mx)) / sum);
    }
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
      r.choice[static_cast<size_t>(t * k + j)] = e;
      r.gate[static_cast<size_t>(t * k + j)] = spec.renormalize ? static_cast<float>(s[e] / raw_sum) : s[e];
    }
  }
  if (spec.capacity_factor > 0) {
    const auto cap = static_cast<int64_t>(
        std::ceil(spec.capacity_factor * static_cast<double>(N * k) / static_cast<double>(E)));
    std::vector<int64_t> used(static_cast<size_t>(E), 0);
    for (int64_t i = 0; i < N * k; ++i)
      if (used[static_cast<size_t>(r.choice[static_cast<size_t>(i)])]++ >= cap)
        r.kept[static_cast<size_t>(i)] = 0;
  }
  return r;
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

}  // namespace ndt
