#pragma once
// Token choice from one full-vocabulary row of logits (host f32), the same on every rank given the same
// row and uniform:
//   temperature 0: argmax, ties to the smaller id;
//   otherwise: softmax(logits / T) restricted to the top_k largest logits (0 = all; ties to the smaller id),
//   then to the smallest nucleus (in that order) whose mass reaches top_p, renormalized; the token is the
//   inverse CDF of u over the kept tokens (in id order when nothing is cut, else in descending order).
#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace ndt {

struct TokenChoice {
  int32_t token = 0;
  float logprob = 0;  // log p(token) under softmax(logits) at temperature 1 (the policy's own logprob)
};

TokenChoice choose_token(const float* logits, int64_t vocab, double temperature, int64_t top_k, double top_p,
                         double u);

// choose_token for every row of logits (n, V) where they live: a host f32 tensor row by row; a CUDA tensor
// (f32 or bf16) on the device (cuda::sample_tokens, one block per row, doubles like the CPU; only the
// order of the CDF's sums differs), copying back just the n choices (one synchronization).
std::vector<TokenChoice> choose_tokens(const Tensor& logits, double temperature, int64_t top_k, double top_p,
                                       const std::vector<double>& u);

// The device half of choose_tokens, writing into given CUDA tensors without synchronizing (capturable in a
// CUDA graph): token (n) i32, logprob (n) f32; u (n) f64 the uniforms.
void choose_tokens_on_device(Tensor& token, Tensor& logprob, const Tensor& logits, double temperature,
                             int64_t top_k, double top_p, const Tensor& u);

// The uniform in [0, 1) that samples generated token `i` of request (prompt_key, sample_key) at `step`:
// a pure function of its arguments (counter-based Philox), hence the same on every layout.
double sampling_uniform(uint64_t seed, int64_t step, uint64_t prompt_key, uint64_t sample_key, int64_t i);

}  // namespace ndt
