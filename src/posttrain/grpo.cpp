#include "posttrain/grpo.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "core/check.h"
#include "posttrain/grpo_loss.h"
#include "posttrain/rollout.h"

namespace ndt {

namespace {
double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}
}  // namespace

double PolicySampler::refit() {
  if (!stale_) return 0;
  const auto t0 = std::chrono::steady_clock::now();
  // Device to device when the training store holds this rank's slices; else, for pipeline stages of whole
  // tensors, broadcast over the stages on the device; else gathered through the host from any layout.
  if (!gen_.refit_from(trainer_.params())) {
    const auto on_device = trainer_.full_weights_on_device();
    if (!on_device || !gen_.refit_from_full(*on_device)) gen_.load_full(trainer_.full_weights());
  }
  stale_ = false;
  return seconds_since(t0);
}

double reward_of(const RewardTask& task, const Tokenizer& tok, const RlPrompt& prompt,
                 const std::vector<int32_t>& completion, int64_t prompt_index, int64_t sample) {
  std::vector<int32_t> body = completion;
  if (!body.empty() && body.back() == tok.eos_id()) body.pop_back();
  const std::string text = tok.decode(body);
  double r = 0;
  try {
    r = task.reward(prompt, text);
  } catch (const std::exception& e) {
    NDT_FAIL("reward of task '{}' failed on prompt {} sample {} (completion \"{}\"): {}", task.name(),
             prompt_index, sample, text, e.what());
  }
  NDT_CHECK(std::isfinite(r), "reward of task '{}' is {} on prompt {} sample {}", task.name(), r,
            prompt_index, sample);
  return r;
}

double PolicySampler::exact_match(const RewardTask& task, const Tokenizer& tok, int64_t n) {
  refit();
  const std::vector<RlPrompt> prompts = task.eval_prompts(n);
  if (prompts.empty()) return -1;
  std::vector<GenRequest> reqs;
  for (size_t i = 0; i < prompts.size(); ++i) reqs.push_back({prompts[i].prompt, i, 0});
  SamplingParams sp;
  sp.temperature = 0;
  sp.max_new_tokens = task.max_answer_tokens();
  sp.stop_ids = {tok.eos_id()};
  const auto outs = gen_.generate(reqs, sp, 0);
  int64_t solved = 0;
  for (size_t i = 0; i < prompts.size(); ++i)
    solved += reward_of(task, tok, prompts[i], outs[i].tokens, static_cast<int64_t>(i), 0) >= 1.0;
  return static_cast<double>(solved) / static_cast<double>(prompts.size());
}

GrpoRunner::GrpoRunner(Trainer& trainer, Generator& gen, const RewardTask& task, const Tokenizer& tok)
    : trainer_(trainer), sampler_(trainer, gen), task_(task), tok_(tok) {
  if (trainer_.config().posttrain.kl_coef > 0) trainer_.swap_weights(reference_);  // takes a copy
}

