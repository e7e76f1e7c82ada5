#pragma once
// Fault injection for reliability tests (docs/reliability.md). Off unless `debug.fault` (or, when that
// key is empty, the environment variable NDT_FAULT) holds a spec:
//
//   spec  := fault (';' fault)*
//   fault := kind '@' arg (',' arg)*
//   kind  := nan_grad | inf_grad | nan_loss | inf_loss      (values)
//          | kill | abort | hang | slow                     (the process, at the start of the step)
//          | gpu_hang                                      (this rank's GPU, at the start of the step)
//          | ckpt_write_error | ckpt_short_write           (the checkpoint saved after that many steps)
//   arg   := 'step=' S | 'steps=' A '-' B | 'rank=' R | 'ms=' M (slow: milliseconds per step, default 1000)
//
// e.g. `nan_grad@step=3,rank=1`, `nan_loss@steps=2-6`, `hang@step=2,rank=3`. A grad fault writes NaN (or
// +Inf) into element 0 of the first local parameter's gradient after backward, before the gradient
// reduction; a loss fault replaces this rank's local loss sum before it is reduced. kill raises SIGKILL
// (a lost node), abort calls std::abort, hang sleeps forever (the collective watchdog must end the job),
// slow sleeps M ms, gpu_hang enqueues a kernel that never finishes on the compute stream (train.device cuda;
// the host goes on until it waits for the GPU, where the watchdog must end the job). ckpt_write_error makes
// this rank's shard write fail as on a full disk; ckpt_short_write truncates the shard after writing it (a
// disk that lied), which only a later load can notice. Without rank= the fault fires on every rank.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/status.h"

namespace ndt {

struct Fault {
  enum class Kind {
    NanGrad,
    InfGrad,
    NanLoss,
    InfLoss,
    Kill,
    Abort,
    Hang,
    Slow,
    GpuHang,
    CkptWriteError,
    CkptShortWrite
  };
  Kind kind = Kind::NanGrad;
  int64_t first_step = 0, last_step = 0;  // inclusive
  int64_t rank = -1;                      // world rank; -1 = every rank
  int64_t ms = 1000;                      // slow
  bool is_value() const { return kind <= Kind::InfLoss; }
  bool on_grad() const { return kind == Kind::NanGrad || kind == Kind::InfGrad; }
  bool on_process() const { return kind >= Kind::Kill && kind <= Kind::GpuHang; }
  bool on_checkpoint() const { return kind == Kind::CkptWriteError || kind == Kind::CkptShortWrite; }
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

// Kills, aborts, hangs or slows this process (or hangs its GPU) if a process fault fires at `step` on
// `world_rank` (a line on stderr says so first). Returns when none fires, after a slow one's sleep, or after
// enqueueing gpu_hang's kernel (on_gpu: the run's device is cuda; gpu_hang is an error otherwise).
void apply_process_faults(const std::vector<Fault>& faults, int64_t step, int64_t world_rank, bool on_gpu);

// The checkpoint fault for the save after `step` steps on `world_rank`, if any.
std::optional<Fault::Kind> checkpoint_fault(const std::vector<Fault>& faults, int64_t step,
                                            int64_t world_rank);

}  // namespace ndt
