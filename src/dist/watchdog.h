#pragma once
// The collective watchdog (train.collective_timeout_s, docs/reliability.md): a thread that ends this
// process when one blocking wait has not returned within the timeout — a communication call whose peer is
// stuck or dead, or a wait for the GPU behind a collective that never completes —, after printing which
// call, on a group of how many ranks, at which step. Before the exit, timeout hooks run: NCCL communicators
// name the operation they still have in flight and abort themselves (ncclCommAbort). The launcher (mpirun)
// then ends every other rank, so a hang becomes a prompt, explained, non-zero exit instead of a job that
// sits until its allocation runs out. Blocking waits are recorded by core/blocking_wait.h (MPI calls
// through Watchdog::Scope, NCCL calls and GPU synchronisation directly). One per process, owned by the app.
#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/blocking_wait.h"

namespace ndt {

class Watchdog {
 public:
  // exit_code: what the process exits with on a timeout.
  Watchdog(double timeout_s, int world_rank, int world_size, int exit_code = 124);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;
  void set_step(int64_t step) { step_.store(step); }
  int64_t step() const { return step_.load(); }
  double timeout_s() const { return timeout_s_; }

  // The process's watchdog (null when none runs): device communicators register their hooks with it.
  static Watchdog* current();

  // A hook runs on the watchdog's thread when it fires, before the exit: it says what it had in flight
  // (say()) and releases what it must (an NCCL communicator aborts). Hooks run under a lock that remove_hook
  // also takes, so a hook never outlives its owner.
  int add_hook(std::function<void(Watchdog&)> hook);
  void remove_hook(int id);
  // A line on stderr, prefixed with the rank, flushed at once.
  void say(const std::string& line) const;

  // Marks one blocking communication call for its lifetime when a watchdog is given (see BlockingWait).
  class Scope {
   public:
    Scope(Watchdog* w, const char* op, int group_size) {
      if (w) wait_.emplace(op, group_size);
    }

   private:
    std::optional<BlockingWait> wait_;  // empty without a watchdog
  };

 private:
  void run();
  void fire(const BlockingWait::Snapshot& wait);
  double timeout_s_;
  int rank_, size_, exit_code_;
  std::atomic<int64_t> step_{-1};
  std::atomic<bool> stop_{false};
  std::mutex hooks_mu_;
  std::vector<std::pair<int, std::function<void(Watchdog&)>>> hooks_;
  int next_hook_ = 0;
  std::thread thread_;
};

}  // namespace ndt
