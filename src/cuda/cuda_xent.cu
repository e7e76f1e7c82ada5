// Softmax cross-entropy in vocab-parallel pieces. One block works a row of logits at a time (V is large);
// rows are read with 16-byte accesses after a short scalar head that reaches alignment (V need not be a
// multiple of 8). exp/log are expf/logf as on CPU; sums in fp32 per thread and then a fixed-order block tree.
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "cuda/cuda_kernel_utils.cuh"
#include "cuda/cuda_ops.h"
#include "cuda/runtime.h"

namespace ndt::cuda {

namespace {
using detail::from_f;
using detail::load;
using detail::to_f;
// Blocks of 256 threads, three per SM, each striding over the rows (row blockIdx.x, then + gridDim.x, ...):
// GPT-2's fused loss kernel took 1.37 ms a step so against 1.81 ms with a block of 512 per row, the 1B
// Llama's 0.97 against 1.15 ms (H200 traces, session 44). Every row kernel uses the same block, so the fused
// and the separate kernels sum a row in the same order.
constexpr int kBlock = 256;
constexpr int kRowBlocksPerSM = 3;
unsigned rows_grid(int64_t T) {
  return static_cast<unsigned>(std::min<int64_t>(T, static_cast<int64_t>(kRowBlocksPerSM) * sm_count()));
}

// Elements of row p before its first 16-byte boundary (at most n): the scalar head of the rows' split.
template <typename E>
__device__ __forceinline__ int64_t row_head(const E* p, int64_t n) {
  const int64_t head =
      static_cast<int64_t>(((16u - (reinterpret_cast<uintptr_t>(p) & 15u)) & 15u) / sizeof(E));
  return head < n ? head : n;
}

// The rows' split over the block's threads: fs(j) for each j of the scalar head and tail of row p[0, n) and
// fp(pk, j0) for each 16-byte pack p[j0, j0 + kV) between (pk a copy; fp may change and store it), thread i
// taking packs i, i + blockDim.x, ..., in this order: head, packs, tail. KU packs are loaded before they are
// visited, so that KU 16-byte loads are in flight per thread. E may be const.
template <int KU, typename E, typename FS, typename FP>
__device__ __forceinline__ void row_visit(E* p, int64_t n, FS&& fs, FP&& fp) {
  using T = std::remove_const_t<E>;
  constexpr int kV = detail::kVec<T>;
  using P = detail::Pack<T, kV>;
  const int64_t head = row_head(p, n), nv = (n - head) / kV, step = blockDim.x;
  for (int64_t j = threadIdx.x; j < head; j += step) fs(j);
  int64_t v = threadIdx.x;
  for (; v + (KU - 1) * step < nv; v += KU * step) {
    P pk[KU];
#pragma unroll
    for (int u = 0; u < KU; ++u) pk[u] = *reinterpret_cast<const P*>(p + head + (v + u * step) * kV);
#pragma unroll
    for (int u = 0; u < KU; ++u) fp(pk[u], head + (v + u * step) * kV);
  }
  for (; v < nv; v += step) {
    P pk = *reinterpret_cast<const P*>(p + head + v * kV);
    fp(pk, head + v * kV);
  }
  for (int64_t j = head + nv * kV + threadIdx.x; j < n; j += step) fs(j);
}

// Calls fs(x, j) for the scalar head and tail of row p[0, n) and fp(x[kV], j0) for each 16-byte pack
// between, in row_visit's split and order, one load in flight.
template <typename E, typename FS, typename FP>
__device__ __forceinline__ void row_foreach_pack(const E* p, int64_t n, FS&& fs, FP&& fp) {
  constexpr int kV = detail::kVec<E>;
  row_visit<1>(
      p, n, [&](int64_t j) { fs(to_f(p[j]), j); },
      [&](detail::Pack<E, kV>& pk, int64_t j0) {
        float x[kV];
#pragma unroll
        for (int k = 0; k < kV; ++k) x[k] = to_f(pk.v[k]);
        fp(x, j0);
      });
}

// Calls f(value, j) for every j in [0, n) of row p, in row_foreach_pack's split and order.
template <typename E, typename F>
__device__ __forceinline__ void row_foreach(const E* p, int64_t n, F&& f) {
  constexpr int kV = detail::kVec<E>;
  row_foreach_pack(p, n, f, [&](const float(&x)[kV], int64_t j0) {
#pragma unroll
    for (int k = 0; k < kV; ++k) f(x[k], j0 + k);
  });
}

// Block-wide reductions (result valid in every thread). `sm` holds 32 floats.
__device__ float block_sum(float x, float* sm) {
  x = detail::warp_sum(x);
  if ((threadIdx.x & 31) == 0) sm[threadIdx.x >> 5] = x;
  __syncthreads();
  const int nw = blockDim.x >> 5;
  float r = static_cast<int>(threadIdx.x & 31) < nw ? sm[threadIdx.x & 31] : 0.f;
  r = detail::warp_sum(r);
  __syncthreads();  // sm may be reused right after
  return r;
}
__device__ float block_max(float x, float* sm) {
  x = detail::warp_max(x);
  if ((threadIdx.x & 31) == 0) sm[threadIdx.x >> 5] = x;
  __syncthreads();
  const int nw = blockDim.x >> 5;
  float r = static_cast<int>(threadIdx.x & 31) < nw ? sm[threadIdx.x & 31] : -INFINITY;
  r = detail::warp_max(r);
  __syncthreads();
  return r;
}

template <typename E>
__global__ void rowmax_kernel(float* rowmax, const E* logits, int64_t T, int64_t V) {
  detail::pdl_prologue();
  __shared__ float sm[32];
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    float m = -INFINITY;  // an empty shard must not win the max
    row_foreach(logits + t * V, V, [&](float x, int64_t) { m = fmaxf(m, x); });
    m = block_max(m, sm);
    if (threadIdx.x == 0) rowmax[t] = m;
  }
}

template <typename E>
__global__ void sumexp_kernel(float* sumexp, const E* logits, const float* rowmax, int64_t T, int64_t V) {
  detail::pdl_prologue();
  __shared__ float sm[32];
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    const float m = rowmax[t];
    float s = 0.f;
    row_foreach(logits + t * V, V, [&](float x, int64_t) { s += expf(x - m); });
    s = block_sum(s, sm);
    if (threadIdx.x == 0) sumexp[t] = s;
  }
}

