// The generation engine on the GPU against the CPU engine and against itself: greedy and sampled decoding
// of a tiny model (both styles) in fp32 give the CPU's tokens (logprobs within 1e-4: fp32 kernels, another
// summation order); in bf16, decode steps replayed from CUDA graphs give bit-identical tokens and logprobs
// to the same steps launched one kernel at a time (NDT_GEN_CUDA_GRAPHS=0), with and without stop tokens
// (stops change the number of live sequences, hence the graph used).
#include <gtest/gtest.h>

#include <cstdlib>
#include <random>

#include "../tiny_model.h"
#include "dist/communicator.h"
#include "generate/generator.h"
#include "gpu_test.h"
#include "model/transformer.h"

namespace ndt {
namespace {

std::vector<GenOutput> run(const std::string& style, const std::string& device, const std::string& precision,
                           double temperature, int64_t top_k, std::vector<int32_t> stop) {
  Config cfg;
  cfg.model = testing::tiny_model(style == "qwen3" ? "llama" : style);
  cfg.model.max_seq_len = 64;
  cfg.model.d_model = 256;  // head dim 64: what the CUDA attention kernels take
  if (style == "qwen3") {   // q/k norms; 4 heads of 64 on d_model 128 (H*D = 2C)
    cfg.model.d_model = 128;
    cfg.model.head_dim_override = 64;
    cfg.model.qk_norm = true;
  }
  cfg.model.d_ff = 64;
  cfg.model.init_std = 0.05;
  cfg.train.device = device;
  cfg.train.precision = precision;
  Transformer init(cfg.model, StageSpec{}, nullptr);
  init.params().init(9);
  std::vector<std::pair<std::string, Tensor>> full;
  for (const auto& p : init.params().all()) full.emplace_back(p->name, p->value);
  auto world = make_self_communicator();
  Generator gen(cfg, *world, GenLayout{1});
  gen.load_full(full);
  std::mt19937 rng(4);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(cfg.model.vocab_size) - 1);
  std::vector<GenRequest> reqs;
  for (int i = 0; i < 12; ++i) {
    GenRequest r;
    for (int j = 0; j < 3 + i % 5; ++j) r.prompt.push_back(tok(rng));
    r.prompt_key = static_cast<uint64_t>(i);
    reqs.push_back(r);
  }
  SamplingParams sp;
  sp.temperature = temperature;
  sp.top_k = top_k;
  sp.max_new_tokens = 20;
  sp.stop_ids = std::move(stop);
  sp.seed = 17;
  return gen.generate(reqs, sp, 3);
}

TEST(GpuGenerate, SameTokensAsTheCpuInFp32) {
  NDT_REQUIRE_GPU();
  for (const char* style : {"llama", "gpt2", "qwen3"})
    for (const auto& [temp, k] : std::vector<std::pair<double, int64_t>>{{0.0, 0}, {1.0, 0}, {0.8, 7}}) {
      SCOPED_TRACE(::testing::Message() << style << " T " << temp << " k " << k);
      const auto cpu = run(style, "cpu", "fp32", temp, k, {});
      const auto gpu = run(style, "cuda", "fp32", temp, k, {});
      ASSERT_EQ(cpu.size(), gpu.size());
      for (size_t i = 0; i < cpu.size(); ++i) {
        EXPECT_EQ(cpu[i].tokens, gpu[i].tokens) << "request " << i;
        for (size_t j = 0; j < std::min(cpu[i].logprobs.size(), gpu[i].logprobs.size()); ++j)
          EXPECT_NEAR(cpu[i].logprobs[j], gpu[i].logprobs[j], 1e-4);
      }
    }
}

TEST(GpuGenerate, GraphsReplayTheEagerSteps) {
  NDT_REQUIRE_GPU();
  for (const std::vector<int32_t>& stop : {std::vector<int32_t>{}, std::vector<int32_t>{1, 2, 3, 5, 8}}) {
    setenv("NDT_GEN_CUDA_GRAPHS", "0", 1);
    const auto eager = run("llama", "cuda", "bf16", 1.0, 0, stop);
    setenv("NDT_GEN_CUDA_GRAPHS", "1", 1);
    const auto graphs = run("llama", "cuda", "bf16", 1.0, 0, stop);
    unsetenv("NDT_GEN_CUDA_GRAPHS");
    ASSERT_EQ(eager.size(), graphs.size());
    for (size_t i = 0; i < eager.size(); ++i) {
      EXPECT_EQ(eager[i].tokens, graphs[i].tokens) << "request " << i << " stops " << stop.size();
      EXPECT_EQ(eager[i].logprobs, graphs[i].logprobs) << "request " << i;
      EXPECT_EQ(eager[i].stopped, graphs[i].stopped);
    }
  }
}

}  // namespace
}  // namespace ndt
