#pragma once
// AdamW over a ParamStore's flat buffers, with optional ZeRO-1 (optimizer state sharded over DP).
//
// Gradient flow of one step (grads hold the local sum over microbatches, already scaled by 1/N):
//   1. sync_tp_replicated: replicated params' grads are TP partial sums under sequence parallelism, those
//      marked tp_partial_grad (computed from this rank's heads) always: all-reduced over TP.
//   2. plain DP: all-reduce grads over DP (in buckets).     ZeRO-1: reduce-scatter grads over DP (over NCCL:
//      each range reduced to the ranks that own its parts, in place in the flat gradients).
//   3. global grad norm over all shards (TP-replicated params counted once), clip.
//   4. AdamW on what this rank owns; ZeRO-1 all-gathers the updated parameters.
// fp32 on CPU: the parameters are the master weights. On CUDA the store's flat fp32 buffers (values,
// grads) and the moments live on the device; the update is one fused AdamW launch per run of parameters
// with equal weight decay, which also applies the clip factor (so on CUDA the gradients themselves stay
// unclipped) and refreshes the bf16 compute copy of the weights in mixed precision.
#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "core/step_control.h"
#include "dist/communicator.h"
#include "model/params.h"
#include "train/config.h"

namespace ndt {

struct OptimizerComms {
  Communicator* dp = nullptr;  // ranks holding replicas of the same parameters (DP x CP)
  // Expert params (the store's expert region, ParamStore::expert_begin()): their replicas (the
  // expert-data-parallel group; null = dp) and the EP group whose ranks hold the other experts.
  Communicator* expert_dp = nullptr;
  Communicator* ep = nullptr;
  Communicator* tp = nullptr;          // tensor-parallel group (null or size 1: none)
  Communicator* norm_extra = nullptr;  // further groups the grad norm sums over (pipeline stages)
  bool sequence_parallel = false;
  bool zero1 = false;
  // ZeRO-1 on GPUs over NCCL with bf16 compute: gather the compute copy right after the update, in pieces
  // beside it, and the fp32 values beside the next step (ParamStore::settle_values). False: both at the end
  // of the step, as on the CPU (NDT_ZERO1_GATHER=step; measurements).
  bool defer_zero1_gather = true;
};

class Optimizer {
 public:
  // The store must be flattened with align = dp size (and expert_align = expert_dp size) when zero1 is
  // set. Each region of the flat buffer (dense, expert) is reduced and ZeRO-sharded over its own group.
  Optimizer(ParamStore& params, const TrainConfig& cfg, OptimizerComms comms);
  ~Optimizer();
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;
  // Steps 1-3 above; returns the global gradient norm before clipping. The same as reduce_grads() then
  // clip_grads().
  double reduce_and_clip(double clip);
  // Steps 1-2 and the norm of step 3 (no clipping); returns the global gradient norm (the same on every
  // rank; NaN or Inf when any gradient is).
  double reduce_grads();
  // reduce_grads without the host: the global sum of squared gradients (before the square root) lands in
  // *sum_squares, memory of the store's device (host memory on the CPU), written in stream order.
  void reduce_grads_into(double* sum_squares);
  // Clips to global norm `clip` (0 = off) given the norm reduce_grads() returned.
  void clip_grads(double norm, double clip);
  // Before reduce_grads: whether this rank's local (unreduced) gradients are all finite. CPU stores only
  // (one pass over the flat gradients); nullopt on a device store.
  std::optional<bool> local_grads_finite();
  // After reduce_grads: index (registration order in the store) of the first parameter whose reduced
  // gradient, in the part this rank owns, holds a NaN or Inf; -1 if none. Local (no collective).
  int64_t first_nonfinite_grad();
  // Overlap of the DP reduction with backward (CUDA, NCCL): reduce_early starts the reduction of flat grads
  // [begin, end) at once, on the communicator's stream, ordered after the backward kernels enqueued so far;
  // reduce_and_clip waits for those and reduces only the rest. Plain DP all-reduces the range; ZeRO-1
  // reduces each part of it to the rank that owns that part (NCCL reduce, in place in the flat gradients,
  // which then hold the owned part's reduced gradient: no separate shard buffer).
  // can_reduce_early: reduce_early may be called. Beyond overlaps_reduction(), plain DP on any backend,
  // where it reduces the range at once (blocking): the gathered embedding gradient needs the table's
  // earlier gradient reduced before it adds the group's rows (parallel/dp/gathered_embedding_grad.h).
  bool overlaps_reduction() const;
  bool can_reduce_early() const;
  void reduce_early(int64_t begin, int64_t end);
  // A DP step replayed from a CUDA graph (train/step_graph.h): join_early() makes the compute stream wait
  // for the reductions reduce_early started (called inside the captured work, it joins the communicator's
  // stream into the capture); early_ranges() / set_early_ranges() carry the ranges a replay's skipped host
  // code would have recorded; discard_early() drops what a failed capture left.
  void join_early();
  const std::vector<std::pair<int64_t, int64_t>>& early_ranges() const { return early_ranges_; }
  void set_early_ranges(std::vector<std::pair<int64_t, int64_t>> r) { early_ranges_ = std::move(r); }
  void discard_early();
  // [begin, end) of the dense region holds its reduced gradient already (the gathered untied embedding
  // table): reduce_grads leaves it out. Same condition as reduce_early.
  void mark_reduced(int64_t begin, int64_t end);
  // Plain DP on the device: where set, the dense region's all-reduces (early ranges and the rest) go through
  // `reduce` (buf, count: a range of the flat gradients) instead of the DP communicator; non-blocking, in
  // the same order on every rank (the copy-engine reduction, dist/copy_engine_reduction.h).
  using RangeReducer = std::function<std::unique_ptr<CommHandle>(float* buf, int64_t count)>;
  void set_range_reducer(RangeReducer reduce) { range_reducer_ = std::move(reduce); }
  // ZeRO-1 on the device: where set, the dense region's reductions to the owners go through `reduce` (buf,
  // count, this rank's owned part as flat indices [own_begin, own_end)) instead of NCCL's reduce per owner.
  using OwnerReducer = std::function<std::unique_ptr<CommHandle>(float* buf, int64_t count, int64_t own_begin,
                                                                 int64_t own_end)>;
  void set_owner_reducer(OwnerReducer reduce) { owner_reducer_ = std::move(reduce); }
  // Step 4 with learning rate lr.
  void step(double lr);
  // Step 4 as decided on the device (core/step_control.h, memory of the store's device): skipped where it
  // says so, with its clip factor and step count. On the device the host's count (steps_taken) lags until
  // set_steps_taken brings it level.
  void step_controlled(double lr, const StepControl* control);
  int64_t steps_taken() const { return step_; }
  // Elements of the optimizer's own buffers: one AdamW moment (m and v are each this long) and the ZeRO-1
  // reduced-gradient shards (0 without ZeRO-1). The planner's memory model is checked against them.
  int64_t moment_elements() const { return m_.numel(); }
  int64_t shard_grad_elements() const {
    int64_t n = 0;
    for (const Region& r : regions_) n += r.shard_grad.defined() ? r.shard_grad.numel() : 0;
    return n;
  }
  void set_steps_taken(int64_t n) { step_ = n; }
  // Moments for the whole local flat buffer (ZeRO-1 shards all-gathered over their groups), for checkpoints.
  void gather_moments(Tensor& full_m, Tensor& full_v);
  // After reduce_grads: the reduced (complete) gradients of the whole local flat buffer on the host (ZeRO-1
  // shards all-gathered over their groups), for parity checks. Collective over the DP groups.
  Tensor gather_grads();
  // Takes this rank's owned range from whole-buffer moments (after loading a checkpoint).
  void scatter_moments(const Tensor& full_m, const Tensor& full_v);