// Online softmax normalizer: each thread keeps (max m, sum s of exp(x - m)), rescaled when the max grows;
// row_normalizer combines the threads' pairs into the row's (max, sum exp(x - max)).
__device__ __forceinline__ void online_add(float x, float& m, float& s) {
  if (x > m) {
    s = s * expf(m - x) + 1.0f;  // expf(-inf) = 0 on the first element
    m = x;
  } else {
    s += expf(x - m);
  }
}
// online_add over a 16-byte pack: the pack's max first, so the running sum is rescaled at most once per pack
// and every element costs one exponential, with no per-element branch (divergent in a warp) on the max.
template <int N>
__device__ __forceinline__ void online_add_pack(const float (&x)[N], float& m, float& s) {
  float pm = x[0];
#pragma unroll
  for (int k = 1; k < N; ++k) pm = fmaxf(pm, x[k]);
  if (pm > m) {
    s *= expf(m - pm);  // expf(-inf) = 0 before the first element
    m = pm;
  }
#pragma unroll
  for (int k = 0; k < N; ++k) s += expf(x[k] - m);
}

__device__ float2 row_normalizer(float m, float s, float* sm) {
  const float M = block_max(m, sm);
  s = (m == -INFINITY) ? 0.f : s * expf(m - M);
  return make_float2(M, block_sum(s, sm));
}

