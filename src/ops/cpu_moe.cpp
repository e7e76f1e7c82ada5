// CPU reference of the MoE row movement ops (contracts in ops.h).
#include "ops/cpu_ops.h"

namespace ndt::cpu {

void moe_permute(float* out, const float* x, const int32_t* src, const float* scale, int64_t R, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < R; ++i) {
    const float* in = x + static_cast<int64_t>(src[i]) * C;
    const float s = scale ? scale[i] : 1.0f;
    for (int64_t c = 0; c < C; ++c) out[i * C + c] = in[c] * s;
  }
}

void moe_unpermute(float* out, const float* y, const int32_t* pos, const float* gates, int64_t N, int64_t k,
                   int64_t C, bool accumulate) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) {
    float* o = out + t * C;
    if (!accumulate)
      for (int64_t c = 0; c < C; ++c) o[c] = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t p = pos[t * k + j];
      if (p < 0) continue;
      const float g = gates ? gates[t * k + j] : 1.0f;
      const float* in = y + static_cast<int64_t>(p) * C;
      for (int64_t c = 0; c < C; ++c) o[c] += g * in[c];
    }
  }
}

void moe_gate_grad(float* dgates, const float* dout, const float* y, const int32_t* pos, int64_t N, int64_t k,
                   int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int32_t p = pos[t * k + j];
      double acc = 0;
      if (p >= 0)
        for (int64_t c = 0; c < C; ++c)
          acc += static_cast<double>(dout[t * C + c]) * y[static_cast<int64_t>(p) * C + c];
      dgates[t * k + j] = static_cast<float>(acc);
    }
}

}  // namespace ndt::cpu
