// Causal grouped-query attention on packed sequences (THD layout with cu_seqlens).
// Forward saves lse(T, H); backward recomputes P = exp(S - lse) row by row (flash-attention math:
// dS = P * (dP - rowsum(dO * O))) and accumulates (+=) into dq, dk, dv.
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

inline void axpy(float* y, float a, const float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

void check_seqlens(const int32_t* cu_seqlens, int64_t nseq, int64_t T) {
  NDT_CHECK(nseq >= 0 && cu_seqlens[0] >= 0, "attention: bad cu_seqlens start");
  for (int64_t s = 0; s < nseq; ++s)
    NDT_CHECK(cu_seqlens[s] <= cu_seqlens[s + 1], "attention: cu_seqlens not non-decreasing at {}", s);
  NDT_CHECK(cu_seqlens[nseq] <= T, "attention: cu_seqlens ends at {} beyond T = {}", cu_seqlens[nseq], T);
}

// Query rows are split in blocks so that one long sequence still spreads over threads.
constexpr int64_t kRowBlock = 32;

// Query-key pairs times H * D: below this, threading costs more than the work itself.
int64_t attention_work(const int32_t* cu_seqlens, int64_t nseq, int64_t H, int64_t D) {
  int64_t pairs = 0;
  for (int64_t s = 0; s < nseq; ++s) {
    const int64_t n = cu_seqlens[s + 1] - cu_seqlens[s];
    pairs += n * (n + 1) / 2;
  }
  return pairs * H * D;
}
constexpr int64_t kMinParallelWork = 1 << 18;

struct Task {
  int64_t s, h, r0, r1;
};

}  // namespace

void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                       const int32_t* cu_seqlens, int64_t nseq, int64_t T, int64_t H, int64_t KV, int64_t D,
                       float scale) {
  NDT_CHECK(KV > 0 && H % KV == 0, "attention: {} query heads not divisible by {} kv heads", H, KV);
  check_seqlens(cu_seqlens, nseq, T);
  const int64_t group = H / KV;
  // Rows outside every sequence (padding past cu_seqlens[nseq]) get zero output.
  for (int64_t t = cu_seqlens[nseq]; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t d = 0; d < D; ++d) out[(t * H + h) * D + d] = 0.0f;
      lse[t * H + h] = 0.0f;
    }
  std::vector<Task> tasks;
  for (int64_t s = 0; s < nseq; ++s)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t r = cu_seqlens[s]; r < cu_seqlens[s + 1]; r += kRowBlock)
        tasks.push_back({s, h, r, std::min<int64_t>(r + kRowBlock, cu_seqlens[s + 1])});
  const int64_t ntask = static_cast<int64_t>(tasks.size());
#pragma omp parallel if (ntask > 1 && attention_work(cu_seqlens, nseq, H, D) >= kMinParallelWork)
  {
    std::vector<float> p, acc(static_cast<size_t>(D));
#pragma omp for schedule(dynamic, 1)
    for (int64_t ti = 0; ti < ntask; ++ti) {
      const Task tk = tasks[ti];
      const int64_t start = cu_seqlens[tk.s], g = tk.h / group;
      p.resize(static_cast<size_t>(tk.r1 - start));
      for (int64_t i = tk.r0; i < tk.r1; ++i) {
        const float* qi = q + (i * H + tk.h) * D;
        const int64_t n = i - start + 1;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < n; ++j) {
          p[j] = scale * dot(qi, k + ((start + j) * KV + g) * D, D);
          m = std::max(m, p[j]);
        }
        double sum = 0.0;
        for (int64_t j = 0; j < n; ++j) {
          p[j] = std::exp(p[j] - m);
          sum += p[j];
        }
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t j = 0; j < n; ++j) axpy(acc.data(), p[j], v + ((start + j) * KV + g) * D, D);
        const float inv = static_cast<float>(1.0 / sum);
        float* oi = out + (i * H + tk.h) * D;
        for (int64_t d = 0; d < D; ++d) oi[d] = acc[d] * inv;
        lse[i * H + tk.h] = m + static_cast<float>(std::log(sum));
      }
    }
  }
}

void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                        const float* v, const float* out, const float* lse, const int32_t* cu_seqlens,
                        int64_t nseq, int64_t T, int64_t H, int64_t KV, int64_t D, float scale) {
  NDT_CHECK(KV > 0 && H % KV == 0, "attention: {} query heads not divisible by {} kv heads", H, KV);
  check_seqlens(cu_seqlens, nseq, T);
  const int64_t group = H / KV;
  // One task per (sequence, kv head): it owns dk/dv of that head within the sequence and loops
  // over the query heads of its group, so no two threads touch the same gradient row.
  // Queries go in blocks of kQueryBlock so that each key row's dk/dv contributions are summed in
  // L1-resident buffers and written once per block instead of once per query.
  constexpr int64_t kQueryBlock = 16;
  const int64_t ntask = nseq * KV;
#pragma omp parallel if (ntask > 1 && attention_work(cu_seqlens, nseq, H, D) >= kMinParallelWork)
  {
    std::vector<float> dqacc(static_cast<size_t>(kQueryBlock * D)), dkacc(static_cast<size_t>(D)),
        dvacc(static_cast<size_t>(D)), di(kQueryBlock), li(kQueryBlock);
#pragma omp for schedule(dynamic, 1)
    for (int64_t ti = 0; ti < ntask; ++ti) {
      const int64_t s = ti / KV, g = ti % KV;
      const int64_t start = cu_seqlens[s], end = cu_seqlens[s + 1];
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        for (int64_t i0 = start; i0 < end; i0 += kQueryBlock) {
          const int64_t nb = std::min(kQueryBlock, end - i0);
          for (int64_t b = 0; b < nb; ++b) {
            const int64_t row = (i0 + b) * H + h;
            di[b] = dot(dout + row * D, out + row * D, D);  // rowsum(dO * O)
            li[b] = lse[row];
          }
          std::fill(dqacc.begin(), dqacc.end(), 0.0f);
          for (int64_t j = start; j < i0 + nb; ++j) {
            const float* kj = k + (j * KV + g) * D;
            const float* vj = v + (j * KV + g) * D;
            std::fill(dkacc.begin(), dkacc.end(), 0.0f);
            std::fill(dvacc.begin(), dvacc.end(), 0.0f);
            for (int64_t b = std::max<int64_t>(0, j - i0); b < nb; ++b) {  // causal: queries i >= j
              const float* qi = q + ((i0 + b) * H + h) * D;
              const float* doi = dout + ((i0 + b) * H + h) * D;
              const float pij = std::exp(scale * dot(qi, kj, D) - li[b]);
              const float ds = pij * (dot(doi, vj, D) - di[b]);
              axpy(dqacc.data() + b * D, ds, kj, D);
              axpy(dkacc.data(), ds, qi, D);
              axpy(dvacc.data(), pij, doi, D);
            }
            if (dk) axpy(dk + (j * KV + g) * D, scale, dkacc.data(), D);
            if (dv) axpy(dv + (j * KV + g) * D, 1.0f, dvacc.data(), D);
          }
          if (dq)
            for (int64_t b = 0; b < nb; ++b)
              axpy(dq + ((i0 + b) * H + h) * D, scale, dqacc.data() + b * D, D);
        }
      }
    }
  }
}

}  // namespace ndt::cpu
