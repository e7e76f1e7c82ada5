// LayerNorm and RMSNorm over the last dim: one warp per row (statistics in fp32, two passes over the row,
// which stays in L1), 16-byte vector accesses when C and the pointers allow. Backward: dinp per row
// (accumulated), parameter gradients by the deterministic column sum (detail::colsum).
#include <algorithm>
#include <type_traits>

#include "cuda/cuda_kernel_utils.cuh"
#include "cuda/cuda_ops.h"

namespace ndt::cuda {

namespace {
using detail::load;
using detail::store;
using detail::to_f;
constexpr int kWarps = 8;  // rows per block

// One row normalized by N cooperating threads (thread `tid` of them), their sums combined by `reduce`.
// RMS: no mean, no bias.
template <typename E, int VEC, bool RMS, int N, typename Reduce>
__device__ __forceinline__ void norm_row(E* out, float* mean, float* rstd, const E* inp, const E* weight,
                                         const E* bias, int64_t t, int64_t C, float eps, int tid,
                                         Reduce reduce) {
  const E* x = inp + t * C;
  float m = 0.f;
  if constexpr (!RMS) {
    float s = 0.f;
    for (int64_t c = tid * VEC; c < C; c += N * VEC) {
      float v[VEC];
      load<VEC>(v, x, c);
#pragma unroll
      for (int k = 0; k < VEC; ++k) s += v[k];
    }
    m = reduce(s) / static_cast<float>(C);
  }
  float ss = 0.f;
  for (int64_t c = tid * VEC; c < C; c += N * VEC) {
    float v[VEC];
    load<VEC>(v, x, c);
#pragma unroll
    for (int k = 0; k < VEC; ++k) ss += (v[k] - m) * (v[k] - m);
  }
  const float rs = 1.0f / sqrtf(reduce(ss) / static_cast<float>(C) + eps);
  E* o = out + t * C;
  for (int64_t c = tid * VEC; c < C; c += N * VEC) {
    float v[VEC], w[VEC], b[VEC];
    load<VEC>(v, x, c);
    load<VEC>(w, weight, c);
    if (!RMS && bias) {
      load<VEC>(b, bias, c);
    } else {
#pragma unroll
      for (int k = 0; k < VEC; ++k) b[k] = 0.f;
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) v[k] = ((v[k] - m) * rs) * w[k] + b[k];
    store<VEC>(o, c, v);
  }
  if (tid == 0) {
    if (!RMS && mean) mean[t] = m;
    if (rstd) rstd[t] = rs;
  }
}

// The residual add before a norm: h = a + (b + rbias) rounded to E and stored, then the norm of h. Each
// thread re-reads only the elements it stored (norm_row walks the same columns), so the norm sees h exactly
// as the separate add would leave it: the result equals add-then-norm bit for bit.
template <typename E, int VEC, bool RMS, int N, typename Reduce>
__device__ __forceinline__ void add_norm_row(E* h, E* out, float* mean, float* rstd, const E* a, const E* b,
                                             const E* rbias, const E* weight, const E* bias, int64_t t,
                                             int64_t C, float eps, int tid, Reduce reduce) {
  for (int64_t c = tid * VEC; c < C; c += N * VEC) {
    float x[VEC], y[VEC], z[VEC];
    load<VEC>(x, a + t * C, c);
    load<VEC>(y, b + t * C, c);
    if (rbias) {
      load<VEC>(z, rbias, c);
#pragma unroll
      for (int k = 0; k < VEC; ++k) x[k] += y[k] + z[k];
    } else {
#pragma unroll
      for (int k = 0; k < VEC; ++k) x[k] += y[k];
    }
    store<VEC>(h + t * C, c, x);
  }
  norm_row<E, VEC, RMS, N>(out, mean, rstd, h, weight, bias, t, C, eps, tid, reduce);
}

// A warp per row.
template <typename E, int VEC, bool RMS>
__global__ void norm_forward_kernel(E* out, float* mean, float* rstd, const E* inp, const E* weight,
                                    const E* bias, int64_t T, int64_t C, float eps) {
  detail::pdl_prologue();
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (t >= T) return;
  norm_row<E, VEC, RMS, 32>(out, mean, rstd, inp, weight, bias, t, C, eps, threadIdx.x & 31,
                            [](float v) { return detail::warp_sum(v); });
}

// One VEC-column chunk of a row's input gradient: d = base + rs * (g * w - a - xhat * b) (base is the
// residual gradient, or dinp itself to accumulate). Shared by the dinp kernel and the fused backward.
// With sum set, sum[k] += the values as stored (rounded to E): the column sums of dinp itself.
template <typename E, int VEC>
__device__ __forceinline__ void write_dinp_chunk(E* d, const E* base, const E* x, const E* g, const E* weight,
                                                 int64_t c, float m, float rs, float a, float b,
                                                 float* sum = nullptr) {
  float xv[VEC], gv[VEC], wv[VEC], dv[VEC];
  load<VEC>(xv, x, c);
  load<VEC>(gv, g, c);
  load<VEC>(wv, weight, c);
  load<VEC>(dv, base, c);
#pragma unroll
  for (int k = 0; k < VEC; ++k) dv[k] += rs * (gv[k] * wv[k] - a - ((xv[k] - m) * rs) * b);
  store<VEC>(d, c, dv);
  if (sum) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) sum[k] += to_f(detail::from_f<E>(dv[k]));
  }
}

