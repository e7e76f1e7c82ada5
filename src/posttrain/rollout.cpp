#include "posttrain/rollout.h"

#include <cmath>

#include "core/check.h"

namespace ndt {

std::vector<double> group_advantages(const std::vector<double>& rewards, int64_t group,
                                     const std::string& baseline, bool std_normalize, double eps) {
  const int64_t n = static_cast<int64_t>(rewards.size());
  NDT_CHECK(group >= 1 && n % group == 0, "{} rewards do not form groups of {}", n, group);
  NDT_CHECK(baseline == "mean" || baseline == "loo", "unknown advantage baseline '{}'", baseline);
  std::vector<double> adv(rewards.size());
  for (int64_t g = 0; g < n; g += group) {
    double sum = 0;
    for (int64_t i = g; i < g + group; ++i) sum += rewards[static_cast<size_t>(i)];
    const double mean = sum / static_cast<double>(group);
    double var = 0;
    for (int64_t i = g; i < g + group; ++i) {
      const double d = rewards[static_cast<size_t>(i)] - mean;
      var += d * d;
    }
    const double sd = group > 1 ? std::sqrt(var / static_cast<double>(group - 1)) : 0.0;
    for (int64_t i = g; i < g + group; ++i) {
      const double r = rewards[static_cast<size_t>(i)];
      const double b = baseline == "loo" && group > 1 ? (sum - r) / static_cast<double>(group - 1) : mean;
      // All-equal rewards have sd = 0 and r = b: no signal, also when eps = 0.
      adv[static_cast<size_t>(i)] = !std_normalize ? r - b : sd + eps > 0 ? (r - b) / (sd + eps) : 0.0;
    }
  }
  return adv;
}

std::vector<bool> informative_groups(const std::vector<double>& rewards, int64_t group) {
  std::vector<bool> keep;
  for (size_t g = 0; g < rewards.size(); g += static_cast<size_t>(group)) {
    bool varied = false;
    for (size_t i = g + 1; i < g + static_cast<size_t>(group); ++i)
      varied = varied || rewards[i] != rewards[g];
    keep.push_back(varied);
  }
  return keep;
}

GenAgreement gen_agreement(const std::vector<std::vector<float>>& train_lp,
                           const std::vector<std::vector<float>>& gen_lp) {
  NDT_CHECK(train_lp.size() == gen_lp.size(), "{} training vs {} generator logprob rows", train_lp.size(),
            gen_lp.size());
  GenAgreement g;
  for (size_t i = 0; i < train_lp.size(); ++i) {
    NDT_CHECK(train_lp[i].size() == gen_lp[i].size(), "sample {}: {} vs {} logprobs", i, train_lp[i].size(),
              gen_lp[i].size());
    for (size_t t = 0; t < train_lp[i].size(); ++t) {
      const double d = static_cast<double>(train_lp[i][t]) - gen_lp[i][t];
      g.gen_kl_error += std::exp(d) - d - 1.0;
      g.token_prob_error += std::abs(std::exp(static_cast<double>(train_lp[i][t])) -
                                     std::exp(static_cast<double>(gen_lp[i][t])));
      ++g.tokens;
    }
  }
  if (g.tokens > 0) {
    g.gen_kl_error /= static_cast<double>(g.tokens);
    g.token_prob_error /= static_cast<double>(g.tokens);
  }
  return g;
}

}  // namespace ndt