 private:
  // A range of the flat buffer with its own replica group.
  struct Region {
    int64_t begin = 0, end = 0;          // [begin, end) of the flat buffer
    Communicator* dp = nullptr;          // gradient reduction and ZeRO-1 group
    Communicator* norm_extra = nullptr;  // ranks holding OTHER parameters of this region (EP)
    int64_t own_begin = 0, own_end = 0;  // the part this rank updates
    int64_t state_offset = 0;            // where that part's moments start in m_ / v_
    bool zero = false;                   // ZeRO-1: optimizer state (and reduced gradient) sharded over dp
    // ZeRO-1 over NCCL: gradients reduced to their owners in place (the owned part of the flat gradients
    // holds the reduced gradient); else reduce-scattered into shard_grad.
    bool in_flat = false;
    // ZeRO-1 with deferred gathers (OptimizerComms::defer_zero1_gather): the fp32 values are gathered over
    // a communicator of their own, so the gather may run beside the next step's collectives.
    std::shared_ptr<Communicator> values_comm;
    bool deferred() const { return values_comm != nullptr; }
    Tensor shard_grad;
    bool sharded() const { return zero; }
    float* grad(ParamStore& ps) const;  // reduced gradient of the owned part
    int64_t owner_begin(int q) const { return begin + (end - begin) / dp->size() * q; }
  };
  // Checks [begin, end) (a range of the dense region, early reduction possible) and records it as reduced
  // before reduce_grads.
  void add_early_range(const char* what, int64_t begin, int64_t end);
  // ZeRO-1 in place: reduces [b, e) of region r to the owners of its parts (asynchronous; appended to
  // early_waits_).
  void reduce_to_owners(Region& r, int64_t b, int64_t e);
  // Plain DP over NCCL: all-reduces [b, e) of region r (asynchronous; appended to early_waits_), through the
  // range reducer where the region is the dense one and one is set.
  void all_reduce_range(Region& r, int64_t b, int64_t e);
  // Calls fn(param, region, b, e) for every parameter piece [b, e) (flat indices) this rank owns.
  template <typename F>
  void for_owned(F&& fn);
  void all_gather_owned(Region& r);
  // Makes the compute stream wait for the deferred gathers of the values (the store's settle hook).
  void settle_gathers();
  // reduce_grads' steps 1-2; then the global sum of squares (norm_sum_squares: on the host) over the ranges
  // norm_runs lists for a region (parameters counted in the norm, TP-replicated ones on TP rank 0).
  void reduce_only();
  double norm_sum_squares();
  std::vector<std::pair<int64_t, int64_t>> norm_runs(const Region& r);

