#include "dist/watchdog.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>

namespace ndt {
namespace {
int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
}  // namespace

Watchdog::Watchdog(double timeout_s, int world_rank, int world_size, int exit_code)
    : timeout_s_(timeout_s), rank_(world_rank), size_(world_size), exit_code_(exit_code) {
  thread_ = std::thread([this] { run(); });
}

Watchdog::~Watchdog() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
}

Watchdog::Scope::Scope(Watchdog* w, const char* op, int group_size) : w_(w) {
  if (!w_ || w_->since_ns_.load() != 0) return;
  outer_ = true;
  w_->op_.store(op);
  w_->group_.store(group_size);
  w_->since_ns_.store(now_ns());
}

Watchdog::Scope::~Scope() {
  if (outer_) w_->since_ns_.store(0);
}

void Watchdog::run() {
  // Polled a few times per second: the timeout is minutes in production, seconds in tests.
  const auto period = std::chrono::milliseconds(timeout_s_ < 10 ? 100 : 500);
  while (!stop_.load()) {
    std::this_thread::sleep_for(period);
    const int64_t since = since_ns_.load();
    if (since == 0) continue;
    const double waited = static_cast<double>(now_ns() - since) * 1e-9;
    if (waited < timeout_s_) continue;
    const int64_t step = step_.load();
    std::fprintf(stderr,
                 "ndtrain [rank %d/%d]: watchdog: %s on a group of %d rank(s) has not returned after %.0f s "
                 "(train.collective_timeout_s = %g) at step %lld: a rank is stuck or dead; ending the job "
                 "(resume with --resume auto)\n",
                 rank_, size_, op_.load(), group_.load(), waited, timeout_s_, static_cast<long long>(step));
    std::fflush(stderr);
    std::fflush(stdout);
    std::_Exit(exit_code_);  // (from this thread: the main one is blocked inside the call)
  }
}

}  // namespace ndt
