// Whole training steps on the GPU against the CPU reference (the same Trainer, train.device switched).
// fp32 on the GPU runs the same math in a different order (cuBLASLt without TF32, flash attention,
// atomics in dq): losses agree to 1e-5 relative and weights after 3 AdamW steps to 1e-4 relative L2.
// bf16 compute (fp32 master weights and optimizer) follows the fp32 run within bf16 noise: losses to
// 2e-2 relative. Head dim 64: the flash-attention kernels take D = 64 or 128.
#include <gtest/gtest.h>

#include <cmath>

#include "../temp_dir.h"
#include "cuda/cudnn_attention.h"
#include "cuda/runtime.h"
#include "data/make_dataset.h"
#include "gpu_test.h"
#include "train/trainer.h"

namespace ndt {
namespace {

Config small_config(const std::string& style, const std::vector<std::string>& extra) {
  std::vector<std::string> sets = {"model.style=" + style, "model.vocab_size=320", "model.d_model=128",
                                   "model.n_layers=2",     "model.n_heads=2",      "model.max_seq_len=128",
                                   "data.task=lm",         "data.seq_len=96",      "train.global_batch=4",
                                   "train.micro_batch=2",  "train.steps=3",        "train.warmup_steps=1",
                                   "train.lr=0.003",       "train.adam_eps=1e-6"};
  if (style == "llama") sets.push_back("model.n_kv_heads=1");
  sets.insert(sets.end(), extra.begin(), extra.end());
  return parse_config_string("{}", sets).value();
}

struct TrainResult {
  std::vector<double> losses;
  std::vector<float> weights;
  double peak_mem_gib = 0;
  std::vector<double> peak_mem_gib_per_rank;
  int64_t graph_replays = -1, graph_captures = -1;  // -1: the run used no CUDA graphs
};

TrainResult train(const Config& cfg) {
  auto tok = make_tokenizer("byte").value();
  auto data = make_dataset(cfg.data, *tok, false).value();
  cuda::reset_peak_memory();  // the high-water mark is per process; measure this run alone
  Trainer t(cfg, RunComms{}, *tok, *data, nullptr);
  TrainResult r;
  for (int64_t s = 0; s < cfg.train.steps; ++s) {
    const StepStats st = t.train_step(s);
    r.losses.push_back(st.loss);
    r.peak_mem_gib = st.peak_mem_gib;
    r.peak_mem_gib_per_rank = st.peak_mem_gib_per_rank;
  }
  r.weights = t.params().flat_values().to_vector<float>();
  if (const StepGraph* g = t.step_graph()) {
    r.graph_replays = g->replays();
    r.graph_captures = g->captures();
  }
  return r;
}

double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

struct Case {
  std::string name;
  std::string style;
  std::vector<std::string> extra;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class GpuTrain : public ::testing::TestWithParam<Case> {};

TEST_P(GpuTrain, Fp32MatchesCpu) {
  NDT_REQUIRE_GPU();
  const Case& c = GetParam();
  TrainResult cpu = train(small_config(c.style, c.extra));
  std::vector<std::string> gpu_sets = c.extra;
  gpu_sets.insert(gpu_sets.end(), {"train.device=cuda", "train.precision=fp32"});
  TrainResult gpu = train(small_config(c.style, gpu_sets));
  ASSERT_EQ(cpu.losses.size(), gpu.losses.size());
  for (size_t i = 0; i < cpu.losses.size(); ++i)
    EXPECT_NEAR(gpu.losses[i], cpu.losses[i], 1e-5 * cpu.losses[i]) << "step " << i;
  EXPECT_LT(cpu.losses.back(), cpu.losses.front());
  ASSERT_EQ(cpu.weights.size(), gpu.weights.size());
  EXPECT_LT(rel_l2(gpu.weights, cpu.weights), 1e-4);
  // Peak memory: reported on the GPU (one rank here), absent on the CPU.
  EXPECT_EQ(cpu.peak_mem_gib, 0.0);
  EXPECT_TRUE(cpu.peak_mem_gib_per_rank.empty());
  ASSERT_EQ(gpu.peak_mem_gib_per_rank.size(), 1u);
  EXPECT_GT(gpu.peak_mem_gib, 0.0);
  EXPECT_EQ(gpu.peak_mem_gib_per_rank[0], gpu.peak_mem_gib);
}

TEST_P(GpuTrain, Bf16FollowsFp32) {
  NDT_REQUIRE_GPU();
  const Case& c = GetParam();
  TrainResult cpu = train(small_config(c.style, c.extra));
  std::vector<std::string> gpu_sets = c.extra;
  gpu_sets.insert(gpu_sets.end(), {"train.device=cuda", "train.precision=bf16"});
  TrainResult gpu = train(small_config(c.style, gpu_sets));
  for (size_t i = 0; i < cpu.losses.size(); ++i)
    EXPECT_NEAR(gpu.losses[i], cpu.losses[i], 2e-2 * cpu.losses[i]) << "step " << i;
  EXPECT_LT(gpu.losses.back(), gpu.losses.front());
}

// CUDA graphs (train.cuda_graphs, on by default) against launching every kernel from the host, 5 steps
// with different data each. fp32 runs the built-in attention, which is bit-reproducible: a replay must give
// the same bits. Unpacked, step 0 runs eagerly, step 1 is captured, every step from 1 on is replayed (also
// when the loss-bearing token count, so the loss scale, changes: llama_padded); packed microbatches change
// their sequence layout from step to step, so those steps run eagerly.
TEST_P(GpuTrain, GraphReplayGivesEagerBits) {
  NDT_REQUIRE_GPU();
  const Case& c = GetParam();
  std::vector<std::string> sets = c.extra;
  sets.insert(sets.end(), {"train.device=cuda", "train.precision=fp32", "train.steps=5"});
  TrainResult graphed = train(small_config(c.style, sets));
  sets.push_back("train.cuda_graphs=false");
  TrainResult eager = train(small_config(c.style, sets));
  EXPECT_EQ(eager.graph_replays, -1);
  const bool packed = c.name.find("packed") != std::string::npos;
  if (!packed) {
    EXPECT_EQ(graphed.graph_captures, 1);
    EXPECT_EQ(graphed.graph_replays, 4);
  }
  EXPECT_EQ(graphed.losses, eager.losses);
  EXPECT_TRUE(graphed.weights == eager.weights);
  EXPECT_NE(graphed.losses[3], graphed.losses[4]);
}

// train.host_sync = log (the default on cuda: each step's end decided on the device, the steps read back
// every log step, the host running ahead) against host_sync = step, fp32 (bit-reproducible), graphs on: every
// step's loss, norm and skip flag and the final weights bit for bit, with clipping and a skipped NaN step
// inside a batch of steps in flight.
TEST(GpuHostSync, LogRunGivesStepRunBits) {
  NDT_REQUIRE_GPU();
  ndt::testing::TempDir dir;
  struct Out {
    std::vector<StepStats> steps;
    std::vector<float> weights;
    int64_t opt_steps = 0;
  };
  auto run = [&](const std::string& sync) {
    const Config cfg = small_config(
        "llama", {"train.device=cuda", "train.precision=fp32", "train.steps=9", "train.log_every=4",
                  "train.grad_clip=0.5", "train.nonfinite=skip", "debug.fault=nan_grad@step=5",
                  "train.eval_samples=2", "train.host_sync=" + sync, "train.out_dir=" + dir.file(sync)});
    auto tok = make_tokenizer("byte").value();
    auto data = make_dataset(cfg.data, *tok, false).value();
    Trainer t(cfg, RunComms{}, *tok, *data, nullptr);
    Out o;
    t.run([&](const StepStats& st) { o.steps.push_back(st); });
    o.weights = t.params().flat_values().to_vector<float>();
    o.opt_steps = t.optimizer().steps_taken();
    return o;
  };
  const Out a = run("step"), b = run("log");
  ASSERT_EQ(a.steps.size(), 9u);
  ASSERT_EQ(b.steps.size(), 9u);
  for (size_t i = 0; i < 9; ++i) {
    EXPECT_EQ(a.steps[i].loss, b.steps[i].loss) << i;
    if (i != 5) EXPECT_EQ(a.steps[i].grad_norm, b.steps[i].grad_norm) << i;
    EXPECT_EQ(a.steps[i].skipped, b.steps[i].skipped) << i;
    EXPECT_GT(b.steps[i].seconds, 0.0) << i;
  }
  EXPECT_TRUE(b.steps[5].skipped);
  EXPECT_TRUE(std::isnan(b.steps[5].grad_norm));
  EXPECT_TRUE(a.weights == b.weights);
  EXPECT_EQ(a.opt_steps, 8);
  EXPECT_EQ(b.opt_steps, 8);
}

// Programmatic dependent launch (cuda::pdl_enabled, on by default on sm_90+: ndtrain's kernels start while
// the one before is finishing and wait for it in their prologue) against ordinary launches, fp32 (the
// built-in attention, bit-reproducible), 5 steps replayed from a graph and 5 launched from the host: the
// same bits. A kernel touching memory before its wait would race with its predecessor here.
TEST_P(GpuTrain, DependentLaunchGivesSameBits) {
  NDT_REQUIRE_GPU();
  if (!cuda::pdl_enabled()) GTEST_SKIP() << "programmatic dependent launch is off (NDT_PDL=0 or before sm_90)";
  const Case& c = GetParam();
  for (const char* graphs : {"true", "false"}) {
    SCOPED_TRACE(std::string("cuda_graphs=") + graphs);
    std::vector<std::string> sets = c.extra;
    sets.insert(sets.end(), {"train.device=cuda", "train.precision=fp32", "train.steps=5",
                             std::string("train.cuda_graphs=") + graphs});
    TrainResult pdl = train(small_config(c.style, sets));
    cuda::set_pdl_enabled(false);
    TrainResult plain = train(small_config(c.style, sets));
    cuda::set_pdl_enabled(true);
    EXPECT_EQ(pdl.losses, plain.losses);
    EXPECT_TRUE(pdl.weights == plain.weights);
  }
}

// bf16 runs cuDNN's fused attention inside the graph; its backward sums dQ with atomics, so the runs agree
// to the tolerance of two eager runs (as recomputation's test below): losses to 1e-3 relative.
TEST_P(GpuTrain, GraphReplayBf16FollowsEager) {
  NDT_REQUIRE_GPU();
  const Case& c = GetParam();
  std::vector<std::string> sets = c.extra;
  sets.insert(sets.end(), {"train.device=cuda", "train.precision=bf16", "train.steps=5"});
  TrainResult graphed = train(small_config(c.style, sets));
  sets.push_back("train.cuda_graphs=false");
  TrainResult eager = train(small_config(c.style, sets));
  if (c.name.find("packed") == std::string::npos) EXPECT_EQ(graphed.graph_replays, 4);
  EXPECT_DOUBLE_EQ(graphed.losses[0], eager.losses[0]);
  for (size_t i = 1; i < eager.losses.size(); ++i)
    EXPECT_NEAR(graphed.losses[i], eager.losses[i], 1e-3 * eager.losses[i]) << "step " << i;
  std::printf("[info] peak memory: eager %.4f GiB, graphed %.4f GiB\n", eager.peak_mem_gib,
              graphed.peak_mem_gib);
}

// bf16 on the built-in attention kernels (train.attention=native) reads the sequence layout on the device:
// those steps are replayed too.
TEST(GpuTrainGraphs, NativeAttentionBf16Replays) {
  NDT_REQUIRE_GPU();
  const std::vector<std::string> sets = {"train.device=cuda", "train.precision=bf16", "train.steps=5",
                                         "train.attention=native"};
  TrainResult graphed = train(small_config("llama", sets));
  std::vector<std::string> eager_sets = sets;
  eager_sets.push_back("train.cuda_graphs=false");
  TrainResult eager = train(small_config("llama", eager_sets));
  ndt::cuda::set_cudnn_attention_enabled(true);  // (train.attention=native turned it off for the process)
  EXPECT_EQ(graphed.graph_replays, 4);
  for (size_t i = 0; i < eager.losses.size(); ++i)
    EXPECT_NEAR(graphed.losses[i], eager.losses[i], 1e-3 * eager.losses[i]) << "step " << i;
}

TEST(GpuTrainRecompute, SameLossesAsStoring) {
  NDT_REQUIRE_GPU();
  // Recomputation reruns each layer's forward with the same inputs and kernels: identical values, and
  // the only difference in the gradients is dq's atomic summation order.
  TrainResult a = train(small_config("llama", {"train.device=cuda", "train.precision=bf16"}));
  TrainResult b =
      train(small_config("llama", {"train.device=cuda", "train.precision=bf16", "train.recompute=true"}));
  EXPECT_DOUBLE_EQ(a.losses[0], b.losses[0]);
  for (size_t i = 1; i < a.losses.size(); ++i) EXPECT_NEAR(a.losses[i], b.losses[i], 1e-3 * a.losses[i]);
  // ... and holds fewer activations at its peak.
  std::printf("[info] peak memory: storing %.4f GiB, recomputing %.4f GiB\n", a.peak_mem_gib, b.peak_mem_gib);
  EXPECT_LT(b.peak_mem_gib, a.peak_mem_gib);
}

INSTANTIATE_TEST_SUITE_P(
    Styles, GpuTrain,
    ::testing::Values(Case{"gpt2", "gpt2", {}}, Case{"llama", "llama", {}},
                      Case{"llama_packed", "llama", {"data.packing=true", "data.min_seq_len=8"}},
                      Case{"gpt2_packed", "gpt2", {"data.packing=true", "data.min_seq_len=8"}},
                      // padded samples of 8..96 tokens: the loss-bearing token count changes every step
                      Case{"llama_padded", "llama", {"data.min_seq_len=8"}},
                      // Qwen3: q/k norms, 2 heads of 128 on d_model 128 (H*D = 2C)
                      Case{"qwen3", "llama", {"model.head_dim=128", "model.qk_norm=true"}}),
    [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace ndt
