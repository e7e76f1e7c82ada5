#include "generate/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/check.h"
#include "core/rng.h"

namespace ndt {

double sampling_uniform(uint64_t seed, int64_t step, uint64_t prompt_key, uint64_t sample_key, int64_t i) {
  // One Philox stream per (step, prompt, sample), itself drawn by Philox: key seed ^ (odd * step) (distinct
  // per step for a seed), counter (prompt_key, sample_key); the token index is the stream's counter.
  const std::array<uint32_t, 4> w =
      philox4x32(seed ^ (0x5DEECE66Dull * static_cast<uint64_t>(step)), prompt_key, sample_key);
  const uint64_t stream = static_cast<uint64_t>(w[0]) << 32 | w[1];
  // 53-bit uniform from 64 random bits (philox_uniform has 24: too coarse for large vocabularies).
  return static_cast<double>(philox_u64(seed, stream, static_cast<uint64_t>(i)) >> 11) * 0x1.0p-53;
}

TokenChoice choose_token(const float* logits, int64_t vocab, double temperature, int64_t top_k, double top_p,
                         double u) {
  NDT_CHECK(vocab >= 1, "sampling from an empty vocabulary");
  int64_t arg = 0;
  for (int64_t j = 1; j < vocab; ++j)
    if (logits[j] > logits[arg]) arg = j;  // strict: ties keep the smaller id
  const double mx = logits[arg];
  double z = 0;
  for (int64_t j = 0; j < vocab; ++j) z += std::exp(static_cast<double>(logits[j]) - mx);
  const double logz = mx + std::log(z);
  auto choice = [&](int64_t j) {
    return TokenChoice{static_cast<int32_t>(j), static_cast<float>(static_cast<double>(logits[j]) - logz)};
  };
  if (temperature <= 0) return choice(arg);

  const int64_t k = top_k > 0 ? std::min(top_k, vocab) : vocab;
  std::vector<int32_t> ids(static_cast<size_t>(vocab));
  std::iota(ids.begin(), ids.end(), 0);
  if (k < vocab || top_p < 1.0) {  // descending logits, ties to the smaller id
    auto before = [&](int32_t a, int32_t b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    };
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), before);
    ids.resize(static_cast<size_t>(k));
  }
  std::vector<double> w(ids.size());
  double total = 0;
  for (size_t i = 0; i < ids.size(); ++i) total += w[i] = std::exp((logits[ids[i]] - mx) / temperature);
  if (top_p < 1.0) {  // the smallest prefix (most likely first) whose mass reaches top_p
    double acc = 0;
    size_t keep = 0;
    while (keep < w.size() && acc < top_p * total) acc += w[keep++];
    keep = std::max<size_t>(1, keep);
    ids.resize(keep);
    w.resize(keep);
    total = acc;
  }
  const double target = u * total;
  double acc = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    acc += w[i];
    if (target < acc) return choice(ids[i]);
  }
  // Rounding at the top end: the last token with nonzero weight.
  size_t last = ids.size() - 1;
  while (last > 0 && w[last] == 0) --last;
  return choice(ids[last]);
}

}  // namespace ndt
