// Mixture-of-Experts: router backward and whole-model gradient checks (both styles, both routers, with
// shared experts and the aux / z losses), capacity dropping, and the MoE config errors.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <random>
#include <sstream>

#include "data/packing.h"
#include "gradcheck.h"
#include "model/moe_router.h"
#include "model/transformer.h"
#include "tiny_model.h"
#include "train/metrics.h"

namespace ndt {
namespace {

// Router: objective sum(dgate * gate) + sum(dP * P) + sum(dz * logsumexp) against central differences.
// A perturbation that changes the selection makes the objective discontinuous there: such elements are
// skipped (and must be rare).
void router_check(bool sigmoid, bool renorm) {
  std::mt19937 rng(3);
  RouterSpec spec;
  spec.experts = 6;
  spec.top_k = 2;
  spec.sigmoid = sigmoid;
  spec.renormalize = renorm;
  const int64_t N = 5, E = spec.experts, k = spec.top_k;
  std::vector<float> logits = gradcheck::randn(static_cast<size_t>(N * E), rng);
  std::vector<float> bias = gradcheck::randn(static_cast<size_t>(E), rng, 0.1f);
  const std::vector<float> dgate = gradcheck::randn(static_cast<size_t>(N * k), rng);
  const std::vector<float> dP = gradcheck::randn(static_cast<size_t>(N * E), rng);
  const std::vector<float> dz = gradcheck::randn(static_cast<size_t>(N), rng);
  auto objective = [&](const Routing& r) {
    const std::vector<float> P = balance_probs(r, spec);
    double v = 0;
    for (size_t i = 0; i < r.gate.size(); ++i) v += static_cast<double>(dgate[i]) * r.gate[i];
    for (size_t i = 0; i < P.size(); ++i) v += static_cast<double>(dP[i]) * P[i];
    for (int64_t t = 0; t < N; ++t) {
      double mx = -1e30, s = 0;
      for (int64_t e = 0; e < E; ++e)
        mx = std::max(mx, static_cast<double>(logits[static_cast<size_t>(t * E + e)]));
      for (int64_t e = 0; e < E; ++e) s += std::exp(logits[static_cast<size_t>(t * E + e)] - mx);
      v += dz[static_cast<size_t>(t)] * (mx + std::log(s));
    }
    return v;
  };
  const float* b = sigmoid ? bias.data() : nullptr;
  const Routing r0 = route(logits.data(), b, N, spec);
  std::vector<float> dl(static_cast<size_t>(N * E));
  router_backward(dl.data(), r0, spec, logits.data(), dgate.data(), dP.data(), dz.data());
  int checked = 0;
  for (size_t i = 0; i < logits.size(); ++i) {
    const float x0 = logits[i], eps = 1e-3f;
    logits[i] = x0 + eps;
    const Routing rp = route(logits.data(), b, N, spec);
    const double lp = objective(rp);
    logits[i] = x0 - eps;
    const Routing rm = route(logits.data(), b, N, spec);
    const double lm = objective(rm);
    logits[i] = x0;
    if (rp.choice != r0.choice || rm.choice != r0.choice) continue;
    const double num = (lp - lm) / (2.0 * eps);
    EXPECT_NEAR(num, dl[i], 2e-3 + 1e-2 * std::abs(num)) << "logit " << i;
    ++checked;
  }
  EXPECT_GE(checked, static_cast<int>(logits.size()) - 2);
}

TEST(MoeRouter, SoftmaxRenormalizedGradient) { router_check(false, true); }
TEST(MoeRouter, SoftmaxRawGradient) { router_check(false, false); }
TEST(MoeRouter, SigmoidBiasGradient) { router_check(true, true); }

TEST(MoeRouter, SigmoidBiasSelectsButDoesNotWeigh) {
  RouterSpec spec{4, 1, true, true, 0};
  const std::vector<float> logits = {2.0f, 1.0f, 0.0f, -1.0f};
  const std::vector<float> bias = {0.0f, 0.0f, 5.0f, 0.0f};
  const Routing r = route(logits.data(), bias.data(), 1, spec);
  EXPECT_EQ(r.choice[0], 2);         // selected through its bias
  EXPECT_FLOAT_EQ(r.gate[0], 1.0f);  // renormalised over the one chosen expert
  spec.renormalize = false;
  const Routing raw = route(logits.data(), bias.data(), 1, spec);
  EXPECT_NEAR(raw.gate[0], 0.5f, 1e-6);  // sigmoid(0): the bias never enters the weight
}

TEST(MoeRouter, CapacityDropsLaterTokens) {
  RouterSpec spec{2, 1, false, true, 0.5};  // capacity ceil(0.5 * 4 * 1 / 2) = 1 slot per expert
  const std::vector<float> logits = {1, 0, 1, 0, 0, 1, 0, 1};
  const Routing r = route(logits.data(), nullptr, 4, spec);
  EXPECT_EQ(r.kept, (std::vector<uint8_t>{1, 0, 1, 0}));
}

// The routing decisions of a layer (none for a dense one): a gradient check skips steps that change them.
void append_choices(std::vector<int32_t>& out, const MoeActs& a) {
  if (!a.routed.choice.defined()) return;
  const std::vector<int32_t> c = a.routed.choice.to_vector<int32_t>();
  out.insert(out.end(), c.begin(), c.end());
}

ModelConfig moe_model(const std::string& style, const std::string& router, int64_t top_k, int64_t shared,
                      int64_t first_dense) {
  ModelConfig m = testing::tiny_model(style);
  m.moe.num_experts = 4;
  m.moe.top_k = top_k;
  m.moe.d_ff_expert = 12;
  m.moe.shared_experts = shared;
  m.moe.first_dense = first_dense;
  m.moe.router = router;
  m.moe.renormalize = router == "softmax";
  m.moe.aux_loss_coef = 0.1;
  m.moe.z_loss_coef = 0.01;
  return m;
}

Microbatch moe_batch(std::mt19937& rng, int64_t vocab) {
  PackLayout layout;
  layout.seq_multiple = layout.stream_multiple =
      4;  // padding tokens: routed, but outside every balancing statistic
  return testing::three_sequences(rng, vocab, layout);
}

// Whole model: d(CE sum + aux + z)/dw against central differences of the same objective. Elements whose
// perturbation changes any routing decision are skipped (the objective is discontinuous there).
void model_gradcheck(const ModelConfig& cfg) {
  std::mt19937 rng(5);
  Transformer m(cfg, StageSpec{}, nullptr);
  m.params().init(13);
  const Microbatch mb = moe_batch(rng, cfg.vocab_size);
  MoeStepContext ctx;
  ctx.seqs = static_cast<double>(mb.num_real_seqs());
  ctx.tokens = static_cast<double>(mb.num_real_tokens());
  m.set_moe_context(&ctx);
  auto run = [&](std::vector<int32_t>* choices) {
    ctx.record = true;
    for (auto& [l, layer] : m.moe_layers()) layer->stats().clear(cfg.moe.num_experts);
    Activations a;
    m.forward(mb, Tensor(), a);
    double v = m.loss_sum(mb, a);
    for (auto& [l, layer] : m.moe_layers()) v += layer->stats().aux + layer->stats().z;
    if (choices) {
      choices->clear();
      for (auto& la : a.layers) append_choices(*choices, la.moe);
    }
    ctx.record = false;
    return v;
  };
  m.params().zero_grad();
  std::vector<int32_t> base;
  {
    Activations a;
    m.forward(mb, Tensor(), a);
    for (auto& la : a.layers) append_choices(base, la.moe);
    m.backward(mb, Tensor(), 1.0f, a);
  }
  float G = 0;
  for (auto& p : m.params().all())
    for (int64_t i = 0; i < p->numel(); ++i) G = std::max(G, std::abs(p->grad.f32()[i]));
  const float eps = 1e-2f;
  int checked = 0, skipped = 0;
  for (auto& p : m.params().all()) {
    if (p->name.find("expert_bias") != std::string::npos) continue;  // not trained by the gradient
    float gmax = 0;
    for (int64_t i = 0; i < p->numel(); ++i) gmax = std::max(gmax, std::abs(p->grad.f32()[i]));
    EXPECT_GT(gmax, 0.0f) << p->name << " received no gradient";
    std::uniform_int_distribution<int64_t> pick(0, p->numel() - 1);
    for (int k = 0; k < 6; ++k) {
      const int64_t i = pick(rng);
      float& w = p->value.f32()[i];
      const float w0 = w;
      std::vector<int32_t> cp, cm;
      w = w0 + eps;
      const double lp = run(&cp);
      w = w0 - eps;
      const double lm = run(&cm);
      w = w0;
      if (cp != base || cm != base) {
        ++skipped;
        continue;
      }
      const double num = (lp - lm) / (2.0 * eps), ana = p->grad.f32()[i];
      EXPECT_LE(std::abs(num - ana), 2e-2 * std::abs(num) + 2e-3 * G)
          << cfg.style << " " << p->name << "[" << i << "] numeric " << num << " analytic " << ana;
      ++checked;
    }
  }
  EXPECT_GT(checked, 50);
  EXPECT_LE(skipped, checked / 5) << "too many perturbations changed the routing";
}

TEST(MoeGradcheck, LlamaSoftmaxTop2SharedExpert) { model_gradcheck(moe_model("llama", "softmax", 2, 1, 0)); }
TEST(MoeGradcheck, Gpt2SigmoidTop1FirstDense) { model_gradcheck(moe_model("gpt2", "sigmoid", 1, 0, 1)); }
TEST(MoeGradcheck, Gpt2SoftmaxTop2Shared) { model_gradcheck(moe_model("gpt2", "softmax", 2, 2, 0)); }
TEST(MoeGradcheck, LlamaSigmoidTop2) { model_gradcheck(moe_model("llama", "sigmoid", 2, 0, 0)); }

TEST(MoeConfig, BadInputNamesTheKeys) {
  auto err = [](const std::vector<std::string>& sets) {
    auto r = parse_config_string("model: {style: llama}\n", sets);
    return r ? std::string("ok") : r.status().message();
  };
  EXPECT_NE(err({"model.moe.num_experts=4", "model.moe.top_k=5"})
                .find("model.moe.top_k (5) must be <= model.moe.num_experts (4)"),
            std::string::npos);
  EXPECT_NE(err({"parallel.ep=2", "parallel.dp=2"}).find("needs a Mixture-of-Experts model"),
            std::string::npos);
  EXPECT_NE(err({"model.moe.num_experts=6", "parallel.ep=4", "parallel.dp=4"})
                .find("model.moe.num_experts (6) must be divisible by parallel.ep (4)"),
            std::string::npos);
  EXPECT_NE(err({"model.moe.num_experts=4", "parallel.ep=4", "parallel.dp=2", "train.global_batch=8"})
                .find("parallel.ep (4) must divide parallel.dp * parallel.cp = 2 * 1 = 2"),
            std::string::npos);
  EXPECT_NE(err({"model.moe.num_experts=4", "model.moe.router=topk"}).find("model.moe.router"),
            std::string::npos);
  EXPECT_EQ(err({"model.moe.num_experts=4", "parallel.ep=2", "parallel.cp=2", "data.seq_len=32"}), "ok");
}

TEST(MoeConfig, RoundTripsThroughYaml) {
  auto c =
      parse_config_string("model: {style: gpt2, moe: {num_experts: 8, top_k: 1, router: sigmoid}}\n", {});
  ASSERT_TRUE(c) << c.status().message();
  auto again = parse_config_string(config_to_yaml(c.value()), {});
  ASSERT_TRUE(again) << again.status().message();
  EXPECT_EQ(again.value().model.moe.num_experts, 8);
  EXPECT_EQ(again.value().model.moe.top_k, 1);
  EXPECT_EQ(again.value().model.moe.router, "sigmoid");
}

TEST(MoeMetrics, ExpertLoadSvgBinsLongRuns) {
  // 1000 steps of 2 layers x 4 experts: at most 200 columns, so 2 * 200 * 4 cells plus the background.
  std::vector<int64_t> steps;
  std::vector<std::vector<std::vector<double>>> loads(2);
  for (int64_t s = 0; s < 1000; ++s) {
    steps.push_back(s);
    for (auto& l : loads) l.push_back({1.0, 2.0, 3.0, static_cast<double>(s % 5)});
  }
  const std::string path = ::testing::TempDir() + "/expert_load.svg";
  ASSERT_TRUE(write_expert_load_svg(steps, {1, 3}, loads, path, "t"));
  std::stringstream ss;
  ss << std::ifstream(path).rdbuf();
  const std::string svg = ss.str();
  size_t rects = 0;
  for (size_t at = svg.find("<rect"); at != std::string::npos; at = svg.find("<rect", at + 1)) ++rects;
  EXPECT_EQ(rects, 1u + 2u * 200u * 4u);
  EXPECT_NE(svg.find("layer 3 (rows: experts 0..3; columns: steps, 5 per column)"), std::string::npos);
  EXPECT_FALSE(write_expert_load_svg(steps, {1}, loads, path, "t"));  // one series per layer
}

}  // namespace
}  // namespace ndt
