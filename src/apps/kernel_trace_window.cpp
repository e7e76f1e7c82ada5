#include "apps/kernel_trace_window.h"

#include <fmt/format.h>

#include <charconv>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "apps/setup.h"
#include "core/check.h"

#ifdef NDT_HAVE_CUDA
#include "cuda/kernel_trace.h"
#endif

namespace ndt::app {

Status parse_step_window(const std::string& s, int64_t& first, int64_t& last) {
  auto num = [](std::string_view v, int64_t& out) {
    auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
    return ec == std::errc() && p == v.data() + v.size() && out >= 0;
  };
  const size_t colon = s.find(':');
  const std::string_view sv(s);
  const bool ok = colon == std::string::npos
                      ? num(sv, first) && num(sv, last)
                      : num(sv.substr(0, colon), first) && num(sv.substr(colon + 1), last);
  if (!ok || last < first)
    return Status::error(
        fmt::format("--kernel-trace-steps '{}': expected FIRST:LAST (0-based steps, FIRST <= "
                    "LAST) or one step N",
                    s));
  return Status::ok();
}

std::unique_ptr<KernelTraceWindow> KernelTraceWindow::create(const std::string& dir, const std::string& steps,
                                                             const Config& cfg, Communicator& world,
                                                             int64_t start_step) {
  if (dir.empty()) return nullptr;
  int64_t first = 0, last = 0;
  Status st = parse_step_window(steps, first, last);
  if (st.is_ok() && (first < start_step || last >= cfg.train.steps))
    st =
        Status::error(fmt::format("--kernel-trace-steps {}:{} lies outside the steps this run takes ({}..{})",
                                  first, last, start_step, cfg.train.steps - 1));
  if (st.is_ok() && cfg.train.device != "cuda")
    st = Status::error("--kernel-trace records GPU activity: it needs train.device=cuda");
#ifdef NDT_HAVE_CUDA
  std::string why;
  if (st.is_ok() && !cuda::KernelTrace::available(&why)) st = Status::error("--kernel-trace: " + why);
#else
  if (st.is_ok()) st = Status::error("--kernel-trace needs a CUDA build of ndtrain");
#endif
  if (st.is_ok()) st = check_writable_dir(dir, "--kernel-trace");
  agree_or_throw(st, world);
  std::unique_ptr<KernelTraceWindow> w(new KernelTraceWindow(dir, first, last, world.rank()));
  if (first == start_step) w->after_step(first - 1);  // the window opens with the run's first step
  return w;
}

void KernelTraceWindow::after_step(int64_t step) {
#ifdef NDT_HAVE_CUDA
  // Started after the step before the window, so that the window holds whole steps (start() waits for
  // the device); stopped after its last step.
  if (!running_ && step + 1 == first_) {
    cuda::KernelTrace::start();
    running_ = true;
  }
  if (running_ && step == last_) {
    running_ = false;
    const std::vector<cuda::TraceRecord> recs = cuda::KernelTrace::stop();
    const std::filesystem::path base = std::filesystem::path(dir_) / fmt::format("kernels.rank{}", rank_);
    const std::string table = cuda::trace_summary(recs, last_ - first_ + 1);
    std::ofstream(base.string() + ".json") << cuda::trace_chrome_json(recs, rank_);
    std::ofstream(base.string() + ".txt") << table;
    if (rank_ == 0) {
      std::printf(
          "kernel trace of steps %lld..%lld (rank 0; every rank's in %s/kernels.rank*.{json,txt}):\n%s",
          static_cast<long long>(first_), static_cast<long long>(last_), dir_.c_str(),
          cuda::trace_summary(recs, last_ - first_ + 1, 25).c_str());
      std::fflush(stdout);
    }
  }
#else
  (void)step;
#endif
}

}  // namespace ndt::app
