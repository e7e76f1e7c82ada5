#include "posttrain/grpo_loss.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"

namespace ndt {

double GrpoLoss::seed(const Microbatch& mb, const std::vector<float>& logprob, std::vector<float>& dloss) {
  const std::vector<RowSource> src = row_sources(mb);
  const float* mask = mb.loss_mask.f32();
  double loss = 0;
  for (size_t r = 0; r < src.size(); ++r) {
    dloss[r] = 0.0f;
    if (mask[r] == 0.0f || src[r].sample < 0) continue;
    NDT_CHECK(src[r].sample < static_cast<int64_t>(samples_.size()), "GRPO: row of unknown sample {}",
              src[r].sample);
    const GrpoSample& s = samples_[static_cast<size_t>(src[r].sample)];
    const auto j = static_cast<size_t>(src[r].token);
    NDT_CHECK(j < s.old_lp.size(), "GRPO: token {} beyond sample {}'s {} logprobs", j, src[r].sample,
              s.old_lp.size());
    const double lp = logprob[r], A = s.advantage;
    const double ratio = std::exp(lp - s.old_lp[j]);
    const double clipped_ratio = std::clamp(ratio, 1.0 - opt_.clip_low, 1.0 + opt_.clip_high);
    const double unclipped = ratio * A, clipped = clipped_ratio * A;
    // min picks the unclipped term (gradient flows) unless clipping makes it smaller (gradient 0).
    const bool flows = unclipped <= clipped;
    const double pg = -std::min(unclipped, clipped);
    double dpg = flows ? -A * ratio : 0.0;  // d pg / d lp
    double w = 1.0;
    if (opt_.tis_cap > 0)
      w = std::min(std::exp(static_cast<double>(s.old_lp[j]) - s.gen_lp[j]), opt_.tis_cap);
    double l = w * pg, dl = w * dpg;
    double k3 = 0;
    if (opt_.kl_coef > 0) {
      const double d = static_cast<double>(s.ref_lp[j]) - lp;
      k3 = std::exp(d) - d - 1.0;
      l += opt_.kl_coef * k3;
      dl += opt_.kl_coef * (1.0 - std::exp(d));
    }
    const double norm =
        opt_.sequence_mean
            ? 1.0 / (opt_.global_samples * static_cast<double>(std::max<int64_t>(1, s.loss_tokens)))
            : 1.0 / opt_.global_tokens;
    loss += l * norm;
    dloss[r] = static_cast<float>(-dl * norm);  // the seed is dL/d(-lp)
    sums_.tokens += 1;
    sums_.clipped += flows ? 0.0 : 1.0;
    sums_.kl += k3;
    sums_.ratio += ratio;
  }
  return loss;
}

}  // namespace ndt
