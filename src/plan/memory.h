#pragma once
// Predicted peak device memory of each pipeline rank of a layout (train.device cuda): persistent buffers
// (plan/param_count.h) plus the activations of the microbatches the schedule holds at once, replayed
// action by action over the rank's actual schedule (parallel/pp/schedule.h) with the per-chunk profiles of
// plan/act_mirror.h. The number is what cuda::memory_stats().peak_allocated_gib reports: bytes of live
// tensors from the stream-ordered pool, which excludes the CUDA context, cuBLASLt workspaces and NCCL's
// own buffers (see PlanOptions for those).
#include <cstdint>
#include <string>

#include "plan/param_count.h"
#include "train/config.h"

namespace ndt::plan {

// The microbatches of one step on one DP rank (data/packing.h, Trainer::microbatches): unpacked, micro_batch
// samples padded to seq_len each; packed, the token budget filled with full-length samples (an upper bound:
// shorter samples give fewer, equally large microbatches).
struct MicrobatchShape {
  int64_t tokens = 0;   // tokens of one microbatch on one CP rank (T)
  int64_t count = 0;    // microbatches per step (m)
  int64_t samples = 0;  // samples per microbatch
};
MicrobatchShape microbatch_shape(const Config& cfg);

struct StageMemory {
  int64_t pp_rank = 0;
  ParamCounts params;
  FlatSizes flat;
  PersistentBytes persistent;
  int64_t act_per_microbatch =
      0;                  // kept by one microbatch's forward of one chunk (largest chunk), input included
  int max_in_flight = 0;  // (microbatch, chunk) pairs held at once: forward done, backward not yet
  int64_t activation_peak = 0;  // peak minus persistent: activations in flight plus the worst transient
  int64_t peak = 0;             // predicted peak allocated bytes
  std::string peak_at;          // where in the step the peak happens
};

// cfg holds a valid layout (validate_layout accepted it).
StageMemory stage_memory(const Config& cfg, int64_t pp_rank);

}  // namespace ndt::plan
