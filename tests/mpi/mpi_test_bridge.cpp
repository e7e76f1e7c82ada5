// The bridge's exchange on 4 ranks: forward delivers every LLM shard's rows from the encoder shards, and
// backward is its adjoint: <forward(x), y> summed over the LLM shards equals <x, backward(y)> summed over
// the encoder shards, for fan-in, fan-out and encoder TP (replicated encoder outputs: one copy counted).
#include <gtest/gtest.h>

#include "dist/communicator.h"
#include "parallel/bridge/bridge.h"

namespace ndt {
namespace {

constexpr int64_t kRows = 3, kC = 2, kBatch = 8;

float value_of(int64_t sample, int64_t row, int64_t c) {
  return static_cast<float>(sample * 100 + row * 10 + c);
}

BridgeMap map_for(Communicator& w, int64_t etp, int64_t edp, int64_t ldp) {
  BridgeMap m;
  m.batch = kBatch;
  m.enc_tp = etp;
  m.enc_dp = edp;
  m.llm_dp = ldp;
  for (int r = 0; r < w.size(); ++r) {
    m.enc_tp_of.push_back(r % etp);
    m.enc_dp_of.push_back(r / etp);
    m.llm_dp_of.push_back(r % ldp);  // LLM dp innermost: a different order from the encoder's
  }
  return m;
}

void run_case(int64_t etp, int64_t edp, int64_t ldp) {
  auto world = make_mpi_world();
  ASSERT_EQ(world->size(), 4);
  const BridgeMap m = map_for(*world, etp, edp, ldp);
  Bridge bridge(m, *world, nullptr);
  const int me = world->rank();
  const auto [ef, ec] = m.enc_block(me);
  const auto [lf, lc] = m.llm_block(me);
  std::vector<float> enc;
  for (int64_t j = ef; j < ef + ec; ++j)
    for (int64_t i = 0; i < kRows; ++i)
      for (int64_t c = 0; c < kC; ++c) enc.push_back(value_of(j, i, c));
  const Tensor out = bridge.forward(Tensor::from_vector(enc, {ec * kRows, kC}), kRows);
  ASSERT_EQ(out.size(0), lc * kRows);
  for (int64_t j = lf; j < lf + lc; ++j)
    for (int64_t i = 0; i < kRows; ++i)
      for (int64_t c = 0; c < kC; ++c)
        ASSERT_EQ(out.f32()[((j - lf) * kRows + i) * kC + c], value_of(j, i, c)) << "sample " << j;
  // Backward: each LLM rank's gradient of sample j is g_j (complete: no replica partials here); every
  // encoder rank of sample j must get exactly g_j (not a sum over the LLM ranks that used it).
  std::vector<float> g;
  for (int64_t j = lf; j < lf + lc; ++j)
    for (int64_t i = 0; i < kRows * kC; ++i) g.push_back(static_cast<float>(j) + 0.5f);
  Tensor gt = Tensor::from_vector(g, {lc * kRows, kC});
  const Tensor back = bridge.backward(gt, kRows);
  ASSERT_EQ(back.size(0), ec * kRows);
  for (int64_t j = ef; j < ef + ec; ++j)
    for (int64_t i = 0; i < kRows * kC; ++i)
      ASSERT_EQ(back.f32()[(j - ef) * kRows * kC + i], static_cast<float>(j) + 0.5f);
}

TEST(MpiBridge, Equal) { run_case(1, 4, 4); }
TEST(MpiBridge, FanIn) { run_case(1, 4, 2); }
TEST(MpiBridge, FanInToOneReplica) { run_case(1, 4, 1); }
TEST(MpiBridge, FanOut) { run_case(2, 2, 4); }
TEST(MpiBridge, EncoderTp4) { run_case(4, 1, 2); }

// With a replica group the LLM gradient pieces are summed before routing: two ranks of one replica each
// hold half of every row's gradient.
TEST(MpiBridge, ReplicaPartialsAreSummed) {
  auto world = make_mpi_world();
  const BridgeMap m = map_for(*world, 1, 4, 2);  // LLM replicas {0, 2} and {1, 3}
  auto replica = world->split(static_cast<int>(m.llm_dp_of[world->rank()]), world->rank());
  Bridge bridge(m, *world, replica.get());
  const auto [ef, ec] = m.enc_block(world->rank());
  const auto [lf, lc] = m.llm_block(world->rank());
  std::vector<float> g;
  for (int64_t j = lf; j < lf + lc; ++j)
    for (int64_t i = 0; i < kRows * kC; ++i) g.push_back((static_cast<float>(j) + 0.5f) / 2);
  Tensor gt = Tensor::from_vector(g, {lc * kRows, kC});
  const Tensor back = bridge.backward(gt, kRows);
  for (int64_t j = ef; j < ef + ec; ++j)
    for (int64_t i = 0; i < kRows * kC; ++i)
      ASSERT_EQ(back.f32()[(j - ef) * kRows * kC + i], static_cast<float>(j) + 0.5f);
  // Without the sum each encoder rank would get half its gradient.
  Tensor gt2 = Tensor::from_vector(g, {lc * kRows, kC});
  const Tensor half = bridge.backward_unreduced(gt2, kRows);
  EXPECT_EQ(half.f32()[0], (static_cast<float>(ef) + 0.5f) / 2);
}

}  // namespace
}  // namespace ndt
