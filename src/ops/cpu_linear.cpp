// Linear layer through OpenBLAS sgemm; weight is (OC, IC) as in PyTorch. Backward accumulates (+=).
#include <cblas.h>

#include <algorithm>

#include "ops/cpu_ops.h"

namespace ndt::cpu {

namespace {
// Below this many elements a parallel region costs more than it saves (and threads spin on a
// loaded machine).
constexpr int64_t kMinParallelWork = 1 << 15;
}  // namespace

void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t T,
                    int64_t IC, int64_t OC) {
  if (T == 0 || OC == 0) return;
  float beta = 0.0f;
  if (bias) {
#pragma omp parallel for schedule(static) if (T * OC >= kMinParallelWork)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t o = 0; o < OC; ++o) out[t * OC + o] = bias[o];
    beta = 1.0f;
  }
  if (IC == 0) {
    if (!bias) std::fill(out, out + T * OC, 0.0f);
    return;
  }
  // out(T, OC) = inp(T, IC) @ weight(OC, IC)^T (+ out when the bias was written first)
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, OC, IC, 1.0f, inp, IC, weight, IC, beta, out, OC);
}

void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int64_t T, int64_t IC, int64_t OC) {
  if (T == 0 || OC == 0) return;
  if (IC > 0) {
    // dinp(T, IC) += dout(T, OC) @ weight(OC, IC)
    if (dinp)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, IC, OC, 1.0f, dout, OC, weight, IC, 1.0f,
                  dinp, IC);
    // dweight(OC, IC) += dout(T, OC)^T @ inp(T, IC)
    if (dweight)
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OC, IC, T, 1.0f, dout, OC, inp, IC, 1.0f, dweight,
                  IC);
  }
  if (dbias) {
    // Column blocks: race-free and a fixed summation order over rows.
    constexpr int64_t kBlk = 64;
    const int64_t nblk = (OC + kBlk - 1) / kBlk;
#pragma omp parallel for schedule(static) if (T * OC >= kMinParallelWork)
    for (int64_t b = 0; b < nblk; ++b) {
      const int64_t o0 = b * kBlk, o1 = std::min(OC, o0 + kBlk);
      float acc[kBlk] = {};
      for (int64_t t = 0; t < T; ++t) {
        const float* g = dout + t * OC;
        for (int64_t o = o0; o < o1; ++o) acc[o - o0] += g[o];
      }
      for (int64_t o = o0; o < o1; ++o) dbias[o] += acc[o - o0];
    }
  }
}

}  // namespace ndt::cpu
