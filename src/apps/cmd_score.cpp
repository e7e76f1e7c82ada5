// ndtrain score: per-token logprobs and top-k logits of dataset samples under any layout, written as
// JSONL in sample order (for RL reference-model KL, distillation targets, or checking a model).
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "apps/commands.h"
#include "apps/setup.h"
#include "mimo/mimo.h"
#include "parallel/layout.h"
#include "train/safetensors.h"
#include "train/trainer.h"

namespace ndt::app {

Runner add_score(CLI::App& app) {
  auto* cmd = app.add_subcommand("score", "Per-token logprobs and top-k logits of dataset samples (JSONL)");
  struct Opts {
    std::string config, weights, resume, out;
    std::vector<std::string> sets;
    int64_t samples = 16, top_k = 5;
  };
  auto o = std::make_shared<Opts>();
  cmd->add_option("-c,--config", o->config, "YAML config (model, data to score, layout)")->required();
  cmd->add_option("--set", o->sets,
                  "Config overrides, e.g. --set data.task=sft data.path=x.jsonl parallel.cp=2");
  cmd->add_option("--weights", o->weights, "model.safetensors written by a training run (default: the init)");
  cmd->add_option("--resume", o->resume, "Take the weights from a checkpoint (any layout)");
  cmd->add_option("-n,--samples", o->samples, "Score samples 0..n-1 of the dataset")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("-k,--top-k", o->top_k, "Largest logits kept per token")->check(CLI::Range(1, 1 << 16));
  cmd->add_option("-o,--out", o->out, "Output JSONL (rank 0 writes it)")->required();
  return [o](Communicator& world) {
    RunSetup s = load_run(world, o->config, o->sets);
    auto layout = Layout::create(s.cfg, world);
    agree_or_throw(layout.status(), world);
    Trainer trainer(s.cfg, layout.value()->comms(), *s.tok, *s.train, nullptr);
    const auto encoder = attach_encoder(trainer, world, layout.value().get(), *s.tok, *s.train);
    if (!o->resume.empty()) trainer.resume(o->resume);
    if (!o->weights.empty()) {
      auto file = open_safetensors(o->weights);
      agree_or_throw(file.status(), world);
      std::vector<std::pair<std::string, Tensor>> full;
      for (const auto& name : file.value().names()) full.emplace_back(name, file.value().read(name));
      trainer.load_weights(full);
    }
    int64_t n = o->samples;
    if (s.train->size() >= 0) n = std::min(n, s.train->size());
    std::vector<Sample> samples;
    for (int64_t i = 0; i < n; ++i) samples.push_back(s.train->get(i));
    const auto scores = trainer.score(samples, o->top_k);
    if (world.rank() == 0) {
      std::ofstream f(o->out);
      if (!f) NDT_FAIL("cannot write {}", o->out);
      for (int64_t i = 0; i < n; ++i) {
        const SampleScores& sc = scores[static_cast<size_t>(i)];
        const size_t rows = sc.logprob.size(), k = static_cast<size_t>(o->top_k);
        nlohmann::json j;
        j["sample"] = i;
        j["tokens"] = std::vector<int32_t>(
            samples[static_cast<size_t>(i)].tokens.begin(),
            samples[static_cast<size_t>(i)].tokens.begin() + static_cast<long>(rows) + 1);
        j["logprob"] = sc.logprob;
        j["topk_id"] = nlohmann::json::array();
        j["topk_logit"] = nlohmann::json::array();
        for (size_t t = 0; t < rows; ++t) {
          j["topk_id"].push_back(
              std::vector<int32_t>(sc.topk_id.begin() + t * k, sc.topk_id.begin() + (t + 1) * k));
          j["topk_logit"].push_back(
              std::vector<float>(sc.topk_value.begin() + t * k, sc.topk_value.begin() + (t + 1) * k));
        }
        f << j.dump() << "\n";
      }
      std::printf("scored %lld samples (%s) -> %s\n", static_cast<long long>(n),
                  layout.value()->grid().describe().c_str(), o->out.c_str());
    }
    return 0;
  };
}

}  // namespace ndt::app
