#include "core/blocking_wait.h"

#include <atomic>
#include <chrono>

namespace ndt {
namespace {

std::atomic<int64_t> g_since_ns{0};  // start of the wait in flight (steady clock), 0 = none
std::atomic<const char*> g_what{nullptr};
std::atomic<int> g_group{0};

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

BlockingWait::BlockingWait(const char* what, int group) {
  if (g_since_ns.load() != 0) return;
  outer_ = true;
  g_what.store(what);
  g_group.store(group);
  g_since_ns.store(now_ns());
}

BlockingWait::~BlockingWait() {
  if (outer_) g_since_ns.store(0);
}

BlockingWait::Snapshot BlockingWait::current() {
  Snapshot s;
  const int64_t since = g_since_ns.load();
  if (since == 0) return s;
  s.what = g_what.load();
  s.group = g_group.load();
  s.seconds = static_cast<double>(now_ns() - since) * 1e-9;
  return s;
}

}  // namespace ndt
