// AdamW over a flat fp32 range in one launch (PyTorch semantics, the CPU twin's exact fp32 formula), with
// an optional gradient scale (clipping) and an optional bf16 copy of the updated parameters.
#include <cmath>

#include "core/step_control.h"
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
    // Every operation rounded on its own (no contraction into FMAs, which the compiler may do differently
    // in each kernel that inlines this): the one-range and the many-run launches agree bit for bit.
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float gk = __fmul_rn(g[k], grad_scale);
      p[k] = __fmul_rn(p[k], decay);
      mm[k] = __fadd_rn(__fmul_rn(beta1, mm[k]), __fmul_rn(1.0f - beta1, gk));
      vv[k] = __fadd_rn(__fmul_rn(beta2, vv[k]), __fmul_rn(__fmul_rn(1.0f - beta2, gk), gk));
      const float den = __fadd_rn(__fdiv_rn(__fsqrt_rn(vv[k]), bc2_sqrt), eps);
      p[k] = __fsub_rn(p[k], __fdiv_rn(__fmul_rn(step_size, mm[k]), den));
    }
    store<N>(param, i, p);
    store<N>(m, i, mm);
    store<N>(v, i, vv);
    if (param_bf16) store<N>(param_bf16, i, p);
  }
};

// One block per chunk of kAdamwChunk elements of one run (found by binary search over the runs' first
// chunks), with the run's own AdamwOp: the same per-element arithmetic as adamw_update.
__global__ void adamw_runs_kernel(const AdamwRun* runs, int nruns, AdamwOp base, float decayed,
                                  const StepControl* control) {
  detail::pdl_prologue();
  if (control) {  // the step decided on the device (core/step_control.h)
    if (control->skip) return;
    base.step_size = control->step_size, base.bc2_sqrt = control->bc2_sqrt,
    base.grad_scale = control->grad_scale;
  }
  const int64_t c = blockIdx.x;
  int lo = 0, hi = nruns - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (runs[mid].chunk0 <= c)
      lo = mid;
    else
      hi = mid - 1;
  }
  const AdamwRun& r = runs[lo];
  AdamwOp op = base;
  op.param = r.param, op.grad = r.grad, op.m = r.m, op.v = r.v, op.param_bf16 = r.param_bf16;
  op.decay = r.decay ? decayed : 1.0f;
  const int64_t first = (c - r.chunk0) * kAdamwChunk;
  const int64_t last = first + kAdamwChunk < r.n ? first + kAdamwChunk : r.n;
  if (r.vec) {
    const int64_t vlast = first + (last - first) / 4 * 4;
    for (int64_t i = first + 4 * static_cast<int64_t>(threadIdx.x); i < vlast; i += 4 * blockDim.x)
      op.template apply<4>(i);
    for (int64_t i = vlast + threadIdx.x; i < last; i += blockDim.x) op.template apply<1>(i);
  } else {
    for (int64_t i = first + threadIdx.x; i < last; i += blockDim.x) op.template apply<1>(i);
  }
}

// The step's scalars; pointers and the decay factor are the caller's.
AdamwOp adamw_op(float lr, float beta1, float beta2, float eps, int64_t step, float grad_scale) {
  NDT_CUDA_REQUIRE(step >= 1, "adamw: step counts from 1");
  // Bias corrections in double on the host (core/step_control.h: as the CPU twin and decide_step).
  const AdamStepScalars a =
      adam_step_scalars(lr, adam_bias_correction(beta1, step), adam_bias_correction(beta2, step));
  AdamwOp op{};
  op.beta1 = beta1, op.beta2 = beta2, op.eps = eps, op.grad_scale = grad_scale, op.decay = 1.0f;
  op.step_size = a.step_size;
  op.bc2_sqrt = a.bc2_sqrt;
  return op;
}
}  // namespace

void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, float lr, float beta1,
                  float beta2, float eps, float weight_decay, int64_t step, __nv_bfloat16* param_bf16,
                  float grad_scale, cudaStream_t stream) {
  AdamwOp op = adamw_op(lr, beta1, beta2, eps, step, grad_scale);
  op.param = param, op.grad = grad, op.m = m, op.v = v, op.param_bf16 = param_bf16;
  op.decay = 1.0f - lr * weight_decay;
  // Packs of 4 floats (16 bytes); the bf16 copy then moves 8 bytes per pack.
  detail::launch_elementwise<float>(op, n, detail::all_aligned16({param, grad, m, v, param_bf16}), stream);
}

int64_t adamw_plan_runs(AdamwRun* runs, int nruns) {
  int64_t chunks = 0;
  for (int i = 0; i < nruns; ++i) {
    AdamwRun& r = runs[i];
    r.chunk0 = chunks;
    r.vec = detail::all_aligned16({r.param, r.grad, r.m, r.v, r.param_bf16}) ? 1 : 0;
    chunks += (r.n + kAdamwChunk - 1) / kAdamwChunk;
  }
  return chunks;
}

void adamw_update_runs(const AdamwRun* runs_dev, int nruns, int64_t chunks, float lr, float beta1,
                       float beta2, float eps, float weight_decay, int64_t step, float grad_scale,
                       cudaStream_t stream, const StepControl* control) {
  const AdamwOp base = adamw_op(lr, beta1, beta2, eps, control ? 1 : step, grad_scale);
  if (nruns <= 0 || chunks <= 0) return;
  detail::launch_pdl(adamw_runs_kernel, static_cast<unsigned>(chunks), 256, 0, stream, runs_dev, nruns, base,
                     1.0f - lr * weight_decay, control);
  NDT_CUDA_CHECK_LAUNCH();
}

namespace {
__global__ void decide_step_kernel(StepControl* control, StepDecision d, StepRecord* record) {
  detail::pdl_prologue();
  decide_step(*control, d, *record);
}
}  // namespace

void decide_step(StepControl* control, const StepDecision& d, StepRecord* record, cudaStream_t stream) {
  detail::launch_pdl(decide_step_kernel, 1, 1, 0, stream, control, d, record);
  NDT_CUDA_CHECK_LAUNCH();
}

}  // namespace ndt::cuda
