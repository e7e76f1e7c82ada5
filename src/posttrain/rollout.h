#pragma once
// Pieces of a GRPO step that are pure functions of the rollouts (the same on every rank, no collectives):
// group advantages and the generator-vs-trainer agreement metrics.
#include <cstdint>
#include <string>
#include <vector>

namespace ndt {

// Advantages of G samples per prompt (rewards grouped consecutively, G at a time):
//   baseline "mean": b_i = mean of the group; "loo": b_i = mean of the group without sample i;
//   A_i = (r_i - b_i) / (std + eps) when std_normalize (std: the group's unbiased standard deviation,
//   0 for G = 1), else r_i - b_i.
std::vector<double> group_advantages(const std::vector<double>& rewards, int64_t group,
                                     const std::string& baseline, bool std_normalize, double eps);

// Whether group g's rewards are not all equal (dynamic sampling keeps only those: the others have zero
// advantage everywhere and only dilute the batch).
std::vector<bool> informative_groups(const std::vector<double>& rewards, int64_t group);

// Agreement of the generator's and the training policy's logprobs on the generated tokens:
//   gen_kl_error     = mean_t [exp(d_t) - d_t - 1], d_t = lp_train - lp_gen   (k3 estimate of
//                      KL(generator || trainer) from tokens the generator sampled; >= 0, 0 iff equal)
//   token_prob_error = mean_t |exp(lp_train) - exp(lp_gen)|
struct GenAgreement {
  double gen_kl_error = 0, token_prob_error = 0;
  int64_t tokens = 0;
};
GenAgreement gen_agreement(const std::vector<std::vector<float>>& train_lp,
                           const std::vector<std::vector<float>>& gen_lp);

}  // namespace ndt
