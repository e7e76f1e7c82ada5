// AdamW over a flat fp32 range in one launch (PyTorch semantics, the CPU twin's exact fp32 formula), with
// an optional gradient scale (clipping) and an optional bf16 copy of the updated parameters.
#include <cmath>

#include "cuda/cuda_kernel_utils.cuh"
#include "cuda/cuda_ops.h"

namespace ndt::cuda {

namespace {
using detail::load;
using detail::store;

struct AdamwOp {
  float* param;
  const float* grad;
  float* m;
  float* v;
  __nv_bfloat16* param_bf16;
  float beta1, beta2, eps, step_size, bc2_sqrt, decay, grad_scale;
  template <int N>
  __device__ void apply(int64_t i) const {
    float p[N], g[N], mm[N], vv[N];
    load<N>(p, param, i);
    load<N>(g, grad, i);
    load<N>(mm, m, i);
    load<N>(vv, v, i);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float gk = g[k] * grad_scale;
      p[k] *= decay;
      mm[k] = beta1 * mm[k] + (1.0f - beta1) * gk;
      vv[k] = beta2 * vv[k] + (1.0f - beta2) * gk * gk;
      p[k] -= step_size * mm[k] / (sqrtf(vv[k]) / bc2_sqrt + eps);
    }
    store<N>(param, i, p);
    store<N>(m, i, mm);
    store<N>(v, i, vv);
    if (param_bf16) store<N>(param_bf16, i, p);
  }
};
}  // namespace

void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, float lr, float beta1,
                  float beta2, float eps, float weight_decay, int64_t step, __nv_bfloat16* param_bf16,
                  float grad_scale, cudaStream_t stream) {
  NDT_CUDA_REQUIRE(step >= 1, "adamw: step counts from 1");
  // Bias corrections in double on the host, as PyTorch (and the CPU twin) compute them.
  const double bc1 = 1.0 - std::pow(static_cast<double>(beta1), static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(beta2), static_cast<double>(step));
  const AdamwOp op{param,
                   grad,
                   m,
                   v,
                   param_bf16,
                   beta1,
                   beta2,
                   eps,
                   static_cast<float>(lr / bc1),
                   static_cast<float>(std::sqrt(bc2)),
                   1.0f - lr * weight_decay,
                   grad_scale};
  // Packs of 4 floats (16 bytes); the bf16 copy then moves 8 bytes per pack.
  detail::launch_elementwise<float>(op, n, detail::all_aligned16({param, grad, m, v, param_bf16}), stream);
}

}  // namespace ndt::cuda
