#pragma once
// Losses that are functions of per-token target logprobs (DESIGN.md §6). Cross-entropy, DPO and GRPO all
// depend on the model only through lp_t = log p(target_t) of a microbatch's loss-bearing rows, so a loss
// is an object that, given those logprobs (after the last stage's forward), returns its contribution and
// the seed of the backward per row: dloss_t = dL/d(-lp_t) (what the vocab-parallel softmax backward
// multiplies (softmax - onehot) by). The model and the pipeline know nothing else about the loss.
#include <cstdint>
#include <vector>

#include "data/dataset.h"

namespace ndt {

class TokenLoss {
 public:
  virtual ~TokenLoss() = default;
  // Called once per microbatch on every rank of the last pipeline stage, in schedule order (so a loss
  // may run collectives over the CP group here: all CP ranks of the stage call it for the same
  // microbatch). mb is this rank's (CP-sharded) microbatch, logprob its (T) rows on the host. Fills
  // dloss (T) and returns this rank's contribution to the loss (the caller sums over PP and DP x CP).
  virtual double seed(const Microbatch& mb, const std::vector<float>& logprob, std::vector<float>& dloss) = 0;
};

// Where a microbatch row's target comes from: row t predicts token `token` (>= 1) of sample `sample`
// (an entry of Microbatch::sample_ids; -1 for padding sequences).
struct RowSource {
  int64_t sample = -1;
  int64_t token = 0;
};
// One entry per row of mb (CP shards included: positions are global).
std::vector<RowSource> row_sources(const Microbatch& mb);

}  // namespace ndt
