// Reliability (docs/reliability.md): the fault-injection spec, its config errors, and the non-finite
// check of one process (stop names step, tensor and rank; skip leaves weights and optimizer state as
// they were; too many skips in a row stop the run). Multi-rank runs: tests/reliability.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>

#include "data/make_dataset.h"
#include "train/fault.h"
#include "train/trainer.h"

namespace ndt {
namespace {

std::string spec_error(const std::string& spec) {
  auto r = parse_fault_spec(spec);
  return r ? std::string() : r.status().message();
}

TEST(FaultSpec, ParsesKindsStepsAndRanks) {
  auto r =
      parse_fault_spec("nan_grad@step=3,rank=1; inf_loss@steps=2-4 ;inf_grad@rank=0,step=0;nan_loss@step=7");
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  const auto& f = r.value();
  ASSERT_EQ(f.size(), 4u);
  EXPECT_EQ(f[0].kind, Fault::Kind::NanGrad);
  EXPECT_EQ(f[0].first_step, 3);
  EXPECT_EQ(f[0].last_step, 3);
  EXPECT_EQ(f[0].rank, 1);
  EXPECT_EQ(f[1].kind, Fault::Kind::InfLoss);
  EXPECT_EQ(f[1].first_step, 2);
  EXPECT_EQ(f[1].last_step, 4);
  EXPECT_EQ(f[1].rank, -1);  // every rank
  EXPECT_EQ(f[2].kind, Fault::Kind::InfGrad);
  EXPECT_EQ(f[3].kind, Fault::Kind::NanLoss);
  EXPECT_TRUE(std::isnan(f[0].value()));
  EXPECT_TRUE(std::isinf(f[2].value()));
  EXPECT_TRUE(parse_fault_spec("").value().empty());
  EXPECT_TRUE(parse_fault_spec("  ").value().empty());
}

TEST(FaultSpec, FiresOnlyAtItsStepsAndRank) {
  auto f = parse_fault_spec("nan_grad@step=3,rank=1;inf_loss@steps=2-3").value();
  EXPECT_FALSE(fault_value(f, true, 2, 1));
  EXPECT_FALSE(fault_value(f, true, 3, 0));
  EXPECT_TRUE(std::isnan(*fault_value(f, true, 3, 1)));
  EXPECT_FALSE(fault_value(f, false, 1, 0));
  EXPECT_TRUE(std::isinf(*fault_value(f, false, 2, 5)));
  EXPECT_TRUE(std::isinf(*fault_value(f, false, 3, 0)));
  EXPECT_FALSE(fault_value(f, false, 4, 0));
}

TEST(FaultSpec, ProcessAndCheckpointKinds) {
  auto r = parse_fault_spec(
      "kill@step=5,rank=1;abort@step=2;hang@steps=3-4,rank=0;slow@steps=1-2,rank=1,ms=250;"
      "ckpt_write_error@step=4,rank=0;ckpt_short_write@step=8;gpu_hang@step=9,rank=2");
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  const auto& f = r.value();
  ASSERT_EQ(f.size(), 7u);
  EXPECT_EQ(f[0].kind, Fault::Kind::Kill);
  EXPECT_EQ(f[1].kind, Fault::Kind::Abort);
  EXPECT_EQ(f[2].kind, Fault::Kind::Hang);
  EXPECT_EQ(f[3].kind, Fault::Kind::Slow);
  EXPECT_EQ(f[3].ms, 250);
  EXPECT_EQ(f[4].kind, Fault::Kind::CkptWriteError);
  EXPECT_EQ(f[5].kind, Fault::Kind::CkptShortWrite);
  EXPECT_EQ(f[6].kind, Fault::Kind::GpuHang);
  EXPECT_TRUE(f[6].on_process());
  for (const Fault& x : f) EXPECT_FALSE(x.is_value());
  // None of them injects a value; checkpoint faults fire for their save only.
  EXPECT_FALSE(fault_value(f, false, 5, 1));
  EXPECT_FALSE(fault_value(f, true, 5, 1));
  EXPECT_EQ(checkpoint_fault(f, 4, 0), Fault::Kind::CkptWriteError);
  EXPECT_FALSE(checkpoint_fault(f, 4, 1));
  EXPECT_EQ(checkpoint_fault(f, 8, 3), Fault::Kind::CkptShortWrite);
  // A slow fault that fires returns after its sleep; others at other steps do nothing.
  const auto t0 = std::chrono::steady_clock::now();
  apply_process_faults(f, 1, 1, false);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(250));
  apply_process_faults(f, 6, 0, false);
  // gpu_hang on a CPU run is an error, not a silent no-op (the GPU side is tests/cuda/gpu_watchdog.sh).
  EXPECT_THROW(apply_process_faults(f, 9, 2, false), std::exception);
  EXPECT_NE(spec_error("kill@step=1,ms=5").find("unknown fault argument 'ms=5'"), std::string::npos);
  EXPECT_NE(spec_error("slow@step=1,ms=x").find("ms must be given once"), std::string::npos);
}

TEST(FaultSpec, ErrorsSayWhatIsWrong) {
  EXPECT_NE(spec_error("nan_grd@step=3").find("unknown fault kind 'nan_grd'"), std::string::npos);
  EXPECT_NE(spec_error("nan_grad").find("has no '@step=...'"), std::string::npos);
  EXPECT_NE(spec_error("nan_grad@rank=1").find("needs step=S or steps=A-B"), std::string::npos);
  EXPECT_NE(spec_error("nan_grad@step=x").find("step must be an integer >= 0, got 'x'"), std::string::npos);
  EXPECT_NE(spec_error("nan_grad@step=-1").find("step must be an integer"), std::string::npos);
  EXPECT_NE(spec_error("nan_grad@step=3,rank=").find("rank must be an integer"), std::string::npos);
  EXPECT_NE(spec_error("nan_grad@steps=5-2").find("steps must be A-B"), std::string::npos);
  EXPECT_NE(spec_error("nan_grad@step=1,when=2").find("unknown fault argument 'when=2'"), std::string::npos);
  EXPECT_NE(spec_error("nan_grad@step=1,step=2").find("gives 'step' twice"), std::string::npos);
  EXPECT_NE(spec_error("nan_grad@step=1;;").find("empty fault"), std::string::npos);
}

TEST(FaultSpec, ConfigErrorsNameTheKey) {
  auto bad = [](const std::vector<std::string>& sets) {
    auto r = parse_config_string("{}", sets);
    return r ? std::string() : r.status().message();
  };
  EXPECT_NE(bad({"debug.fault=nan_grd@step=3"}).find("config key 'debug.fault': unknown fault kind"),
            std::string::npos);
  EXPECT_NE(bad({"debug.fault=nan_grad@step=3,rank=2", "parallel.dp=2"})
                .find("config key 'debug.fault': rank 2 is outside the 2 rank(s)"),
            std::string::npos);
  EXPECT_NE(bad({"debug.fault=gpu_hang@step=1"}).find("gpu_hang needs train.device cuda"), std::string::npos);
  EXPECT_NE(bad({"train.nonfinite=ignore"}).find("config key 'train.nonfinite' must be one of stop, skip"),
            std::string::npos);
  EXPECT_NE(bad({"train.max_consecutive_skips=0"}).find("'train.max_consecutive_skips' must be >= 1"),
            std::string::npos);
  auto ok = parse_config_string("{}", {"debug.fault=nan_grad@step=3,rank=1", "parallel.dp=2"});
  ASSERT_TRUE(ok.is_ok()) << ok.status().message();
  EXPECT_EQ(ok.value().debug.fault, "nan_grad@step=3,rank=1");
  EXPECT_EQ(ok.value().train.nonfinite, "stop");  // the defaults
  EXPECT_EQ(ok.value().train.max_consecutive_skips, 5);
  // The effective config round-trips the keys.
  const std::string yaml = config_to_yaml(ok.value());
  auto again = parse_config_string(yaml, {});
  ASSERT_TRUE(again.is_ok()) << again.status().message();
  EXPECT_EQ(again.value().debug.fault, "nan_grad@step=3,rank=1");
}

Config tiny(const std::vector<std::string>& extra) {
  std::vector<std::string> sets = {"model.style=llama",    "model.vocab_size=264", "model.d_model=32",
                                   "model.n_layers=2",     "model.n_heads=4",      "model.n_kv_heads=2",
                                   "model.max_seq_len=32", "data.seq_len=16",      "train.global_batch=4",
                                   "train.steps=6",        "train.warmup_steps=1", "train.lr=0.01"};
  sets.insert(sets.end(), extra.begin(), extra.end());
  return parse_config_string("{}", sets).value();
}

struct Snapshot {
  std::vector<Tensor> weights;
  Tensor m, v;
  int64_t opt_steps = 0;
};

Snapshot snapshot(Trainer& t) {
  Snapshot s;
  t.swap_weights(s.weights);  // empty: takes a copy
  t.optimizer().gather_moments(s.m, s.v);
  s.opt_steps = t.optimizer().steps_taken();
  return s;
}

bool bit_equal(const Tensor& a, const Tensor& b) {
  return a.numel() == b.numel() && std::memcmp(a.data_ptr(), b.data_ptr(), a.numel() * sizeof(float)) == 0;
}

void expect_same_state(const Snapshot& a, const Snapshot& b) {
  ASSERT_EQ(a.weights.size(), b.weights.size());
  for (size_t i = 0; i < a.weights.size(); ++i) EXPECT_TRUE(bit_equal(a.weights[i], b.weights[i])) << i;
  EXPECT_TRUE(bit_equal(a.m, b.m));
  EXPECT_TRUE(bit_equal(a.v, b.v));
  EXPECT_EQ(a.opt_steps, b.opt_steps);
}

void skip_leaves_state(const std::string& fault, const std::string& sync = "step") {
  const Config cfg = tiny({"train.nonfinite=skip", "debug.fault=" + fault, "train.host_sync=" + sync});
  auto tok = make_tokenizer("byte").value();
  auto data = make_dataset(cfg.data, *tok, false).value();
  Trainer t(cfg, RunComms{}, *tok, *data, nullptr);
  for (int64_t s = 0; s < 2; ++s) EXPECT_FALSE(t.train_step(s).skipped);
  const Snapshot before = snapshot(t);
  const StepStats st = t.train_step(2);
  EXPECT_TRUE(st.skipped);
  EXPECT_EQ(st.skipped_steps, 1);
  expect_same_state(before, snapshot(t));
  for (int64_t s = 3; s < 5; ++s) {  // training goes on, with finite losses and moving weights
    const StepStats next = t.train_step(s);
    EXPECT_FALSE(next.skipped);
    EXPECT_TRUE(std::isfinite(next.loss)) << s;
    EXPECT_EQ(next.skipped_steps, 1);
  }
  const Snapshot after = snapshot(t);
  EXPECT_EQ(after.opt_steps, 4);
  EXPECT_FALSE(bit_equal(after.weights[0], before.weights[0]));
}

TEST(NonFinite, SkipLeavesWeightsAndOptimizerState) {
  skip_leaves_state("nan_grad@step=2");
  skip_leaves_state("inf_grad@step=2,rank=0");
  skip_leaves_state("nan_loss@step=2");  // a non-finite loss alone (finite gradients)
  // The decision on the device (train.host_sync = log; tests/test_host_sync.cpp)
  skip_leaves_state("nan_grad@step=2", "log");
  skip_leaves_state("nan_loss@step=2", "log");
}

TEST(NonFinite, StopNamesStepTensorAndRank) {
  const Config cfg = tiny({"debug.fault=inf_grad@step=1"});
  auto tok = make_tokenizer("byte").value();
  auto data = make_dataset(cfg.data, *tok, false).value();
  Trainer t(cfg, RunComms{}, *tok, *data, nullptr);
  t.train_step(0);
  try {
    t.train_step(1);
    FAIL() << "a non-finite gradient should stop the run";
  } catch (const AgreedError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("non-finite values at step 1 (train.nonfinite = stop)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("'embed.tokens.weight'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("before the reduction on rank(s) 0"), std::string::npos) << msg;
  }
}

void too_many_skips_stop(const std::string& sync) {
  const Config cfg = tiny({"train.nonfinite=skip", "train.max_consecutive_skips=3",
                           "debug.fault=nan_loss@steps=1-2;nan_grad@steps=4-6", "train.host_sync=" + sync});
  auto tok = make_tokenizer("byte").value();
  auto data = make_dataset(cfg.data, *tok, false).value();
  Trainer t(cfg, RunComms{}, *tok, *data, nullptr);
  EXPECT_FALSE(t.train_step(0).skipped);
  EXPECT_TRUE(t.train_step(1).skipped);
  EXPECT_TRUE(t.train_step(2).skipped);
  EXPECT_FALSE(t.train_step(3).skipped);  // resets the count in a row
  EXPECT_TRUE(t.train_step(4).skipped);
  EXPECT_EQ(t.train_step(5).skipped_steps, 4);
  try {
    t.train_step(6);
    FAIL() << "the third skip in a row should stop the run";
  } catch (const AgreedError& e) {
    EXPECT_NE(std::string(e.what()).find("3 consecutive steps skipped for non-finite values "
                                         "(train.max_consecutive_skips = 3); the last, step 6"),
              std::string::npos)
        << e.what();
  }
}

TEST(NonFinite, TooManySkipsInARowStop) {
  too_many_skips_stop("step");
  too_many_skips_stop("log");
}

}  // namespace
}  // namespace ndt
