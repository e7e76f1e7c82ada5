// Token sampling on the device: the CUDA twin of generate/sampler.cpp's choose_token, one block per row.
// Same rules: argmax ties to the smaller id; softmax(logits / T) over the top_k largest logits (ties to
// the smaller id), cut to the smallest most-likely-first prefix whose mass reaches top_p, renormalized;
// the token is the inverse CDF of u, in id order when nothing is cut and in descending-logit order
// otherwise; logprob is log p(token) under the temperature-1 softmax of the whole row. Weights and prefix
// sums are doubles, like the CPU's; only the summation order differs (block scan instead of a left fold),
// so a choice can differ from the CPU only where u * total lies within rounding of a CDF step.
#include <cub/device/device_segmented_radix_sort.cuh>

#include "cuda/cuda_check.h"
#include "cuda/cuda_kernel_utils.cuh"
#include "cuda/cuda_ops.h"

namespace ndt::cuda {
namespace {

using detail::to_f;
constexpr int kThreads = 512;

// Block-wide reductions in a fixed order (thread 0 combines the warps' results in order).
struct MaxArg {
  float v;
  int32_t i;
};
__device__ __forceinline__ MaxArg better(MaxArg a, MaxArg b) {
  return (b.v > a.v || (b.v == a.v && b.i < a.i)) ? b : a;
}

__device__ MaxArg block_argmax(MaxArg x) {
  __shared__ MaxArg part[kThreads / 32];
  __shared__ MaxArg res;
  for (int o = 16; o > 0; o >>= 1) {
    MaxArg y{__shfl_down_sync(0xffffffffu, x.v, o), __shfl_down_sync(0xffffffffu, x.i, o)};
    x = better(x, y);
  }
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = x;
  __syncthreads();
  if (threadIdx.x == 0) {
    MaxArg r = part[0];
    for (int w = 1; w < kThreads / 32; ++w) r = better(r, part[w]);
    res = r;
  }
  __syncthreads();
  return res;
}

__device__ double block_sum(double x) {
  __shared__ double part[kThreads / 32];
  __shared__ double res;
  for (int o = 16; o > 0; o >>= 1) x += __shfl_down_sync(0xffffffffu, x, o);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = x;
  __syncthreads();
  if (threadIdx.x == 0) {
    double r = 0;
    for (int w = 0; w < kThreads / 32; ++w) r += part[w];
    res = r;
  }
  __syncthreads();
  return res;
}

// Exclusive prefix of each thread's x over the block (thread order); *total gets the block's sum.
__device__ double block_exclusive_scan(double x, double* total) {
  __shared__ double vals[kThreads];
  vals[threadIdx.x] = x;
  __syncthreads();
  if (threadIdx.x == 0) {
    double acc = 0;
    for (int t = 0; t < kThreads; ++t) {
      const double v = vals[t];
      vals[t] = acc;
      acc += v;
    }
    *total = acc;
  }
  __syncthreads();
  const double r = vals[threadIdx.x];
  __syncthreads();
  return r;
}

// Inverse CDF over n weights w(0..n-1) in that order: the first j whose prefix sum through j exceeds
// frac * (sum of all n), or, if rounding leaves none, the last j with nonzero weight. Each thread owns a
// contiguous chunk, so a block scan of the chunk sums keeps the order.
template <typename W>
__device__ int32_t inverse_cdf(W w, int64_t n, double frac) {
  __shared__ int32_t found, last;
  __shared__ double total;
  const int64_t chunk = (n + kThreads - 1) / kThreads;
  const int64_t b = threadIdx.x * chunk, e = b + chunk < n ? b + chunk : n;
  double s = 0;
  int32_t last_nonzero = -1;
  for (int64_t j = b; j < e; ++j) {
    const double x = w(j);
    s += x;
    if (x > 0) last_nonzero = static_cast<int32_t>(j);
  }
  if (threadIdx.x == 0) found = last = -1;
  double acc = block_exclusive_scan(s, &total);  // synchronizes: found/last are reset
  const double target = frac * total;
  // The owner of the step: its prefix before the chunk is <= target < its prefix after it (unique: the
  // chunks' intervals are disjoint, and the walk below re-adds the same terms in the same order).
  if (b < e && acc <= target && target < acc + s) {
    for (int64_t j = b; j < e; ++j) {
      acc += w(j);
      if (target < acc) {
        found = static_cast<int32_t>(j);
        break;
      }
    }
  }
  atomicMax(&last, last_nonzero);
  __syncthreads();
  const int32_t r = found >= 0 ? found : (last >= 0 ? last : 0);
  __syncthreads();  // found/last are reused by the next call
  return r;
}

// Row statistics: argmax (ties to the smaller id), its logit, and log-sum-exp of the temperature-1 softmax.
template <typename E>
__device__ void row_stats(const E* row, int64_t V, int32_t* arg, float* mx, double* logz) {
  MaxArg m{-INFINITY, 0x7fffffff};
  for (int64_t j = threadIdx.x; j < V; j += kThreads)
    m = better(m, MaxArg{to_f(row[j]), static_cast<int32_t>(j)});
  m = block_argmax(m);
  double z = 0;
  for (int64_t j = threadIdx.x; j < V; j += kThreads) z += exp(static_cast<double>(to_f(row[j])) - m.v);
  z = block_sum(z);
  *arg = m.i;
  *mx = m.v;
  *logz = static_cast<double>(m.v) + log(z);
}

// Greedy, or temperature sampling over the whole vocabulary: inverse CDF in id order.
template <typename E>
__global__ void sample_plain_kernel(int32_t* token, float* logprob, const E* logits, int64_t V,
                                    double temperature, const double* u) {
  const E* row = logits + static_cast<int64_t>(blockIdx.x) * V;
  int32_t tok;
  float mx;
  double logz;
  row_stats(row, V, &tok, &mx, &logz);
  if (temperature > 0) {
    auto w = [&](int64_t j) { return exp((static_cast<double>(to_f(row[j])) - mx) / temperature); };
    tok = inverse_cdf(w, V, u[blockIdx.x]);
  }
  if (threadIdx.x == 0) {
    token[blockIdx.x] = tok;
    logprob[blockIdx.x] = static_cast<float>(static_cast<double>(to_f(row[tok])) - logz);
  }
}

// top-k / top-p over each row's logits sorted descending (stable: equal logits keep ascending ids).
template <typename E>
__global__ void sample_sorted_kernel(int32_t* token, float* logprob, const E* logits,
                                     const float* sorted_keys, const int32_t* sorted_ids, int64_t V,
                                     int64_t k, double temperature, double top_p, const double* u) {
  const int64_t r = blockIdx.x;
  const E* row = logits + r * V;
  const float* keys = sorted_keys + r * V;
  int32_t arg;
  float mx;
  double logz;
  row_stats(row, V, &arg, &mx, &logz);
  auto w = [&](int64_t i) { return exp((static_cast<double>(keys[i]) - mx) / temperature); };
  // top-p: the smallest prefix whose mass reaches top_p of the top-k mass (the first i whose prefix through
  // i exceeds it; a prefix exactly equal to the goal, which the CPU would stop at, has measure zero).
  const int64_t keep = top_p < 1.0 ? inverse_cdf(w, k, top_p) + 1 : k;
  const int32_t pos = inverse_cdf(w, keep, u[r]);
  if (threadIdx.x == 0) {
    const int32_t tok = sorted_ids[r * V + pos];
    token[r] = tok;
    logprob[r] = static_cast<float>(static_cast<double>(to_f(row[tok])) - logz);
  }
}

template <typename E>
__global__ void keys_ids_kernel(float* keys, int32_t* ids, const E* logits, int64_t V) {
  const int64_t r = blockIdx.y;
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < V;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    keys[r * V + j] = to_f(logits[r * V + j]);
    ids[r * V + j] = static_cast<int32_t>(j);
  }
}

__global__ void offsets_kernel(int32_t* off, int64_t n, int64_t V) {
  for (int64_t i = threadIdx.x; i <= n; i += blockDim.x) off[i] = static_cast<int32_t>(i * V);
}

}  // namespace

