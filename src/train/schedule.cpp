#include "train/schedule.h"

#include <algorithm>
#include <cmath>

namespace ndt {

double lr_at(int64_t step, int64_t total_steps, int64_t warmup_steps, double lr, double min_lr) {
  if (step < warmup_steps) return lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  const int64_t decay_steps = std::max<int64_t>(1, total_steps - warmup_steps - 1);
  const double progress =
      std::min(1.0, static_cast<double>(step - warmup_steps) / static_cast<double>(decay_steps));
  return min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(M_PI * progress));
}

}  // namespace ndt
