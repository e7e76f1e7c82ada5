#pragma once
// The GRPO step (docs/posttraining.md), colocated: refit the generator from the training layout, sample
// G completions per prompt, reward them, form group advantages, score the rollouts with the training
// policy (old logprobs) and the frozen reference, then take posttrain.epochs optimizer steps of the
// clipped policy loss (posttrain/grpo_loss.h). Every rank holds every rollout; each DP rank trains on its
// contiguous block of them.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <vector>

#include "data/tokenizer.h"
#include "generate/generator.h"
#include "posttrain/tasks.h"
#include "train/trainer.h"

namespace ndt {

struct PosttrainStep {
  StepStats train;                 // the last optimizer step of this batch (loss, grad norm, lr)
  bool updated = false;            // false: no informative samples this step (no optimizer step)
  nlohmann::ordered_json metrics;  // everything else, for the progress line and metrics.jsonl
};

// Generator refits and held-out greedy exact match, shared by the GRPO and DPO loops.
class PolicySampler {
 public:
  PolicySampler(Trainer& trainer, Generator& gen) : trainer_(trainer), gen_(gen) {}
  // Copies the training weights into the generator if they changed since the last refit; returns seconds.
  double refit();
  void mark_stale() { stale_ = true; }
  // Greedy completions of the first n held-out prompts scored by the task (reward >= 1 counts as solved).
  double exact_match(const RewardTask& task, const Tokenizer& tok, int64_t n);
  Generator& generator() { return gen_; }

 private:
  Trainer& trainer_;
  Generator& gen_;
  bool stale_ = true;
};

// Decoded completion text without the stop token, and the task's reward for it; a throwing reward is
// reported with the prompt and sample it failed on.
double reward_of(const RewardTask& task, const Tokenizer& tok, const RlPrompt& prompt,
                 const std::vector<int32_t>& completion, int64_t prompt_index, int64_t sample);

class GrpoRunner {
 public:
  GrpoRunner(Trainer& trainer, Generator& gen, const RewardTask& task, const Tokenizer& tok);
  PosttrainStep step(int64_t step);  // collective
  PolicySampler& sampler() { return sampler_; }

 private:
  Trainer& trainer_;
  PolicySampler sampler_;
  const RewardTask& task_;
  const Tokenizer& tok_;
  std::vector<Tensor> reference_;  // this rank's slices of the frozen reference policy
};

}  // namespace ndt
