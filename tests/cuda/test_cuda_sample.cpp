// Device sampling (cuda::sample_tokens through choose_tokens) against its CPU twin choose_token on random
// logits (never zero), f32 and bf16 (bf16 logits are compared with the CPU on the same rounded values),
// greedy, full-vocabulary temperature sampling, top-k, top-p and both, with exact ties planted. Tokens must
// be equal (the CDF's sums are doubles on both sides; only their order differs, which can move a choice
// only when u * total lies within ~1e-15 relative of a step: not met on these draws); logprobs within
// 1e-5 absolute (float outputs of double arithmetic).
#include <gtest/gtest.h>

#include <random>

#include "generate/sampler.h"
#include "gpu_test.h"
#include "ops/ops.h"

namespace ndt {
namespace {

using testing::to_device_as;

struct Case {
  int64_t n, V;
  double temperature;
  int64_t top_k;
  double top_p;
};

TEST(CudaSample, MatchesCpuTwin) {
  NDT_REQUIRE_GPU();
  std::mt19937 rng(7);
  std::normal_distribution<float> logit(0.0f, 3.0f);
  std::uniform_real_distribution<double> unif(0.0, 1.0);
  const std::vector<Case> cases = {
      {16, 50, 0.0, 0, 1.0},    {16, 50, 1.0, 0, 1.0},    {16, 1000, 0.7, 0, 1.0},  {8, 32007, 1.0, 0, 1.0},
      {16, 1000, 1.0, 5, 1.0},  {16, 1000, 1.0, 0, 0.9},  {16, 1000, 0.8, 50, 0.7}, {8, 32007, 1.0, 40, 0.95},
      {4, 129, 1.3, 1000, 0.5}, {64, 32000, 1.0, 0, 1.0}, {3, 7, 1.0, 0, 0.3}};
  for (DType dt : {DType::F32, DType::BF16})
    for (const Case& c : cases) {
      Tensor host = Tensor::empty({c.n, c.V});
      for (int64_t i = 0; i < host.numel(); ++i) host.f32()[i] = logit(rng);
      // Exact ties: copy the row's largest logit to another id (the smaller id must win).
      for (int64_t r = 0; r < c.n; ++r) {
        float* row = host.f32() + r * c.V;
        const int64_t a = std::max_element(row, row + c.V) - row;
        row[(a + c.V / 2) % c.V] = row[a];
      }
      const Tensor dev = to_device_as(host, dt);
      const Tensor same = ops::to_host_f32(dev);  // the values the device sees
      std::vector<double> u(static_cast<size_t>(c.n));
      for (double& x : u) x = unif(rng);
      const std::vector<TokenChoice> got = choose_tokens(dev, c.temperature, c.top_k, c.top_p, u);
      const std::vector<TokenChoice> want = choose_tokens(same, c.temperature, c.top_k, c.top_p, u);
      for (int64_t r = 0; r < c.n; ++r) {
        SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " V " << c.V << " T " << c.temperature << " k "
                                          << c.top_k << " p " << c.top_p << " row " << r);
        EXPECT_EQ(got[static_cast<size_t>(r)].token, want[static_cast<size_t>(r)].token);
        EXPECT_NEAR(got[static_cast<size_t>(r)].logprob, want[static_cast<size_t>(r)].logprob, 1e-5);
      }
    }
}

// Frequencies over many rows of the same logits follow the tempered softmax restricted to top-k (a check of
// the distribution itself, independent of the CPU code).
TEST(CudaSample, FrequenciesFollowTheTopKSoftmax) {
  NDT_REQUIRE_GPU();
  const int64_t n = 20000, V = 6;
  const std::vector<float> row = {1.0f, 2.0f, 0.5f, 2.0f, -1.0f, 1.5f};
  Tensor host = Tensor::empty({n, V});
  for (int64_t r = 0; r < n; ++r) std::copy(row.begin(), row.end(), host.f32() + r * V);
  std::vector<double> u(static_cast<size_t>(n));
  for (int64_t r = 0; r < n; ++r) u[static_cast<size_t>(r)] = (static_cast<double>(r) + 0.5) / n;
  const std::vector<TokenChoice> got = choose_tokens(host.to(Device::CUDA), 0.5, 3, 1.0, u);
  // Top 3 logits: ids 1, 3 (2.0 each) and 5 (1.5); weights exp(x / 0.5).
  const double w2 = std::exp(4.0), w15 = std::exp(3.0), tot = 2 * w2 + w15;
  std::vector<int64_t> count(static_cast<size_t>(V), 0);
  for (const auto& c : got) ++count[static_cast<size_t>(c.token)];
  EXPECT_EQ(count[0] + count[2] + count[4], 0);
  EXPECT_NEAR(static_cast<double>(count[1]) / n, w2 / tot, 1e-3);
  EXPECT_NEAR(static_cast<double>(count[3]) / n, w2 / tot, 1e-3);
  EXPECT_NEAR(static_cast<double>(count[5]) / n, w15 / tot, 1e-3);
}

}  // namespace
}  // namespace ndt
