// Elementwise ops: GELU (tanh), SwiGLU, residual add, scale/add in place, f32<->bf16 casts. Math in fp32
// with the CPU twin's formulas (tanhf/expf, not fast intrinsics, so fp32 matches to ~1e-7); bf16 SwiGLU
// takes the fast exponential and division (swiglu_sigmoid).
#include <type_traits>

#include "cuda/cuda_kernel_utils.cuh"
#include "cuda/cuda_ops.h"

namespace ndt::cuda {

namespace {
using detail::from_f;
using detail::load;
using detail::store;
using detail::to_f;
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;

template <typename E>
struct GeluFwd {
  E* out;
  const E* inp;
  template <int N>
  __device__ void apply(int64_t i) const {
    float x[N], y[N];
    load<N>(x, inp, i);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float u = kGeluScale * (x[k] + kGeluCubic * x[k] * x[k] * x[k]);
      y[k] = 0.5f * x[k] * (1.0f + tanhf(u));
    }
    store<N>(out, i, y);
  }
};

// The current value of an accumulated output, or 0 when the op overwrites it (then it is not read).
template <int N, typename E>
__device__ __forceinline__ void load_or_zero(float (&out)[N], const E* p, int64_t i, bool accumulate) {
  if (accumulate) {
    load<N>(out, p, i);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = 0.f;
  }
}

template <typename E>
struct GeluBwd {
  E* dinp;
  const E* dout;
  const E* inp;
  bool accumulate;
  template <int N>
  __device__ void apply(int64_t i) const {
    float x[N], g[N], d[N];
    load<N>(x, inp, i);
    load<N>(g, dout, i);
    load_or_zero<N>(d, dinp, i, accumulate);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float u = kGeluScale * (x[k] + kGeluCubic * x[k] * x[k] * x[k]);
      const float th = tanhf(u);
      const float sech2 = 1.0f - th * th;
      const float grad =
          0.5f * (1.0f + th) + 0.5f * x[k] * sech2 * kGeluScale * (1.0f + 3.0f * kGeluCubic * x[k] * x[k]);
      d[k] += grad * g[k];
    }
    store<N>(dinp, i, d);
  }
};

// SwiGLU's sigmoid. fp32 keeps the CPU twin's expf and division (~1e-7 apart); for bf16 results, whose
// rounding (2^-9) dwarfs the fast intrinsics' few-ulp error, __expf and __fdividef: fewer instructions
// (the 1B Llama's forward 7% faster on an H200; the backward is bound by memory, not arithmetic).
// e^-x overflowing to inf gives 0, as it should.
template <typename E>
__device__ __forceinline__ float swiglu_sigmoid(float x) {
  if constexpr (std::is_same_v<E, float>)
    return 1.0f / (1.0f + expf(-x));
  else
    return __fdividef(1.0f, 1.0f + __expf(-x));
}
// silu(g) * u: the forward, shared by both layouts (the same bits from either).
template <typename E>
__device__ __forceinline__ float swiglu_value(float g, float u) {
  if constexpr (std::is_same_v<E, float>)
    return g / (1.0f + expf(-g)) * u;
  else
    return g * swiglu_sigmoid<E>(g) * u;
}

template <typename E>
struct SwigluFwd {
  E* out;
  const E* gate;
  const E* up;
  template <int N>
  __device__ void apply(int64_t i) const {
    float g[N], u[N], y[N];
    load<N>(g, gate, i);
    load<N>(u, up, i);
#pragma unroll
    for (int k = 0; k < N; ++k) y[k] = swiglu_value<E>(g[k], u[k]);
    store<N>(out, i, y);
  }
};

// Elementwise over (T, F) reading the fused gate/up row pair (T, 2F).
template <typename E>
__global__ void swiglu_fused_kernel(E* out, const E* h13, int64_t T, int64_t F) {
  detail::pdl_prologue();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < T * F;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / F, f = i - t * F;
    const float g = to_f(h13[t * 2 * F + f]), u = to_f(h13[t * 2 * F + F + f]);
    out[i] = from_f<E>(swiglu_value<E>(g, u));
  }
}

template <typename E>
struct SwigluBwd {
  E* dgate;
  E* dup;
  const E* dout;
  const E* gate;
  const E* up;
  bool accumulate;
  template <int N>
  __device__ void apply(int64_t i) const {
    float g[N], u[N], go[N], sig[N], a[N];
    load<N>(g, gate, i);
    load<N>(u, up, i);
    load<N>(go, dout, i);
    // One exponential and one division per element for both gradients (as the CPU twin computes them).
#pragma unroll
    for (int k = 0; k < N; ++k) sig[k] = swiglu_sigmoid<E>(g[k]);
    if (dgate) {
      load_or_zero<N>(a, dgate, i, accumulate);
#pragma unroll
      for (int k = 0; k < N; ++k) a[k] += go[k] * u[k] * sig[k] * (1.0f + g[k] * (1.0f - sig[k]));
      store<N>(dgate, i, a);
    }
    if (dup) {
      load_or_zero<N>(a, dup, i, accumulate);
#pragma unroll
      for (int k = 0; k < N; ++k) a[k] += go[k] * g[k] * sig[k];
      store<N>(dup, i, a);
    }
  }
};

template <typename E>
struct AddOp {  // out = a + b
  E* out;
  const E* a;
  const E* b;
  template <int N>
  __device__ void apply(int64_t i) const {
    float x[N], y[N];
    load<N>(x, a, i);
    load<N>(y, b, i);
#pragma unroll
    for (int k = 0; k < N; ++k) x[k] += y[k];
    store<N>(out, i, x);
  }
};