PosttrainStep GrpoRunner::step(int64_t step) {
  const Config& cfg = trainer_.config();
  const PosttrainConfig& pc = cfg.posttrain;
  const RunComms& c = trainer_.comms();
  const int64_t P = pc.prompts_per_step, G = pc.samples_per_prompt;
  PosttrainStep out;
  auto& m = out.metrics;

  const double t_refit = sampler_.refit();

  // Rollouts: G samples of each of this step's prompts, keyed by (prompt index, sample) for the RNG.
  auto t0 = std::chrono::steady_clock::now();
  std::vector<RlPrompt> prompts;
  std::vector<GenRequest> reqs;
  for (int64_t j = 0; j < P; ++j) {
    const int64_t idx = step * P + j;
    prompts.push_back(task_.prompt(idx));
    for (int64_t g = 0; g < G; ++g)
      reqs.push_back({prompts.back().prompt, static_cast<uint64_t>(idx), static_cast<uint64_t>(g)});
  }
  SamplingParams sp;
  sp.temperature = pc.temperature;
  sp.top_k = pc.top_k;
  sp.top_p = pc.top_p;
  sp.max_new_tokens = pc.max_new_tokens;
  sp.stop_ids = {tok_.eos_id()};
  sp.seed = static_cast<uint64_t>(cfg.train.seed);
  const std::vector<GenOutput> gens = sampler_.generator().generate(reqs, sp, step);
  const double t_gen = seconds_since(t0);

  std::vector<double> rewards(reqs.size());
  double len_sum = 0, solved = 0;
  for (size_t i = 0; i < reqs.size(); ++i) {
    rewards[i] =
        reward_of(task_, tok_, prompts[i / static_cast<size_t>(G)], gens[i].tokens,
                  static_cast<int64_t>(reqs[i].prompt_key), static_cast<int64_t>(reqs[i].sample_key));
    len_sum += static_cast<double>(gens[i].tokens.size());
    solved += rewards[i] >= 1.0;
  }
  const std::vector<double> adv = group_advantages(rewards, G, pc.baseline, pc.std_normalize, pc.adv_eps);
  std::vector<bool> keep_group(static_cast<size_t>(P), true);
  if (pc.dynamic_sampling) keep_group = informative_groups(rewards, G);

  // The kept rollouts as training samples: prompt + completion, loss on the completion.
  std::vector<Sample> samples;
  std::vector<size_t> source;  // kept sample -> rollout index
  for (size_t i = 0; i < reqs.size(); ++i) {
    if (!keep_group[i / static_cast<size_t>(G)] || gens[i].tokens.empty()) continue;
    Sample s;
    s.tokens = reqs[i].prompt;
    s.tokens.insert(s.tokens.end(), gens[i].tokens.begin(), gens[i].tokens.end());
    s.loss_mask.assign(s.tokens.size(), 0);
    std::fill(s.loss_mask.begin() + static_cast<std::ptrdiff_t>(reqs[i].prompt.size()), s.loss_mask.end(), 1);
    NDT_CHECK(static_cast<int64_t>(s.tokens.size()) <= cfg.data.seq_len + 1,
              "GRPO: prompt {} ({} tokens) + completion ({} tokens) exceeds data.seq_len + 1 = {}; raise "
              "data.seq_len or lower posttrain.max_new_tokens",
              reqs[i].prompt_key, reqs[i].prompt.size(), gens[i].tokens.size(), cfg.data.seq_len + 1);
    samples.push_back(std::move(s));
    source.push_back(i);
  }
  double mean = 0, var = 0;
  for (double r : rewards) mean += r / static_cast<double>(rewards.size());
  for (double r : rewards) var += (r - mean) * (r - mean) / static_cast<double>(rewards.size());
  m["reward_mean"] = mean;
  m["reward_std"] = std::sqrt(var);
  m["solved_rate"] = solved / static_cast<double>(rewards.size());
  m["response_len"] = len_sum / static_cast<double>(rewards.size());
  m["samples_kept"] = static_cast<int64_t>(samples.size());

  const int64_t n = static_cast<int64_t>(samples.size()), dp = c.dp->size();
  if (n < dp) {  // nothing (or too little) to learn from: every rank skips the update alike
    m["refit_seconds"] = t_refit;
    m["time_generate"] = t_gen;
    return out;
  }

  // Old-policy (and reference) logprobs of every kept rollout under the training layout.
  t0 = std::chrono::steady_clock::now();
  const std::vector<SampleScores> old = trainer_.score(samples, 1);
  std::vector<SampleScores> ref;
  if (pc.kl_coef > 0) {
    trainer_.swap_weights(reference_);
    ref = trainer_.score(samples, 1);
    trainer_.swap_weights(reference_);
  }
  const double t_lp = seconds_since(t0);

  std::vector<GrpoSample> data(samples.size());
  std::vector<std::vector<float>> train_lp(samples.size()), gen_lp(samples.size());
  int64_t loss_tokens = 0;
  for (size_t k = 0; k < samples.size(); ++k) {
    const size_t i = source[k], plen = reqs[i].prompt.size(), ntok = samples[k].tokens.size();
    GrpoSample& d = data[k];
    d.advantage = adv[i];
    d.old_lp.assign(ntok, 0.0f);
    d.gen_lp.assign(ntok, 0.0f);
    if (pc.kl_coef > 0) d.ref_lp.assign(ntok, 0.0f);
    for (size_t j = 1; j < ntok; ++j) {
      d.old_lp[j] = old[k].logprob[j - 1];
      if (pc.kl_coef > 0) d.ref_lp[j] = ref[k].logprob[j - 1];
    }
    for (size_t t = 0; t < gens[i].tokens.size(); ++t) {
      d.gen_lp[plen + t] = gens[i].logprobs[t];
      train_lp[k].push_back(d.old_lp[plen + t]);
      gen_lp[k].push_back(gens[i].logprobs[t]);
    }
    d.loss_tokens = static_cast<int64_t>(gens[i].tokens.size());
    loss_tokens += d.loss_tokens;
  }
  const GenAgreement agree = gen_agreement(train_lp, gen_lp);

  // This DP rank's contiguous block of the kept rollouts.
  const int64_t b0 = c.dp->rank() * n / dp, b1 = (c.dp->rank() + 1) * n / dp;
  std::vector<Microbatch> mbs = trainer_.microbatches({samples.begin() + b0, samples.begin() + b1});
  for (Microbatch& mb : mbs)
    for (int64_t& id : mb.sample_ids)
      if (id >= 0) id += b0;

  GrpoLossOptions lo;
  lo.clip_low = pc.clip_low;
  lo.clip_high = pc.clip_high;
  lo.kl_coef = pc.kl_coef;
  lo.tis_cap = pc.tis_cap;
  lo.sequence_mean = pc.loss_agg == "sequence";
  lo.global_tokens = static_cast<double>(loss_tokens);
  lo.global_samples = static_cast<double>(n);
  t0 = std::chrono::steady_clock::now();
  double sums[4] = {0, 0, 0, 0};
  for (int64_t e = 0; e < pc.epochs; ++e) {
    GrpoLoss loss(data, lo);
    out.train = trainer_.train_step_on(step, mbs, loss);
    const auto& s = loss.sums();
    sums[0] += s.tokens;
    sums[1] += s.clipped;
    sums[2] += s.kl;
    sums[3] += s.ratio;
  }
  const double t_train = seconds_since(t0);
  sampler_.mark_stale();
  out.updated = true;
  // Token sums live on the last stage, one copy per TP rank: reduce like the loss (PP, then DP x CP).
  c.pp->all_reduce(sums, 4, DType::F64, ReduceOp::Sum);
  c.grad->all_reduce(sums, 4, DType::F64, ReduceOp::Sum);
  const double tok = std::max(1.0, sums[0]);
  m["clip_fraction"] = sums[1] / tok;
  m["kl_ref"] = sums[2] / tok;
  m["ratio_mean"] = sums[3] / tok;
  m["gen_kl_error"] = agree.gen_kl_error;
  m["token_prob_error"] = agree.token_prob_error;
  m["refit_seconds"] = t_refit;
  m["time_generate"] = t_gen;
  m["time_logprobs"] = t_lp;
  m["time_train"] = t_train;
  return out;
}

}  // namespace ndt
