// Whole-model gradient checks (both styles) and layout-independent initialization.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
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
// head_dim: model.head_dim (0 = d_model / n_heads); qk_norm (Qwen3): the q/k norm weights are set to
// 1 + N(0, 0.3) so that each of their elements matters differently.
struct GradcheckOpts {
  bool qkv_bias = false;
  int64_t head_dim = 0;
  bool qk_norm = false;
};

void gradcheck(const std::string& style, GradcheckOpts o = {}) {
  std::mt19937 rng(7);
  ModelConfig cfg = testing::tiny_model(style);
  cfg.qkv_bias = o.qkv_bias;
  cfg.head_dim_override = o.head_dim;
  cfg.qk_norm = o.qk_norm;
  Transformer m(cfg, StageSpec{}, nullptr);
  m.params().init(11);
  if (o.head_dim > 0)
    EXPECT_EQ(m.params().get("layers.0.attn.wo.weight").global_shape,
              (Shape{cfg.d_model, cfg.n_heads * o.head_dim}));
  if (o.qk_norm) {
    std::normal_distribution<float> d(0.0f, 0.3f);
    int norms = 0;
    for (auto& p : m.params().all())
      if (p->name.find(".attn.q_norm.") != std::string::npos ||
          p->name.find(".attn.k_norm.") != std::string::npos) {
        EXPECT_EQ(p->numel(), cfg.head_dim());
        for (int64_t i = 0; i < p->numel(); ++i) p->value.f32()[i] = 1.0f + d(rng);
        ++norms;
      }
    EXPECT_EQ(norms, 2 * cfg.n_layers);
  }
  if (o.qkv_bias) {
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
  double worst = 0;  // max over the checked elements of |numeric - analytic| / allowed
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
      const double allowed = 2e-2 * std::abs(num) + 2e-3 * G;
      worst = std::max(worst, std::abs(num - ana) / allowed);
      EXPECT_LE(std::abs(num - ana), allowed)
          << style << " " << p->name << "[" << i << "] numeric " << num << " analytic " << ana;
      ++checked;
    }
  }
  EXPECT_GT(checked, 50);
  std::printf("gradcheck %s%s%s%s: %d elements, worst |numeric - analytic| / allowed = %.3f\n", style.c_str(),
              o.qkv_bias ? " qkv_bias" : "",
              o.head_dim ? (" head_dim=" + std::to_string(o.head_dim)).c_str() : "",
              o.qk_norm ? " qk_norm" : "", checked, worst);
}

TEST(ModelGradcheck, Llama) { gradcheck("llama"); }
TEST(ModelGradcheck, Gpt2) { gradcheck("gpt2"); }
TEST(ModelGradcheck, LlamaQkvBias) { gradcheck("llama", {.qkv_bias = true}); }
// model.head_dim 6 with d_model 16 / 4 heads: the attention width H*D = 24 differs from C.
TEST(ModelGradcheck, LlamaHeadDim) { gradcheck("llama", {.head_dim = 6}); }
TEST(ModelGradcheck, Gpt2HeadDim) { gradcheck("gpt2", {.head_dim = 6}); }
// Qwen3: q/k RMSNorm per head before RoPE, with a decoupled head width.
TEST(ModelGradcheck, Qwen3QkNormHeadDim) { gradcheck("llama", {.head_dim = 6, .qk_norm = true}); }
TEST(ModelGradcheck, LlamaQkNorm) { gradcheck("llama", {.qk_norm = true}); }

TEST(ModelInit, ShardsAreSlicesOfTheFullTensor) {
  for (const std::string style : {"llama", "gpt2", "qwen3"}) {
    ModelConfig cfg = testing::tiny_model(style == "qwen3" ? "llama" : style);
    if (style == "qwen3") {  // decoupled head width, q/k norms (replicated over TP)
      cfg.head_dim_override = 6;
      cfg.qk_norm = true;
    }
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

// to_device with a gradient buffer (DP's gradients in NCCL memory on GPUs): every Param::grad becomes a
// view of the given flat buffer at its offset; a buffer of another shape or dtype is refused, naming both.
TEST(ParamStoreGradsBuffer, ParamGradsViewTheGivenBuffer) {
  Transformer m(testing::tiny_model("llama"), StageSpec{}, nullptr);
  ParamStore& ps = m.params();
  ps.flatten(4);
  Tensor storage = Tensor::zeros(ps.flat_grads().shape());
  ps.to_device(Device::CPU, DType::F32, storage);
  EXPECT_EQ(ps.flat_grads().data_ptr(), storage.data_ptr());
  for (auto& p : ps.all()) {
    ASSERT_EQ(p->grad.f32(), storage.f32() + ps.offset_of(*p)) << p->name;
    p->grad.f32()[p->numel() - 1] = 1.0f;
  }
  double sum = 0;
  for (int64_t i = 0; i < storage.numel(); ++i) sum += storage.f32()[i];
  EXPECT_EQ(sum, static_cast<double>(ps.all().size()));
  try {
    ps.to_device(Device::CPU, DType::F32, Tensor::zeros({3}));
    FAIL() << "a buffer of the wrong shape was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("to_device: grads (3) f32 on cpu for a store of ("),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(ps.to_device(Device::CPU, DType::F32, Tensor::zeros(ps.flat_grads().shape(), DType::F64)),
               Error);
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
