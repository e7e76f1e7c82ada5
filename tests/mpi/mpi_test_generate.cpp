// Generation layouts draw the same rollouts: generation TP over the ranks and data-parallel replicas
// return the tokens (exactly) and logprobs (1e-5) of one process, with temperature-1 sampling.
#include <gtest/gtest.h>

#include <cmath>

#include "core/check.h"
#include "dist/communicator.h"
#include "generate/generator.h"
#include "model/transformer.h"
#include "parallel/tp/comm_tp_hooks.h"

namespace ndt {
namespace {

Config tiny(const std::string& style, int64_t experts) {
  Config c;
  c.model.style = style;
  c.model.vocab_size = 48;
  c.model.d_model = 16;
  c.model.n_layers = 2;
  c.model.n_heads = 4;
  c.model.n_kv_heads = style == "llama" ? 2 : 0;
  c.model.d_ff = 32;
  c.model.max_seq_len = 24;
  c.model.init_std = 0.3;
  c.model.moe.num_experts = experts;
  return c;
}

void same_rollouts(const std::string& style, int64_t experts) {
  auto world = make_mpi_world();
  const Config cfg = tiny(style, experts);
  Transformer ref(cfg.model, StageSpec{}, nullptr);
  ref.params().init(17);
  std::vector<std::pair<std::string, Tensor>> full;
  for (const auto& p : ref.params().all()) full.emplace_back(p->name, p->value.clone());

  // 5 prompts x 2 samples, prompts of different lengths; one rank alone is the reference.
  std::vector<GenRequest> reqs;
  for (uint64_t i = 0; i < 5; ++i) {
    std::vector<int32_t> prompt;
    for (uint64_t t = 0; t < 2 + 3 * i; ++t) prompt.push_back(static_cast<int32_t>((7 * i + 5 * t + 1) % 48));
    for (uint64_t s = 0; s < 2; ++s) reqs.push_back({prompt, i, s});
  }
  SamplingParams sp;
  sp.temperature = 1.0;
  sp.top_k = 40;
  sp.top_p = 0.95;
  sp.max_new_tokens = 9;
  sp.stop_ids = {3};
  sp.seed = 11;
  auto self = make_self_communicator();
  Generator one(cfg, *self, GenLayout{1});
  one.load_full(full);
  const auto want = one.generate(reqs, sp, 2);

  for (int64_t tp : {int64_t{1}, static_cast<int64_t>(world->size())}) {
    Generator gen(cfg, *world, GenLayout{tp});
    gen.load_full(full);
    const auto got = gen.generate(reqs, sp, 2);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(got[i].tokens, want[i].tokens) << style << " gen_tp=" << tp << " request " << i;
      EXPECT_EQ(got[i].stopped, want[i].stopped) << "request " << i;
      ASSERT_EQ(got[i].logprobs.size(), want[i].logprobs.size());
      for (size_t j = 0; j < want[i].logprobs.size(); ++j)
        EXPECT_NEAR(got[i].logprobs[j], want[i].logprobs[j], 1e-5) << "request " << i << " token " << j;
    }
  }
}

TEST(GenerateLayouts, LlamaTpAndReplicasMatchOneRank) { same_rollouts("llama", 0); }
TEST(GenerateLayouts, Gpt2TpAndReplicasMatchOneRank) { same_rollouts("gpt2", 0); }
TEST(GenerateLayouts, MoeTpAndReplicasMatchOneRank) { same_rollouts("llama", 4); }

// refit_from without a gather: from TP shards (training tp = gen_tp over the same ranks) and from whole
// tensors (a DP training layout; each rank takes its gen_tp block) it generates what load_full of the full
// weights generates; a store holding another shard than this rank's is refused on every rank.
TEST(GenerateLayouts, RefitFromTpShardsEqualsLoadFull) {
  auto world = make_mpi_world();
  const Config cfg = tiny("llama", 0);
  Transformer whole(cfg.model, StageSpec{}, nullptr);
  whole.params().init(17);
  std::vector<std::pair<std::string, Tensor>> full;
  for (const auto& p : whole.params().all()) full.emplace_back(p->name, p->value.clone());
  CommTpHooks hooks(*world, /*sequence_parallel=*/false);
  Transformer sharded(cfg.model, StageSpec{}, &hooks);
  sharded.params().init(17);
  sharded.params().flatten();
  const int64_t tp = world->size();
  Generator a(cfg, *world, GenLayout{tp}), b(cfg, *world, GenLayout{tp});
  a.load_full(full);
  ASSERT_TRUE(b.refit_from(sharded.params()));
  std::vector<GenRequest> reqs;
  for (uint64_t i = 0; i < 4; ++i) reqs.push_back({{static_cast<int32_t>(i + 1), 5, 9}, i, 0});
  SamplingParams sp;
  sp.temperature = 1.0;
  sp.max_new_tokens = 6;
  sp.seed = 3;
  const auto ga = a.generate(reqs, sp, 1), gb = b.generate(reqs, sp, 1);
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(ga[i].tokens, gb[i].tokens) << "request " << i;
    EXPECT_EQ(ga[i].logprobs, gb[i].logprobs) << "request " << i;
  }
  whole.params().flatten();
  Generator c(cfg, *world, GenLayout{tp});
  ASSERT_TRUE(c.refit_from(whole.params()));
  const auto gc = c.generate(reqs, sp, 1);
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(ga[i].tokens, gc[i].tokens) << "request " << i;
    EXPECT_EQ(ga[i].logprobs, gc[i].logprobs) << "request " << i;
  }
  if (tp > 1) {  // the next rank's shards: same shapes, other offsets
    auto rev = world->split(0, world->size() - 1 - world->rank());
    CommTpHooks rev_hooks(*rev, /*sequence_parallel=*/false);
    Transformer other(cfg.model, StageSpec{}, &rev_hooks);
    other.params().init(17);
    other.params().flatten();
    EXPECT_FALSE(c.refit_from(other.params()));
  }
}

TEST(GenerateLayouts, BadGenTpFailsOnEveryRank) {
  auto world = make_mpi_world();
  const Config cfg = tiny("llama", 0);
  // Thrown before any collective on every rank (no rank waits for another).
  EXPECT_THROW({ Generator g(cfg, *world, GenLayout{3}); }, Error);
  world->barrier();
}

}  // namespace
}  // namespace ndt
