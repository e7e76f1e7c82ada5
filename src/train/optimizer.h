#pragma once
// AdamW over a ParamStore's flat buffers, with optional ZeRO-1 (optimizer state sharded over DP).
//
// Gradient flow of one step (grads hold the local sum over microbatches, already scaled by 1/N):
//   1. sync_tp_replicated: under sequence parallelism, replicated params' grads are TP partial sums.
//   2. plain DP: all-reduce grads over DP (in buckets).     ZeRO-1: reduce-scatter grads over DP.
//   3. global grad norm over all shards (TP-replicated params counted once), clip.
//   4. AdamW on what this rank owns; ZeRO-1 all-gathers the updated parameters.
// fp32 on CPU: the parameters are the master weights. On CUDA the store's flat fp32 buffers (values,
// grads) and the moments live on the device; the update is one fused AdamW launch per run of parameters
// with equal weight decay, which also applies the clip factor (so on CUDA the gradients themselves stay
// unclipped) and refreshes the bf16 compute copy of the weights in mixed precision.
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "dist/communicator.h"
#include "model/params.h"
#include "train/config.h"

namespace ndt {

struct OptimizerComms {
  Communicator* dp = nullptr;          // ranks holding replicas of the same parameters (DP x CP)
  Communicator* tp = nullptr;          // tensor-parallel group (null or size 1: none)
  Communicator* norm_extra = nullptr;  // further groups the grad norm sums over (pipeline stages)
  bool sequence_parallel = false;
  bool zero1 = false;
};

class Optimizer {
 public:
  // The store must be flattened with align = dp size when zero1 is set.
  Optimizer(ParamStore& params, const TrainConfig& cfg, OptimizerComms comms);
  // Steps 1-3 above; returns the global gradient norm before clipping.
  double reduce_and_clip(double clip);
  // Overlap of the DP reduction with backward (CUDA, NCCL, plain DP without ZeRO-1): reduce_early starts
  // the all-reduce of flat grads [begin, end) at once, on the communicator's stream, ordered after the
  // backward kernels enqueued so far; reduce_and_clip waits for those and reduces only the rest.
  bool overlaps_reduction() const;
  void reduce_early(int64_t begin, int64_t end);
  // Step 4 with learning rate lr.
  void step(double lr);
  int64_t steps_taken() const { return step_; }
  void set_steps_taken(int64_t n) { step_ = n; }
  // Moments for the whole local flat buffer (ZeRO-1 shards all-gathered over DP), for checkpoints.
  void gather_moments(Tensor& full_m, Tensor& full_v);
  // Takes this rank's owned range from whole-buffer moments (after loading a checkpoint).
  void scatter_moments(const Tensor& full_m, const Tensor& full_v);
  // Optimizer state for checkpoints: (m, v) over the owned range of the flat buffer.
  Tensor& exp_avg() { return m_; }
  Tensor& exp_avg_sq() { return v_; }
  int64_t owned_begin() const { return own_begin_; }
  int64_t owned_end() const { return own_end_; }

 private:
  ParamStore& params_;
  TrainConfig cfg_;
  OptimizerComms c_;
  int64_t own_begin_ = 0, own_end_ = 0;  // range of the flat buffer this rank updates
  Tensor m_, v_;                         // (own_end - own_begin)
  Tensor shard_grad_;                    // ZeRO-1: reduced grad of the owned range
  int64_t step_ = 0;
  float grad_scale_ = 1.0f;                                // CUDA: clip factor for the next step()
  std::vector<std::pair<int64_t, int64_t>> early_ranges_;  // reduce_early ranges of this step
  std::vector<std::function<void()>> early_waits_;         // their completion (compute stream waits)
#ifdef NDT_HAVE_CUDA
  void step_device(double lr, float* g, float* w);
#endif
};

}  // namespace ndt
