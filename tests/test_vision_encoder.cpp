// The vision encoder + projector on one device: gradient check of every parameter tensor (both styles),
// output shape and placement, parameter names and TP shards, patch layout, and bidirectional attention
// that stays inside each image.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>

#include "gradcheck.h"
#include "model/vision_encoder.h"
#include "tiny_model.h"

namespace ndt {
namespace {

constexpr int64_t kLlmC = 12, kB = 3;

using testing::tiny_encoder;

Tensor random_tensor(Shape s, std::mt19937& rng) {
  Tensor t = Tensor::empty(std::move(s));
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = d(rng);
  return t;
}

// Every value random N(0, 0.3) (norm weights around 1): no zero bias or unit norm hides a missing term.
void randomize(ParamStore& store, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 0.3f);
  for (auto& p : store.all())
    for (int64_t i = 0; i < p->numel(); ++i)
      p->value.f32()[i] = d(rng) + (p->init == InitKind::Ones ? 1.0f : 0.0f);
}

struct Fixture {
  ParamStore store;
  VisionEncoder enc;
  explicit Fixture(const std::string& style, TpHooks* tp = nullptr)
      : enc(tiny_encoder(style), kLlmC, 1e-5, 0.3, tp, store) {
    store.init(5);
  }
};

// Objective L = sum(out * R), accumulated in double; dL/dout = R.
double objective(VisionEncoder& enc, const Tensor& images, const Tensor& R) {
  EncoderActs acts;
  const std::vector<float> out = enc.forward(images, acts).to_vector<float>();
  return gradcheck::weighted_sum(out, R.to_vector<float>());
}

// Central differences on a few elements of every parameter tensor, with gradcheck.h's tolerance
// |num - ana| <= 1e-3 + 1e-2 |num| (step 1e-2). Element picks include the first and last of each tensor.
void gradcheck_encoder(const std::string& style) {
  Fixture f(style);
  randomize(f.store, 21);
  std::mt19937 rng(3);
  const Tensor images = random_tensor({kB, 2, 8, 8}, rng);
  const Tensor R = random_tensor({kB * f.enc.patches(), kLlmC}, rng);
  f.store.zero_grad();
  EncoderActs acts;
  f.enc.forward(images, acts);
  f.enc.backward(R, acts);

  int tensors = 0, elements = 0;
  for (auto& p : f.store.all()) {
    std::set<int64_t> picks = {0, p->numel() - 1};
    std::uniform_int_distribution<int64_t> pick(0, p->numel() - 1);
    while (static_cast<int64_t>(picks.size()) < std::min<int64_t>(5, p->numel())) picks.insert(pick(rng));
    const std::vector<int64_t> idx(picks.begin(), picks.end());
    std::vector<float> x, ana;
    for (int64_t i : idx) {
      x.push_back(p->value.f32()[i]);
      ana.push_back(p->grad.f32()[i]);
    }
    auto loss = [&] {
      for (size_t j = 0; j < idx.size(); ++j) p->value.f32()[idx[j]] = x[j];
      return objective(f.enc, images, R);
    };
    gradcheck::check_grad(style + " " + p->name, x, ana, loss);
    for (size_t j = 0; j < idx.size(); ++j) p->value.f32()[idx[j]] = x[j];
    ++tensors;
    elements += static_cast<int>(idx.size());
  }
  // gpt2: 3 front + 2 layers x 15 + 2 final norm + 4 projector; llama: 3 + 2 x 9 + 1 + 4.
  EXPECT_EQ(tensors, style == "gpt2" ? 39 : 26);
  EXPECT_GT(elements, 4 * tensors);
}

TEST(VisionEncoder, GradcheckGpt2) { gradcheck_encoder("gpt2"); }
TEST(VisionEncoder, GradcheckLlama) { gradcheck_encoder("llama"); }

TEST(VisionEncoder, BackwardAccumulates) {
  Fixture f("llama");
  randomize(f.store, 4);
  std::mt19937 rng(8);
  const Tensor images = random_tensor({2, 2, 8, 8}, rng);
  const Tensor R = random_tensor({2 * f.enc.patches(), kLlmC}, rng);
  f.store.zero_grad();
  for (int pass = 0; pass < 2; ++pass) {
    EncoderActs acts;
    f.enc.forward(images, acts);
    f.enc.backward(R, acts);
  }
  // Two identical passes: every gradient is twice that of one pass.
  Fixture g("llama");
  randomize(g.store, 4);
  g.store.zero_grad();
  EncoderActs acts;
  g.enc.forward(images, acts);
  g.enc.backward(R, acts);
  for (auto& p : f.store.all()) {
    const Param& q = g.store.get(p->name);
    for (int64_t i = 0; i < p->numel(); ++i)
      ASSERT_NEAR(p->grad.f32()[i], 2.0f * q.grad.f32()[i], 1e-6f + 1e-5f * std::abs(q.grad.f32()[i]))
          << p->name;
  }
}

TEST(VisionEncoder, OutputShapeAndPlacement) {
  for (const std::string style : {"gpt2", "llama"}) {
    Fixture f(style);
    EXPECT_EQ(f.enc.patches(), 4);
    std::mt19937 rng(1);
    EncoderActs acts;
    const Tensor out = f.enc.forward(random_tensor({kB, 2, 8, 8}, rng), acts);
    EXPECT_EQ(out.shape(), (Shape{kB * 4, kLlmC})) << style;
    EXPECT_EQ(out.device(), f.store.device());
    EXPECT_EQ(out.dtype(), f.store.compute_dtype());
    for (float v : out.to_vector<float>()) ASSERT_TRUE(std::isfinite(v));
  }
}

TEST(VisionEncoder, PatchifyIsRowMajorPatchesChannelMajorFeatures) {
  // Pixel value encodes (b, c, y, x); patch (gy, gx) of image b is row b*4 + gy*2 + gx; feature
  // c*16 + py*4 + px is pixel (c, gy*4 + py, gx*4 + px).
  Tensor img = Tensor::empty({2, 2, 8, 8});
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t c = 0; c < 2; ++c)
      for (int64_t y = 0; y < 8; ++y)
        for (int64_t x = 0; x < 8; ++x)
          img.f32()[((b * 2 + c) * 8 + y) * 8 + x] = static_cast<float>(1000 * b + 100 * c + 10 * y + x);
  const Tensor p = patchify(img, 4);
  ASSERT_EQ(p.shape(), (Shape{8, 32}));
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t gy = 0; gy < 2; ++gy)
      for (int64_t gx = 0; gx < 2; ++gx)
        for (int64_t c = 0; c < 2; ++c)
          for (int64_t py = 0; py < 4; ++py)
            for (int64_t px = 0; px < 4; ++px)
              ASSERT_EQ(p.f32()[(b * 4 + gy * 2 + gx) * 32 + c * 16 + py * 4 + px],
                        static_cast<float>(1000 * b + 100 * c + 10 * (gy * 4 + py) + gx * 4 + px));
}

