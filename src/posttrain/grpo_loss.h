#pragma once
// The GRPO policy loss (docs/posttraining.md) as a token loss. For a loss-bearing token t of sample i with
// advantage A_i, current logprob lp, the training policy's logprob before this rollout batch's first update
// old, the frozen reference's ref and the generator's gen:
//   ratio = exp(lp - old)
//   pg    = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)
//   k3    = exp(ref - lp) - (ref - lp) - 1                    (KL(pi || ref) estimator, >= 0)
//   w     = min(exp(old - gen), tis_cap)   (truncated importance weight; 1 when tis_cap = 0)
//   l_t   = w * pg + kl_coef * k3
// L = sum_t l_t / N (token: N = loss tokens of the global batch), or
// L = (1/S) sum_i (1/n_i) sum_{t in i} l_t (sequence: S = samples of the global batch, n_i their tokens).
#include <cstdint>
#include <vector>

#include "train/token_loss.h"

namespace ndt {

struct GrpoSample {
  double advantage = 0;
  // Per token index j (log p(tokens[j] | tokens[<j]), index 0 unused): old, reference, generator logprobs.
  std::vector<float> old_lp, ref_lp, gen_lp;
  int64_t loss_tokens = 0;
};

struct GrpoLossOptions {
  double clip_low = 0.2, clip_high = 0.2;
  double kl_coef = 0;
  double tis_cap = 0;
  bool sequence_mean = false;  // loss_agg "sequence"
  double global_tokens = 1;    // N (token aggregation)
  double global_samples = 1;   // S (sequence aggregation)
};

class GrpoLoss final : public TokenLoss {
 public:
  // samples: indexed by Microbatch::sample_ids (global rollout indices).
  GrpoLoss(const std::vector<GrpoSample>& samples, GrpoLossOptions opt) : samples_(samples), opt_(opt) {}
  double seed(const Microbatch& mb, const std::vector<float>& logprob, std::vector<float>& dloss) override;

  // Sums over this rank's loss rows since construction (reduce like the loss: over PP, then DP x CP).
  struct Sums {
    double tokens = 0, clipped = 0, kl = 0, ratio = 0;
  };
  const Sums& sums() const { return sums_; }

 private:
  const std::vector<GrpoSample>& samples_;
  GrpoLossOptions opt_;
  Sums sums_;
};

}  // namespace ndt
