// LayerNorm and RMSNorm over the last dim: one warp per row (statistics in fp32, two passes over the row,
// which stays in L1), 16-byte vector accesses when C and the pointers allow. Backward: dinp per row
// (accumulated), parameter gradients by the deterministic column sum (detail::colsum).
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

// A warp per row.
template <typename E, int VEC, bool RMS>
__global__ void norm_forward_kernel(E* out, float* mean, float* rstd, const E* inp, const E* weight,
                                    const E* bias, int64_t T, int64_t C, float eps) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (t >= T) return;
  norm_row<E, VEC, RMS, 32>(out, mean, rstd, inp, weight, bias, t, C, eps, threadIdx.x & 31,
                            [](float v) { return detail::warp_sum(v); });
}

template <typename E, int VEC, bool RMS>
__global__ void norm_backward_dinp_kernel(E* dinp, const E* dout, const E* inp, const E* weight,
                                          const float* mean, const float* rstd, int64_t T, int64_t C,
                                          const E* dres) {
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
  for (int64_t c = lane * VEC; c < C; c += 32 * VEC) {
    float xv[VEC], gv[VEC], wv[VEC], dv[VEC];
    load<VEC>(xv, x, c);
    load<VEC>(gv, g, c);
    load<VEC>(wv, weight, c);
    load<VEC>(dv, base, c);
#pragma unroll
    for (int k = 0; k < VEC; ++k) dv[k] += rs * (gv[k] * wv[k] - a - ((xv[k] - m) * rs) * b);
    store<VEC>(d, c, dv);
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
  norm_row<E, VEC, RMS, kRowThreads>(out, mean, rstd, inp, weight, bias, blockIdx.x, C, eps, threadIdx.x,
                                     [](float v) { return block_sum_ordered(v); });
}

template <typename E, bool RMS>
void norm_forward(E* out, float* mean, float* rstd, const E* inp, const E* weight, const E* bias, int64_t T,
                  int64_t C, float eps, cudaStream_t stream) {
  if (T <= 0 || C <= 0) return;
  if (T <= kFewRows) {  // a decode step: a block per row
    if (use_vec<E>(C, {out, inp, weight, bias}))
      norm_forward_row_kernel<E, detail::kVec<E>, RMS>
          <<<static_cast<unsigned>(T), kRowThreads, 0, stream>>>(out, mean, rstd, inp, weight, bias, C, eps);
    else
      norm_forward_row_kernel<E, 1, RMS>
          <<<static_cast<unsigned>(T), kRowThreads, 0, stream>>>(out, mean, rstd, inp, weight, bias, C, eps);
    NDT_CUDA_CHECK_LAUNCH();
    return;
  }
  const unsigned grid = static_cast<unsigned>((T + kWarps - 1) / kWarps);
  if (use_vec<E>(C, {out, inp, weight, bias})) {
    norm_forward_kernel<E, detail::kVec<E>, RMS>
        <<<grid, 32 * kWarps, 0, stream>>>(out, mean, rstd, inp, weight, bias, T, C, eps);
  } else {
    norm_forward_kernel<E, 1, RMS>
        <<<grid, 32 * kWarps, 0, stream>>>(out, mean, rstd, inp, weight, bias, T, C, eps);
  }
  NDT_CUDA_CHECK_LAUNCH();
}

template <typename E, bool RMS>
void norm_backward(E* dinp, float* dweight, float* dbias, const E* dout, const E* inp, const E* weight,
                   const float* mean, const float* rstd, int64_t T, int64_t C, cudaStream_t stream,
                   const E* dres) {
  if (T <= 0 || C <= 0) return;
  if (dinp) {
    const unsigned grid = static_cast<unsigned>((T + kWarps - 1) / kWarps);
    if (use_vec<E>(C, {dinp, dout, inp, weight, dres})) {
      norm_backward_dinp_kernel<E, detail::kVec<E>, RMS>
          <<<grid, 32 * kWarps, 0, stream>>>(dinp, dout, inp, weight, mean, rstd, T, C, dres);
    } else {
      norm_backward_dinp_kernel<E, 1, RMS>
          <<<grid, 32 * kWarps, 0, stream>>>(dinp, dout, inp, weight, mean, rstd, T, C, dres);
    }
    NDT_CUDA_CHECK_LAUNCH();
  }
  detail::colsum<2>(dweight, dbias, NormParamGrad<E, RMS>{dout, inp, mean, rstd, C}, T, C, stream);
}
}  // namespace

template <typename E>
void layernorm_forward(E* out, float* mean, float* rstd, const E* inp, const E* weight, const E* bias,
                       int64_t T, int64_t C, float eps, cudaStream_t stream) {
  norm_forward<E, false>(out, mean, rstd, inp, weight, bias, T, C, eps, stream);
}

template <typename E>
void layernorm_backward(E* dinp, float* dweight, float* dbias, const E* dout, const E* inp, const E* weight,
                        const float* mean, const float* rstd, int64_t T, int64_t C, cudaStream_t stream,
                        const E* dres) {
  norm_backward<E, false>(dinp, dweight, dbias, dout, inp, weight, mean, rstd, T, C, stream, dres);
}

template <typename E>
void rmsnorm_forward(E* out, float* rstd, const E* inp, const E* weight, int64_t T, int64_t C, float eps,
                     cudaStream_t stream) {
  norm_forward<E, true>(out, nullptr, rstd, inp, weight, nullptr, T, C, eps, stream);
}

template <typename E>
void rmsnorm_backward(E* dinp, float* dweight, const E* dout, const E* inp, const E* weight,
                      const float* rstd, int64_t T, int64_t C, cudaStream_t stream, const E* dres) {
  norm_backward<E, true>(dinp, dweight, nullptr, dout, inp, weight, nullptr, rstd, T, C, stream, dres);
}

#define NDT_INSTANTIATE(E)                                                                                 \
  template void layernorm_forward<E>(E*, float*, float*, const E*, const E*, const E*, int64_t, int64_t,   \
                                     float, cudaStream_t);                                                 \
  template void layernorm_backward<E>(E*, float*, float*, const E*, const E*, const E*, const float*,      \
                                      const float*, int64_t, int64_t, cudaStream_t, const E*);             \
  template void rmsnorm_forward<E>(E*, float*, const E*, const E*, int64_t, int64_t, float, cudaStream_t); \
  template void rmsnorm_backward<E>(E*, float*, const E*, const E*, const E*, const float*, int64_t,       \
                                    int64_t, cudaStream_t, const E*);
NDT_INSTANTIATE(float)
NDT_INSTANTIATE(__nv_bfloat16)
#undef NDT_INSTANTIATE

}  // namespace ndt::cuda
