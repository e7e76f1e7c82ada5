#include "train/logprobs.h"

#include <algorithm>

#include "core/check.h"
#include "train/evaluate.h"

namespace ndt {

std::vector<SampleScores> score_samples(PipelineEngine& engine, const std::vector<Sample>& samples, int64_t k,
                                        const PackLayout& layout, int32_t pad_id, Communicator& dp,
                                        int64_t batch, bool lockstep) {
  NDT_CHECK(batch >= 1 && k >= 1, "score_samples: batch {} and k {} must be >= 1", batch, k);
  const int64_t n = static_cast<int64_t>(samples.size());
  // Scored rows of each sample and their offsets in one flat buffer (the same on every rank).
  std::vector<int64_t> rows(static_cast<size_t>(n)), offset(static_cast<size_t>(n) + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    int64_t r = static_cast<int64_t>(samples[static_cast<size_t>(i)].tokens.size()) - 1;
    if (layout.max_len >= 0) r = std::min(r, layout.max_len);
    rows[static_cast<size_t>(i)] = r;
    offset[static_cast<size_t>(i) + 1] = offset[static_cast<size_t>(i)] + r;
  }
  const int64_t total = offset.back();
  std::vector<float> lp(static_cast<size_t>(total), 0.0f), val(static_cast<size_t>(total * k), 0.0f),
      ids(static_cast<size_t>(total * k), 0.0f);
  const int64_t per = (n + dp.size() - 1) / dp.size();
  const int64_t b = std::min(n, per * dp.rank()), e = std::min(n, b + per);
  // Engine calls are collective within one replica (its PP, TP and CP groups) only.
  const int64_t calls = lockstep_count((e - b + batch - 1) / batch, dp, lockstep);
  for (int64_t c = 0, first = b; c < calls; ++c, first += batch) {
    const int64_t last = std::max(first, std::min(e, first + batch));  // past the share: pad-only (lockstep)
    std::vector<Sample> group(samples.begin() + std::min(first, last), samples.begin() + last);
    Microbatch mb = pack_samples(group, pad_id, layout);
    for (int64_t& id : mb.sample_ids)  // indices into `samples` (a multimodal model's rows follow them)
      if (id >= 0) id += first;
    PipelineEngine::Scores sc = engine.scores(mb, k);
    for (int64_t i = first; i < last; ++i) {
      const int64_t row0 = mb.cu_seqlens.i32()[i - first];
      for (int64_t t = 0; t < rows[static_cast<size_t>(i)]; ++t) {
        const size_t dst = static_cast<size_t>(offset[static_cast<size_t>(i)] + t);
        lp[dst] = sc.logprob[static_cast<size_t>(row0 + t)];
        for (int64_t j = 0; j < k; ++j) {
          val[dst * k + j] = sc.topk_value[static_cast<size_t>((row0 + t) * k + j)];
          ids[dst * k + j] = static_cast<float>(sc.topk_id[static_cast<size_t>((row0 + t) * k + j)]);
        }
      }
    }
  }
  for (std::vector<float>* buf : {&lp, &val, &ids})  // each slot written by one DP rank: a sum gathers
    dp.all_reduce(buf->data(), static_cast<int64_t>(buf->size()), DType::F32, ReduceOp::Sum);
  std::vector<SampleScores> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t o = offset[static_cast<size_t>(i)], r = rows[static_cast<size_t>(i)];
    SampleScores& s = out[static_cast<size_t>(i)];
    s.logprob.assign(lp.begin() + o, lp.begin() + o + r);
    s.topk_value.assign(val.begin() + o * k, val.begin() + (o + r) * k);
    for (int64_t j = o * k; j < (o + r) * k; ++j)
      s.topk_id.push_back(static_cast<int32_t>(ids[static_cast<size_t>(j)]));
  }
  return out;
}

}  // namespace ndt
