#pragma once
// Learning rate: linear warmup from lr/warmup to lr over `warmup_steps`, then cosine decay to min_lr at
// the last step. Steps count from 0.
#include <cstdint>

namespace ndt {

double lr_at(int64_t step, int64_t total_steps, int64_t warmup_steps, double lr, double min_lr);

}  // namespace ndt
