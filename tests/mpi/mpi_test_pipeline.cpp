// Pipeline engine with microbatches of different token counts (packed, THD): loss and every gradient
// match a single-process model on the same microbatches, for 1F1B, GPipe and interleaved schedules.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "dist/communicator.h"
#include "parallel/pp/pipeline.h"
#include "train/evaluate.h"

namespace ndt {
namespace {

Config tiny(const std::string& style, int pp, int v, const std::string& schedule) {
  Config c;
  c.model.style = style;
  c.model.vocab_size = 48;
  c.model.d_model = 16;
  c.model.n_layers = 8;
  c.model.n_heads = 4;
  c.model.n_kv_heads = style == "llama" ? 2 : 0;
  c.model.d_ff = 32;
  c.model.max_seq_len = 32;
  c.parallel.pp = pp;
  c.parallel.virtual_stages = v;
  c.parallel.schedule = schedule;
  return c;
}

// Microbatch i packs i+1 sequences of different lengths: token counts differ per microbatch.
std::vector<Microbatch> uneven_microbatches(int m) {
  std::vector<Microbatch> out;
  for (int i = 0; i < m; ++i) {
    std::vector<Sample> samples;
    for (int s = 0; s <= i; ++s) {
      Sample smp;
      const int len = 3 + (5 * i + 3 * s) % 11;
      for (int t = 0; t < len; ++t) {
        smp.tokens.push_back((7 * i + 13 * s + 5 * t) % 48);
        smp.loss_mask.push_back(t > 0);
      }
      samples.push_back(smp);
    }
    out.push_back(pack_samples(samples, 0));
  }
  return out;
}

void check(const std::string& style, int v, const std::string& schedule, int m) {
  auto world = make_mpi_world();
  const int p = world->size();
  Config cfg = tiny(style, p, v, schedule);
  std::vector<Microbatch> mbs = uneven_microbatches(m);
  ASSERT_NE(mbs.front().num_tokens(), mbs.back().num_tokens());
  int64_t n_tokens = 0;
  for (auto& mb : mbs) n_tokens += mb.num_loss_tokens;
  const float scale = 1.0f / static_cast<float>(n_tokens);

  PipelineEngine engine(cfg, *world, nullptr);
  engine.params().init(3);
  double loss = engine.train(mbs, scale);
  loss += engine.take_loss();
  engine.sync_tied_grads();
  world->all_reduce(&loss, 1, DType::F64, ReduceOp::Sum);

  // Reference: the whole model in this process, same microbatches, plain accumulation.
  Config ref_cfg = cfg;
  ref_cfg.parallel = ParallelConfig{};
  Transformer ref(ref_cfg.model, StageSpec{}, nullptr);
  ref.params().init(3);
  double ref_loss = 0;
  for (auto& mb : mbs) {
    Activations a;
    ref.forward(mb, Tensor(), a);
    ref_loss += ref.loss_sum(mb, a);
    ref.backward(mb, Tensor(), scale, a);
  }
  EXPECT_NEAR(loss, ref_loss, 1e-5 * ref_loss) << style << " " << schedule << " v=" << v;
  // fp32 tolerance: |g - g_ref| <= 1e-5 * max|g_ref| + 1e-4 * |g_ref| per element.
  for (auto& prm : engine.params().all()) {
    const Param& r = ref.params().get(prm->name);
    float gmax = 0;
    for (int64_t i = 0; i < r.numel(); ++i) gmax = std::max(gmax, std::abs(r.grad.f32()[i]));
    for (int64_t i = 0; i < r.numel(); ++i) {
      const float a = prm->grad.f32()[i], b = r.grad.f32()[i];
      ASSERT_LE(std::abs(a - b), 1e-5f * gmax + 1e-4f * std::abs(b))
          << prm->name << "[" << i << "] " << style << " " << schedule << " v=" << v;
    }
  }
}

// The ranges the engine hands to the DP overlap (Optimizer::reduce_early, CUDA + NCCL only) as each
// layer's gradients become final, and the head's (final norm and output matrix, one range) on the last
// stage: dense parameters only, disjoint, none marked as reduced already. A MoE stage's experts sit in the
// store's expert region right after its last layer's dense weights; a range spanning both broke pp2 x ep2 on
// GPUs.
TEST(PipelineEngine, GradsReadyRangesAreDenseOnly) {
  auto world = make_mpi_world();
  Config cfg = tiny("llama", world->size(), 1, "1f1b");
  cfg.model.moe.num_experts = 4;
  PipelineEngine engine(cfg, *world, nullptr);
  engine.params().init(3);
  engine.params().flatten();  // as the trainer does: dense region, then the expert region
  std::vector<std::pair<int64_t, int64_t>> ranges;
  int reduced = 0;
  engine.set_grads_ready_hook([&](int64_t b, int64_t e, bool r) {
    ranges.emplace_back(b, e);
    reduced += r ? 1 : 0;
  });
  const std::vector<Microbatch> mbs = uneven_microbatches(2);
  int64_t n_tokens = 0;
  for (auto& mb : mbs) n_tokens += mb.num_loss_tokens;
  engine.begin_moe_step(3, static_cast<double>(n_tokens));  // 1 + 2 sequences
  engine.train(mbs, 1.0f / static_cast<float>(n_tokens));
  engine.end_moe_step();
  ASSERT_GT(engine.params().expert_begin(), 0);
  const bool head = world->rank() == world->size() - 1;
  EXPECT_EQ(ranges.size(), static_cast<size_t>(cfg.model.n_layers / world->size() + (head ? 1 : 0)));
  EXPECT_EQ(reduced, 0);
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 0; i < ranges.size(); ++i) {
    EXPECT_LT(ranges[i].first, ranges[i].second);
    EXPECT_LE(ranges[i].second, engine.params().expert_begin()) << "range " << i << " reaches the experts";
    if (i > 0) EXPECT_LE(ranges[i - 1].second, ranges[i].first);
  }
}

TEST(PipelineEngine, UnevenMicrobatches1F1B) {
  check("llama", 1, "1f1b", 5);
  check("gpt2", 1, "1f1b", 3);
}
TEST(PipelineEngine, UnevenMicrobatchesGPipe) { check("llama", 1, "gpipe", 4); }
TEST(PipelineEngine, UnevenMicrobatchesInterleaved) {
  const int p = make_mpi_world()->size();
  check("llama", 2, "interleaved", 2 * p);
  check("gpt2", 2, "interleaved", p);
}

}  // namespace
}  // namespace ndt
