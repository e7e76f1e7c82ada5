#pragma once
// Token choice from one full-vocabulary row of logits (host f32), the same on every rank given the same
// row and uniform:
//   temperature 0: argmax, ties to the smaller id;
//   otherwise: softmax(logits / T) restricted to the top_k largest logits (0 = all; ties to the smaller id),
//   then to the smallest nucleus (in that order) whose mass reaches top_p, renormalized; the token is the
//   inverse CDF of u over the kept tokens (in id order when nothing is cut, else in descending order).
#include <cstdint>

namespace ndt {

struct TokenChoice {
  int32_t token = 0;
  float logprob = 0;  // log p(token) under softmax(logits) at temperature 1 (the policy's own logprob)
};

TokenChoice choose_token(const float* logits, int64_t vocab, double temperature, int64_t top_k, double top_p,
                         double u);

// The uniform in [0, 1) that samples generated token `i` of request (prompt_key, sample_key) at `step`:
// a pure function of its arguments (counter-based Philox), hence the same on every layout.
double sampling_uniform(uint64_t seed, int64_t step, uint64_t prompt_key, uint64_t sample_key, int64_t i);

}  // namespace ndt
