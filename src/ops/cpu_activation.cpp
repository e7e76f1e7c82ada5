// Elementwise activations: GELU (tanh approximation, as GPT-2) and SwiGLU. Backward accumulates (+=).
#include <cmath>

#include "ops/cpu_ops.h"

namespace ndt::cpu {

namespace {
// Below this many elements a parallel region costs more than it saves (and threads spin on a
// loaded machine).
constexpr int64_t kMinParallelWork = 1 << 15;
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;
}  // namespace

void gelu_forward(float* out, const float* inp, int64_t N) {
#pragma omp parallel for schedule(static) if (N >= kMinParallelWork)
  for (int64_t i = 0; i < N; ++i) {
    const float x = inp[i];
    const float u = kGeluScale * (x + kGeluCubic * x * x * x);
    out[i] = 0.5f * x * (1.0f + std::tanh(u));
  }
}

void gelu_backward(float* dinp, const float* dout, const float* inp, int64_t N) {
  if (!dinp) return;
#pragma omp parallel for schedule(static) if (N >= kMinParallelWork)
  for (int64_t i = 0; i < N; ++i) {
    const float x = inp[i];
    const float u = kGeluScale * (x + kGeluCubic * x * x * x);
    const float th = std::tanh(u);
    const float sech2 = 1.0f - th * th;
    const float grad =
        0.5f * (1.0f + th) + 0.5f * x * sech2 * kGeluScale * (1.0f + 3.0f * kGeluCubic * x * x);
    dinp[i] += grad * dout[i];
  }
}

void swiglu_forward(float* out, const float* gate, const float* up, int64_t N) {
#pragma omp parallel for schedule(static) if (N >= kMinParallelWork)
  for (int64_t i = 0; i < N; ++i) {
    const float g = gate[i];
    const float sig = 1.0f / (1.0f + std::exp(-g));
    out[i] = g * sig * up[i];
  }
}

void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate, const float* up,
                     int64_t N) {
#pragma omp parallel for schedule(static) if (N >= kMinParallelWork)
  for (int64_t i = 0; i < N; ++i) {
    const float g = gate[i];
    const float sig = 1.0f / (1.0f + std::exp(-g));
    // d silu(g) / dg = sig * (1 + g * (1 - sig))
    if (dgate) dgate[i] += dout[i] * up[i] * sig * (1.0f + g * (1.0f - sig));
    if (dup) dup[i] += dout[i] * g * sig;
  }
}

}  // namespace ndt::cpu
