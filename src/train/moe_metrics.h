#pragma once
// The end of an MoE training step: routing statistics of every MoE layer summed over the global batch
// (DP x CP ranks, TP under sequence parallelism, pipeline stages), the balancing-loss values, and the
// DeepSeek-V3 expert-bias update of sigmoid routers (from the global load, so the same on every rank).
#include <cstdint>
#include <utility>
#include <vector>

#include "dist/communicator.h"
#include "model/moe.h"
#include "train/config.h"

namespace ndt {

struct MoeStepReport {
  bool active = false;
  double aux_loss = 0, z_loss = 0;        // values over the global batch, coefficients applied
  double load_ratio = 0;                  // max over layers of (max expert load / mean expert load)
  double dropped = 0;                     // fraction of slots dropped by the capacity factor
  std::vector<int64_t> layers;            // the model's MoE layer indices, ascending
  std::vector<std::vector<double>> load;  // per MoE layer: slots routed to each expert (real tokens)
};

// Collective over grad (DP x CP), tp and pp. `layers`: this rank's MoE layers (global index, layer).
// update_bias = false leaves the sigmoid routers' expert bias as it is (a skipped step).
MoeStepReport finish_moe_step(const Config& cfg, const std::vector<std::pair<int64_t, MoeLayer*>>& layers,
                              Communicator& grad, Communicator& tp, Communicator& pp,
                              bool update_bias = true);

}  // namespace ndt
