// LayerNorm and RMSNorm over the last dim (C); statistics per row in double, saved as float.
// Backward accumulates (+=). Parameter gradients are reduced over rows in column blocks so that
// threads never race and the summation order is fixed.
#include <algorithm>
#include <cmath>

#include "ops/cpu_ops.h"

namespace ndt::cpu {

namespace {
// Below this many elements a parallel region costs more than it saves (and threads spin on a
// loaded machine).
constexpr int64_t kMinParallelWork = 1 << 15;
constexpr int64_t kColBlock = 64;
}  // namespace

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int64_t T, int64_t C, float eps) {
#pragma omp parallel for schedule(static) if (T * C >= kMinParallelWork)
  for (int64_t t = 0; t < T; ++t) {
    const float* x = inp + t * C;
    double s = 0.0;
    for (int64_t c = 0; c < C; ++c) s += x[c];
    const double m = s / static_cast<double>(C);
    double v = 0.0;
    for (int64_t c = 0; c < C; ++c) v += (x[c] - m) * (x[c] - m);
    v /= static_cast<double>(C);
    const float mf = static_cast<float>(m);
    const float rs = static_cast<float>(1.0 / std::sqrt(v + eps));
    float* o = out + t * C;
    for (int64_t c = 0; c < C; ++c) {
      const float n = (x[c] - mf) * rs;
      o[c] = n * weight[c] + (bias ? bias[c] : 0.0f);
    }
    if (mean) mean[t] = mf;
    if (rstd) rstd[t] = rs;
  }
}

void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int64_t T, int64_t C) {
  if (dinp) {
#pragma omp parallel for schedule(static) if (T * C >= kMinParallelWork)
    for (int64_t t = 0; t < T; ++t) {
      const float* x = inp + t * C;
      const float* g = dout + t * C;
      const float m = mean[t], rs = rstd[t];
      double sum_dn = 0.0, sum_dn_n = 0.0;  // means of dnorm and dnorm * norm
      for (int64_t c = 0; c < C; ++c) {
        const float dn = g[c] * weight[c];
        sum_dn += dn;
        sum_dn_n += dn * ((x[c] - m) * rs);
      }
      const float a = static_cast<float>(sum_dn / C), b = static_cast<float>(sum_dn_n / C);
      float* d = dinp + t * C;
      for (int64_t c = 0; c < C; ++c) {
        const float n = (x[c] - m) * rs;
        d[c] += rs * (g[c] * weight[c] - a - n * b);
      }
    }
  }
  if (dweight || dbias) {
    const int64_t nblk = (C + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static) if (T * C >= kMinParallelWork)
    for (int64_t blk = 0; blk < nblk; ++blk) {
      const int64_t c0 = blk * kColBlock, c1 = std::min(C, c0 + kColBlock);
      float dw[kColBlock] = {}, db[kColBlock] = {};
      for (int64_t t = 0; t < T; ++t) {
        const float* x = inp + t * C;
        const float* g = dout + t * C;
        const float m = mean[t], rs = rstd[t];
        for (int64_t c = c0; c < c1; ++c) {
          dw[c - c0] += g[c] * ((x[c] - m) * rs);
          db[c - c0] += g[c];
        }
      }
      for (int64_t c = c0; c < c1; ++c) {
        if (dweight) dweight[c] += dw[c - c0];
        if (dbias) dbias[c] += db[c - c0];
      }
    }
  }
}

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t T, int64_t C,
                     float eps) {
#pragma omp parallel for schedule(static) if (T * C >= kMinParallelWork)
  for (int64_t t = 0; t < T; ++t) {
    const float* x = inp + t * C;
    double ss = 0.0;
    for (int64_t c = 0; c < C; ++c) ss += static_cast<double>(x[c]) * x[c];
    const float rs = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(C) + eps));
    float* o = out + t * C;
    for (int64_t c = 0; c < C; ++c) o[c] = x[c] * rs * weight[c];
    if (rstd) rstd[t] = rs;
  }
}

void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                      const float* rstd, int64_t T, int64_t C) {
  if (dinp) {
#pragma omp parallel for schedule(static) if (T * C >= kMinParallelWork)
    for (int64_t t = 0; t < T; ++t) {
      const float* x = inp + t * C;
      const float* g = dout + t * C;
      const float rs = rstd[t];
      double sum_dn_n = 0.0;
      for (int64_t c = 0; c < C; ++c) sum_dn_n += static_cast<double>(g[c] * weight[c]) * (x[c] * rs);
      const float b = static_cast<float>(sum_dn_n / C);
      float* d = dinp + t * C;
      for (int64_t c = 0; c < C; ++c) d[c] += rs * (g[c] * weight[c] - x[c] * rs * b);
    }
  }
  if (dweight) {
    const int64_t nblk = (C + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static) if (T * C >= kMinParallelWork)
    for (int64_t blk = 0; blk < nblk; ++blk) {
      const int64_t c0 = blk * kColBlock, c1 = std::min(C, c0 + kColBlock);
      float dw[kColBlock] = {};
      for (int64_t t = 0; t < T; ++t) {
        const float* x = inp + t * C;
        const float* g = dout + t * C;
        const float rs = rstd[t];
        for (int64_t c = c0; c < c1; ++c) dw[c - c0] += g[c] * (x[c] * rs);
      }
      for (int64_t c = c0; c < c1; ++c) dweight[c] += dw[c - c0];
    }
  }
}

}  // namespace ndt::cpu
