#pragma once
// `ndtrain train --kernel-trace DIR`: the GPU activity of steps FIRST..LAST (CUPTI, cuda/kernel_trace.h),
// written per rank as DIR/kernels.rank<r>.json (Chrome trace) and DIR/kernels.rank<r>.txt (per-kernel
// table); rank 0 prints the head of its table.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dist/communicator.h"
#include "train/config.h"

namespace ndt::app {

class KernelTraceWindow {
 public:
  // Checks the request (a CUDA run, CUPTI loadable on every rank, a writable DIR, "FIRST:LAST" within the
  // run's steps); errors agreed over the world. Null when `dir` is empty.
  static std::unique_ptr<KernelTraceWindow> create(const std::string& dir, const std::string& steps,
                                                   const Config& cfg, Communicator& world,
                                                   int64_t start_step);
  // Called after each training step with its index.
  void after_step(int64_t step);
  // The steps after which the device must have finished before the next one starts (the window's edges:
  // the step before it and its last): a run with steps in flight waits there (Trainer::wait_after_steps).
  std::vector<int64_t> edges() const { return {first_ - 1, last_}; }

 private:
  KernelTraceWindow(std::string dir, int64_t first, int64_t last, int rank)
      : dir_(std::move(dir)), first_(first), last_(last), rank_(rank) {}
  std::string dir_;
  int64_t first_, last_;
  int rank_;
  bool running_ = false;
};

// "FIRST:LAST" (inclusive, 0-based step indices) or "N" (the one step N); an error naming the text else.
Status parse_step_window(const std::string& s, int64_t& first, int64_t& last);

}  // namespace ndt::app
