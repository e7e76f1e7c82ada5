// The MoE router on the device (contracts in cuda/moe_route.h; host twins in model/moe_router.cpp). Each
// token's arithmetic follows the host reference step by step, doubles included, so routing decisions and
// gradients agree with it up to the last bit of exp/log; the permutation is exact (a block scan per expert).
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "cuda/cuda_kernel_utils.cuh"
#include "cuda/moe_route.h"

namespace ndt::cuda {
namespace {

constexpr int kTokenThreads = 128;
constexpr int kScanThreads = 512;

unsigned token_blocks(int64_t N) { return static_cast<unsigned>((N + kTokenThreads - 1) / kTokenThreads); }

__global__ void route_kernel(float* score, int32_t* choice, float* gate, float* lse, float* pnorm,
                             const float* logits, const float* bias, int64_t N, int E, int k, bool sigmoid,
                             bool renormalize) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= N) return;
  const float* l = logits + t * E;
  float* s = score + t * E;
  float mx = l[0];
  for (int e = 1; e < E; ++e) mx = fmaxf(mx, l[e]);
  double sum = 0;
  for (int e = 0; e < E; ++e) sum += exp(static_cast<double>(l[e] - mx));
  lse[t] = static_cast<float>(static_cast<double>(mx) + log(sum));
  double ssum = 0;
  for (int e = 0; e < E; ++e) {
    s[e] = sigmoid ? static_cast<float>(1.0 / (1.0 + exp(-static_cast<double>(l[e]))))
                   : static_cast<float>(exp(static_cast<double>(l[e] - mx)) / sum);
    ssum += s[e];
  }
  pnorm[t] = sigmoid ? static_cast<float>(ssum) : 1.0f;
  // The j-th choice is the best (selection score descending, id ascending) after the (j-1)-th.
  float prev_sel = 0.0f;
  int prev = -1;
  double raw_sum = 0;
  for (int j = 0; j < k; ++j) {
    int best = -1;
    float best_sel = 0.0f;
    for (int e = 0; e < E; ++e) {
      const float sel = s[e] + (bias ? bias[e] : 0.0f);
      const bool after = prev < 0 || sel < prev_sel || (sel == prev_sel && e > prev);
      if (after && (best < 0 || sel > best_sel)) {
        best = e;
        best_sel = sel;
      }
    }
    choice[t * k + j] = best;
    prev = best;
    prev_sel = best_sel;
    raw_sum += s[best];
  }
  for (int j = 0; j < k; ++j) {
    const float se = s[choice[t * k + j]];
    gate[t * k + j] = renormalize ? static_cast<float>(se / raw_sum) : se;
  }
}

__global__ void count_kernel(int32_t* counts, const int32_t* choice, int64_t S, int64_t cap) {
  using Reduce = cub::BlockReduce<int, kScanThreads>;
  __shared__ typename Reduce::TempStorage temp;
  const int e = static_cast<int>(blockIdx.x);
  int c = 0;
  for (int64_t i = threadIdx.x; i < S; i += kScanThreads) c += choice[i] == e;
  c = Reduce(temp).Sum(c);
  if (threadIdx.x == 0) counts[e] = static_cast<int32_t>(cap >= 0 && c > cap ? cap : c);
}

__global__ void place_kernel(int32_t* slot_pos, float* kept_gate, int32_t* row_token, float* row_gate,
                             const int32_t* counts, const int32_t* choice, const float* gate, int64_t S,
                             int k, int64_t cap) {
  using Scan = cub::BlockScan<int, kScanThreads>;
  __shared__ typename Scan::TempStorage temp;
  __shared__ int64_t offset;
  const int e = static_cast<int>(blockIdx.x);
  if (threadIdx.x == 0) {
    int64_t o = 0;
    for (int q = 0; q < e; ++q) o += counts[q];
    offset = o;
  }
  __syncthreads();
  int64_t running = 0;  // this expert's slots before the current chunk
  for (int64_t base = 0; base < S; base += kScanThreads) {
    const int64_t i = base + threadIdx.x;
    const int mine = i < S && choice[i] == e;
    int rank = 0, total = 0;
    Scan(temp).ExclusiveSum(mine, rank, total);
    if (mine) {
      const int64_t r = running + rank;
      if (cap < 0 || r < cap) {
        const int64_t p = offset + r;
        slot_pos[i] = static_cast<int32_t>(p);
        kept_gate[i] = gate[i];
        row_token[p] = static_cast<int32_t>(i / k);
        row_gate[p] = gate[i];
      } else {
        slot_pos[i] = -1;
        kept_gate[i] = 0.0f;
      }
    }
    running += total;
    __syncthreads();  // temp is reused by the next chunk's scan
  }
}

