#pragma once
// Double-precision reference math for tests that check imported models against an independent computation.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace ndt::testing {

// Causal grouped-query attention of one sequence: q (T, H, D), k/v (T, KV, D) row-major; query head h reads
// kv head h / (H / KV). Returns (T, H, D).
inline std::vector<double> causal_gqa_attention(const std::vector<double>& q, const std::vector<double>& k,
                                                const std::vector<double>& v, int64_t T, int64_t H,
                                                int64_t KV, int64_t D) {
  std::vector<double> att(static_cast<size_t>(T * H * D), 0.0);
  for (int64_t hd = 0; hd < H; ++hd) {
    const int64_t g = hd / (H / KV);
    for (int64_t i = 0; i < T; ++i) {
      std::vector<double> s(static_cast<size_t>(i + 1));
      double mx = -1e300, z = 0;
      for (int64_t j = 0; j <= i; ++j) {
        double dd = 0;
        for (int64_t e = 0; e < D; ++e)
          dd += q[static_cast<size_t>((i * H + hd) * D + e)] * k[static_cast<size_t>((j * KV + g) * D + e)];
        s[static_cast<size_t>(j)] = dd / std::sqrt(static_cast<double>(D));
        mx = std::max(mx, s[static_cast<size_t>(j)]);
      }
      for (auto& e : s) z += e = std::exp(e - mx);
      for (int64_t j = 0; j <= i; ++j)
        for (int64_t e = 0; e < D; ++e)
          att[static_cast<size_t>((i * H + hd) * D + e)] +=
              s[static_cast<size_t>(j)] / z * v[static_cast<size_t>((j * KV + g) * D + e)];
    }
  }
  return att;
}

// The LM head: logits (T, V) = x (T, C) times head (V, C) transposed, row-major.
template <typename W>
std::vector<double> head_logits(const std::vector<double>& x, const std::vector<W>& head, int64_t T,
                                int64_t C, int64_t V) {
  std::vector<double> logits(static_cast<size_t>(T * V));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t v = 0; v < V; ++v) {
      double s = 0;
      for (int64_t i = 0; i < C; ++i)
        s += x[static_cast<size_t>(t * C + i)] * head[static_cast<size_t>(v * C + i)];
      logits[static_cast<size_t>(t * V + v)] = s;
    }
  return logits;
}

}  // namespace ndt::testing
