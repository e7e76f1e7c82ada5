#include "dist/watchdog.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>

namespace ndt {
namespace {
std::atomic<Watchdog*> g_current{nullptr};
}  // namespace

Watchdog::Watchdog(double timeout_s, int world_rank, int world_size, int exit_code)
    : timeout_s_(timeout_s), rank_(world_rank), size_(world_size), exit_code_(exit_code) {
  g_current.store(this);
  thread_ = std::thread([this] { run(); });
}

Watchdog::~Watchdog() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
  Watchdog* self = this;
  g_current.compare_exchange_strong(self, nullptr);
}

Watchdog* Watchdog::current() { return g_current.load(); }

int Watchdog::add_hook(std::function<void(Watchdog&)> hook) {
  std::lock_guard<std::mutex> lock(hooks_mu_);
  hooks_.emplace_back(next_hook_, std::move(hook));
  return next_hook_++;
}

void Watchdog::remove_hook(int id) {
  std::lock_guard<std::mutex> lock(hooks_mu_);
  for (auto it = hooks_.begin(); it != hooks_.end(); ++it)
    if (it->first == id) {
      hooks_.erase(it);
      return;
    }
}

void Watchdog::say(const std::string& line) const {
  std::fprintf(stderr, "ndtrain [rank %d/%d]: watchdog: %s\n", rank_, size_, line.c_str());
  std::fflush(stderr);
}

void Watchdog::run() {
  // Polled a few times per second: the timeout is minutes in production, seconds in tests.
  const auto period = std::chrono::milliseconds(timeout_s_ < 10 ? 100 : 500);
  while (!stop_.load()) {
    std::this_thread::sleep_for(period);
    const BlockingWait::Snapshot wait = BlockingWait::current();
    if (wait.what && wait.seconds >= timeout_s_) fire(wait);
  }
}

void Watchdog::fire(const BlockingWait::Snapshot& wait) {
  const auto step = static_cast<long long>(step_.load());
  std::fprintf(stderr,
               "ndtrain [rank %d/%d]: watchdog: %s on a group of %d rank(s) has not returned after %.0f s "
               "(train.collective_timeout_s = %g) at step %lld: a rank is stuck or dead; ending the job "
               "(resume with --resume auto)\n",
               rank_, size_, wait.what, wait.group, wait.seconds, timeout_s_, step);
  std::fflush(stderr);
  // The hooks (NCCL aborts) get a few seconds on a helper thread: a hook that hangs too must not keep the
  // process alive.
  std::atomic<bool> hooks_done{false};
  std::thread([this, &hooks_done] {
    std::lock_guard<std::mutex> lock(hooks_mu_);
    for (auto& [id, hook] : hooks_) hook(*this);
    hooks_done.store(true);
  }).detach();
  for (int i = 0; i < 100 && !hooks_done.load(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  std::fflush(stdout);
  std::_Exit(exit_code_);  // (from this thread: the main one is blocked inside the wait)
}

}  // namespace ndt