template <typename E>
__global__ void rowmax_sumexp_kernel(float* rowmax, float* sumexp, const E* logits, int64_t T, int64_t V) {
  detail::pdl_prologue();
  __shared__ float sm[32];
  constexpr int kV = detail::kVec<E>;
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    float m = -INFINITY, s = 0.f;
    row_foreach_pack(
        logits + t * V, V, [&](float x, int64_t) { online_add(x, m, s); },
        [&](const float(&x)[kV], int64_t) { online_add_pack(x, m, s); });
    const float2 ms = row_normalizer(m, s, sm);
    if (threadIdx.x == 0) {
      rowmax[t] = ms.x;
      sumexp[t] = ms.y;
    }
  }
}

__global__ void rebase_kernel(float* sumexp, const float* local_max, const float* global_max, int64_t T) {
  detail::pdl_prologue();
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= T) return;
  sumexp[t] = local_max[t] == -INFINITY ? 0.f : sumexp[t] * expf(local_max[t] - global_max[t]);
}

template <typename E>
__global__ void target_logit_kernel(float* tl, const E* logits, const int32_t* targets, int64_t T, int64_t V,
                                    int64_t start) {
  detail::pdl_prologue();
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= T) return;
  const int64_t j = static_cast<int64_t>(targets[t]) - start;
  tl[t] = (j >= 0 && j < V) ? to_f(logits[t * V + j]) : 0.f;
}

__global__ void logprob_kernel(float* lp, const float* tl, const float* rowmax, const float* sumexp,
                               int64_t T) {
  detail::pdl_prologue();
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t < T) lp[t] = tl[t] - rowmax[t] - logf(sumexp[t]);
}

// One element's gradient dl * (softmax - onehot(target)) = scale * exp(x - m) - [is_target] * dl, scale =
// dl / sumexp; 0 where dl is 0 (uniform over a row's block).
__device__ __forceinline__ float xent_grad(float x, float m, float scale, float dl, bool is_target) {
  if (dl == 0.0f) return 0.0f;
  const float g = scale * expf(x - m);
  return is_target ? g - dl : g;
}

// Writes one row's gradient (xent_grad) in row_foreach_pack's split. INPLACE: d is overwritten (0 when dl is
// 0; d may alias l); else d += gradient. Same row offset and (checked by the host) same base alignment: the
// head/vector/tail split of the logits row fits the gradient row, so both are read and written with 16-byte
// accesses.
template <typename E, bool INPLACE>
__device__ void write_row_grad(E* d, const E* l, float m, float scale, float dl, int64_t tj, int64_t V) {
  constexpr int kV = detail::kVec<E>;
  row_foreach_pack(
      l, V,
      [&](float x, int64_t j) {
        const float g = xent_grad(x, m, scale, dl, j == tj);
        d[j] = from_f<E>(INPLACE ? g : to_f(d[j]) + g);
      },
      [&](const float(&x)[kV], int64_t j0) {
        float o[kV], y[kV];
        if (!INPLACE) load<kV>(o, d, j0);
#pragma unroll
        for (int k = 0; k < kV; ++k)
          y[k] = xent_grad(x[k], m, scale, dl, j0 + k == tj) + (INPLACE ? 0.0f : o[k]);
        detail::store<kV>(d, j0, y);
      });
}

// INPLACE: dlogits aliases the logits and is overwritten (0 for rows with dloss 0); else dlogits +=.
template <typename E, bool INPLACE>
__global__ void xent_backward_kernel(E* dlogits, const E* logits, const float* rowmax, const float* sumexp,
                                     const int32_t* targets, const float* dloss, int64_t T, int64_t V,
                                     int64_t start) {
  detail::pdl_prologue();
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    const float dl = dloss[t];
    if (!INPLACE && dl == 0.0f) continue;  // (the whole block)
    const float scale = dl == 0.0f ? 0.0f : dl / sumexp[t];
    const int64_t tj = static_cast<int64_t>(targets[t]) - start;  // outside [0, V): another shard's target
    write_row_grad<E, INPLACE>(dlogits + t * V, logits + t * V, rowmax[t], scale, dl, tj, V);
  }
}