TEST(VisionEncoder, ParameterNamesAndShards) {
  for (const std::string style : {"gpt2", "llama"}) {
    Fixture f(style);
    std::set<std::string> names;
    for (auto& p : f.store.all()) {
      names.insert(p->name);
      EXPECT_TRUE(p->name.rfind("encoder.", 0) == 0 || p->name.rfind("projector.", 0) == 0) << p->name;
    }
    std::vector<std::string> want = {"encoder.patch_embed.weight",
                                     "encoder.patch_embed.bias",
                                     "encoder.positions.weight",
                                     "encoder.layers.0.attn_norm.weight",
                                     "encoder.layers.0.attn.wq.weight",
                                     "encoder.layers.1.attn.wo.weight",
                                     "encoder.layers.1.mlp_norm.weight",
                                     "encoder.final_norm.weight",
                                     "projector.fc1.weight",
                                     "projector.fc1.bias",
                                     "projector.fc2.weight",
                                     "projector.fc2.bias"};
    if (style == "gpt2")
      want.insert(want.end(), {"encoder.layers.0.mlp.fc.weight", "encoder.final_norm.bias"});
    else
      want.insert(want.end(), {"encoder.layers.0.mlp.w1.weight", "encoder.layers.1.mlp.w3.weight"});
    for (const auto& n : want) EXPECT_TRUE(names.count(n)) << style << " lacks " << n;
    EXPECT_EQ(names.count("encoder.final_norm.bias"), style == "gpt2" ? 1u : 0u);
    EXPECT_EQ(f.store.get("encoder.patch_embed.weight").global_shape, (Shape{16, 32}));
    EXPECT_EQ(f.store.get("encoder.positions.weight").global_shape, (Shape{4, 16}));

    for (int r = 0; r < 2; ++r) {
      testing::FakeTp tp(2, r);
      Fixture s(style, &tp);
      const Param& fc1 = s.store.get("projector.fc1.weight");
      EXPECT_EQ(fc1.global_shape, (Shape{24, 16}));
      EXPECT_EQ(fc1.value.shape(), (Shape{12, 16}));
      EXPECT_EQ(fc1.shard_dim, 0);
      EXPECT_EQ(fc1.shard_offset, 12 * r);
      EXPECT_EQ(s.store.get("projector.fc1.bias").shard_dim, 0);
      const Param& fc2 = s.store.get("projector.fc2.weight");
      EXPECT_EQ(fc2.global_shape, (Shape{kLlmC, 24}));
      EXPECT_EQ(fc2.value.shape(), (Shape{kLlmC, 12}));
      EXPECT_EQ(fc2.shard_dim, 1);
      for (const char* rep : {"projector.fc2.bias", "encoder.patch_embed.weight", "encoder.positions.weight",
                              "encoder.final_norm.weight"})
        EXPECT_TRUE(s.store.get(rep).tp_replicated) << rep;
      EXPECT_EQ(s.store.get("encoder.layers.0.attn.wq.weight").value.size(0), 8);  // 1 of 2 heads
      // Layout-independent init: a shard holds its slice of the one-rank tensor.
      for (auto& p : s.store.all()) {
        const Param& full = f.store.get(p->name);
        for (int64_t i = 0; i < p->numel(); ++i)
          ASSERT_EQ(p->value.f32()[i], full.value.f32()[p->global_index(i)]) << p->name;
      }
    }
  }
}

