// Training loop: determinism, seed sensitivity, per-token normalization over the global batch.
#include <gtest/gtest.h>

#include "data/make_dataset.h"
#include "train/schedule.h"
#include "train/trainer.h"

namespace ndt {
namespace {

Config tiny_config(const std::vector<std::string>& extra = {}) {
  std::vector<std::string> sets = {"model.style=llama",    "model.vocab_size=264", "model.d_model=32",
                                   "model.n_layers=2",     "model.n_heads=4",      "model.n_kv_heads=2",
                                   "model.max_seq_len=32", "data.seq_len=16",      "train.global_batch=8",
                                   "train.steps=4",        "train.warmup_steps=1", "train.lr=0.01"};
  sets.insert(sets.end(), extra.begin(), extra.end());
  return parse_config_string("{}", sets).value();
}

std::vector<double> losses(const Config& cfg) {
  auto tok = make_tokenizer("byte").value();
  auto data = make_dataset(cfg.data, *tok, false).value();
  Trainer t(cfg, RunComms{}, *tok, *data, nullptr);
  std::vector<double> out;
  for (int64_t s = 0; s < cfg.train.steps; ++s) out.push_back(t.train_step(s).loss);
  return out;
}

TEST(Trainer, SameSeedBitIdentical) {
  auto a = losses(tiny_config()), b = losses(tiny_config());
  ASSERT_EQ(a.size(), 4u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], b[i]) << "step " << i;
  EXPECT_LT(a.back(), a.front()) << "loss should fall over 4 steps";
}

TEST(Trainer, DifferentSeedDifferentLosses) {
  auto a = losses(tiny_config()), b = losses(tiny_config({"train.seed=43"}));
  EXPECT_NE(a[0], b[0]);
}

TEST(Trainer, GradientAccumulationMatchesOneMicrobatch) {
  // Loss is normalized by the token count of the whole global batch, so splitting the batch into
  // microbatches changes only the summation order.
  auto a = losses(tiny_config()), b = losses(tiny_config({"train.micro_batch=2"}));
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-5 * a[i]) << "step " << i;
}

TEST(Schedule, WarmupThenCosine) {
  EXPECT_DOUBLE_EQ(lr_at(0, 100, 10, 1.0, 0.1), 0.1);
  EXPECT_DOUBLE_EQ(lr_at(9, 100, 10, 1.0, 0.1), 1.0);
  EXPECT_NEAR(lr_at(10, 100, 10, 1.0, 0.1), 1.0, 1e-12);
  EXPECT_NEAR(lr_at(99, 100, 10, 1.0, 0.1), 0.1, 1e-12);
  EXPECT_LT(lr_at(60, 100, 10, 1.0, 0.1), lr_at(40, 100, 10, 1.0, 0.1));
}

}  // namespace
}  // namespace ndt

namespace ndt {
namespace {

// A CUDA graph replays a step only when the host would enqueue the same work: the signature must change with
// everything the host reads from the microbatches, and not with the token values (nor with the loss scale,
// which the replay reads from a device buffer).
TEST(StepSignature, ChangesWithWhatTheHostDecides) {
  auto sample = [](std::vector<int32_t> t) {
    const size_t n = t.size();
    return Sample{std::move(t), std::vector<uint8_t>(n, 1), {}};
  };
  auto mb = [&](std::vector<int32_t> first, int64_t seq_len) {
    return make_microbatch({sample(std::move(first)), sample({5, 6, 7, 8, 9, 10})}, seq_len, 0);
  };
  const std::vector<Microbatch> a = {mb({1, 2, 3, 4, 5, 6}, 5)};
  const std::vector<int64_t> sig = step_signature(a);
  EXPECT_EQ(step_signature({mb({7, 7, 7, 7, 7, 7}, 5)}), sig);  // other tokens, same work
  EXPECT_NE(step_signature({mb({1, 2, 3, 4, 5, 6}, 4)}), sig);  // shorter sequences
  EXPECT_NE(step_signature({a[0], a[0]}), sig);                 // two microbatches
  Microbatch scaled = a[0];
  scaled.loss_scale = Tensor::full({1}, 0.5f);
  EXPECT_NE(step_signature({scaled}), sig);  // the loss scale read from a tensor: another kernel
  Microbatch packed = pack_samples({sample({1, 2, 3}), sample({4, 5, 6, 7, 8, 9, 10})}, 0);
  Microbatch repacked = pack_samples({sample({1, 2, 3, 4, 5}), sample({6, 7, 8, 9, 10})}, 0);
  ASSERT_EQ(packed.num_tokens(), repacked.num_tokens());
  EXPECT_NE(step_signature({packed}), step_signature({repacked}));  // another sequence layout
}

}  // namespace
}  // namespace ndt