// Loss and gradient of one rank's whole vocabulary in one kernel (no vocab shards to reduce between): pass 1
// is rowmax_sumexp_kernel's online reduction (the same per-thread order and packs, so the same values) and
// also picks up the target logit; pass 2 writes xent_backward_kernel<E, true>'s gradient, reading the row
// again (mostly from L2: the row was just read). Both passes keep four 16-byte accesses in flight per thread
// and find the target once per pack. Staging the row in shared memory instead (two blocks per SM) measured
// 0.1 ms slower per GPT-2 step.
template <typename E>
__device__ void xent_loss_backward_row(E* logits, float* logprob, const int32_t* targets, const float* dloss,
                                       int64_t t, int64_t V, float* sm) {
  constexpr int kV = detail::kVec<E>, kU = 4;
  using P = detail::Pack<E, kV>;
  E* l = logits + t * V;
  const int64_t tj = targets[t];
  // The target's place in the pack at j0 (0..kV-1), or -1 when it is elsewhere.
  const auto target_in = [&](int64_t j0) {
    const int64_t r = tj - j0;
    return r >= 0 && r < kV ? static_cast<int>(r) : -1;
  };
  float m = -INFINITY, acc = 0.f, tl = 0.f;
  row_visit<kU>(
      static_cast<const E*>(l), V,
      [&](int64_t j) {
        const float x = to_f(l[j]);
        if (j == tj) tl = x;
        online_add(x, m, acc);
      },
      [&](const P& pk, int64_t j0) {
        float x[kV];
        const int rk = target_in(j0);
#pragma unroll
        for (int k = 0; k < kV; ++k) {
          x[k] = to_f(pk.v[k]);
          if (k == rk) tl = x[k];
        }
        online_add_pack(x, m, acc);
      });
  const float2 ms = row_normalizer(m, acc, sm);
  const float target = block_sum(tl, sm);  // one thread holds it, the others 0: exact
  if (threadIdx.x == 0) logprob[t] = target - ms.x - logf(ms.y);
  // (block_sum ends with a barrier: every read of the row above is done before it is overwritten)
  // Pass 2: the gradient (xent_grad) in place.
  const float dl = dloss[t], M = ms.x, scale = dl == 0.0f ? 0.0f : dl / ms.y;
  row_visit<kU>(
      l, V, [&](int64_t j) { l[j] = from_f<E>(xent_grad(to_f(l[j]), M, scale, dl, j == tj)); },
      [&](P& pk, int64_t j0) {
        const int rk = target_in(j0);
#pragma unroll
        for (int k = 0; k < kV; ++k) pk.v[k] = from_f<E>(xent_grad(to_f(pk.v[k]), M, scale, dl, k == rk));
        *reinterpret_cast<P*>(l + j0) = pk;
      });
}

template <typename E>
__global__ void xent_loss_backward_kernel(E* logits, float* logprob, const int32_t* targets,
                                          const float* dloss, int64_t T, int64_t V) {
  detail::pdl_prologue();
  __shared__ float sm[32];
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x)
    xent_loss_backward_row(logits, logprob, targets, dloss, t, V, sm);
}

template <typename E>
__global__ void xent_backward_scalar_kernel(E* dlogits, const E* logits, const float* rowmax,
                                            const float* sumexp, const int32_t* targets, const float* dloss,
                                            int64_t T, int64_t V, int64_t start) {
  detail::pdl_prologue();
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    const float dl = dloss[t];
    if (dl == 0.0f) continue;
    const float m = rowmax[t], scale = dl / sumexp[t];
    const int64_t tj = static_cast<int64_t>(targets[t]) - start;
    const E* l = logits + t * V;
    E* d = dlogits + t * V;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x)
      d[j] = from_f<E>(to_f(d[j]) + xent_grad(to_f(l[j]), m, scale, dl, j == tj));
  }
}