template <typename E, int VEC, bool RMS>
__global__ void norm_backward_dinp_kernel(E* dinp, const E* dout, const E* inp, const E* weight,
                                          const float* mean, const float* rstd, int64_t T, int64_t C,
                                          const E* dres) {
  detail::pdl_prologue();
  const int lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (t >= T) return;
  const E* x = inp + t * C;
  const E* g = dout + t * C;
  const float m = RMS ? 0.f : mean[t], rs = rstd[t];
  float sum_dn = 0.f, sum_dn_n = 0.f;
  for (int64_t c = lane * VEC; c < C; c += 32 * VEC) {
    float xv[VEC], gv[VEC], wv[VEC];
    load<VEC>(xv, x, c);
    load<VEC>(gv, g, c);
    load<VEC>(wv, weight, c);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const float dn = gv[k] * wv[k];
      sum_dn += dn;
      sum_dn_n += dn * ((xv[k] - m) * rs);
    }
  }
  const float a = RMS ? 0.f : detail::warp_sum(sum_dn) / static_cast<float>(C);
  const float b = detail::warp_sum(sum_dn_n) / static_cast<float>(C);
  E* d = dinp + t * C;
  const E* base = (dres ? dres : dinp) + t * C;  // what the gradient is added to
  for (int64_t c = lane * VEC; c < C; c += 32 * VEC)
    write_dinp_chunk<E, VEC>(d, base, x, g, weight, c, m, rs, a, b);
}

// bf16 rows of up to kFusedMaxChunks * 256 columns: dinp as norm_backward_dinp_kernel computes it, and in
// the same pass over dout and inp the parameter gradients' column sums. Each warp accumulates its rows'
// terms in registers (chunk j holds columns [j * 256, (j + 1) * 256), 8 per lane); the block then sums its
// 8 warps in order through shared memory and writes one partial row per output, and colsum_finish
// adds the blocks' partials in order: deterministic, like detail::colsum, without its second read of dout
// and inp (which ran at ~1.5 TB/s: one scalar load per thread and column).
constexpr int kFusedMaxChunks = 8;
constexpr unsigned kFusedMaxBlocks = 512;  // fixed: the summation order must not depend on the device

