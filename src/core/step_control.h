#pragma once
// The end of a training step decided where the gradients live (train.host_sync = log): from the step's
// global sum of squared gradients and loss sum, whether the update is skipped (non-finite values), the
// clip factor, the optimizer's step count and AdamW's bias-corrected scalars. The AdamW launch reads them
// from there, so the host need not wait for the norm; the host reads the records back every log step.
// One function for the CPU and the GPU (a one-thread kernel, cuda/cuda_adamw.cu), with the arithmetic of the
// host's per-step decision (train/trainer.cpp, cuda::adamw_op), so every path decides alike, bit for bit.
#include <math.h>

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define NDT_HOST_DEVICE __host__ __device__
#else
#define NDT_HOST_DEVICE
#endif

namespace ndt {

// AdamW's bias correction 1 - beta^t in double (beta as the kernels take it, a float), as PyTorch computes
// it on the host: the CPU twin, the CUDA launch and the step decided on the device all take it from here.
inline double adam_bias_correction(float beta, int64_t t) {
  return 1.0 - std::pow(static_cast<double>(beta), static_cast<double>(t));
}
// The step's scalars from the bias corrections bc1, bc2: lr / bc1 and sqrt(bc2), rounded to float.
struct AdamStepScalars {
  float step_size, bc2_sqrt;
};
NDT_HOST_DEVICE inline AdamStepScalars adam_step_scalars(float lr, double bc1, double bc2) {
  return {static_cast<float>(static_cast<double>(lr) / bc1), static_cast<float>(sqrt(bc2))};
}

// Lives on the step's device (host memory on the CPU). The step writes sum_squares and loss_sum; decide_step
// fills the rest.
struct StepControl {
  double sum_squares = 0;  // this step's global sum of squared gradients
  double loss_sum = 0;     // this step's global loss sum
  int64_t opt_steps = 0;   // optimizer updates applied so far
  int64_t consecutive_skips = 0;
  int32_t stopped = 0;   // a stop condition was met: this and every later update is skipped
  int32_t skip = 0;      // this step's update is skipped
  float grad_scale = 1;  // clip factor (1: no clipping)
  float step_size = 0;   // lr / (1 - beta1^t)
  float bc2_sqrt = 0;    // sqrt(1 - beta2^t)
  int32_t clipped = 0;   // grad_scale applies
};

// One step as the host reads it back.
struct StepRecord {
  double loss_sum = 0, sum_squares = 0;
  int64_t opt_steps = 0;  // after the step
  int64_t consecutive_skips = 0;
  int32_t flags = 0;  // kLossNonfinite | kNormNonfinite
  int32_t skipped = 0;
  int32_t stopped = 0;  // the update was skipped because a stop condition was met (now or before)
  int32_t pad = 0;
};
constexpr int32_t kLossNonfinite = 1, kNormNonfinite = 2;

struct StepDecision {
  float lr = 0;  // as AdamW takes it (float, promoted to double for the step size)
  double clip = 0;
  // bias_corrections[2k], [2k+1] = adam_bias_correction(beta1 | beta2, base + k), for
  // base + k up to the most updates the steps in flight can apply.
  const double* bias_corrections = nullptr;
  int64_t base = 0;
  int64_t max_consecutive = 0;
  int32_t stop_on_nonfinite = 0;  // train.nonfinite = stop
};

NDT_HOST_DEVICE inline void decide_step(StepControl& c, const StepDecision& d, StepRecord& rec) {
  const double norm = sqrt(c.sum_squares);
  const int32_t flags = (isfinite(c.loss_sum) ? 0 : kLossNonfinite) | (isfinite(norm) ? 0 : kNormNonfinite);
  c.skip = 1;
  c.clipped = 0;
  c.grad_scale = 1.0f;
  if (!c.stopped && flags != 0) {
    ++c.consecutive_skips;
    if (d.stop_on_nonfinite || c.consecutive_skips >= d.max_consecutive) c.stopped = 1;
  } else if (!c.stopped) {
    c.consecutive_skips = 0;
    c.skip = 0;
    ++c.opt_steps;
    const int64_t k = c.opt_steps - d.base;
    const AdamStepScalars a =
        adam_step_scalars(d.lr, d.bias_corrections[2 * k], d.bias_corrections[2 * k + 1]);
    c.step_size = a.step_size;
    c.bc2_sqrt = a.bc2_sqrt;
    if (d.clip > 0 && norm > d.clip) {
      c.grad_scale = static_cast<float>(d.clip / (norm + 1e-6));
      c.clipped = 1;
    }
  }
  rec.loss_sum = c.loss_sum;
  rec.sum_squares = c.sum_squares;
  rec.opt_steps = c.opt_steps;
  rec.consecutive_skips = c.consecutive_skips;
  rec.flags = flags;
  rec.skipped = c.skip;
  rec.stopped = c.stopped;
}

}  // namespace ndt
