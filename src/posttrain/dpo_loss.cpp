#include "posttrain/dpo_loss.h"

#include <cmath>
#include <map>

#include "core/check.h"

namespace ndt {

namespace {
double sigmoid(double x) { return x >= 0 ? 1.0 / (1.0 + std::exp(-x)) : std::exp(x) / (1.0 + std::exp(x)); }
}  // namespace

double dpo_pair_loss(double z) { return z < 0 ? -z + std::log1p(std::exp(z)) : std::log1p(std::exp(-z)); }

double DpoLoss::seed(const Microbatch& mb, const std::vector<float>& logprob, std::vector<float>& dloss) {
  const std::vector<RowSource> src = row_sources(mb);
  const float* mask = mb.loss_mask.f32();
  // The pairs of this microbatch -> slot, numbered in sequence order (the same on every CP rank: each CP
  // rank holds a share of every sequence).
  std::map<int64_t, size_t> slot;
  for (int64_t id : mb.sample_ids)
    if (id >= 0) slot.emplace(id / 2, slot.size());
  for (const auto& entry : slot)
    NDT_CHECK(2 * entry.first + 1 < static_cast<int64_t>(samples_.size()), "DPO: pair {} beyond the batch",
              entry.first);
  // Per pair: policy sums of the chosen and rejected responses over this rank's rows.
  std::vector<double> sums(2 * slot.size(), 0.0);
  auto weight = [&](int64_t sample) {
    const DpoSample& s = samples_[static_cast<size_t>(sample)];
    return opt_.mean ? 1.0 / static_cast<double>(std::max<int64_t>(1, s.loss_tokens)) : 1.0;
  };
  for (size_t r = 0; r < src.size(); ++r)
    if (mask[r] != 0.0f && src[r].sample >= 0)
      sums[2 * slot.at(src[r].sample / 2) + static_cast<size_t>(src[r].sample % 2)] +=
          weight(src[r].sample) * logprob[r];
  cp_sum_(sums.data(), static_cast<int64_t>(sums.size()));

  double loss = 0;
  std::vector<double> dz(slot.size());  // dL/dz_p
  for (auto& [pair, i] : slot) {
    const double chosen = opt_.beta * (sums[2 * i] - samples_[static_cast<size_t>(2 * pair)].ref);
    const double rejected = opt_.beta * (sums[2 * i + 1] - samples_[static_cast<size_t>(2 * pair + 1)].ref);
    const double z = chosen - rejected;
    dz[i] = -sigmoid(-z) / opt_.global_pairs;
    if (cp_rank_ != 0) continue;
    loss += dpo_pair_loss(z) / opt_.global_pairs;
    sums_.pairs += 1;
    sums_.correct += z > 0 ? 1.0 : 0.0;
    sums_.margin += z;
    sums_.chosen_reward += chosen;
    sums_.rejected_reward += rejected;
  }
  for (size_t r = 0; r < src.size(); ++r) {
    dloss[r] = 0.0f;
    if (mask[r] == 0.0f || src[r].sample < 0) continue;
    const int64_t id = src[r].sample;
    const bool is_chosen = id % 2 == 0;
    double dl = dz[slot.at(id / 2)] * opt_.beta * (is_chosen ? 1.0 : -1.0) * weight(id);  // dL/dlp
    if (is_chosen && opt_.sft_coef > 0) {
      dl -= opt_.sft_coef / opt_.global_chosen_tokens;
      loss -= opt_.sft_coef * logprob[r] / opt_.global_chosen_tokens;
    }
    dloss[r] = static_cast<float>(-dl);
  }
  return loss;
}

}  // namespace ndt
