// MoE row movement on the GPU against its CPU twin (ops::moe_permute / moe_unpermute / moe_gate_grad) on
// random inputs, fp32 and bf16, with dropped slots; the router (route_tokens, seq_stats, router_backward)
// against its host twin; and a whole MoE layer's forward/backward on the GPU against the CPU (router in fp32
// on both sides). Tolerances: fp32 1e-5 relative to the output's max magnitude, bf16 2e-2 (one bf16 rounding
// of inputs and outputs).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "gpu_test.h"
#include "model/moe.h"
#include "model/moe_router.h"
#include "ops/ops.h"

namespace ndt {
namespace {

Tensor rand_tensor(Shape s, std::mt19937& rng) {
  Tensor t = Tensor::empty(std::move(s));
  std::normal_distribution<float> d;
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = d(rng);
  return t;
}

Tensor to_dev(const Tensor& host, DType dt) {
  Tensor d = Tensor::empty(host.shape(), dt, Device::CUDA);
  if (dt == DType::F32) {
    d.copy_from(host);
  } else {
    Tensor f = host.to(Device::CUDA);
    ops::cast_into(d, f);
  }
  return d;
}

// Rounds host values through bf16 when dt is bf16 (so both sides start from the same inputs).
Tensor rounded(const Tensor& host, DType dt) {
  return dt == DType::F32 ? host : ops::to_host_f32(to_dev(host, dt));
}

void expect_close(const char* what, const Tensor& gpu, const Tensor& cpu, double tol) {
  const Tensor g = ops::to_host_f32(gpu);
  double mx = 1e-12, err = 0;
  for (int64_t i = 0; i < cpu.numel(); ++i) {
    mx = std::max(mx, static_cast<double>(std::abs(cpu.f32()[i])));
    err = std::max(err, static_cast<double>(std::abs(g.f32()[i] - cpu.f32()[i])));
  }
  EXPECT_LE(err / mx, tol) << what << ": max error " << err << " of max " << mx;
}

void row_movement(DType dt) {
  std::mt19937 rng(11);
  const int64_t N = 37, k = 2, C = 72;
  // Slots: a random permutation of the kept ones, some dropped.
  std::vector<int32_t> pos(static_cast<size_t>(N * k));
  std::vector<int32_t> order(static_cast<size_t>(N * k));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  int32_t R = 0;
  std::vector<int32_t> row_token;
  for (int32_t slot : order) {
    if (slot % 7 == 3) {
      pos[static_cast<size_t>(slot)] = -1;
      continue;
    }
    pos[static_cast<size_t>(slot)] = R++;
  }
  row_token.resize(static_cast<size_t>(R));
  for (int64_t s = 0; s < N * k; ++s)
    if (pos[static_cast<size_t>(s)] >= 0)
      row_token[static_cast<size_t>(pos[static_cast<size_t>(s)])] = static_cast<int32_t>(s / k);
  const Tensor pos_t = Tensor::from_vector(pos, {N * k}), tok_t = Tensor::from_vector(row_token, {R});
  const Tensor x = rounded(rand_tensor({N, C}, rng), dt), y = rounded(rand_tensor({R, C}, rng), dt);
  const Tensor gates = rand_tensor({N * k}, rng), scale = rand_tensor({R}, rng);
  const double tol = dt == DType::F32 ? 1e-5 : 2e-2;

  Tensor xp_cpu = Tensor::empty({R, C}), xp_gpu = Tensor::empty({R, C}, dt, Device::CUDA);
  ops::moe_permute(xp_cpu, x, tok_t, &scale);
  ops::moe_permute(xp_gpu, to_dev(x, dt), tok_t, &scale);
  expect_close("moe_permute", xp_gpu, xp_cpu, tol);

  Tensor out_cpu = rand_tensor({N, C}, rng);
  Tensor out_gpu = to_dev(out_cpu, dt);
  out_cpu = rounded(out_cpu, dt);
  ops::moe_unpermute(out_cpu, y, pos_t, &gates, k, /*accumulate=*/true);
  ops::moe_unpermute(out_gpu, to_dev(y, dt), pos_t, &gates, k, /*accumulate=*/true);
  expect_close("moe_unpermute(+=)", out_gpu, out_cpu, tol);
  ops::moe_unpermute(out_cpu, y, pos_t, nullptr, k, /*accumulate=*/false);
  ops::moe_unpermute(out_gpu, to_dev(y, dt), pos_t, nullptr, k, /*accumulate=*/false);
  expect_close("moe_unpermute(=)", out_gpu, out_cpu, tol);

  Tensor dg_cpu = Tensor::empty({N * k}), dg_gpu = Tensor::empty({N * k}, DType::F32, Device::CUDA);
  ops::moe_gate_grad(dg_cpu, x, y, pos_t, k);
  ops::moe_gate_grad(dg_gpu, to_dev(x, dt), to_dev(y, dt), pos_t, k);
  expect_close("moe_gate_grad", dg_gpu, dg_cpu, dt == DType::F32 ? 1e-5 : 1e-2);
}

TEST(CudaMoe, RowMovementF32) {
  NDT_REQUIRE_GPU();
  row_movement(DType::F32);
}
TEST(CudaMoe, RowMovementBf16) {
  NDT_REQUIRE_GPU();
  row_movement(DType::BF16);
}

// The router on the device against its host twin (model/moe_router.h) on random logits: scores, choices,
// gates, logsumexp and the permutation exactly or within 1e-6 relative (exp/log may differ in the last bit
// of a double); the router backward within 1e-5 of the largest gradient. Softmax and sigmoid (with a
// selection bias), with and without a capacity factor, top-1 to top-4 of 6 to 64 experts; ties included
// (logits rounded to a few values).
void router_twin(const RouterSpec& spec, int64_t N, bool ties, uint32_t seed) {
  std::mt19937 rng(seed);
  const int64_t E = spec.experts, k = spec.top_k;
  Tensor logits = rand_tensor({N, E}, rng), bias = rand_tensor({E}, rng);
  if (ties)
    for (int64_t i = 0; i < logits.numel(); ++i) logits.f32()[i] = std::round(logits.f32()[i] * 2.0f) / 2.0f;
  for (int64_t e = 0; e < E; ++e) bias.f32()[e] *= 0.05f;
  const Tensor* b = spec.sigmoid ? &bias : nullptr;
  const RoutedTokens cpu = route_tokens(logits, b, spec);
  const Tensor dlogits = logits.to(Device::CUDA), dbias = bias.to(Device::CUDA);
  const RoutedTokens gpu = route_tokens(dlogits, spec.sigmoid ? &dbias : nullptr, spec);
  EXPECT_EQ(gpu.counts, cpu.counts);
  auto ints = [](const Tensor& t) { return t.to_vector<int32_t>(); };
  EXPECT_EQ(ints(gpu.choice), ints(cpu.choice));
  EXPECT_EQ(ints(gpu.slot_pos), ints(cpu.slot_pos));
  EXPECT_EQ(ints(gpu.row_token), ints(cpu.row_token));
  expect_close("score", gpu.score, cpu.score, 1e-6);
  expect_close("gate", gpu.gate, cpu.gate, 1e-6);
  expect_close("kept_gate", gpu.kept_gate, cpu.kept_gate, 1e-6);
  expect_close("row_gate", gpu.row_gate, cpu.row_gate, 1e-6);
  expect_close("lse", gpu.lse, cpu.lse, 1e-6);

  expect_close("pnorm", gpu.pnorm, cpu.pnorm, 1e-6);

  // Three sequences (token 0 is padding): statistics, then the backward from gate gradients, a balancing
  // term and a z-loss term.
  Tensor seq = Tensor::empty({N}, DType::I32);
  for (int64_t t = 0; t < N; ++t) seq.i32()[t] = t == 0 ? -1 : static_cast<int32_t>(t % 3);
  const Tensor seq_gpu = seq.to(Device::CUDA);
  const std::vector<float> st_cpu = seq_stats(cpu, seq, 3, spec), st_gpu = seq_stats(gpu, seq_gpu, 3, spec);
  expect_close("seq_stats", Tensor::from_vector(st_gpu, {static_cast<int64_t>(st_gpu.size())}),
               Tensor::from_vector(st_cpu, {static_cast<int64_t>(st_cpu.size())}), 1e-6);
  const Tensor dgate = rand_tensor({N * k}, rng), w = rand_tensor({3}, rng), cnt = rand_tensor({3, E}, rng);
  const RouterLossGrad loss_cpu{seq, w, cnt, 0.37};
  const RouterLossGrad loss_gpu{seq_gpu, w.to(Device::CUDA), cnt.to(Device::CUDA), 0.37};
  Tensor dl_cpu = Tensor::empty({N, E}), dl_gpu = Tensor::empty({N, E}, DType::F32, Device::CUDA);
  router_backward(dl_cpu, cpu, spec, logits, dgate, &loss_cpu);
  router_backward(dl_gpu, gpu, spec, dlogits, dgate.to(Device::CUDA), &loss_gpu);
  expect_close("dlogits", dl_gpu, dl_cpu, 1e-5);
}

TEST(CudaMoe, RouterMatchesHost) {
  NDT_REQUIRE_GPU();
  int seed = 1;
  for (const bool sigmoid : {false, true})
    for (const double cf : {0.0, 0.8})
      for (const auto& [E, k] : std::vector<std::pair<int64_t, int64_t>>{{6, 1}, {16, 2}, {64, 4}})
        for (const bool ties : {false, true}) {
          SCOPED_TRACE(::testing::Message() << "sigmoid " << sigmoid << " cf " << cf << " E " << E << " k "
                                            << k << " ties " << ties);
          RouterSpec spec{E, k, sigmoid, /*renormalize=*/!sigmoid || k > 1, cf};
          router_twin(spec, /*N=*/1000 + E, ties, static_cast<uint32_t>(seed++));
        }
}

// One MoE layer (llama experts, top-2, aux and z losses) forward + backward on the GPU in fp32 against the
// CPU: outputs, input gradient and every parameter gradient.
TEST(CudaMoe, LayerMatchesCpu) {
  NDT_REQUIRE_GPU();
  ModelConfig cfg;
  cfg.style = "llama";
  cfg.d_model = 64;
  cfg.moe.num_experts = 4;
  cfg.moe.top_k = 2;
  cfg.moe.d_ff_expert = 96;
  cfg.moe.z_loss_coef = 0.01;
  std::mt19937 rng(5);
  const int64_t T = 24;
  std::vector<Sample> samples(2);
  for (auto& s : samples)
    for (int i = 0; i < 13; ++i) {
      s.tokens.push_back(i);
      s.loss_mask.push_back(1);
    }
  const Microbatch mb = make_microbatch(samples, T / 2, 0);
  const Tensor x = rand_tensor({T, cfg.d_model}, rng), dy = rand_tensor({T, cfg.d_model}, rng);
  MoeStepContext ctx;
  ctx.seqs = 2;
  ctx.tokens = static_cast<double>(T);
  auto run = [&](Device dev, std::vector<Tensor>& outs) {
    ParamStore ps;
    MoeLayer layer(cfg, "layers.0.mlp.", ps, nullptr);
    layer.set_context(&ctx);
    ps.flatten();
    ps.init(3);
    if (dev == Device::CUDA) ps.to_device(Device::CUDA, DType::F32);
    MoeActs a;
    Tensor out = layer.forward(mb, 0, dev == Device::CUDA ? x.to(dev) : x, a);
    Tensor dx = layer.backward(dev == Device::CUDA ? dy.to(dev) : dy, a);
    outs = {out, dx};
    for (auto& p : ps.all()) outs.push_back(p->grad);
  };
  std::vector<Tensor> cpu, gpu;
  run(Device::CPU, cpu);
  run(Device::CUDA, gpu);
  ASSERT_EQ(cpu.size(), gpu.size());
  for (size_t i = 0; i < cpu.size(); ++i)
    expect_close(i == 0 ? "out" : i == 1 ? "dx" : "param grad", gpu[i], cpu[i], 1e-4);
}

}  // namespace
}  // namespace ndt
