#pragma once
// The collective watchdog (train.collective_timeout_s, docs/reliability.md): a thread that ends this
// process when one blocking communication call has not returned within the timeout — a peer is stuck or
// dead —, after printing which call, on a group of how many ranks, at which step. The launcher (mpirun)
// then ends every other rank, so a hang becomes a prompt, explained, non-zero exit instead of a job that
// sits until its allocation runs out. Communicators report their blocking calls through Watchdog::Scope
// (Communicator::set_watchdog; groups split off later inherit it). One per process, owned by the app.
#include <atomic>
#include <cstdint>
#include <thread>

namespace ndt {

class Watchdog {
 public:
  // exit_code: what the process exits with on a timeout.
  Watchdog(double timeout_s, int world_rank, int world_size, int exit_code = 124);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;
  void set_step(int64_t step) { step_.store(step); }
  double timeout_s() const { return timeout_s_; }

  // Marks one blocking call for its lifetime (calls do not nest; the outermost one counts).
  class Scope {
   public:
    Scope(Watchdog* w, const char* op, int group_size);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    Watchdog* w_;
    bool outer_ = false;
  };

 private:
  void run();
  double timeout_s_;
  int rank_, size_, exit_code_;
  std::atomic<int64_t> step_{-1};
  std::atomic<int64_t> since_ns_{0};  // start of the call in flight (steady clock), 0 = none
  std::atomic<const char*> op_{nullptr};
  std::atomic<int> group_{0};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace ndt
