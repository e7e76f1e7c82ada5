#pragma once
// The post-training loop (posttrain.algo dpo | grpo): steps with a progress line, metrics.jsonl, held-out
// evaluation, reward.svg and the final model.safetensors (rank 0 writes files). Collective.
#include <memory>
#include <nlohmann/json.hpp>

#include "data/tokenizer.h"
#include "dist/communicator.h"
#include "train/trainer.h"

namespace ndt {

class DpoRunner;
class GrpoRunner;
class Generator;
class PolicySampler;
class PreferenceData;
class RewardTask;
struct PosttrainStep;

// Everything a post-training run holds besides the trainer: the task or preference data, the generator
// (GRPO, and DPO on embedded tasks for exact match) and the algorithm's runner. `world` is the
// generator's world (the trainer's own world for a run; a one-rank communicator for a reference).
class PosttrainSession {
 public:
  PosttrainSession(Trainer& trainer, const Tokenizer& tok, Communicator& world);
  ~PosttrainSession();
  PosttrainStep step(int64_t step);   // collective
  nlohmann::ordered_json evaluate();  // held-out metrics (collective)
  bool is_grpo() const { return grpo_ != nullptr; }

 private:
  const Config& cfg_;
  const Tokenizer& tok_;
  std::unique_ptr<RewardTask> task_;
  std::unique_ptr<PreferenceData> prefs_;
  std::unique_ptr<Generator> gen_;
  std::unique_ptr<GrpoRunner> grpo_;
  std::unique_ptr<DpoRunner> dpo_;
  std::unique_ptr<PolicySampler> sampler_;
  PolicySampler* policy_ = nullptr;
};

void run_posttrain(Trainer& trainer, const Tokenizer& tok, Communicator& world);

}  // namespace ndt
