// Softmax cross-entropy split into vocab-parallel pieces (row max, sum of exp, target logit), so a
// TP caller can reduce each piece over its group between steps. Backward accumulates (+=).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/check.h"
#include "ops/cpu_ops.h"

namespace ndt::cpu {

namespace {
// Below this many elements a parallel region costs more than it saves (and threads spin on a
// loaded machine).
constexpr int64_t kMinParallelWork = 1 << 15;
}  // namespace

void xent_rowmax(float* rowmax, const float* logits, int64_t T, int64_t V) {
#pragma omp parallel for schedule(static) if (T * V >= kMinParallelWork)
  for (int64_t t = 0; t < T; ++t) {
    const float* l = logits + t * V;
    float m = -std::numeric_limits<float>::infinity();  // an empty shard must not win the max
    for (int64_t j = 0; j < V; ++j) m = std::max(m, l[j]);
    rowmax[t] = m;
  }
}

void xent_sumexp(float* sumexp, const float* logits, const float* rowmax, int64_t T, int64_t V) {
#pragma omp parallel for schedule(static) if (T * V >= kMinParallelWork)
  for (int64_t t = 0; t < T; ++t) {
    const float* l = logits + t * V;
    const float m = rowmax[t];
    double s = 0.0;
    for (int64_t j = 0; j < V; ++j) s += std::exp(l[j] - m);
    sumexp[t] = static_cast<float>(s);
  }
}

void xent_target_logit(float* target_logit, const float* logits, const int32_t* targets, int64_t T, int64_t V,
                       int64_t vocab_start) {
#pragma omp parallel for schedule(static) if (T >= kMinParallelWork)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t j = static_cast<int64_t>(targets[t]) - vocab_start;
    target_logit[t] = (j >= 0 && j < V) ? logits[t * V + j] : 0.0f;
  }
}

void xent_logprob(float* logprob, const float* target_logit, const float* rowmax, const float* sumexp,
                  int64_t T) {
#pragma omp parallel for schedule(static) if (T >= kMinParallelWork)
  for (int64_t t = 0; t < T; ++t) logprob[t] = target_logit[t] - rowmax[t] - std::log(sumexp[t]);
}

void xent_backward(float* dlogits, const float* logits, const float* rowmax, const float* sumexp,
                   const int32_t* targets, const float* dloss, int64_t T, int64_t V, int64_t vocab_start) {
#pragma omp parallel for schedule(static) if (T * V >= kMinParallelWork)
  for (int64_t t = 0; t < T; ++t) {
    const float dl = dloss[t];
    if (dl == 0.0f) continue;
    const float* l = logits + t * V;
    float* d = dlogits + t * V;
    const float m = rowmax[t], scale = dl / sumexp[t];
    for (int64_t j = 0; j < V; ++j) d[j] += scale * std::exp(l[j] - m);
    const int64_t tj = static_cast<int64_t>(targets[t]) - vocab_start;
    if (tj >= 0 && tj < V) d[tj] -= dl;
  }
}

double cross_entropy_forward(float* losses, const float* logits, const int32_t* targets, const float* mask,
                             int64_t T, int64_t V) {
  for (int64_t t = 0; t < T; ++t)
    NDT_CHECK((mask && mask[t] == 0.0f) || (targets[t] >= 0 && targets[t] < V),
              "cross_entropy: target {} of token {} outside vocab {}", targets[t], t, V);
  std::vector<float> rowmax(static_cast<size_t>(T)), sumexp(static_cast<size_t>(T)),
      tl(static_cast<size_t>(T));
  xent_rowmax(rowmax.data(), logits, T, V);
  xent_sumexp(sumexp.data(), logits, rowmax.data(), T, V);
  xent_target_logit(tl.data(), logits, targets, T, V, 0);
  xent_logprob(losses, tl.data(), rowmax.data(), sumexp.data(), T);
  double total = 0.0;
  for (int64_t t = 0; t < T; ++t) {
    losses[t] = (mask && mask[t] == 0.0f) ? 0.0f : -losses[t];
    total += losses[t];
  }
  return total;
}

}  // namespace ndt::cpu
