#pragma once
// train.host_sync = log: training steps whose end (skip, clip, the optimizer's step count) is decided where
// the gradients live (core/step_control.h), so the host launches the next step without waiting for this
// one's norm and loss. Each step leaves a record on the device; collect() waits for the steps in flight and
// reads their records back at once, with their times (CUDA events: the steps as the device ran them).
// The trainer turns the records into the StepStats a per-step run would have produced (train/trainer.cpp).
#include <chrono>
#include <cstdint>
#include <vector>

#include "core/step_control.h"
#include "core/tensor.h"
#include "train/config.h"

namespace ndt {

namespace cuda {
class StepClock;
}

class DeferredSteps {
 public:
  // The most steps in flight before collect() must run (the trainer collects sooner: log steps).
  static constexpr int64_t kMaxInFlight = 256;

  DeferredSteps(Device device, const TrainConfig& tc);
  ~DeferredSteps();
  DeferredSteps(const DeferredSteps&) = delete;
  DeferredSteps& operator=(const DeferredSteps&) = delete;

  // Opens a step. With none in flight, the device's counts start from the host's (a resume, per-step steps
  // between): `opt_steps` updates applied, `consecutive_skips` skipped steps in a row.
  void begin_step(int64_t opt_steps, int64_t consecutive_skips);
  // The step's control block (memory of the device; host memory on the CPU): the step writes sum_squares
  // and loss_sum before decide().
  StepControl* control();
  // control()->loss_sum = acc's value (an F64 scalar on the same device, undefined: 0), or = v.
  void set_loss(const Tensor& acc);
  void set_loss(double v);
  // Decides the step where the control lives (stream order) and keeps its record.
  void decide(float lr);
  // Closes the step: marks its end on the device's clock.
  void end_step();
  int64_t in_flight() const { return in_flight_; }
  bool full() const { return in_flight_ == kMaxInFlight; }

  struct Collected {
    std::vector<StepRecord> records;
    std::vector<double> seconds;  // each step's time (device: from the previous step's end)
  };
  // Waits for the steps in flight; their records and times, in order. Local (no collective).
  Collected collect();

 private:
  Device device_;
  TrainConfig tc_;
  Tensor control_, records_, bias_corrections_;  // on device_
  int64_t base_ = 0;                             // bias_corrections_ starts at step base_
  int64_t in_flight_ = 0;
  std::chrono::steady_clock::time_point host_mark_;  // the CPU's clock
  std::vector<double> host_seconds_;
#ifdef NDT_HAVE_CUDA
  std::unique_ptr<cuda::StepClock> clock_;
#endif
};

}  // namespace ndt