// losses[t] = mask[t] == 0 ? 0 : -(tl - max - log sumexp); *total = their sum (one block, fixed order).
__global__ void loss_sum_kernel(float* losses, double* total, const float* tl, const float* rowmax,
                                const float* sumexp, const float* mask, int64_t T) {
  detail::pdl_prologue();
  __shared__ double sm[1024];
  double acc = 0.0;
  for (int64_t t = threadIdx.x; t < T; t += blockDim.x) {
    const float loss = (mask && mask[t] == 0.0f) ? 0.f : -(tl[t] - rowmax[t] - logf(sumexp[t]));
    losses[t] = loss;
    acc += loss;
  }
  sm[threadIdx.x] = acc;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (static_cast<int>(threadIdx.x) < s) sm[threadIdx.x] += sm[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) *total = sm[0];
}

unsigned blocks_for(int64_t T) { return static_cast<unsigned>((T + 255) / 256); }
}  // namespace

template <typename E>
void xent_rowmax(float* rowmax, const E* logits, int64_t T, int64_t V, cudaStream_t stream) {
  if (T <= 0) return;
  detail::launch_pdl(rowmax_kernel<E>, rows_grid(T), kBlock, 0, stream, rowmax, logits, T, V);
  NDT_CUDA_CHECK_LAUNCH();
}

template <typename E>
void xent_sumexp(float* sumexp, const E* logits, const float* rowmax, int64_t T, int64_t V,
                 cudaStream_t stream) {
  if (T <= 0) return;
  detail::launch_pdl(sumexp_kernel<E>, rows_grid(T), kBlock, 0, stream, sumexp, logits, rowmax, T, V);
  NDT_CUDA_CHECK_LAUNCH();
}

template <typename E>
void xent_rowmax_sumexp(float* rowmax, float* sumexp, const E* logits, int64_t T, int64_t V,
                        cudaStream_t stream) {
  if (T <= 0) return;
  detail::launch_pdl(rowmax_sumexp_kernel<E>, rows_grid(T), kBlock, 0, stream, rowmax, sumexp, logits, T, V);
  NDT_CUDA_CHECK_LAUNCH();
}

void xent_rebase_sumexp(float* sumexp, const float* local_max, const float* global_max, int64_t T,
                        cudaStream_t stream) {
  if (T <= 0) return;
  detail::launch_pdl(rebase_kernel, blocks_for(T), 256, 0, stream, sumexp, local_max, global_max, T);
  NDT_CUDA_CHECK_LAUNCH();
}

template <typename E>
void xent_target_logit(float* target_logit, const E* logits, const int32_t* targets, int64_t T, int64_t V,
                       int64_t vocab_start, cudaStream_t stream) {
  if (T <= 0) return;
  detail::launch_pdl(target_logit_kernel<E>, blocks_for(T), 256, 0, stream, target_logit, logits, targets, T,
                     V, vocab_start);
  NDT_CUDA_CHECK_LAUNCH();
}

void xent_logprob(float* logprob, const float* target_logit, const float* rowmax, const float* sumexp,
                  int64_t T, cudaStream_t stream) {
  if (T <= 0) return;
  detail::launch_pdl(logprob_kernel, blocks_for(T), 256, 0, stream, logprob, target_logit, rowmax, sumexp, T);
  NDT_CUDA_CHECK_LAUNCH();
}

template <typename E>
void xent_backward(E* dlogits, const E* logits, const float* rowmax, const float* sumexp,
                   const int32_t* targets, const float* dloss, int64_t T, int64_t V, int64_t vocab_start,
                   cudaStream_t stream) {
  if (!dlogits || T <= 0 || V <= 0) return;
  const bool same_phase =
      ((reinterpret_cast<uintptr_t>(dlogits) ^ reinterpret_cast<uintptr_t>(logits)) & 15u) == 0;
  if (same_phase) {
    detail::launch_pdl(xent_backward_kernel<E, false>, rows_grid(T), kBlock, 0, stream, dlogits, logits,
                       rowmax, sumexp, targets, dloss, T, V, vocab_start);
  } else {
    detail::launch_pdl(xent_backward_scalar_kernel<E>, rows_grid(T), kBlock, 0, stream, dlogits, logits,
                       rowmax, sumexp, targets, dloss, T, V, vocab_start);
  }
  NDT_CUDA_CHECK_LAUNCH();
}

