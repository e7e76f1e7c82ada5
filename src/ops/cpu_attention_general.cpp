// Attention between separate query and key row sets with a positional causal mask (contract in
// cpu_ops.h): the building block of context-parallel attention (all-gather and ring). The plain causal
// path (cpu_attention.cpp) stays separate because it is the hot path of every other layout.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/check.h"
#include "ops/cpu_ops.h"

namespace ndt::cpu {

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

void check_segments(const int32_t* cu, int64_t nseq, int64_t T, const char* what) {
  NDT_CHECK(nseq >= 0 && cu[0] >= 0, "attention: bad {} start", what);
  for (int64_t s = 0; s < nseq; ++s)
    NDT_CHECK(cu[s] <= cu[s + 1], "attention: {} not non-decreasing at {}", what, s);
  NDT_CHECK(cu[nseq] <= T, "attention: {} ends at {} beyond {} rows", what, cu[nseq], T);
}

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

}  // namespace

void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                       const int32_t* cu_q, const int32_t* cu_k, const int32_t* pos_q, const int32_t* pos_k,
                       int64_t nseq, int64_t Tq, int64_t Tk, int64_t H, int64_t KV, int64_t D, float scale) {
  NDT_CHECK(KV > 0 && H % KV == 0, "attention: {} query heads not divisible by {} kv heads", H, KV);
  check_segments(cu_q, nseq, Tq, "cu_seqlens_q");
  check_segments(cu_k, nseq, Tk, "cu_seqlens_k");
  const int64_t group = H / KV;
  std::fill(out + cu_q[nseq] * H * D, out + Tq * H * D, 0.0f);
  std::fill(lse + cu_q[nseq] * H, lse + Tq * H, 0.0f);
  const int64_t ntask = nseq * H;
#pragma omp parallel
  {
    std::vector<float> p, acc(static_cast<size_t>(D));
#pragma omp for schedule(dynamic, 1)
    for (int64_t ti = 0; ti < ntask; ++ti) {
      const int64_t s = ti / H, h = ti % H, g = h / group;
      const int64_t k0 = cu_k[s], nk = cu_k[s + 1] - cu_k[s];
      p.resize(static_cast<size_t>(nk));
      for (int64_t i = cu_q[s]; i < cu_q[s + 1]; ++i) {
        const float* qi = q + (i * H + h) * D;
        float m = kNegInf;
        for (int64_t j = 0; j < nk; ++j) {
          p[j] = pos_k[k0 + j] <= pos_q[i] ? scale * dot(qi, k + ((k0 + j) * KV + g) * D, D) : kNegInf;
          m = std::max(m, p[j]);
        }
        float* oi = out + (i * H + h) * D;
        if (m == kNegInf) {  // nothing visible in this key set
          std::fill(oi, oi + D, 0.0f);
          lse[i * H + h] = kNegInf;
          continue;
        }
        double sum = 0.0;
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t j = 0; j < nk; ++j) {
          if (p[j] == kNegInf) continue;
          const float e = std::exp(p[j] - m);
          sum += e;
          const float* vj = v + ((k0 + j) * KV + g) * D;
          for (int64_t d = 0; d < D; ++d) acc[d] += e * vj[d];
        }
        const float inv = static_cast<float>(1.0 / sum);
        for (int64_t d = 0; d < D; ++d) oi[d] = acc[d] * inv;
        lse[i * H + h] = m + static_cast<float>(std::log(sum));
      }
    }
  }
}

void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                        const float* v, const float* out, const float* lse, const int32_t* cu_q,
                        const int32_t* cu_k, const int32_t* pos_q, const int32_t* pos_k, int64_t nseq,
                        int64_t Tq, int64_t Tk, int64_t H, int64_t KV, int64_t D, float scale) {
  NDT_CHECK(KV > 0 && H % KV == 0, "attention: {} query heads not divisible by {} kv heads", H, KV);
  check_segments(cu_q, nseq, Tq, "cu_seqlens_q");
  check_segments(cu_k, nseq, Tk, "cu_seqlens_k");
  const int64_t group = H / KV;
  // One task per (sequence, kv head): it alone writes that head's dk/dv rows of the sequence and the dq
  // rows of the query heads in its group.
  const int64_t ntask = nseq * KV;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t ti = 0; ti < ntask; ++ti) {
    const int64_t s = ti / KV, g = ti % KV;
    for (int64_t h = g * group; h < (g + 1) * group; ++h) {
      for (int64_t i = cu_q[s]; i < cu_q[s + 1]; ++i) {
        const float li = lse[i * H + h];
        if (li == kNegInf) continue;  // the row saw no key of this set
        const float* qi = q + (i * H + h) * D;
        const float* doi = dout + (i * H + h) * D;
        const float di = dot(doi, out + (i * H + h) * D, D);  // rowsum(dO * O)
        for (int64_t j = cu_k[s]; j < cu_k[s + 1]; ++j) {
          if (pos_k[j] > pos_q[i]) continue;
          const float* kj = k + (j * KV + g) * D;
          const float* vj = v + (j * KV + g) * D;
          const float pij = std::exp(scale * dot(qi, kj, D) - li);
          const float ds = pij * (dot(doi, vj, D) - di) * scale;
          if (dq)
            for (int64_t d = 0; d < D; ++d) dq[(i * H + h) * D + d] += ds * kj[d];
          if (dk)
            for (int64_t d = 0; d < D; ++d) dk[(j * KV + g) * D + d] += ds * qi[d];
          if (dv)
            for (int64_t d = 0; d < D; ++d) dv[(j * KV + g) * D + d] += pij * doi[d];
        }
      }
    }
  }
}

void attention_merge(float* out, float* lse, const float* o, const float* l, int64_t rows, int64_t D) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < rows; ++i) {
    if (l[i] == kNegInf) continue;
    float a = 0.0f, b = 1.0f, merged = l[i];
    if (lse[i] != kNegInf) {
      const float m = std::max(lse[i], l[i]);
      a = std::exp(lse[i] - m);
      b = std::exp(l[i] - m);
      const float s = a + b;
      a /= s;
      b /= s;
      merged = m + std::log(s);
    }
    for (int64_t d = 0; d < D; ++d) out[i * D + d] = a * out[i * D + d] + b * o[i * D + d];
    lse[i] = merged;
  }
}

}  // namespace ndt::cpu