__global__ void seq_stats_kernel(float* stats, const int32_t* tok_seq, const int32_t* choice,
                                 const int32_t* slot_pos, const float* score, const float* pnorm,
                                 const float* lse, int64_t N, int S, int E, int k) {
  using Reduce = cub::BlockReduce<double, kScanThreads>;
  __shared__ typename Reduce::TempStorage temp;
  const int b = static_cast<int>(blockIdx.x);
  double a = 0, c = 0;
  if (b < S * E) {
    const int s = b / E, e = b % E;
    for (int64_t t = threadIdx.x; t < N; t += kScanThreads) {
      if (tok_seq[t] != s) continue;
      a += static_cast<double>(score[t * E + e]) / pnorm[t];
      for (int j = 0; j < k; ++j) c += choice[t * k + j] == e;
    }
  } else {
    for (int64_t t = threadIdx.x; t < N; t += kScanThreads) {
      if (tok_seq[t] < 0) continue;
      a += static_cast<double>(lse[t]) * lse[t];
      for (int j = 0; j < k; ++j) c += slot_pos[t * k + j] < 0;
    }
  }
  a = Reduce(temp).Sum(a);
  __syncthreads();
  c = Reduce(temp).Sum(c);
  if (threadIdx.x != 0) return;
  if (b < S * E) {
    stats[b] = static_cast<float>(c);
    stats[S * E + b] = static_cast<float>(a);
  } else {
    stats[2 * S * E] = static_cast<float>(c);
    stats[2 * S * E + 1] = static_cast<float>(a);
  }
}

__global__ void router_backward_kernel(float* dlogits, const float* score, const int32_t* choice,
                                       const float* gate, const int32_t* slot_pos, const float* logits,
                                       const float* lse, const float* dgate, const int32_t* tok_seq,
                                       const float* aux_w, const float* aux_cnt, double z_scale, int64_t N,
                                       int E, int k, bool sigmoid, bool renormalize) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= N) return;
  const float* s = score + t * E;
  const int64_t base = t * k;
  double raw_sum = 0, dot = 0;
  for (int j = 0; j < k; ++j) {
    raw_sum += s[choice[base + j]];
    if (slot_pos[base + j] >= 0) dot += static_cast<double>(dgate[base + j]) * gate[base + j];
  }
  const int real_seq = tok_seq ? tok_seq[t] : -1;
  const int seq = aux_w ? real_seq : -1;
  // dP[e] as the host builds it: a float from the double product.
  auto dp = [&](int e) {
    return static_cast<float>(static_cast<double>(aux_w[seq]) * aux_cnt[static_cast<int64_t>(seq) * E + e]);
  };
  double ssum = 0, ppdot = 0;  // sigmoid: P = s / sum(s), so dP enters through sum(dP * s) / sum(s)
  if (seq >= 0 && sigmoid) {
    for (int e = 0; e < E; ++e) ssum += s[e];
    for (int e = 0; e < E; ++e) ppdot += static_cast<double>(dp(e)) * s[e] / ssum;
  }
  auto ds = [&](int e) {
    double v = 0;
    for (int j = 0; j < k; ++j)
      if (choice[base + j] == e) {
        const double dg = slot_pos[base + j] >= 0 ? dgate[base + j] : 0.0;
        v += renormalize ? (dg - dot) / raw_sum : dg;
      }
    if (seq >= 0) v += sigmoid ? (dp(e) - ppdot) / ssum : static_cast<double>(dp(e));
    return v;
  };
  float* dl = dlogits + t * E;
  if (sigmoid) {
    for (int e = 0; e < E; ++e) dl[e] = static_cast<float>(ds(e) * s[e] * (1.0 - s[e]));
  } else {
    double pdot = 0;
    for (int e = 0; e < E; ++e) pdot += ds(e) * s[e];
    for (int e = 0; e < E; ++e) dl[e] = static_cast<float>(s[e] * (ds(e) - pdot));
  }
  const float dz = real_seq >= 0 ? static_cast<float>(z_scale * lse[t]) : 0.0f;
  if (dz != 0.0f) {
    const float* l = logits + t * E;
    float mx = l[0];
    for (int e = 1; e < E; ++e) mx = fmaxf(mx, l[e]);
    double sum = 0;
    for (int e = 0; e < E; ++e) sum += exp(static_cast<double>(l[e] - mx));
    for (int e = 0; e < E; ++e) dl[e] += static_cast<float>(dz * exp(static_cast<double>(l[e] - mx)) / sum);
  }
}

}  // namespace