  ParamStore& params_;
  TrainConfig cfg_;
  OptimizerComms c_;
  std::vector<Region> regions_;
  Tensor m_, v_;  // moments of the owned parts, region after region
  int64_t step_ = 0;
  float grad_scale_ = 1.0f;                                // CUDA: clip factor for the next step()
  std::vector<std::pair<int64_t, int64_t>> early_ranges_;  // reduce_early ranges of this step
  std::vector<std::function<void()>> early_waits_;         // their completion (compute stream waits)
  RangeReducer range_reducer_;
  OwnerReducer owner_reducer_;
  std::vector<std::unique_ptr<CommHandle>> values_gathers_;  // deferred, in flight
#ifdef NDT_HAVE_CUDA
  void step_device(double lr, const StepControl* control = nullptr);
  void norm_sum_squares_device(double* sum_squares);
  // A deferred region's bf16 compute copy: this rank's [off, off + count) of its owned part to every peer,
  // theirs from them (NCCL group of sends and receives, asynchronous).
  std::unique_ptr<CommHandle> exchange_compute(Region& r, int64_t off, int64_t count);
  // The AdamW runs of the last device step (cuda::AdamwRun as bytes) and their device copy, uploaded again
  // only when they change (the flat buffers stay put, so in practice once).
  std::vector<uint8_t> runs_bytes_;
  Tensor runs_dev_;
#endif
};

}  // namespace ndt