template <typename E>
struct AddBiasOp {  // out = a + (b + bias[i % C]); the vector path needs C % N == 0 (a pack stays in one row)
  E* out;
  const E* a;
  const E* b;
  const E* bias;
  int64_t C;
  template <int N>
  __device__ void apply(int64_t i) const {
    float x[N], y[N], z[N];
    load<N>(x, a, i);
    load<N>(y, b, i);
    load<N>(z, bias, i % C);
#pragma unroll
    for (int k = 0; k < N; ++k) x[k] += y[k] + z[k];
    store<N>(out, i, x);
  }
};

template <typename E>
struct ScaleOp {
  E* x;
  float s;
  template <int N>
  __device__ void apply(int64_t i) const {
    float v[N];
    load<N>(v, x, i);
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] *= s;
    store<N>(x, i, v);
  }
};

template <typename In, typename Out>
struct CastOp {
  Out* out;
  const In* in;
  template <int N>
  __device__ void apply(int64_t i) const {
    float v[N];
    load<N>(v, in, i);
    store<N>(out, i, v);
  }
};

using detail::all_aligned16;
using detail::launch_elementwise;
}  // namespace

template <typename E>
void gelu_forward(E* out, const E* inp, int64_t N, cudaStream_t stream) {
  launch_elementwise<E>(GeluFwd<E>{out, inp}, N, all_aligned16({out, inp}), stream);
}

template <typename E>
void gelu_backward(E* dinp, const E* dout, const E* inp, int64_t N, cudaStream_t stream, bool accumulate) {
  if (!dinp) return;
  launch_elementwise<E>(GeluBwd<E>{dinp, dout, inp, accumulate}, N, all_aligned16({dinp, dout, inp}), stream);
}

template <typename E>
void swiglu_forward(E* out, const E* gate, const E* up, int64_t N, cudaStream_t stream) {
  launch_elementwise<E>(SwigluFwd<E>{out, gate, up}, N, all_aligned16({out, gate, up}), stream);
}

template <typename E>
void swiglu_forward_fused(E* out, const E* h13, int64_t T, int64_t F, cudaStream_t stream) {
  const int64_t n = T * F;
  if (n <= 0) return;
  const int block = 256;
  const auto grid = static_cast<unsigned>(std::min<int64_t>((n + block - 1) / block, 65535));
  detail::launch_pdl(swiglu_fused_kernel<E>, grid, block, 0, stream, out, h13, T, F);
  NDT_CUDA_CHECK_LAUNCH();
}

template <typename E>
void swiglu_backward(E* dgate, E* dup, const E* dout, const E* gate, const E* up, int64_t N,
                     cudaStream_t stream, bool accumulate) {
  if (!dgate && !dup) return;
  launch_elementwise<E>(SwigluBwd<E>{dgate, dup, dout, gate, up, accumulate}, N,
                        all_aligned16({dgate, dup, dout, gate, up}), stream);
}

template <typename E>
void residual_forward(E* out, const E* a, const E* b, int64_t N, cudaStream_t stream, const E* bias,
                      int64_t C) {
  if (!bias) {
    launch_elementwise<E>(AddOp<E>{out, a, b}, N, all_aligned16({out, a, b}), stream);
    return;
  }
  NDT_CUDA_REQUIRE(C > 0 && N % C == 0, "residual_forward: the bias size must divide the element count");
  launch_elementwise<E>(AddBiasOp<E>{out, a, b, bias, C}, N,
                        all_aligned16({out, a, b, bias}) && C % detail::kVec<E> == 0, stream);
}

template <typename E>
void scale_inplace(E* x, float s, int64_t n, cudaStream_t stream) {
  launch_elementwise<E>(ScaleOp<E>{x, s}, n, all_aligned16({x}), stream);
}

template <typename E>
void add_inplace(E* y, const E* x, int64_t n, cudaStream_t stream) {
  launch_elementwise<E>(AddOp<E>{y, y, x}, n, all_aligned16({y, x}), stream);
}

void cast(__nv_bfloat16* out, const float* in, int64_t n, cudaStream_t stream) {
  // Vector width of the narrower side (8 bf16 = 16 bytes; its 8 floats are two aligned 16-byte loads).
  launch_elementwise<__nv_bfloat16>(CastOp<float, __nv_bfloat16>{out, in}, n,
                                    detail::all_aligned16({out, in}), stream);
}

void cast(float* out, const __nv_bfloat16* in, int64_t n, cudaStream_t stream) {
  launch_elementwise<__nv_bfloat16>(CastOp<__nv_bfloat16, float>{out, in}, n,
                                    detail::all_aligned16({out, in}), stream);
}

#define NDT_INSTANTIATE(E)                                                                             \
  template void gelu_forward<E>(E*, const E*, int64_t, cudaStream_t);                                  \
  template void gelu_backward<E>(E*, const E*, const E*, int64_t, cudaStream_t, bool);                 \
  template void swiglu_forward<E>(E*, const E*, const E*, int64_t, cudaStream_t);                      \
  template void swiglu_forward_fused<E>(E*, const E*, int64_t, int64_t, cudaStream_t);                 \
  template void swiglu_backward<E>(E*, E*, const E*, const E*, const E*, int64_t, cudaStream_t, bool); \
  template void residual_forward<E>(E*, const E*, const E*, int64_t, cudaStream_t, const E*, int64_t); \
  template void scale_inplace<E>(E*, float, int64_t, cudaStream_t);                                    \
  template void add_inplace<E>(E*, const E*, int64_t, cudaStream_t);
NDT_INSTANTIATE(float)
NDT_INSTANTIATE(__nv_bfloat16)
#undef NDT_INSTANTIATE

}  // namespace ndt::cuda
