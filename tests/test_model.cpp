// Whole-model gradient checks (both styles) and layout-independent initialization.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "model/transformer.h"
#include "tiny_model.h"
#include "train/evaluate.h"

namespace ndt {
namespace {

Microbatch batch(std::mt19937& rng, int64_t vocab) { return testing::three_sequences(rng, vocab); }

double loss_of(Transformer& m, const Microbatch& mb) {
  Activations a;
  m.forward(mb, Tensor(), a);
  return m.loss_sum(mb, a);
}

// Central differences on fp32 forward passes (loss summed in double). Tolerance: an element passes
// when |numeric - analytic| <= 2e-2 * |numeric| + 2e-3 * G, with G the largest gradient element of the
// whole model (finite-difference noise is absolute in loss units, so it scales with the model, not with
// the tensor: gpt2's key bias has an exactly-zero true gradient); eps = 1e-2.
// qkv_bias (llama, Qwen2-style): the q/k/v biases are set to random values (a key bias matters under RoPE).
void gradcheck(const std::string& style, bool qkv_bias = false) {
  std::mt19937 rng(7);
  ModelConfig cfg = testing::tiny_model(style);
  cfg.qkv_bias = qkv_bias;
  Transformer m(cfg, StageSpec{}, nullptr);
  m.params().init(11);
  if (qkv_bias) {
    std::normal_distribution<float> d(0.0f, 0.3f);
    int biases = 0;
    for (auto& p : m.params().all())
      if (p->name.find(".attn.w") != std::string::npos && p->name.find(".bias") != std::string::npos) {
        for (int64_t i = 0; i < p->numel(); ++i) p->value.f32()[i] = d(rng);
        ++biases;
      }
    EXPECT_EQ(biases, 3 * cfg.n_layers);
  }
  Microbatch mb = batch(rng, 32);
  m.params().zero_grad();
  Activations a;
  m.forward(mb, Tensor(), a);
  m.backward(mb, Tensor(), 1.0f, a);
  const float eps = 1e-2f;
  int checked = 0;
  float G = 0;
  for (auto& p : m.params().all())
    for (int64_t i = 0; i < p->numel(); ++i) G = std::max(G, std::abs(p->grad.f32()[i]));
  for (auto& p : m.params().all()) {
    float gmax = 0;
    for (int64_t i = 0; i < p->numel(); ++i) gmax = std::max(gmax, std::abs(p->grad.f32()[i]));
    EXPECT_GT(gmax, 0.0f) << p->name << " received no gradient";
    std::uniform_int_distribution<int64_t> pick(0, p->numel() - 1);
    for (int k = 0; k < 6; ++k) {
      const int64_t i = pick(rng);
      float& w = p->value.f32()[i];
      const float w0 = w;
      w = w0 + eps;
      const double lp = loss_of(m, mb);
      w = w0 - eps;
      const double lm = loss_of(m, mb);
      w = w0;
      const double num = (lp - lm) / (2.0 * eps), ana = p->grad.f32()[i];
      EXPECT_LE(std::abs(num - ana), 2e-2 * std::abs(num) + 2e-3 * G)
          << style << " " << p->name << "[" << i << "] numeric " << num << " analytic " << ana;
      ++checked;
    }
  }
  EXPECT_GT(checked, 50);
}

TEST(ModelGradcheck, Llama) { gradcheck("llama"); }
TEST(ModelGradcheck, Gpt2) { gradcheck("gpt2"); }
TEST(ModelGradcheck, LlamaQkvBias) { gradcheck("llama", /*qkv_bias=*/true); }

TEST(ModelInit, ShardsAreSlicesOfTheFullTensor) {
  for (const std::string style : {"llama", "gpt2"}) {
    ModelConfig cfg = testing::tiny_model(style);
    Transformer full(cfg, StageSpec{}, nullptr);
    full.params().init(5);
    for (int r = 0; r < 2; ++r) {
      testing::FakeTp tp(2, r);
      Transformer shard(cfg, StageSpec{}, &tp);
      shard.params().init(5);
      for (auto& p : shard.params().all()) {
        const Param& f = full.params().get(p->name);
        for (int64_t i = 0; i < p->numel(); ++i)
          ASSERT_EQ(p->value.f32()[i], f.value.f32()[p->global_index(i)])
              << style << " " << p->name << " rank " << r;
      }
    }
  }
}

TEST(ModelInit, SeedChangesWeights) {
  Transformer a(testing::tiny_model("llama"), StageSpec{}, nullptr),
      b(testing::tiny_model("llama"), StageSpec{}, nullptr);
  a.params().init(1);
  b.params().init(2);
  const Param& pa = a.params().get("layers.0.attn.wq.weight");
  const Param& pb = b.params().get("layers.0.attn.wq.weight");
  EXPECT_NE(pa.value.f32()[0], pb.value.f32()[0]);
}

TEST(ModelForward, PackedEqualsSeparate) {
  // Attention never crosses a sequence boundary: a packed batch gives each sequence the same loss as
  // running it alone.
  std::mt19937 rng(3);
  Transformer m(testing::tiny_model("llama"), StageSpec{}, nullptr);
  m.params().init(9);
  std::vector<Sample> samples;
  for (int len : {6, 9}) {
    Sample s;
    for (int i = 0; i < len; ++i) {
      s.tokens.push_back(static_cast<int32_t>(rng() % 32));
      s.loss_mask.push_back(i > 0);
    }
    samples.push_back(s);
  }
  const double packed = loss_of(m, pack_samples(samples, 0));
  const double sep = loss_of(m, pack_samples({samples[0]}, 0)) + loss_of(m, pack_samples({samples[1]}, 0));
  EXPECT_NEAR(packed, sep, 1e-5 * std::abs(sep));
}

}  // namespace
}  // namespace ndt
