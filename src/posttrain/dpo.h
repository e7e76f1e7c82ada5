#pragma once
// The DPO step (docs/posttraining.md): this step's preference pairs (chosen and rejected of a pair always in
// one microbatch or pack), the frozen reference's response logprobs (the initial policy, swapped in for
// scoring), then one optimizer step of the DPO loss (posttrain/dpo_loss.h). Pairs are split over DP in
// contiguous blocks.
#include <cstdint>
#include <vector>

#include "posttrain/grpo.h"
#include "posttrain/preferences.h"

namespace ndt {

class DpoRunner {
 public:
  DpoRunner(Trainer& trainer, const PreferenceData& data);
  PosttrainStep step(int64_t step);  // collective
  // Reward accuracy, margin and loss on `n` held-out pairs (pairs the run never trains on), no update.
  nlohmann::ordered_json evaluate(int64_t n);

 private:
  struct PairBatch {
    std::vector<Sample> samples;  // chosen, rejected, chosen, ...
    std::vector<int64_t> response_tokens;
  };
  PairBatch pairs(int64_t first_index, int64_t count, int64_t step) const;
  // Response logprob sums (or means) of every sample under the current weights.
  std::vector<double> response_scores(const PairBatch& b);

  Trainer& trainer_;
  const PreferenceData& data_;
  std::vector<Tensor> reference_;
};

}  // namespace ndt
