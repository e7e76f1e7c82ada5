#pragma once
// Step-time estimate of a layout: matmul and attention FLOPs at an assumed fraction of the GPU's peak,
// stretched by the pipeline bubble, plus the time of every collective and P2P transfer from its message
// size over an assumed bandwidth, with no overlap (an upper bound on communication). docs/planner.md has
// the formulas; this is an estimate for ranking layouts, not a measurement.
#include <cstdint>

#include "train/config.h"

namespace ndt::plan {

struct Hardware {
  double tflops = 989;       // dense bf16 peak per GPU (H100 / H200 SXM)
  double mfu = 0.5;          // fraction of the peak the matmuls and attention reach
  double nvlink_gbps = 450;  // GB/s per direction per GPU inside a node
  double ib_gbps = 50;       // GB/s per direction per GPU between nodes (400 Gb/s per GPU)
  int gpus_per_node = 8;     // groups spanning more world ranks than this cross nodes
  double hbm_gbps = 3350;    // memory bandwidth (the AdamW update is bandwidth-bound)
  double latency_us = 10;    // fixed cost of one collective or P2P call
};

struct StepTime {
  double bubble = 0;     // pipeline bubble as a fraction of the step's pipelined part
  double compute_s = 0;  // slowest pipeline rank's forward + backward (+ recompute) over the step
  double tp_s = 0, cp_s = 0, ep_s = 0, pp_s = 0;  // per-microbatch communication summed over the step
  double dp_s = 0;         // gradient reduction (all-reduce or ZeRO-1 reduce-scatter + all-gather)
  double optimizer_s = 0;  // AdamW over the owned parameters
  double step_s = 0;
  int64_t critical_pp_rank = 0;
  double model_flops = 0;  // FLOPs of one step of the whole model (6 N_active tokens + attention)
  double tokens_per_s = 0;
};

// cfg holds a valid layout.
StepTime step_time(const Config& cfg, const Hardware& hw);

// Parameters of the whole model (each once) and those one token uses (MoE: top-k routed experts).
struct ModelSize {
  int64_t total = 0;
  int64_t active = 0;
};
ModelSize model_size(const ModelConfig& m);

}  // namespace ndt::plan
