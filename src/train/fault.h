#pragma once
// Fault injection for reliability tests (docs/reliability.md). Off unless `debug.fault` (or, when that
// key is empty, the environment variable NDT_FAULT) holds a spec:
//
//   spec  := fault (';' fault)*
//   fault := kind '@' arg (',' arg)*        kind: nan_grad | inf_grad | nan_loss | inf_loss
//   arg   := 'step=' S | 'steps=' A '-' B | 'rank=' R
//
// e.g. `nan_grad@step=3,rank=1`, `nan_loss@steps=2-6`. A grad fault writes NaN (or +Inf) into element 0
// of the first local parameter's gradient after backward, before the gradient reduction; a loss fault
// replaces this rank's local loss sum before it is reduced. Without rank= the fault fires on every rank.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/status.h"

namespace ndt {

struct Fault {
  enum class Kind { NanGrad, InfGrad, NanLoss, InfLoss };
  Kind kind = Kind::NanGrad;
  int64_t first_step = 0, last_step = 0;  // inclusive
  int64_t rank = -1;                      // world rank; -1 = every rank
  bool on_grad() const { return kind == Kind::NanGrad || kind == Kind::InfGrad; }
  float value() const;  // NaN or +Inf
  bool fires(int64_t step, int64_t world_rank) const {
    return step >= first_step && step <= last_step && (rank < 0 || rank == world_rank);
  }
};

// Parses a spec (empty = no faults). Errors say what is wrong and show the accepted syntax; callers
// prefix the key (`debug.fault`) or the variable (NDT_FAULT).
Result<std::vector<Fault>> parse_fault_spec(const std::string& spec);

// The value to inject on `world_rank` at `step` into the gradient (grad = true) or the loss, if any.
std::optional<float> fault_value(const std::vector<Fault>& faults, bool grad, int64_t step,
                                 int64_t world_rank);

}  // namespace ndt