template <typename E>
void sample_tokens(int32_t* token, float* logprob, const E* logits, int64_t n, int64_t V, double temperature,
                   int64_t top_k, double top_p, const double* u, cudaStream_t stream) {
  if (n == 0) return;
  const int64_t k = top_k > 0 && top_k < V ? top_k : V;
  if (temperature <= 0 || (k == V && top_p >= 1.0)) {
    sample_plain_kernel<E>
        <<<static_cast<unsigned>(n), kThreads, 0, stream>>>(token, logprob, logits, V, temperature, u);
    NDT_CUDA_CHECK(cudaGetLastError());
    return;
  }
  float *keys_in, *keys_out;
  int32_t *ids_in, *ids_out, *off;
  const size_t nv = static_cast<size_t>(n * V);
  NDT_CUDA_CHECK(cudaMallocAsync(&keys_in, nv * sizeof(float), stream));
  NDT_CUDA_CHECK(cudaMallocAsync(&keys_out, nv * sizeof(float), stream));
  NDT_CUDA_CHECK(cudaMallocAsync(&ids_in, nv * sizeof(int32_t), stream));
  NDT_CUDA_CHECK(cudaMallocAsync(&ids_out, nv * sizeof(int32_t), stream));
  NDT_CUDA_CHECK(cudaMallocAsync(&off, static_cast<size_t>(n + 1) * sizeof(int32_t), stream));
  keys_ids_kernel<E>
      <<<dim3(static_cast<unsigned>((V + 255) / 256 < 64 ? (V + 255) / 256 : 64), static_cast<unsigned>(n)),
         256, 0, stream>>>(keys_in, ids_in, logits, V);
  offsets_kernel<<<1, 256, 0, stream>>>(off, n, V);
  NDT_CUDA_CHECK(cudaGetLastError());
  size_t bytes = 0;
  NDT_CUDA_CHECK(cub::DeviceSegmentedRadixSort::SortPairsDescending(
      nullptr, bytes, keys_in, keys_out, ids_in, ids_out, static_cast<int>(nv), static_cast<int>(n), off,
      off + 1, 0, 32, stream));
  void* tmp;
  NDT_CUDA_CHECK(cudaMallocAsync(&tmp, bytes, stream));
  NDT_CUDA_CHECK(cub::DeviceSegmentedRadixSort::SortPairsDescending(
      tmp, bytes, keys_in, keys_out, ids_in, ids_out, static_cast<int>(nv), static_cast<int>(n), off, off + 1,
      0, 32, stream));
  sample_sorted_kernel<E><<<static_cast<unsigned>(n), kThreads, 0, stream>>>(
      token, logprob, logits, keys_out, ids_out, V, k, temperature, top_p, u);
  NDT_CUDA_CHECK(cudaGetLastError());
  for (void* p : {static_cast<void*>(keys_in), static_cast<void*>(keys_out), static_cast<void*>(ids_in),
                  static_cast<void*>(ids_out), static_cast<void*>(off), tmp})
    NDT_CUDA_CHECK(cudaFreeAsync(p, stream));
}

template void sample_tokens<float>(int32_t*, float*, const float*, int64_t, int64_t, double, int64_t, double,
                                   const double*, cudaStream_t);
template void sample_tokens<__nv_bfloat16>(int32_t*, float*, const __nv_bfloat16*, int64_t, int64_t, double,
                                           int64_t, double, const double*, cudaStream_t);

}  // namespace ndt::cuda
