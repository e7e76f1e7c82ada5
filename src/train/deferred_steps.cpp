#include "train/deferred_steps.h"

#include <cstddef>
#include <cstring>

#include "core/check.h"

#ifdef NDT_HAVE_CUDA
#include "cuda/cuda_ops.h"
#include "cuda/runtime.h"
#endif

namespace ndt {
namespace {
template <typename T>
Tensor words_for(int64_t n, Device dev) {  // n objects of T as an I64 tensor
  return Tensor::zeros({static_cast<int64_t>((n * sizeof(T) + 7) / 8)}, DType::I64, dev);
}
}  // namespace

DeferredSteps::DeferredSteps(Device device, const TrainConfig& tc) : device_(device), tc_(tc) {
  control_ = words_for<StepControl>(1, device_);
  records_ = words_for<StepRecord>(kMaxInFlight, device_);
  bias_corrections_ = Tensor::zeros({2 * (kMaxInFlight + 1)}, DType::F64, device_);
#ifdef NDT_HAVE_CUDA
  if (device_ == Device::CUDA) clock_ = std::make_unique<cuda::StepClock>();
#endif
}

DeferredSteps::~DeferredSteps() = default;

StepControl* DeferredSteps::control() { return static_cast<StepControl*>(control_.data_ptr()); }

void DeferredSteps::begin_step(int64_t opt_steps, int64_t consecutive_skips) {
  NDT_CHECK(!full(), "deferred steps: {} steps in flight, collect() first", in_flight_);
  host_mark_ = std::chrono::steady_clock::now();
  if (in_flight_ > 0) return;
  // The device's counts from the host's, and AdamW's bias corrections for the updates this batch can
  // apply, as cuda::adamw_op and the CPU's AdamW compute them.
  StepControl start;
  start.opt_steps = opt_steps;
  start.consecutive_skips = consecutive_skips;
  Tensor host = words_for<StepControl>(1, Device::CPU);
  std::memcpy(host.data_ptr(), &start, sizeof(start));
  control_.copy_from(host);
  base_ = opt_steps;
  std::vector<double> bc(2 * (kMaxInFlight + 1), 0.0);
  for (int64_t k = 1; k <= kMaxInFlight; ++k) {
    bc[2 * k] = adam_bias_correction(static_cast<float>(tc_.beta1), base_ + k);
    bc[2 * k + 1] = adam_bias_correction(static_cast<float>(tc_.beta2), base_ + k);
  }
  bias_corrections_.copy_from(Tensor::from_vector(bc, {static_cast<int64_t>(bc.size())}));
#ifdef NDT_HAVE_CUDA
  if (clock_) clock_->mark();
#endif
}

void DeferredSteps::set_loss(const Tensor& acc) {
  if (!acc.defined()) return set_loss(0.0);
  NDT_CHECK(acc.dtype() == DType::F64 && acc.numel() == 1 && acc.device() == device_,
            "deferred steps: the loss sum must be one F64 value on the step's device");
  // (view of the control block's loss_sum: word 1 of the I64 words, reinterpreted as F64)
  static_assert(offsetof(StepControl, loss_sum) == 8);
  Tensor::adopt(std::shared_ptr<uint8_t>(static_cast<uint8_t*>(control_.data_ptr()) + 8, [](uint8_t*) {}),
                {1}, DType::F64, device_)
      .copy_from(acc);
}

void DeferredSteps::set_loss(double v) {
  set_loss(Tensor::from_vector(std::vector<double>{v}, {1}).to(device_));
}

void DeferredSteps::decide(float lr) {
  StepDecision d;
  d.lr = lr;
  d.clip = tc_.grad_clip;
  d.bias_corrections = bias_corrections_.data<double>();
  d.base = base_;
  d.max_consecutive = tc_.max_consecutive_skips;
  d.stop_on_nonfinite = tc_.nonfinite == "stop" ? 1 : 0;
  StepRecord* rec = static_cast<StepRecord*>(records_.data_ptr()) + in_flight_;
#ifdef NDT_HAVE_CUDA
  if (device_ == Device::CUDA) {
    cuda::decide_step(control(), d, rec, cuda::stream());
    return;
  }
#endif
  decide_step(*control(), d, *rec);
}

void DeferredSteps::end_step() {
  ++in_flight_;
#ifdef NDT_HAVE_CUDA
  if (clock_) {
    clock_->mark();
    return;
  }
#endif
  host_seconds_.push_back(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - host_mark_).count());
}

DeferredSteps::Collected DeferredSteps::collect() {
  Collected out;
  if (in_flight_ == 0) return out;
#ifdef NDT_HAVE_CUDA
  if (clock_) out.seconds = clock_->collect();
#endif
  if (out.seconds.empty()) out.seconds = std::move(host_seconds_);
  host_seconds_.clear();
  const Tensor words = records_.device() == Device::CPU ? records_ : records_.to(Device::CPU);
  out.records.resize(static_cast<size_t>(in_flight_));
  std::memcpy(out.records.data(), words.data_ptr(), out.records.size() * sizeof(StepRecord));
  NDT_CHECK(out.seconds.size() == out.records.size(), "deferred steps: {} times for {} steps",
            out.seconds.size(), out.records.size());
  in_flight_ = 0;
  return out;
}

}  // namespace ndt
