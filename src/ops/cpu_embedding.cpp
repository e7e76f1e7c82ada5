// Token and learned-position embeddings. Backward ops accumulate (+=) into dtable.
#include <algorithm>

#include "core/check.h"
#include "ops/cpu_ops.h"

namespace ndt::cpu {

namespace {
// Below this many elements a parallel region costs more than it saves (and threads spin on a
// loaded machine).
constexpr int64_t kMinParallelWork = 1 << 15;
// Column blocks for scatter-add backward: each thread owns a block of channels, so repeated ids
// never race and the summation order over tokens is fixed (deterministic for any thread count).
constexpr int64_t kColBlock = 64;
}  // namespace

void embedding_forward(float* out, const int32_t* ids, const float* table, int64_t T, int64_t V, int64_t C,
                       int64_t vocab_start) {
#pragma omp parallel for schedule(static) if (T * C >= kMinParallelWork)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t row = static_cast<int64_t>(ids[t]) - vocab_start;
    float* o = out + t * C;
    if (row >= 0 && row < V) {
      const float* src = table + row * C;
      for (int64_t c = 0; c < C; ++c) o[c] = src[c];
    } else {
      for (int64_t c = 0; c < C; ++c) o[c] = 0.0f;  // another vocab shard owns this id
    }
  }
}

void embedding_backward(float* dtable, const float* dout, const int32_t* ids, int64_t T, int64_t V, int64_t C,
                        int64_t vocab_start) {
  if (!dtable) return;
  const int64_t nblk = (C + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static) if (T * C >= kMinParallelWork)
  for (int64_t b = 0; b < nblk; ++b) {
    const int64_t c0 = b * kColBlock, c1 = std::min(C, c0 + kColBlock);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t row = static_cast<int64_t>(ids[t]) - vocab_start;
      if (row < 0 || row >= V) continue;
      float* d = dtable + row * C;
      const float* g = dout + t * C;
      for (int64_t c = c0; c < c1; ++c) d[c] += g[c];
    }
  }
}

void add_position_embedding_forward(float* out, const int32_t* pos, const float* pos_table, int64_t T,
                                    int64_t P, int64_t C) {
  for (int64_t t = 0; t < T; ++t)
    NDT_CHECK(pos[t] >= 0 && pos[t] < P, "position {} of token {} outside the position table ({} rows)",
              pos[t], t, P);
#pragma omp parallel for schedule(static) if (T * C >= kMinParallelWork)
  for (int64_t t = 0; t < T; ++t) {
    const float* src = pos_table + static_cast<int64_t>(pos[t]) * C;
    float* o = out + t * C;
    for (int64_t c = 0; c < C; ++c) o[c] += src[c];
  }
}

void add_position_embedding_backward(float* dpos_table, const float* dout, const int32_t* pos, int64_t T,
                                     int64_t P, int64_t C) {
  if (!dpos_table) return;
  for (int64_t t = 0; t < T; ++t)
    NDT_CHECK(pos[t] >= 0 && pos[t] < P, "position {} of token {} outside the position table ({} rows)",
              pos[t], t, P);
  const int64_t nblk = (C + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static) if (T * C >= kMinParallelWork)
  for (int64_t b = 0; b < nblk; ++b) {
    const int64_t c0 = b * kColBlock, c1 = std::min(C, c0 + kColBlock);
    for (int64_t t = 0; t < T; ++t) {
      float* d = dpos_table + static_cast<int64_t>(pos[t]) * C;
      const float* g = dout + t * C;
      for (int64_t c = c0; c < c1; ++c) d[c] += g[c];
    }
  }
}

}  // namespace ndt::cpu