template <typename E>
void xent_backward_inplace(E* logits, const float* rowmax, const float* sumexp, const int32_t* targets,
                           const float* dloss, int64_t T, int64_t V, int64_t vocab_start,
                           cudaStream_t stream) {
  if (T <= 0 || V <= 0) return;
  detail::launch_pdl(xent_backward_kernel<E, true>, rows_grid(T), kBlock, 0, stream, logits, logits, rowmax,
                     sumexp, targets, dloss, T, V, vocab_start);
  NDT_CUDA_CHECK_LAUNCH();
}

template <typename E>
void xent_loss_backward_inplace(E* logits, float* logprob, const int32_t* targets, const float* dloss,
                                int64_t T, int64_t V, cudaStream_t stream) {
  if (T <= 0 || V <= 0) return;
  detail::launch_pdl(xent_loss_backward_kernel<E>, rows_grid(T), kBlock, 0, stream, logits, logprob, targets,
                     dloss, T, V);
  NDT_CUDA_CHECK_LAUNCH();
}

template <typename E>
double cross_entropy_forward(float* losses, const E* logits, const int32_t* targets, const float* mask,
                             int64_t T, int64_t V, cudaStream_t stream) {
  if (T <= 0) return 0.0;
  Scratch buf(sizeof(double) + sizeof(float) * 3 * T, stream);
  double* total = buf.as<double>();
  float* rowmax = reinterpret_cast<float*>(total + 1);
  float* sumexp = rowmax + T;
  float* tl = sumexp + T;
  xent_rowmax_sumexp<E>(rowmax, sumexp, logits, T, V, stream);
  xent_target_logit<E>(tl, logits, targets, T, V, 0, stream);
  detail::launch_pdl(loss_sum_kernel, 1, 1024, 0, stream, losses, total, tl, rowmax, sumexp, mask, T);
  NDT_CUDA_CHECK_LAUNCH();
  double host = 0.0;
  copy_d2h_on(&host, total, sizeof(double), stream);
  return host;
}

#define NDT_INSTANTIATE(E)                                                                                   \
  template void xent_rowmax<E>(float*, const E*, int64_t, int64_t, cudaStream_t);                            \
  template void xent_sumexp<E>(float*, const E*, const float*, int64_t, int64_t, cudaStream_t);              \
  template void xent_rowmax_sumexp<E>(float*, float*, const E*, int64_t, int64_t, cudaStream_t);             \
  template void xent_target_logit<E>(float*, const E*, const int32_t*, int64_t, int64_t, int64_t,            \
                                     cudaStream_t);                                                          \
  template void xent_backward<E>(E*, const E*, const float*, const float*, const int32_t*, const float*,     \
                                 int64_t, int64_t, int64_t, cudaStream_t);                                   \
  template void xent_backward_inplace<E>(E*, const float*, const float*, const int32_t*, const float*,       \
                                         int64_t, int64_t, int64_t, cudaStream_t);                           \
  template void xent_loss_backward_inplace<E>(E*, float*, const int32_t*, const float*, int64_t, int64_t,    \
                                              cudaStream_t);                                                 \
  template double cross_entropy_forward<E>(float*, const E*, const int32_t*, const float*, int64_t, int64_t, \
                                           cudaStream_t);
NDT_INSTANTIATE(float)
NDT_INSTANTIATE(__nv_bfloat16)
#undef NDT_INSTANTIATE

}  // namespace ndt::cuda