template <bool RMS, int CH, bool SUMD>
__global__ void __launch_bounds__(32 * kWarps)
    norm_backward_fused_kernel(__nv_bfloat16* dinp, float* partial, const __nv_bfloat16* dout,
                               const __nv_bfloat16* inp, const __nv_bfloat16* weight, const float* mean,
                               const float* rstd, int64_t T, int64_t C, const __nv_bfloat16* dres) {
  detail::pdl_prologue();
  using E = __nv_bfloat16;
  constexpr int VEC = 8, SPAN = 32 * VEC;
  constexpr int NOUT = (RMS ? 1 : 2) + (SUMD ? 1 : 0);  // dweight, dbias, then dinp's own column sums
  static_assert(SPAN == 32 * kWarps, "one thread per column of a chunk in the block reduction");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float aw[CH][VEC], ab[CH][VEC], ad[SUMD ? CH : 1][VEC];
#pragma unroll
  for (int j = 0; j < CH; ++j)
#pragma unroll
    for (int k = 0; k < VEC; ++k) aw[j][k] = ab[j][k] = ad[SUMD ? j : 0][k] = 0.f;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + warp; t < T;
       t += static_cast<int64_t>(gridDim.x) * kWarps) {
    const E* x = inp + t * C;
    const E* g = dout + t * C;
    const float m = RMS ? 0.f : mean[t], rs = rstd[t];
    float sum_dn = 0.f, sum_dn_n = 0.f;
#pragma unroll
    for (int j = 0; j < CH; ++j) {
      const int64_t c = lane * VEC + j * SPAN;
      if (c >= C) break;
      float xv[VEC], gv[VEC], wv[VEC];
      load<VEC>(xv, x, c);
      load<VEC>(gv, g, c);
      load<VEC>(wv, weight, c);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float dn = gv[k] * wv[k], n = (xv[k] - m) * rs;
        sum_dn += dn;
        sum_dn_n += dn * n;
        aw[j][k] += gv[k] * n;
        if (!RMS) ab[j][k] += gv[k];
      }
    }
    const float a = RMS ? 0.f : detail::warp_sum(sum_dn) / static_cast<float>(C);
    const float b = detail::warp_sum(sum_dn_n) / static_cast<float>(C);
    E* d = dinp + t * C;
    const E* base = (dres ? dres : dinp) + t * C;
#pragma unroll
    for (int j = 0; j < CH; ++j) {
      const int64_t c = lane * VEC + j * SPAN;
      if (c >= C) break;
      write_dinp_chunk<E, VEC>(d, base, x, g, weight, c, m, rs, a, b, SUMD ? ad[SUMD ? j : 0] : nullptr);
    }
  }
  __shared__ float sm[kWarps][SPAN];
#pragma unroll
  for (int out = 0; out < NOUT; ++out) {
#pragma unroll
    for (int j = 0; j < CH; ++j) {
#pragma unroll
      for (int k = 0; k < VEC; ++k)
        sm[warp][lane * VEC + k] = out == 0 ? aw[j][k] : (!RMS && out == 1) ? ab[j][k] : ad[SUMD ? j : 0][k];
      __syncthreads();
      const int64_t c = j * SPAN + threadIdx.x;
      if (c < C) {
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) sum += sm[w][threadIdx.x];
        partial[(static_cast<int64_t>(out) * gridDim.x + blockIdx.x) * C + c] = sum;
      }
      __syncthreads();
    }
  }
}

template <bool RMS, int CH, bool SUMD>
void launch_norm_backward_fused(__nv_bfloat16* dinp, float* dweight, float* dbias, float* dsum,
                                const __nv_bfloat16* dout, const __nv_bfloat16* inp,
                                const __nv_bfloat16* weight, const float* mean, const float* rstd, int64_t T,
                                int64_t C, cudaStream_t stream, const __nv_bfloat16* dres) {
  constexpr int NOUT = (RMS ? 1 : 2) + (SUMD ? 1 : 0);
  const unsigned grid = static_cast<unsigned>(
      std::min<int64_t>((T + kWarps - 1) / kWarps, static_cast<int64_t>(kFusedMaxBlocks)));
  Scratch partial(sizeof(float) * NOUT * grid * C, stream);
  detail::launch_pdl(norm_backward_fused_kernel<RMS, CH, SUMD>, grid, 32 * kWarps, 0, stream, dinp,
                     partial.as<float>(), dout, inp, weight, mean, rstd, T, C, dres);
  NDT_CUDA_CHECK_LAUNCH();
  // The finish kernel skips a null output; an RMSNorm has no bias term (its dinp sums come second).
  detail::colsum_finish(NOUT, dweight, RMS ? dsum : dbias, RMS ? nullptr : dsum, partial.as<float>(), grid, C,
                        stream);
}

