// GRPO and DPO token losses: their seeds are the exact derivative of their value (finite differences on the
// logprobs, and through a whole model's backward), and the rollout helpers' formulas.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "data/packing.h"
#include "model/transformer.h"
#include "posttrain/dpo_loss.h"
#include "posttrain/grpo_loss.h"
#include "posttrain/rollout.h"
#include "tiny_model.h"

namespace ndt {
namespace {

// Four samples (lengths 9, 6, 8, 5): prompt of 3 tokens, loss on the rest.
Microbatch four_samples(std::mt19937& rng, int64_t vocab) {
  std::uniform_int_distribution<int> tokd(0, static_cast<int>(vocab) - 1);
  std::vector<Sample> samples;
  for (int len : {9, 6, 8, 5}) {
    Sample s;
    for (int i = 0; i < len; ++i) {
      s.tokens.push_back(tokd(rng));
      s.loss_mask.push_back(i >= 3);
    }
    samples.push_back(s);
  }
  return pack_samples(samples, 0);
}

std::vector<GrpoSample> grpo_samples(std::mt19937& rng, const Microbatch& mb) {
  std::normal_distribution<float> nd(0.0f, 0.3f);
  std::vector<GrpoSample> out(static_cast<size_t>(mb.nseq));
  for (int64_t s = 0; s < mb.nseq; ++s) {
    const size_t n = static_cast<size_t>(mb.seq_real[static_cast<size_t>(s)]) + 1;
    GrpoSample& g = out[static_cast<size_t>(s)];
    g.advantage = s % 2 == 0 ? 1.3 : -0.7;
    for (size_t j = 0; j < n; ++j) {
      g.old_lp.push_back(-1.5f + nd(rng));
      g.ref_lp.push_back(-1.5f + nd(rng));
      g.gen_lp.push_back(-1.5f + nd(rng));
    }
    g.loss_tokens = static_cast<int64_t>(n) - 3;
  }
  return out;
}

// d value / d lp_t by central differences against -seed_t, for every loss row.
void check_seed_derivative(TokenLoss& make_loss_value, TokenLoss& loss, const Microbatch& mb,
                           std::vector<float> lp) {
  std::vector<float> dloss(lp.size());
  loss.seed(mb, lp, dloss);
  std::vector<float> scratch(lp.size());
  const float h = 1e-3f;
  int checked = 0;
  for (size_t t = 0; t < lp.size(); ++t) {
    if (mb.loss_mask.f32()[t] == 0.0f) {
      EXPECT_EQ(dloss[t], 0.0f) << "row " << t << " bears no loss but has a seed";
      continue;
    }
    const float v0 = lp[t];
    lp[t] = v0 + h;
    const double up = make_loss_value.seed(mb, lp, scratch);
    lp[t] = v0 - h;
    const double down = make_loss_value.seed(mb, lp, scratch);
    lp[t] = v0;
    const double num = (up - down) / (2.0 * h), ana = -dloss[t];
    EXPECT_NEAR(num, ana, 1e-4 + 1e-3 * std::abs(num)) << "row " << t;
    ++checked;
  }
  EXPECT_GT(checked, 10);
}

std::vector<float> current_logprobs(std::mt19937& rng, const std::vector<GrpoSample>& s,
                                    const Microbatch& mb) {
  // Near the old logprobs (ratios around 1, some beyond the clip range), away from the clip boundaries.
  std::normal_distribution<float> nd(0.0f, 0.25f);
  const auto src = row_sources(mb);
  std::vector<float> lp(src.size(), 0.0f);
  for (size_t t = 0; t < src.size(); ++t) {
    if (src[t].sample < 0) continue;
    const float old = s[static_cast<size_t>(src[t].sample)].old_lp[static_cast<size_t>(src[t].token)];
    float d = nd(rng);
    for (float edge : {std::log(0.8f), std::log(1.2f)})
      if (std::abs(d - edge) < 0.01f) d += 0.05f;
    lp[t] = old + d;
  }
  return lp;
}

void grpo_check(GrpoLossOptions o) {
  std::mt19937 rng(3);
  const Microbatch mb = four_samples(rng, 32);
  const auto samples = grpo_samples(rng, mb);
  const auto lp = current_logprobs(rng, samples, mb);
  GrpoLoss loss(samples, o), value(samples, o);
  check_seed_derivative(value, loss, mb, lp);
}

TEST(GrpoLoss, TokenMeanClippedGradient) {
  GrpoLossOptions o;
  o.global_tokens = 17;
  grpo_check(o);
}
TEST(GrpoLoss, SequenceMeanKlAndTruncatedIsGradient) {
  GrpoLossOptions o;
  o.sequence_mean = true;
  o.global_samples = 4;
  o.kl_coef = 0.3;
  o.tis_cap = 1.5;
  o.clip_high = 0.28;
  grpo_check(o);
}

TEST(GrpoLoss, OnPolicyValueIsMinusMeanAdvantage) {
  // At lp == old every ratio is 1 and nothing clips: L = -sum_t A_t / N, the seed A_t / N... per token.
  std::mt19937 rng(4);
  const Microbatch mb = four_samples(rng, 32);
  auto samples = grpo_samples(rng, mb);
  const auto src = row_sources(mb);
  std::vector<float> lp(src.size(), 0.0f), dloss(src.size());
  double expect = 0, n = 0;
  for (size_t t = 0; t < src.size(); ++t) {
    if (mb.loss_mask.f32()[t] == 0.0f) continue;
    const auto& s = samples[static_cast<size_t>(src[t].sample)];
    lp[t] = s.old_lp[static_cast<size_t>(src[t].token)];
    expect -= s.advantage;
    ++n;
  }
  GrpoLossOptions o;
  o.global_tokens = n;
  GrpoLoss loss(samples, o);
  EXPECT_NEAR(loss.seed(mb, lp, dloss), expect / n, 1e-12);
  EXPECT_EQ(loss.sums().clipped, 0.0);
  EXPECT_NEAR(loss.sums().ratio / loss.sums().tokens, 1.0, 1e-12);
}

void dpo_check(DpoLossOptions o) {
  std::mt19937 rng(6);
  const Microbatch mb = four_samples(rng, 32);  // pairs (0, 1) and (2, 3)
  std::vector<DpoSample> samples(4);
  for (int i = 0; i < 4; ++i)
    samples[static_cast<size_t>(i)] = {-8.0 + i, mb.seq_real[static_cast<size_t>(i)] - 2};
  std::normal_distribution<float> nd(-2.0f, 0.5f);
  std::vector<float> lp(static_cast<size_t>(mb.num_tokens()));
  for (auto& v : lp) v = nd(rng);
  auto identity = [](double*, int64_t) {};
  DpoLoss loss(samples, o, identity, 0), value(samples, o, identity, 0);
  check_seed_derivative(value, loss, mb, lp);
}

TEST(DpoLoss, SumGradient) {
  DpoLossOptions o;
  o.global_pairs = 2;
  dpo_check(o);
}
TEST(DpoLoss, MeanWithSftTermGradient) {
  DpoLossOptions o;
  o.mean = true;
  o.beta = 0.5;
  o.sft_coef = 0.2;
  o.global_pairs = 2;
  o.global_chosen_tokens = 11;
  dpo_check(o);
}

// The seeds drive the model's backward: parameter gradients equal finite differences of the loss value
// through the whole forward (GRPO with KL, and DPO), both model styles.
void model_check(const std::string& style, bool dpo) {
  std::mt19937 rng(8);
  ModelConfig cfg = testing::tiny_model(style);
  Transformer m(cfg, StageSpec{}, nullptr);
  m.params().init(21);
  const Microbatch mb = four_samples(rng, cfg.vocab_size);
  auto gsamples = grpo_samples(rng, mb);
  for (auto& s : gsamples)  // old logprobs near the model's own, so ratios are near 1
    for (auto& v : s.old_lp) v = -std::log(32.0f) + 0.1f * (v + 1.5f);
  std::vector<DpoSample> dsamples(4);
  for (int i = 0; i < 4; ++i) dsamples[static_cast<size_t>(i)] = {-20.0 + i, 3};
  GrpoLossOptions go;
  go.global_tokens = static_cast<double>(mb.num_loss_tokens);
  go.kl_coef = 0.2;
  go.clip_low = go.clip_high = 10.0;  // no clipping: the loss stays smooth under perturbation
  DpoLossOptions dopt;
  dopt.global_pairs = 2;
  dopt.sft_coef = 0.1;
  dopt.global_chosen_tokens = 10;
  auto identity = [](double*, int64_t) {};
  auto make = [&]() -> std::unique_ptr<TokenLoss> {
    if (dpo) return std::make_unique<DpoLoss>(dsamples, dopt, identity, 0);
    return std::make_unique<GrpoLoss>(gsamples, go);
  };
  auto value = [&]() {
    Activations a;
    m.forward(mb, Tensor(), a);
    const Tensor lp = a.logprob;
    std::vector<float> v(lp.f32(), lp.f32() + lp.numel()), d(v.size());
    return make()->seed(mb, v, d);
  };
  m.params().zero_grad();
  {
    Activations a;
    m.forward(mb, Tensor(), a);
    std::vector<float> v(a.logprob.f32(), a.logprob.f32() + a.logprob.numel()), d(v.size());
    make()->seed(mb, v, d);
    const Tensor seed = Tensor::from_vector(d, {static_cast<int64_t>(d.size())});
    m.backward(mb, Tensor(), 0.0f, a, &seed);
  }
  float G = 0;
  for (auto& p : m.params().all())
    for (int64_t i = 0; i < p->numel(); ++i) G = std::max(G, std::abs(p->grad.f32()[i]));
  ASSERT_GT(G, 0.0f);
  const float eps = 1e-2f;
  int checked = 0;
  for (auto& p : m.params().all()) {
    std::uniform_int_distribution<int64_t> pick(0, p->numel() - 1);
    for (int k = 0; k < 4; ++k) {
      const int64_t i = pick(rng);
      float& w = p->value.f32()[i];
      const float w0 = w;
      w = w0 + eps;
      const double up = value();
      w = w0 - eps;
      const double down = value();
      w = w0;
      const double num = (up - down) / (2.0 * eps), ana = p->grad.f32()[i];
      // The model gradcheck tolerance of tests/test_moe.cpp (fp32 forward, eps 1e-2).
      EXPECT_LE(std::abs(num - ana), 2e-2 * std::abs(num) + 2e-3 * G)
          << style << " " << p->name << "[" << i << "] numeric " << num << " analytic " << ana;
      ++checked;
    }
  }
  EXPECT_GT(checked, 40);
}

TEST(PosttrainGradcheck, GrpoLlama) { model_check("llama", false); }
TEST(PosttrainGradcheck, GrpoGpt2) { model_check("gpt2", false); }
TEST(PosttrainGradcheck, DpoLlama) { model_check("llama", true); }
TEST(PosttrainGradcheck, DpoGpt2) { model_check("gpt2", true); }

TEST(Rollout, GroupAdvantages) {
  const std::vector<double> r = {1, 0, 0, 1, 2, 2, 2, 2};
  const auto a = group_advantages(r, 4, "mean", true, 0.0);
  const double sd = std::sqrt(4 * 0.25 / 3);  // unbiased std of {1, 0, 0, 1}
  EXPECT_NEAR(a[0], 0.5 / sd, 1e-12);
  EXPECT_NEAR(a[1], -0.5 / sd, 1e-12);
  for (int i = 4; i < 8; ++i) EXPECT_EQ(a[static_cast<size_t>(i)], 0.0);  // equal rewards: no signal
  const auto loo = group_advantages(r, 4, "loo", false, 0.0);
  EXPECT_NEAR(loo[0], 1.0 - 1.0 / 3.0, 1e-12);
  EXPECT_NEAR(loo[1], 0.0 - 2.0 / 3.0, 1e-12);
  const auto keep = informative_groups(r, 4);
  EXPECT_EQ(keep, (std::vector<bool>{true, false}));
  EXPECT_THROW(group_advantages(r, 3, "mean", true, 0.0), std::exception);
}

TEST(Rollout, GenAgreement) {
  const std::vector<std::vector<float>> a = {{-1.0f, -2.0f}, {-0.5f}};
  auto same = gen_agreement(a, a);
  EXPECT_EQ(same.gen_kl_error, 0.0);
  EXPECT_EQ(same.token_prob_error, 0.0);
  EXPECT_EQ(same.tokens, 3);
  auto b = a;
  b[1][0] = -0.6f;
  const auto g = gen_agreement(a, b);
  const double d = -0.5 - -0.6;  // lp_train - lp_gen on the one differing token (float inputs)
  EXPECT_NEAR(g.gen_kl_error, (std::exp(d) - d - 1.0) / 3.0, 1e-7);
  EXPECT_NEAR(g.token_prob_error, (std::exp(-0.5) - std::exp(-0.6)) / 3.0, 1e-7);
}

}  // namespace
}  // namespace ndt
