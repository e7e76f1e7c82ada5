#pragma once
// The DPO loss (docs/posttraining.md) as a token loss. Samples come in pairs: sample 2p is pair p's chosen
// response, 2p + 1 its rejected one (both prompt + response, loss mask on the response). With
// s(x) = sum (or mean, dpo_logprob) over x's response tokens of log pi(token), and the same under the
// frozen reference, precomputed:
//   z_p = beta * [(s(c) - s_ref(c)) - (s(r) - s_ref(r))]
//   L   = (1/P) sum_p -log sigmoid(z_p)  +  sft_coef * (1/Nc) sum_{t in chosen} -lp_t
// P = pairs of the global batch, Nc = chosen response tokens of the global batch. A pair's rows may be
// spread over the CP ranks of its microbatch: the per-pair sums are reduced over CP before z is formed.
#include <cstdint>
#include <functional>
#include <vector>

#include "train/token_loss.h"

namespace ndt {

// -log sigmoid(z), the loss of one pair with margin z (stable for large |z|).
double dpo_pair_loss(double z);

struct DpoSample {
  double ref = 0;           // s_ref of this response (sum or mean, as `mean` says)
  int64_t loss_tokens = 0;  // response tokens (the mean's divisor)
};

struct DpoLossOptions {
  double beta = 0.1;
  bool mean = false;  // mean instead of sum of token logprobs per response
  double sft_coef = 0;
  double global_pairs = 1;
  double global_chosen_tokens = 1;
};

class DpoLoss final : public TokenLoss {
 public:
  // cp_sum: in-place sum over the CP group (identity without CP); cp_rank 0 counts the pair terms.
  DpoLoss(const std::vector<DpoSample>& samples, DpoLossOptions opt,
          std::function<void(double*, int64_t)> cp_sum, int cp_rank)
      : samples_(samples), opt_(opt), cp_sum_(std::move(cp_sum)), cp_rank_(cp_rank) {}
  double seed(const Microbatch& mb, const std::vector<float>& logprob, std::vector<float>& dloss) override;

  // Pair statistics on CP rank 0 of the last stage (reduce over PP, then DP x CP).
  struct Sums {
    double pairs = 0, correct = 0, margin = 0, chosen_reward = 0, rejected_reward = 0;
  };
  const Sums& sums() const { return sums_; }

 private:
  const std::vector<DpoSample>& samples_;
  DpoLossOptions opt_;
  std::function<void(double*, int64_t)> cp_sum_;
  int cp_rank_;
  Sums sums_;
};

}  // namespace ndt