// The fused backward where it applies (bf16, 16-byte aligned rows of a multiple of 8 columns, at most
// kFusedMaxChunks chunks, both parameter gradients wanted); false otherwise.
template <typename E, bool RMS>
bool norm_backward_fused(E* dinp, float* dweight, float* dbias, float* dsum, const E* dout, const E* inp,
                         const E* weight, const float* mean, const float* rstd, int64_t T, int64_t C,
                         cudaStream_t stream, const E* dres) {
  if constexpr (!std::is_same_v<E, __nv_bfloat16>) {
    return false;
  } else {
    const int64_t chunks = (C + 255) / 256;
    if (!dinp || !dweight || (!RMS && !dbias) || C % 8 != 0 || chunks > kFusedMaxChunks ||
        !detail::all_aligned16({dinp, dout, inp, weight, dres}))
      return false;
    switch (chunks) {
#define NDT_FUSED_CASE(n)                                                                                    \
  case n:                                                                                                    \
    if (dsum)                                                                                                \
      launch_norm_backward_fused<RMS, n, true>(dinp, dweight, dbias, dsum, dout, inp, weight, mean, rstd, T, \
                                               C, stream, dres);                                             \
    else                                                                                                     \
      launch_norm_backward_fused<RMS, n, false>(dinp, dweight, dbias, nullptr, dout, inp, weight, mean,      \
                                                rstd, T, C, stream, dres);                                   \
    return true;
      NDT_FUSED_CASE(1)
      NDT_FUSED_CASE(2)
      NDT_FUSED_CASE(3)
      NDT_FUSED_CASE(4)
      NDT_FUSED_CASE(5)
      NDT_FUSED_CASE(6)
      NDT_FUSED_CASE(7)
      NDT_FUSED_CASE(8)
#undef NDT_FUSED_CASE
    }
    return false;
  }
}

// Column-sum terms for the parameter gradients: 0 -> dweight (dout * normalized), 1 -> dbias (dout).
template <typename E, bool RMS>
struct NormParamGrad {
  const E* dout;
  const E* inp;
  const float* mean;
  const float* rstd;
  int64_t C;
  __device__ float value(int64_t t, int64_t c, int which) const {
    const float g = to_f(dout[t * C + c]);
    if (which == 1) return g;
    const float m = RMS ? 0.f : mean[t];
    return g * ((to_f(inp[t * C + c]) - m) * rstd[t]);
  }
};

template <typename E>
bool use_vec(int64_t C, std::initializer_list<const void*> ptrs) {
  return C % detail::kVec<E> == 0 && detail::all_aligned16(ptrs);
}

// Few rows (a decode step): a block per row instead of a warp, so a row's loads are issued in one round
// rather than C / 256 dependent rounds of one warp. Fixed-order reductions (warps, then the warps' sums in
// order): the warp kernel's results up to summation order.
constexpr int kRowThreads = 256;
constexpr int64_t kFewRows = 256;  // up to this many rows: norm_forward_row_kernel
__device__ float block_sum_ordered(float x) {
  __shared__ float part[kRowThreads / 32];
  __shared__ float res;
  x = detail::warp_sum(x);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = x;
  __syncthreads();
  if (threadIdx.x == 0) {
    float r = 0.f;
    for (int w = 0; w < kRowThreads / 32; ++w) r += part[w];
    res = r;
  }
  __syncthreads();
  return res;
}

template <typename E, int VEC, bool RMS>
__global__ void __launch_bounds__(kRowThreads)
    norm_forward_row_kernel(E* out, float* mean, float* rstd, const E* inp, const E* weight, const E* bias,
                            int64_t C, float eps) {
  detail::pdl_prologue();
  norm_row<E, VEC, RMS, kRowThreads>(out, mean, rstd, inp, weight, bias, blockIdx.x, C, eps, threadIdx.x,
                                     [](float v) { return block_sum_ordered(v); });
}

template <typename E, int VEC, bool RMS>
__global__ void add_norm_forward_kernel(E* h, E* out, float* mean, float* rstd, const E* a, const E* b,
                                        const E* rbias, const E* weight, const E* bias, int64_t T, int64_t C,
                                        float eps) {
  detail::pdl_prologue();
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (t >= T) return;
  add_norm_row<E, VEC, RMS, 32>(h, out, mean, rstd, a, b, rbias, weight, bias, t, C, eps, threadIdx.x & 31,
                                [](float v) { return detail::warp_sum(v); });
}