void moe_route(float* score, int32_t* choice, float* gate, float* lse, float* pnorm, const float* logits,
               const float* bias, int64_t N, int64_t E, int64_t k, bool sigmoid, bool renormalize,
               cudaStream_t stream) {
  NDT_CUDA_REQUIRE(k >= 1 && k <= E, "moe_route: top_k must be in [1, experts]");
  if (N == 0) return;
  route_kernel<<<token_blocks(N), kTokenThreads, 0, stream>>>(score, choice, gate, lse, pnorm, logits, bias,
                                                              N, static_cast<int>(E), static_cast<int>(k),
                                                              sigmoid, renormalize);
  NDT_CUDA_CHECK(cudaGetLastError());
}

void moe_seq_stats(float* stats, const int32_t* tok_seq, const int32_t* choice, const int32_t* slot_pos,
                   const float* score, const float* pnorm, const float* lse, int64_t N, int64_t S, int64_t E,
                   int64_t k, cudaStream_t stream) {
  seq_stats_kernel<<<static_cast<unsigned>(S * E + 1), kScanThreads, 0, stream>>>(
      stats, tok_seq, choice, slot_pos, score, pnorm, lse, N, static_cast<int>(S), static_cast<int>(E),
      static_cast<int>(k));
  NDT_CUDA_CHECK(cudaGetLastError());
}

void moe_permutation(int32_t* slot_pos, float* kept_gate, int32_t* row_token, float* row_gate,
                     int32_t* counts, const int32_t* choice, const float* gate, int64_t N, int64_t k,
                     int64_t E, int64_t cap, cudaStream_t stream) {
  const int64_t S = N * k;
  count_kernel<<<static_cast<unsigned>(E), kScanThreads, 0, stream>>>(counts, choice, S, cap);
  NDT_CUDA_CHECK(cudaGetLastError());
  if (S == 0) return;
  place_kernel<<<static_cast<unsigned>(E), kScanThreads, 0, stream>>>(
      slot_pos, kept_gate, row_token, row_gate, counts, choice, gate, S, static_cast<int>(k), cap);
  NDT_CUDA_CHECK(cudaGetLastError());
}

void moe_router_backward(float* dlogits, const float* score, const int32_t* choice, const float* gate,
                         const int32_t* slot_pos, const float* logits, const float* lse, const float* dgate,
                         const int32_t* tok_seq, const float* aux_w, const float* aux_cnt, double z_scale,
                         int64_t N, int64_t E, int64_t k, bool sigmoid, bool renormalize,
                         cudaStream_t stream) {
  if (N == 0) return;
  router_backward_kernel<<<token_blocks(N), kTokenThreads, 0, stream>>>(
      dlogits, score, choice, gate, slot_pos, logits, lse, dgate, tok_seq, aux_w, aux_cnt, z_scale, N,
      static_cast<int>(E), static_cast<int>(k), sigmoid, renormalize);
  NDT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ndt::cuda
