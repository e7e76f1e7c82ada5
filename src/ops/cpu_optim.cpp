// Optimizer helpers: AdamW (PyTorch semantics) and deterministic reductions.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/check.h"
#include "core/step_control.h"
#include "ops/cpu_ops.h"

namespace ndt::cpu {

namespace {
// Below this many elements a parallel region costs more than it saves (and threads spin on a
// loaded machine).
constexpr int64_t kMinParallelWork = 1 << 15;
}  // namespace

void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, float lr, float beta1,
                  float beta2, float eps, float weight_decay, int64_t step) {
  NDT_CHECK(step >= 1, "adamw: step counts from 1, got {}", step);
  // Bias corrections in double, as PyTorch computes them on the host (core/step_control.h).
  // (plain variables: an OpenMP region below may not capture structured bindings under clang)
  const AdamStepScalars a =
      adam_step_scalars(lr, adam_bias_correction(beta1, step), adam_bias_correction(beta2, step));
  const float step_size = a.step_size, bc2_sqrt = a.bc2_sqrt;
  const float decay = 1.0f - lr * weight_decay;
#pragma omp parallel for schedule(static) if (n >= kMinParallelWork)
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad[i];
    param[i] *= decay;
    m[i] = beta1 * m[i] + (1.0f - beta1) * g;
    v[i] = beta2 * v[i] + (1.0f - beta2) * g * g;
    param[i] -= step_size * m[i] / (std::sqrt(v[i]) / bc2_sqrt + eps);
  }
}

double sum_squares(const float* x, int64_t n) {
  // Fixed-size blocks summed in a fixed order: the result does not depend on the thread count.
  constexpr int64_t kBlock = 1 << 14;
  const int64_t nblk = (n + kBlock - 1) / kBlock;
  std::vector<double> part(static_cast<size_t>(nblk));
#pragma omp parallel for schedule(static) if (n >= kMinParallelWork)
  for (int64_t b = 0; b < nblk; ++b) {
    const int64_t i0 = b * kBlock, i1 = std::min(n, i0 + kBlock);
    double s = 0.0;
    for (int64_t i = i0; i < i1; ++i) s += static_cast<double>(x[i]) * x[i];
    part[b] = s;
  }
  double total = 0.0;
  for (double p : part) total += p;
  return total;
}

void scale_inplace(float* x, float s, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= kMinParallelWork)
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

void add_inplace(float* y, const float* x, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= kMinParallelWork)
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

}  // namespace ndt::cpu