TEST(VisionEncoder, AttentionIsBidirectionalWithinEachImageOnly) {
  for (const std::string style : {"gpt2", "llama"}) {
    Fixture f(style);
    randomize(f.store, 6);
    std::mt19937 rng(2);
    Tensor images = random_tensor({kB, 2, 8, 8}, rng);
    EncoderActs acts;
    const std::vector<float> before = f.enc.forward(images, acts).to_vector<float>();
    // Change the LAST patch (bottom-right, rows/cols 4..7) of image 1.
    for (int64_t c = 0; c < 2; ++c)
      for (int64_t y = 4; y < 8; ++y)
        for (int64_t x = 4; x < 8; ++x) images.f32()[((1 * 2 + c) * 8 + y) * 8 + x] += 1.0f;
    const std::vector<float> after = f.enc.forward(images, acts).to_vector<float>();
    const int64_t N = f.enc.patches();
    auto row_diff = [&](int64_t row) {
      float d = 0;
      for (int64_t j = 0; j < kLlmC; ++j)
        d = std::max(d, std::abs(after[static_cast<size_t>(row * kLlmC + j)] -
                                 before[static_cast<size_t>(row * kLlmC + j)]));
      return d;
    };
    EXPECT_GT(row_diff(1 * N), 1e-3f) << style << ": image 1's first patch does not see its last patch";
    for (int64_t b : {0, 2})
      for (int64_t n = 0; n < N; ++n) EXPECT_EQ(row_diff(b * N + n), 0.0f) << style << " image " << b;
  }
}

}  // namespace
}  // namespace ndt