template <typename E, int VEC, bool RMS>
__global__ void __launch_bounds__(kRowThreads)
    add_norm_forward_row_kernel(E* h, E* out, float* mean, float* rstd, const E* a, const E* b,
                                const E* rbias, const E* weight, const E* bias, int64_t C, float eps) {
  detail::pdl_prologue();
  add_norm_row<E, VEC, RMS, kRowThreads>(h, out, mean, rstd, a, b, rbias, weight, bias, blockIdx.x, C, eps,
                                         threadIdx.x, [](float v) { return block_sum_ordered(v); });
}

template <typename E, bool RMS>
void add_norm_forward(E* h, E* out, float* mean, float* rstd, const E* a, const E* b, const E* rbias,
                      const E* weight, const E* bias, int64_t T, int64_t C, float eps, cudaStream_t stream) {
  if (T <= 0 || C <= 0) return;
  const bool vec = use_vec<E>(C, {h, out, a, b, rbias, weight, bias});
  if (T <= kFewRows) {  // a decode step: a block per row, like norm_forward
    if (vec)
      detail::launch_pdl(add_norm_forward_row_kernel<E, detail::kVec<E>, RMS>, static_cast<unsigned>(T),
                         kRowThreads, 0, stream, h, out, mean, rstd, a, b, rbias, weight, bias, C, eps);
    else
      detail::launch_pdl(add_norm_forward_row_kernel<E, 1, RMS>, static_cast<unsigned>(T), kRowThreads, 0,
                         stream, h, out, mean, rstd, a, b, rbias, weight, bias, C, eps);
  } else {
    const unsigned grid = static_cast<unsigned>((T + kWarps - 1) / kWarps);
    if (vec)
      detail::launch_pdl(add_norm_forward_kernel<E, detail::kVec<E>, RMS>, grid, 32 * kWarps, 0, stream, h,
                         out, mean, rstd, a, b, rbias, weight, bias, T, C, eps);
    else
      detail::launch_pdl(add_norm_forward_kernel<E, 1, RMS>, grid, 32 * kWarps, 0, stream, h, out, mean, rstd,
                         a, b, rbias, weight, bias, T, C, eps);
  }
  NDT_CUDA_CHECK_LAUNCH();
}

template <typename E, bool RMS>
void norm_forward(E* out, float* mean, float* rstd, const E* inp, const E* weight, const E* bias, int64_t T,
                  int64_t C, float eps, cudaStream_t stream) {
  if (T <= 0 || C <= 0) return;
  if (T <= kFewRows) {  // a decode step: a block per row
    if (use_vec<E>(C, {out, inp, weight, bias}))
      detail::launch_pdl(norm_forward_row_kernel<E, detail::kVec<E>, RMS>, static_cast<unsigned>(T),
                         kRowThreads, 0, stream, out, mean, rstd, inp, weight, bias, C, eps);
    else
      detail::launch_pdl(norm_forward_row_kernel<E, 1, RMS>, static_cast<unsigned>(T), kRowThreads, 0, stream,
                         out, mean, rstd, inp, weight, bias, C, eps);
    NDT_CUDA_CHECK_LAUNCH();
    return;
  }
  const unsigned grid = static_cast<unsigned>((T + kWarps - 1) / kWarps);
  if (use_vec<E>(C, {out, inp, weight, bias})) {
    detail::launch_pdl(norm_forward_kernel<E, detail::kVec<E>, RMS>, grid, 32 * kWarps, 0, stream, out, mean,
                       rstd, inp, weight, bias, T, C, eps);
  } else {
    detail::launch_pdl(norm_forward_kernel<E, 1, RMS>, grid, 32 * kWarps, 0, stream, out, mean, rstd, inp,
                       weight, bias, T, C, eps);
  }
  NDT_CUDA_CHECK_LAUNCH();
}

