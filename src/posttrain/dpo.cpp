#include "posttrain/dpo.h"

#include <chrono>
#include <cmath>

#include "core/check.h"
#include "posttrain/dpo_loss.h"

namespace ndt {

DpoRunner::DpoRunner(Trainer& trainer, const PreferenceData& data) : trainer_(trainer), data_(data) {
  trainer_.swap_weights(reference_);  // takes a copy: the frozen reference
}

DpoRunner::PairBatch DpoRunner::pairs(int64_t first_index, int64_t count, int64_t step) const {
  const Config& cfg = trainer_.config();
  PairBatch b;
  for (int64_t j = 0; j < count; ++j) {
    const int64_t idx = first_index >= 0
                            ? first_index + j
                            : sample_index(cfg.data.seed, step, j, count, data_.size(), cfg.data.shuffle);
    const PreferencePair p = data_.get(idx);
    for (const auto* resp : {&p.chosen, &p.rejected}) {
      Sample s = prompt_response_sample(p.prompt, *resp);
      NDT_CHECK(static_cast<int64_t>(s.tokens.size()) <= cfg.data.seq_len + 1,
                "DPO: pair {} has {} tokens (prompt + response), more than data.seq_len + 1 = {}", idx,
                s.tokens.size(), cfg.data.seq_len + 1);
      b.response_tokens.push_back(static_cast<int64_t>(resp->size()));
      b.samples.push_back(std::move(s));
    }
  }
  return b;
}

std::vector<double> DpoRunner::response_scores(const PairBatch& b) {
  const bool mean = trainer_.config().posttrain.dpo_logprob == "mean";
  const auto sc = trainer_.score(b.samples, 1);
  std::vector<double> out(b.samples.size(), 0.0);
  for (size_t i = 0; i < b.samples.size(); ++i) {
    for (size_t t = 1; t < b.samples[i].tokens.size(); ++t)
      if (b.samples[i].loss_mask[t]) out[i] += sc[i].logprob[t - 1];
    if (mean) out[i] /= static_cast<double>(std::max<int64_t>(1, b.response_tokens[i]));
  }
  return out;
}

PosttrainStep DpoRunner::step(int64_t step) {
  const Config& cfg = trainer_.config();
  const PosttrainConfig& pc = cfg.posttrain;
  const RunComms& c = trainer_.comms();
  const int64_t P = pc.pairs_per_step, dp = c.dp->size();
  PosttrainStep out;
  const PairBatch b = pairs(-1, P, step);

  auto t0 = std::chrono::steady_clock::now();
  trainer_.swap_weights(reference_);
  const std::vector<double> ref = response_scores(b);
  trainer_.swap_weights(reference_);
  const double t_ref = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  std::vector<DpoSample> data(b.samples.size());
  int64_t chosen_tokens = 0;
  for (size_t i = 0; i < data.size(); ++i) {
    data[i].ref = ref[i];
    data[i].loss_tokens = b.response_tokens[i];
    if (i % 2 == 0) chosen_tokens += b.response_tokens[i];
  }
  // This DP rank's contiguous block of pairs.
  const int64_t p0 = c.dp->rank() * P / dp, p1 = (c.dp->rank() + 1) * P / dp;
  std::vector<Microbatch> mbs =
      trainer_.microbatches({b.samples.begin() + 2 * p0, b.samples.begin() + 2 * p1}, /*group=*/2);
  for (Microbatch& mb : mbs)
    for (int64_t& id : mb.sample_ids)
      if (id >= 0) id += 2 * p0;

  DpoLossOptions lo;
  lo.beta = pc.dpo_beta;
  lo.mean = pc.dpo_logprob == "mean";
  lo.sft_coef = pc.dpo_sft_coef;
  lo.global_pairs = static_cast<double>(P);
  lo.global_chosen_tokens = static_cast<double>(std::max<int64_t>(1, chosen_tokens));
  Communicator* cp = c.cp;
  DpoLoss loss(
      data, lo, [cp](double* buf, int64_t n) { cp->all_reduce(buf, n, DType::F64, ReduceOp::Sum); },
      cp->rank());
  t0 = std::chrono::steady_clock::now();
  out.train = trainer_.train_step_on(step, mbs, loss);
  out.updated = true;
  const double t_train = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const auto& s = loss.sums();
  double sums[5] = {s.pairs, s.correct, s.margin, s.chosen_reward, s.rejected_reward};
  c.pp->all_reduce(sums, 5, DType::F64, ReduceOp::Sum);
  c.grad->all_reduce(sums, 5, DType::F64, ReduceOp::Sum);
  // Pair terms are counted on CP rank 0 of the last stage (TP ranks hold equal copies, not summed).
  const double pairs = std::max(1.0, sums[0]);
  auto& m = out.metrics;
  m["reward_accuracy"] = sums[1] / pairs;
  m["reward_margin"] = sums[2] / pairs;
  m["chosen_reward"] = sums[3] / pairs;
  m["rejected_reward"] = sums[4] / pairs;
  m["time_reference"] = t_ref;
  m["time_train"] = t_train;
  return out;
}

nlohmann::ordered_json DpoRunner::evaluate(int64_t n) {
  const Config& cfg = trainer_.config();
  const double beta = cfg.posttrain.dpo_beta;
  // Unbounded generators: pairs far beyond any step's indices; files: the first n pairs (seen in training).
  const int64_t first = data_.size() < 0 ? (int64_t{1} << 40) : 0;
  const int64_t count = data_.size() < 0 ? n : std::min(n, data_.size());
  nlohmann::ordered_json m = nlohmann::ordered_json::object();  // {} when n = 0 (callers merge it)
  if (count <= 0) return m;
  const PairBatch b = pairs(first, count, 0);
  trainer_.swap_weights(reference_);
  const std::vector<double> ref = response_scores(b);
  trainer_.swap_weights(reference_);
  const std::vector<double> pol = response_scores(b);
  double correct = 0, margin = 0, loss = 0;
  for (int64_t p = 0; p < count; ++p) {
    const size_t c = static_cast<size_t>(2 * p), r = c + 1;
    const double z = beta * ((pol[c] - ref[c]) - (pol[r] - ref[r]));
    correct += z > 0;
    margin += z;
    loss += dpo_pair_loss(z);
  }
  m["eval_reward_accuracy"] = correct / static_cast<double>(count);
  m["eval_reward_margin"] = margin / static_cast<double>(count);
  m["eval_dpo_loss"] = loss / static_cast<double>(count);
  return m;
}

}  // namespace ndt
