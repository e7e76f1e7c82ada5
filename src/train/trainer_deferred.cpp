// Steps decided on the device (train.host_sync = log, train/deferred_steps.h): the end of a step without the
// host waiting for its norm and loss, and the read-back that turns the steps' records into the StepStats a
// step-by-step run gives (the same loss, norm, skip decisions and messages, up to naming the parameter).
#include <cmath>

#include "core/phase_mark.h"
#include "train/trainer.h"

namespace ndt {
namespace {

// A scalar of the step's device reduced over `c` on the device (the compute stream waits; the host does not).
void reduce_scalar(Communicator* c, double* x) {
  if (c && c->size() > 1) c->all_reduce_async(x, 1, DType::F64, ReduceOp::Sum)->wait();
}

std::string nonfinite_message(int32_t flags) {
  std::string msg;
  if (flags & kNormNonfinite) msg = "non-finite gradient norm";
  if (flags & kLossNonfinite) {
    if (!msg.empty()) msg += "; ";
    msg += "non-finite loss after the reduction";
    if (!(flags & kNormNonfinite)) msg += "; gradients finite";
  }
  return msg +
         " (train.host_sync = log decides on the device; train.host_sync = step names the parameter and the "
         "ranks)";
}

}  // namespace

void Trainer::finish_on_device(StepStats st) {
  StepControl* control = deferred_->control();
  opt_->reduce_grads_into(&control->sum_squares);
  // The loss as the per-step path sums it: this rank's part, over the stages, over DP x CP.
  deferred_->set_loss(engine_->loss_sum_tensor());
  if (auto v = fault_value(faults_, /*grad=*/false, st.step, c_.world->rank())) deferred_->set_loss(*v);
  reduce_scalar(c_.pp, &control->loss_sum);
  reduce_scalar(c_.grad, &control->loss_sum);
  deferred_->decide(static_cast<float>(st.lr));
  phase_mark(engine_->params().device(), "optimizer");
  opt_->step_controlled(st.lr, control);
  phase_mark(engine_->params().device(), "other");
  deferred_->end_step();
  note_peak_memory(st);
  pending_.push_back(std::move(st));
}

std::string Trainer::collect_steps() {
  if (pending_.empty()) return {};
  const DeferredSteps::Collected got = deferred_->collect();
  NDT_CHECK(got.records.size() == pending_.size(), "{} step records for {} steps in flight",
            got.records.size(), pending_.size());
  std::vector<StepStats*> all;
  for (StepStats& st : pending_) all.push_back(&st);
  gather_peak_memory(all);
  opt_->set_steps_taken(got.records.back().opt_steps);
  std::string error;
  for (size_t i = 0; i < pending_.size(); ++i) {
    StepStats& st = pending_[i];
    const StepRecord& r = got.records[i];
    st.seconds = got.seconds[i];
    st.grad_norm = std::sqrt(r.sum_squares);
    st.loss = r.loss_sum / static_cast<double>(st.tokens);
    if (r.flags != 0) {  // (a step after a stop condition is not reached: the stop ends the run at its step)
      error = skip_nonfinite(st.step, nonfinite_message(r.flags));
      if (!error.empty()) break;
      st.skipped = true;
    } else {
      consecutive_skips_ = 0;
    }
    st.skipped_steps = skipped_steps_;
    history_.push_back(st);
    ready_.push_back(st);
  }
  pending_.clear();
  return error;
}

}  // namespace ndt
