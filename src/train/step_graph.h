#pragma once
// CUDA graphs for the forward and backward of a training step (docs/gpu.md, "CUDA graphs"). A step whose
// host-side decisions repeat the previous step's is captured once and then replayed: the same kernels with
// the same arguments, so the same values, without a host launch per kernel. What the host decides from the
// microbatches forms the step's signature (step_signature); the inputs that change from step to step (token
// ids, targets, loss mask, positions, and the loss scale 1 / loss-bearing tokens) are copied into fixed
// device buffers before every run, eager or replayed, so a replay reads this step's data. The copies go
// through page-locked staging buffers, a few steps' worth in turn: the host waits only for a buffer the
// device has not copied out of yet.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "data/dataset.h"

namespace ndt {

namespace cuda {
class Graph;
}

// What decides the host side of a step's forward and backward: the number of microbatches; per microbatch
// its token count, sequence count, longest sequence, sequence layout (cu_seqlens, which cuDNN's attention
// reads on the host) and which inputs it has. Equal signatures enqueue the same work on the same buffers.
std::vector<int64_t> step_signature(const std::vector<Microbatch>& mbs);

class StepGraph {
 public:
  // seqlens_on_host: keep cu_seqlens on the host (bf16: cuDNN's attention needs them there; a kernel that
  // would upload them makes the capture fail, and the step runs eagerly); else they go to a device buffer.
  explicit StepGraph(bool seqlens_on_host);
  ~StepGraph();
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;

  // Runs work(device_mbs) once on the GPU, device_mbs being `mbs` with their per-token inputs and
  // `loss_scale` (as Microbatch::loss_scale) in this object's device buffers: replayed when the signature is
  // the captured one; captured, then replayed, when it equals the previous step's (caches warm, buffers at
  // their addresses) and has not failed to capture before; else eagerly. The work must free what it allocates
  // and leave results only in buffers that outlive it (gradients, the engine's loss sum). extra_signature:
  // further host decisions the work depends on (the gathered embedding gradient's agreed sizes), part of the
  // signature. Returns whether the step was replayed.
  bool run(const std::vector<Microbatch>& mbs, float loss_scale,
           const std::function<void(const std::vector<Microbatch>&)>& work,
           const std::vector<int64_t>& extra_signature = {});

  int64_t captures() const { return captures_; }
  int64_t replays() const { return replays_; }
  int64_t eager_steps() const { return eager_; }
  // Why the last capture failed ("" when none did), and whether the last run() attempted one.
  const std::string& failure() const { return failure_; }
  bool just_captured() const { return just_captured_; }

 private:
  struct Inputs;
  struct Staging;
  std::vector<Microbatch> upload(const std::vector<Microbatch>& mbs, float loss_scale);

  bool seqlens_on_host_;
  std::vector<Inputs> bufs_;  // one per microbatch slot
  Tensor scale_;              // (1) f32: the step's loss scale
  // Page-locked copies of the inputs the device copies from asynchronously, so that the host may run ahead
  // of the device (train.host_sync = log) without waiting for each upload.
  std::unique_ptr<Staging> staging_;
  std::unique_ptr<cuda::Graph> graph_;
  std::vector<int64_t> graph_sig_, prev_sig_;
  std::vector<std::vector<int64_t>> failed_;
  int64_t captures_ = 0, replays_ = 0, eager_ = 0;
  std::string failure_;
  bool just_captured_ = false;
};

}  // namespace ndt
