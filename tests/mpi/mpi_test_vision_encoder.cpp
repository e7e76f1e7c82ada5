// The vision encoder + projector with tp = 2 (CommTpHooks over the world, no sequence parallelism)
// computes what one rank computes: the same outputs (relative 1e-5) and, after gathering each sharded
// gradient through its shard_dim/shard_offset, the same gradients (relative 1e-5 of each tensor's largest
// element), with the same weights.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>

#include "../tiny_model.h"
#include "dist/communicator.h"
#include "model/vision_encoder.h"
#include "parallel/tp/comm_tp_hooks.h"

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

float max_abs(const std::vector<float>& v) {
  float m = 0;
  for (float x : v) m = std::max(m, std::abs(x));
  return m;
}

// The full gradient of p: its own tensor when replicated, else the shards of all ranks placed at their
// offsets along shard_dim.
std::vector<float> gathered_grad(const Param& p, Communicator& world) {
  const int64_t n = p.numel();
  if (p.shard_dim < 0) return p.grad.to_vector<float>();
  std::vector<float> all(static_cast<size_t>(n * world.size()));
  world.all_gather(p.grad.f32(), all.data(), n, DType::F32);
  std::vector<int64_t> offsets(static_cast<size_t>(world.size()));
  const int64_t mine = p.shard_offset;
  world.all_gather(&mine, offsets.data(), 1, DType::I64);
  std::vector<float> full(static_cast<size_t>(shape_numel(p.global_shape)), std::nanf(""));
  for (int r = 0; r < world.size(); ++r)
    for (int64_t i = 0; i < n; ++i)
      full[static_cast<size_t>(slice_to_global_index(p.value.shape(), p.global_shape, p.shard_dim,
                                                     offsets[static_cast<size_t>(r)], i))] =
          all[static_cast<size_t>(r * n + i)];
  return full;
}

void tp_matches_one_rank(const std::string& style) {
  auto world = make_mpi_world();
  ASSERT_EQ(world->size(), 2);
  const EncoderConfig cfg = tiny_encoder(style);
  std::mt19937 rng(13);
  const Tensor images = random_tensor({kB, 2, 8, 8}, rng);
  const Tensor R = random_tensor({kB * cfg.patches(), kLlmC}, rng);

  // Reference: one rank, initialized from the seed, then every value perturbed (norms and biases included,
  // so that a bias counted on both ranks or a missing reduction cannot hide behind zeros).
  ParamStore ref_store;
  VisionEncoder ref(cfg, kLlmC, 1e-5, 0.3, nullptr, ref_store);
  ref_store.init(7);
  std::mt19937 prng(5);
  std::normal_distribution<float> d(0.0f, 0.1f);
  for (auto& p : ref_store.all())
    for (int64_t i = 0; i < p->numel(); ++i) p->value.f32()[i] += d(prng);
  ref_store.zero_grad();
  EncoderActs ref_acts;
  const std::vector<float> want = ref.forward(images, ref_acts).to_vector<float>();
  ref.backward(R, ref_acts);

  CommTpHooks tp(*world, /*sequence_parallel=*/false);
  ParamStore store;
  VisionEncoder enc(cfg, kLlmC, 1e-5, 0.3, &tp, store);
  std::map<std::string, const Tensor*> full;
  for (auto& p : ref_store.all()) full[p->name] = &p->value;
  copy_global_slices(store, full, "reference weights");
  ASSERT_EQ(store.all().size(), ref_store.all().size());
  store.zero_grad();
  EncoderActs acts;
  const std::vector<float> got = enc.forward(images, acts).to_vector<float>();
  enc.backward(R, acts);

  // Every collective first: a rank that fails an ASSERT must not leave the other waiting in a gather.
  std::vector<std::vector<float>> grads;
  for (auto& p : store.all()) grads.push_back(gathered_grad(*p, *world));

  ASSERT_EQ(got.size(), want.size());
  const float out_scale = max_abs(want);
  ASSERT_GT(out_scale, 0.0f);
  for (size_t i = 0; i < want.size(); ++i)
    ASSERT_NEAR(got[i], want[i], 1e-5f * out_scale) << style << " output element " << i;
  int sharded = 0;
  for (size_t k = 0; k < store.all().size(); ++k) {
    const Param& p = *store.all()[k];
    const std::vector<float>& g = grads[k];
    const std::vector<float> w = ref_store.get(p.name).grad.to_vector<float>();
    ASSERT_EQ(g.size(), w.size()) << p.name;
    const float scale = max_abs(w);
    EXPECT_GT(scale, 0.0f) << p.name << " has no gradient";
    for (size_t i = 0; i < w.size(); ++i)
      ASSERT_NEAR(g[i], w[i], 1e-5f * scale) << style << " " << p.name << " element " << i;
    sharded += p.shard_dim >= 0;
  }
  // Projector fc1 weight + bias, fc2 weight, and per layer q, k, v, o and the MLP matrices are split.
  EXPECT_GE(sharded, 3 + 2 * 6);
}

TEST(VisionEncoderTp, Gpt2Tp2MatchesOneRank) { tp_matches_one_rank("gpt2"); }
TEST(VisionEncoderTp, LlamaTp2MatchesOneRank) { tp_matches_one_rank("llama"); }

}  // namespace
}  // namespace ndt
