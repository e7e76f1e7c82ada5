#include "posttrain/run.h"

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>

#include "core/check.h"
#include "posttrain/dpo.h"
#include "posttrain/grpo.h"
#include "train/metrics.h"
#include "train/safetensors.h"

namespace ndt {

namespace {

std::string progress_line(const PosttrainStep& s, const std::string& algo) {
  const auto& m = s.metrics;
  auto num = [&](const char* k) { return m.contains(k) ? m[k].get<double>() : 0.0; };
  if (algo == "dpo")
    return fmt::format("loss {:.4f} | acc {:.2f} | margin {:+.3f} | gnorm {:.3f} | {}", s.train.loss,
                       num("reward_accuracy"), num("reward_margin"), s.train.grad_norm,
                       format_duration(s.train.seconds));
  std::string line = fmt::format("reward {:.3f} | solved {:.2f} | len {:.1f}", num("reward_mean"),
                                 num("solved_rate"), num("response_len"));
  if (!s.updated) return line + " | no informative rollouts: no update";
  return line +
         fmt::format(
             " | loss {:+.4f} | gnorm {:.3f} | clip {:.3f} | gen_kl {:.1e} | gen {} lp {} train {} refit {}",
             s.train.loss, s.train.grad_norm, num("clip_fraction"), num("gen_kl_error"),
             format_duration(num("time_generate")), format_duration(num("time_logprobs")),
             format_duration(num("time_train")), format_duration(num("refit_seconds")));
}

}  // namespace

PosttrainSession::PosttrainSession(Trainer& trainer, const Tokenizer& tok, Communicator& world)
    : cfg_(trainer.config()), tok_(tok) {
  const PosttrainConfig& pc = cfg_.posttrain;
  NDT_CHECK(pc.algo == "dpo" || pc.algo == "grpo", "post-training needs posttrain.algo dpo or grpo, got '{}'",
            pc.algo);
  if (pc.algo == "grpo" || pc.task != "jsonl") task_ = make_reward_task(cfg_, tok).value();
  if (pc.algo == "dpo") prefs_ = make_preference_data(cfg_, tok).value();
  if (task_) gen_ = std::make_unique<Generator>(cfg_, world, GenLayout{pc.gen_tp});
  if (pc.algo == "grpo") {
    grpo_ = std::make_unique<GrpoRunner>(trainer, *gen_, *task_, tok);
    policy_ = &grpo_->sampler();
  } else {
    dpo_ = std::make_unique<DpoRunner>(trainer, *prefs_);
    if (gen_) policy_ = (sampler_ = std::make_unique<PolicySampler>(trainer, *gen_)).get();
  }
}

PosttrainSession::~PosttrainSession() = default;

PosttrainStep PosttrainSession::step(int64_t step) {
  if (grpo_) return grpo_->step(step);
  PosttrainStep s = dpo_->step(step);
  if (policy_) policy_->mark_stale();
  return s;
}

nlohmann::ordered_json PosttrainSession::evaluate() {
  const int64_t n = cfg_.posttrain.eval_samples;
  nlohmann::ordered_json j = nlohmann::ordered_json::object();  // eval_samples 0: nothing to report
  if (dpo_) j.update(dpo_->evaluate(n));
  if (policy_ && n > 0) j["exact_match"] = policy_->exact_match(*task_, tok_, n);
  return j;
}

void run_posttrain(Trainer& trainer, const Tokenizer& tok, Communicator& world) {
  const Config& cfg = trainer.config();
  const PosttrainConfig& pc = cfg.posttrain;
  const bool logger = world.rank() == 0;
  const TrainConfig& tc = cfg.train;
  PosttrainSession session(trainer, tok, world);

  std::unique_ptr<MetricsWriter> metrics;
  if (logger) {
    std::filesystem::create_directories(tc.out_dir);
    std::ofstream(std::filesystem::path(tc.out_dir) / "config.yaml") << config_to_yaml(cfg);
    metrics = std::make_unique<MetricsWriter>(MetricsWriter::open(tc.out_dir).value());
    std::printf("ndtrain %s: %s model, task %s, %d rank(s), %lld steps, generation tp=%lld\n",
                pc.algo.c_str(), cfg.model.style.c_str(), pc.task.c_str(), world.size(),
                static_cast<long long>(tc.steps), static_cast<long long>(pc.gen_tp));
    std::fflush(stdout);
  }
  std::vector<std::pair<int64_t, double>> reward_curve, eval_curve;
  bool eval_curve_is_exact = false;
  auto evaluate = [&](int64_t step) {
    nlohmann::ordered_json j = {{"type", "eval"}, {"step", step}};
    j.update(session.evaluate());
    if (!logger) return;
    std::string line = fmt::format("eval @ step {}:", step);
    for (const auto& [k, v] : j.items())
      if (v.is_number_float()) line += fmt::format(" {} {:.4f}", k, v.get<double>());
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
    eval_curve_is_exact = j.contains("exact_match");
    if (j.contains("exact_match"))
      eval_curve.emplace_back(step, j["exact_match"].get<double>());
    else if (j.contains("eval_reward_accuracy"))
      eval_curve.emplace_back(step, j["eval_reward_accuracy"].get<double>());
    metrics->write(j).throw_if_error();
  };

  const auto start = std::chrono::steady_clock::now();
  evaluate(0);
  for (int64_t step = 0; step < tc.steps; ++step) {
    PosttrainStep s = session.step(step);
    if (logger) {
      nlohmann::ordered_json j = {{"type", "train"}, {"step", step}};
      if (s.updated) {
        j["loss"] = s.train.loss;
        j["grad_norm"] = s.train.grad_norm;
        j["lr"] = s.train.lr;
      }
      j.update(s.metrics);
      j["seconds"] = s.train.seconds;
      metrics->write(j).throw_if_error();
      const double curve =
          session.is_grpo() ? s.metrics.value("reward_mean", 0.0) : s.metrics.value("reward_accuracy", 0.0);
      reward_curve.emplace_back(step, curve);
      if ((step + 1) % tc.log_every == 0 || step == 0 || step + 1 == tc.steps)
        std::printf("step %lld/%lld | %s\n", static_cast<long long>(step + 1),
                    static_cast<long long>(tc.steps), progress_line(s, pc.algo).c_str());
      std::fflush(stdout);
    }
    if (tc.eval_every > 0 && (step + 1) % tc.eval_every == 0 && step + 1 < tc.steps) evaluate(step + 1);
  }
  evaluate(tc.steps);
  const auto full = trainer.full_weights();
  if (logger) {
    const std::filesystem::path dir(tc.out_dir);
    save_safetensors((dir / "model.safetensors").string(), full,
                     {{"format", "ndtrain"}, {"style", cfg.model.style}})
        .throw_if_error();
    const bool g = pc.algo == "grpo";
    write_loss_svg(reward_curve, eval_curve, (dir / "reward.svg").string(),
                   fmt::format("{} on {} ({} steps)", pc.algo, pc.task, tc.steps), false,
                   {g ? "rollout reward" : "reward accuracy",
                    eval_curve_is_exact ? "held-out exact match" : "held-out accuracy"})
        .throw_if_error();
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("done in %s; wrote %s/{model.safetensors, metrics.jsonl, reward.svg, config.yaml}\n",
                format_duration(secs).c_str(), tc.out_dir.c_str());
    std::fflush(stdout);
  }
}

}  // namespace ndt
