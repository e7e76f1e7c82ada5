// train.host_sync = log: the end of a step decided where the gradients live (core/step_control.h) and the
// steps read back in batches (train/deferred_steps.h) give a per-step run's bits: the same losses, norms,
// skips, messages' steps, weights and Adam moments. On the CPU the "device" is host memory, so these runs
// take every branch of the deferred path but the kernels (tests/cuda: GpuHostSync, DecideStepKernel).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/step_control.h"
#include "data/make_dataset.h"
#include "temp_dir.h"
#include "train/trainer.h"

namespace ndt {
namespace {

StepDecision decision(std::vector<double>& bc, int64_t base, double clip, int64_t max_consecutive,
                      bool stop) {
  bc.assign(2 * 8, 0.0);
  for (int64_t k = 1; k < 8; ++k) {
    bc[2 * k] = 1.0 - std::pow(static_cast<double>(0.9f), static_cast<double>(base + k));
    bc[2 * k + 1] = 1.0 - std::pow(static_cast<double>(0.95f), static_cast<double>(base + k));
  }
  StepDecision d;
  d.lr = 3e-3f;
  d.clip = clip;
  d.bias_corrections = bc.data();
  d.base = base;
  d.max_consecutive = max_consecutive;
  d.stop_on_nonfinite = stop ? 1 : 0;
  return d;
}

TEST(DecideStep, ClipsCountsAndCorrectsLikeTheHost) {
  std::vector<double> bc;
  const StepDecision d = decision(bc, 5, 1.0, 3, false);
  StepControl c;
  c.opt_steps = 5;
  c.sum_squares = 4.0;  // norm 2 > clip 1
  c.loss_sum = 12.5;
  StepRecord r;
  decide_step(c, d, r);
  EXPECT_EQ(c.skip, 0);
  EXPECT_EQ(c.opt_steps, 6);
  EXPECT_EQ(c.clipped, 1);
  EXPECT_EQ(c.grad_scale, static_cast<float>(1.0 / (2.0 + 1e-6)));  // Optimizer::clip_grads
  // cuda::adamw_op's scalars for step 6
  EXPECT_EQ(c.step_size,
            static_cast<float>(static_cast<double>(3e-3f) / (1.0 - std::pow(double(0.9f), 6.0))));
  EXPECT_EQ(c.bc2_sqrt, static_cast<float>(std::sqrt(1.0 - std::pow(double(0.95f), 6.0))));
  EXPECT_EQ(r.opt_steps, 6);
  EXPECT_EQ(r.flags, 0);
  EXPECT_EQ(r.loss_sum, 12.5);
  EXPECT_EQ(r.sum_squares, 4.0);
  c.sum_squares = 0.25;  // norm 0.5: no clipping
  decide_step(c, d, r);
  EXPECT_EQ(c.clipped, 0);
  EXPECT_EQ(c.grad_scale, 1.0f);
  EXPECT_EQ(c.opt_steps, 7);
}

TEST(DecideStep, SkipsNonFiniteAndStopsAfterTheLimit) {
  std::vector<double> bc;
  const StepDecision d = decision(bc, 0, 1.0, 2, false);
  StepControl c;
  StepRecord r;
  c.loss_sum = NAN;
  decide_step(c, d, r);
  EXPECT_EQ(r.flags, kLossNonfinite);
  EXPECT_EQ(r.skipped, 1);
  EXPECT_EQ(r.stopped, 0);
  EXPECT_EQ(c.opt_steps, 0);
  c.loss_sum = 1.0;  // a finite step resets the count in a row
  decide_step(c, d, r);
  EXPECT_EQ(r.skipped, 0);
  EXPECT_EQ(r.consecutive_skips, 0);
  EXPECT_EQ(c.opt_steps, 1);
  c.sum_squares = INFINITY;
  decide_step(c, d, r);
  EXPECT_EQ(r.flags, kNormNonfinite);
  EXPECT_EQ(r.stopped, 0);
  decide_step(c, d, r);  // the second in a row: the limit
  EXPECT_EQ(r.consecutive_skips, 2);
  EXPECT_EQ(r.stopped, 1);
  c.sum_squares = 1.0;  // stopped: every later update is skipped too
  decide_step(c, d, r);
  EXPECT_EQ(r.flags, 0);
  EXPECT_EQ(r.skipped, 1);
  EXPECT_EQ(c.opt_steps, 1);
}

TEST(DecideStep, StopModeStopsAtTheFirstNonFiniteStep) {
  std::vector<double> bc;
  const StepDecision d = decision(bc, 0, 0.0, 5, true);
  StepControl c;
  StepRecord r;
  c.sum_squares = NAN;
  decide_step(c, d, r);
  EXPECT_EQ(r.stopped, 1);
  EXPECT_EQ(r.skipped, 1);
}

Config tiny(const std::vector<std::string>& extra) {
  std::vector<std::string> sets = {"model.style=llama",    "model.vocab_size=264", "model.d_model=32",
                                   "model.n_layers=2",     "model.n_heads=4",      "model.n_kv_heads=2",
                                   "model.max_seq_len=32", "data.seq_len=16",      "train.global_batch=4",
                                   "train.steps=10",       "train.warmup_steps=2", "train.lr=0.01",
                                   "train.log_every=4",    "train.eval_samples=2", "train.grad_clip=0.5"};
  sets.insert(sets.end(), extra.begin(), extra.end());
  return parse_config_string("{}", sets).value();
}

struct RunOut {
  std::vector<StepStats> steps;
  std::vector<float> weights, m, v;
  int64_t opt_steps = 0;
  std::string error;
};

RunOut run(const std::string& sync, std::vector<std::string> extra, const std::string& dir,
           const std::string& resume = "") {
  extra.insert(extra.end(), {"train.host_sync=" + sync, "train.out_dir=" + dir});
  const Config cfg = tiny(extra);
  auto tok = make_tokenizer("byte").value();
  auto data = make_dataset(cfg.data, *tok, false).value();
  Trainer t(cfg, RunComms{}, *tok, *data, nullptr);
  if (!resume.empty()) t.resume(resume);
  RunOut out;
  try {
    t.run([&](const StepStats& st) { out.steps.push_back(st); });
  } catch (const AgreedError& e) {
    out.error = e.what();
  }
  out.weights = t.params().flat_values().to_vector<float>();
  Tensor m, v;
  t.optimizer().gather_moments(m, v);
  out.m = m.to_vector<float>();
  out.v = v.to_vector<float>();
  out.opt_steps = t.optimizer().steps_taken();
  return out;
}

void expect_same_run(const RunOut& a, const RunOut& b) {
  ASSERT_EQ(a.steps.size(), b.steps.size());
  for (size_t i = 0; i < a.steps.size(); ++i) {
    const StepStats &x = a.steps[i], &y = b.steps[i];
    EXPECT_EQ(x.step, y.step);
    // (NaN losses compare by their bits' class)
    EXPECT_TRUE(x.loss == y.loss || (std::isnan(x.loss) && std::isnan(y.loss))) << x.step;
    EXPECT_TRUE(x.grad_norm == y.grad_norm || (std::isnan(x.grad_norm) && std::isnan(y.grad_norm))) << x.step;
    EXPECT_EQ(x.lr, y.lr);
    EXPECT_EQ(x.tokens, y.tokens);
    EXPECT_EQ(x.skipped, y.skipped) << x.step;
    EXPECT_EQ(x.skipped_steps, y.skipped_steps) << x.step;
  }
  EXPECT_TRUE(a.weights == b.weights);
  EXPECT_TRUE(a.m == b.m);
  EXPECT_TRUE(a.v == b.v);
  EXPECT_EQ(a.opt_steps, b.opt_steps);
}

TEST(HostSync, LogRunGivesTheStepRunsBits) {
  testing::TempDir dir;
  const RunOut a = run("step", {}, dir.file("step")), b = run("log", {}, dir.file("log"));
  expect_same_run(a, b);
  ASSERT_EQ(b.steps.size(), 10u);
  for (size_t i = 0; i < b.steps.size(); ++i) EXPECT_EQ(b.steps[i].step, static_cast<int64_t>(i));
  EXPECT_GT(b.steps[3].grad_norm, 0.5);  // clipping took part
  EXPECT_EQ(b.opt_steps, 10);
}

TEST(HostSync, SkipsInsideABatchAsTheStepRunDoes) {
  testing::TempDir dir;
  const std::vector<std::string> sets = {"train.nonfinite=skip",
                                         "debug.fault=nan_grad@step=5;nan_loss@step=6",
                                         "train.checkpoint_every=3", "train.keep_last=0"};
  const RunOut a = run("step", sets, dir.file("step")), b = run("log", sets, dir.file("log"));
  expect_same_run(a, b);
  ASSERT_EQ(b.steps.size(), 10u);
  EXPECT_TRUE(b.steps[5].skipped && b.steps[6].skipped);
  EXPECT_EQ(b.steps[9].skipped_steps, 2);
  EXPECT_EQ(b.opt_steps, 8);
}

TEST(HostSync, TooManySkipsEndTheRunAtTheSameStep) {
  testing::TempDir dir;
  const std::vector<std::string> sets = {"train.nonfinite=skip", "train.max_consecutive_skips=2",
                                         "debug.fault=nan_loss@steps=5-7"};
  const RunOut a = run("step", sets, dir.file("step")), b = run("log", sets, dir.file("log"));
  expect_same_run(a, b);  // steps 0-5 logged, then the error at step 6; no update after step 4
  EXPECT_EQ(b.steps.size(), 6u);
  EXPECT_NE(
      b.error.find("2 consecutive steps skipped for non-finite values (train.max_consecutive_skips = 2); "
                   "the last, step 6: non-finite loss after the reduction"),
      std::string::npos)
      << b.error;
}

TEST(HostSync, StopLeavesTheStateOfTheStepBefore) {
  testing::TempDir dir;
  const std::vector<std::string> sets = {"debug.fault=inf_grad@step=6"};
  const RunOut a = run("step", sets, dir.file("step")), b = run("log", sets, dir.file("log"));
  expect_same_run(a, b);
  EXPECT_EQ(b.opt_steps, 6);
  EXPECT_NE(b.error.find("non-finite values at step 6 (train.nonfinite = stop): non-finite gradient norm"),
            std::string::npos)
      << b.error;
}

// The order of run()'s callbacks: with host_sync = log the steps arrive in batches at log steps (step 1 once
// steps 2 and 3 have started, step 5 once step 7 has); wait_after_steps(2) makes the run wait after step 2 (a
// kernel trace's window edge).
TEST(HostSync, StepsArriveInBatchesUnlessWaitedFor) {
  testing::TempDir dir;
  for (const bool wait : {false, true}) {
    const Config cfg = tiny({"train.host_sync=log", "train.out_dir=" + dir.file(wait ? "wait" : "batch")});
    auto tok = make_tokenizer("byte").value();
    auto data = make_dataset(cfg.data, *tok, false).value();
    Trainer t(cfg, RunComms{}, *tok, *data, nullptr);
    if (wait) t.wait_after_steps({2});
    std::vector<std::string> events;
    t.run([&](const StepStats& st) { events.push_back("done " + std::to_string(st.step)); },
          [&](int64_t step) { events.push_back("start " + std::to_string(step)); });
    const auto at = [&](const std::string& e) {
      return std::find(events.begin(), events.end(), e) - events.begin();
    };
    EXPECT_LT(at("done 0"), at("start 1"));  // a log step (0, 4, 8) and the last are waited for
    EXPECT_GT(at("done 1"), at("start 2"));  // step 1 is in flight while step 2 starts
    EXPECT_GT(at("done 5"), at("start 7"));
    EXPECT_LT(at("done 4"), at("start 5"));
    EXPECT_EQ(at("done 2") < at("start 3"), wait);
    EXPECT_EQ(events.size(), 20u);
  }
}

TEST(HostSync, ResumesWithTheDevicesStepCount) {
  testing::TempDir dir;
  const std::vector<std::string> sets = {"train.checkpoint_every=4", "train.keep_last=0"};
  const RunOut straight = run("log", sets, dir.file("a"));
  const RunOut resumed = run("log", sets, dir.file("b"), dir.file("a") + "/checkpoints/step-00000004");
  EXPECT_TRUE(straight.weights == resumed.weights);
  EXPECT_TRUE(straight.m == resumed.m);
  EXPECT_EQ(resumed.opt_steps, 10);
}

}  // namespace
}  // namespace ndt
