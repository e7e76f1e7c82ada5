#pragma once
// ndtrain plan: the parallel layouts of a config on N GPUs, each checked by the trainer's own validation
// (validate_config + validate_layout: "divides correctly" means exactly what `ndtrain train` accepts),
// then given a predicted per-rank peak of device memory (plan/memory.h) and a step-time estimate
// (plan/cost.h). Nothing here allocates tensors or communicates. docs/planner.md describes the model.
#include <cstdint>
#include <string>
#include <vector>

#include "plan/cost.h"
#include "plan/memory.h"
#include "train/config.h"

namespace ndt::plan {

// Device memory a run needs outside the pool's tensors, added to the predicted peak to decide whether a
// layout fits (estimates: they are not part of peak_mem_gib_per_rank, which the prediction targets).
inline constexpr double kCudaContextGiB = 0.5;                // CUDA context and module images
inline constexpr double kCublasWorkspaceGiB = 32.0 / 1024.0;  // cuBLASLt workspace of the compute stream
inline constexpr double kNcclGiBPerGroup = 0.25;              // NCCL buffers per process group of > 1 rank
inline constexpr double kPoolSlack = 0.05;                    // pool fragmentation over the allocated peak

struct PlanOptions {
  int gpus = 1;
  double gpu_mem_gib = 80;
  Hardware hw;
};

struct Layout {
  int64_t tp = 1, cp = 1, dp = 1, pp = 1, ep = 1, v = 1;
  std::string schedule = "1f1b";
  bool sp = false, zero1 = false, recompute = false;
  std::string degrees() const;                 // "tp=2 cp=1 dp=4 pp=1 ep=1 v=1"
  std::string flags() const;                   // "sp zero1 recompute" (those set), "-" for none
  std::vector<std::string> overrides() const;  // --set strings that select this layout
};

enum class Verdict { Fits, DoesNotFit, Invalid };

struct LayoutPlan {
  Layout layout;
  Verdict verdict = Verdict::Invalid;
  std::string reason;  // Invalid: the trainer's message; DoesNotFit: predicted need vs the GPU's memory
  // The rest is filled for layouts the trainer accepts.
  MicrobatchShape microbatches;
  std::vector<StageMemory> stages;    // per pipeline rank
  std::vector<double> rank_peak_gib;  // predicted peak_mem_gib_per_rank, per world rank
  int64_t peak_pp_rank = 0, peak_world_rank = 0;
  double peak_gib = 0;  // max over ranks of the predicted allocated peak
  double need_gib = 0;  // peak with pool slack plus the memory outside the pool
  StepTime time;
};

struct PlanResult {
  ModelSize size;
  std::vector<LayoutPlan> layouts;  // fitting ones fastest first, then those that do not fit, then invalid
  std::vector<std::string> notes;   // what the model leaves out for this config
};

// The layouts tried on `gpus` GPUs: every tp * cp * dp * pp = gpus, ep dividing dp * cp (MoE), virtual
// stages dividing the layers, and sequence parallel (tp > 1), ZeRO-1 (dp * cp > 1), recomputation on/off.
std::vector<Layout> candidate_layouts(const Config& base, int gpus);
// The layout of a config as it is (parallel.* and train.recompute).
Layout layout_of(const Config& cfg);
// base with the layout's keys set (schedule: interleaved with v > 1, else the config's own).
Config with_layout(const Config& base, const Layout& l);

LayoutPlan plan_layout(const Config& base, const Layout& l, const PlanOptions& o);
// All candidates (or only the config's own layout), sorted.
PlanResult plan(const Config& base, const PlanOptions& o, bool as_configured = false);

}  // namespace ndt::plan