template <typename E, bool RMS>
void norm_backward(E* dinp, float* dweight, float* dbias, const E* dout, const E* inp, const E* weight,
                   const float* mean, const float* rstd, int64_t T, int64_t C, cudaStream_t stream,
                   const E* dres, float* dsum) {
  if (T <= 0 || C <= 0) return;
  if (norm_backward_fused<E, RMS>(dinp, dweight, dbias, dsum, dout, inp, weight, mean, rstd, T, C, stream,
                                  dres))
    return;
  if (dinp) {
    const unsigned grid = static_cast<unsigned>((T + kWarps - 1) / kWarps);
    if (use_vec<E>(C, {dinp, dout, inp, weight, dres})) {
      detail::launch_pdl(norm_backward_dinp_kernel<E, detail::kVec<E>, RMS>, grid, 32 * kWarps, 0, stream,
                         dinp, dout, inp, weight, mean, rstd, T, C, dres);
    } else {
      detail::launch_pdl(norm_backward_dinp_kernel<E, 1, RMS>, grid, 32 * kWarps, 0, stream, dinp, dout, inp,
                         weight, mean, rstd, T, C, dres);
    }
    NDT_CUDA_CHECK_LAUNCH();
  }
  detail::colsum<2>(dweight, dbias, NormParamGrad<E, RMS>{dout, inp, mean, rstd, C}, T, C, stream);
  if (dsum) bias_backward<E>(dsum, dinp, T, C, stream);
}
}  // namespace

template <typename E>
void layernorm_forward(E* out, float* mean, float* rstd, const E* inp, const E* weight, const E* bias,
                       int64_t T, int64_t C, float eps, cudaStream_t stream) {
  norm_forward<E, false>(out, mean, rstd, inp, weight, bias, T, C, eps, stream);
}

template <typename E>
void add_layernorm_forward(E* h, E* out, float* mean, float* rstd, const E* a, const E* b, const E* rbias,
                           const E* weight, const E* bias, int64_t T, int64_t C, float eps,
                           cudaStream_t stream) {
  add_norm_forward<E, false>(h, out, mean, rstd, a, b, rbias, weight, bias, T, C, eps, stream);
}

template <typename E>
void add_rmsnorm_forward(E* h, E* out, float* rstd, const E* a, const E* b, const E* rbias, const E* weight,
                         int64_t T, int64_t C, float eps, cudaStream_t stream) {
  add_norm_forward<E, true>(h, out, nullptr, rstd, a, b, rbias, weight, nullptr, T, C, eps, stream);
}

template <typename E>
void layernorm_backward(E* dinp, float* dweight, float* dbias, const E* dout, const E* inp, const E* weight,
                        const float* mean, const float* rstd, int64_t T, int64_t C, cudaStream_t stream,
                        const E* dres, float* dsum) {
  norm_backward<E, false>(dinp, dweight, dbias, dout, inp, weight, mean, rstd, T, C, stream, dres, dsum);
}

template <typename E>
void rmsnorm_forward(E* out, float* rstd, const E* inp, const E* weight, int64_t T, int64_t C, float eps,
                     cudaStream_t stream) {
  norm_forward<E, true>(out, nullptr, rstd, inp, weight, nullptr, T, C, eps, stream);
}

template <typename E>
void rmsnorm_backward(E* dinp, float* dweight, const E* dout, const E* inp, const E* weight,
                      const float* rstd, int64_t T, int64_t C, cudaStream_t stream, const E* dres,
                      float* dsum) {
  norm_backward<E, true>(dinp, dweight, nullptr, dout, inp, weight, nullptr, rstd, T, C, stream, dres, dsum);
}

#define NDT_INSTANTIATE(E)                                                                                 \
  template void layernorm_forward<E>(E*, float*, float*, const E*, const E*, const E*, int64_t, int64_t,   \
                                     float, cudaStream_t);                                                 \
  template void layernorm_backward<E>(E*, float*, float*, const E*, const E*, const E*, const float*,      \
                                      const float*, int64_t, int64_t, cudaStream_t, const E*, float*);     \
  template void rmsnorm_forward<E>(E*, float*, const E*, const E*, int64_t, int64_t, float, cudaStream_t); \
  template void add_layernorm_forward<E>(E*, E*, float*, float*, const E*, const E*, const E*, const E*,   \
                                         const E*, int64_t, int64_t, float, cudaStream_t);                 \
  template void add_rmsnorm_forward<E>(E*, E*, float*, const E*, const E*, const E*, const E*, int64_t,    \
                                       int64_t, float, cudaStream_t);                                      \
  template void rmsnorm_backward<E>(E*, float*, const E*, const E*, const E*, const float*, int64_t,       \
                                    int64_t, cudaStream_t, const E*, float*);
NDT_INSTANTIATE(float)
NDT_INSTANTIATE(__nv_bfloat16)
#undef NDT_INSTANTIATE

}  // namespace ndt::cuda
