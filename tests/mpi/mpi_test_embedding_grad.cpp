// The gathered embedding gradient (parallel/dp/gathered_embedding_grad.h) on N ranks (run with 2 and 3):
// every replica ends with the table gradient of all replicas' rows of every microbatch, added to what it
// held, with rows of different lengths per replica and microbatch and ids outside this vocabulary shard.
// Values are small integers, so every summation order gives the same floats and the comparisons are exact. No
// ASSERT before a collective.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "dist/communicator.h"
#include "parallel/dp/gathered_embedding_grad.h"

namespace ndt {
namespace {

constexpr int64_t kV = 7, kC = 3, kStart = 2;  // this rank's shard: ids [2, 9)

// Replica r's microbatch j: 5 + 2r + j tokens.
int64_t tokens_of(int r, int j = 0) { return 5 + 2 * r + j; }
// Its ids: some below and above the shard (they add nothing), repeats within and across ranks.
std::vector<int32_t> ids_of(int r, int j = 0) {
  std::vector<int32_t> v;
  for (int64_t t = 0; t < tokens_of(r, j); ++t)
    v.push_back(static_cast<int32_t>((3 * t + r + 5 * j) % (kV + 4)));
  return v;
}
std::vector<float> rows_of(int r, int j = 0) {
  std::vector<float> v;
  for (int64_t t = 0; t < tokens_of(r, j); ++t)
    for (int64_t c = 0; c < kC; ++c) v.push_back(static_cast<float>(1 + r + 2 * t - c - 3 * j));
  return v;
}

// expect (kV, kC) += the table gradient of replica q's microbatch j (the host reference).
void add_rows(std::vector<float>& expect, int q, int j) {
  const std::vector<int32_t> qi = ids_of(q, j);
  const std::vector<float> qx = rows_of(q, j);
  for (int64_t t = 0; t < tokens_of(q, j); ++t) {
    const int64_t row = qi[t] - kStart;
    if (row < 0 || row >= kV) continue;
    for (int64_t c = 0; c < kC; ++c) expect[row * kC + c] += qx[t * kC + c];
  }
}

// This replica's backward of its microbatch j through g.
void backward_of(GatheredEmbeddingGrad& g, Tensor& dtable, int r, int j) {
  const Tensor ids = Tensor::from_vector(ids_of(r, j), {tokens_of(r, j)});
  const Tensor dx = Tensor::from_vector(rows_of(r, j), {tokens_of(r, j), kC});
  g.backward(dtable, dx, ids, kStart);
}

class GatheredEmbeddingGradTest : public ::testing::Test {
 protected:
  void SetUp() override {
    world = make_mpi_world();
    if (world->size() < 2) GTEST_SKIP() << "run this binary with mpirun -np N, N >= 2";
  }
  std::unique_ptr<Communicator> world;
};

TEST_F(GatheredEmbeddingGradTest, EveryReplicaAddsTheGroupsRowsAtFinish) {
  const int P = world->size(), r = world->rank();
  constexpr int kMicrobatches = 2;
  GatheredEmbeddingGrad g(*world);
  g.set_step(tokens_of(P - 1, kMicrobatches - 1), /*per_microbatch=*/true);  // the longest of any replica
  std::vector<float> start(kV * kC);
  for (int64_t i = 0; i < kV * kC; ++i) start[i] = static_cast<float>(i % 5);  // accumulated into (+=)
  Tensor dtable = Tensor::from_vector(start, {kV, kC});
  for (int j = 0; j < kMicrobatches; ++j) backward_of(g, dtable, r, j);
  const std::vector<float> before_finish = dtable.to_vector<float>();
  g.finish();
  std::vector<float> expect = start;
  for (int j = 0; j < kMicrobatches; ++j)
    for (int q = 0; q < P; ++q) add_rows(expect, q, j);
  EXPECT_EQ(before_finish, start);  // backward only gathers
  EXPECT_EQ(dtable.to_vector<float>(), expect);
  g.finish();  // nothing pending: a no-op
  EXPECT_EQ(dtable.to_vector<float>(), expect);
}

// Replicas with different microbatch counts (rank r runs 1 + r): one gather in finish(), of every replica's
// rows back to back, sized by the largest sum.
TEST_F(GatheredEmbeddingGradTest, OneGatherWhenMicrobatchCountsDiffer) {
  const int P = world->size(), r = world->rank();
  auto count = [](int q) { return 1 + q; };
  int64_t largest = 0;
  for (int q = 0; q < P; ++q) {
    int64_t sum = 0;
    for (int j = 0; j < count(q); ++j) sum += tokens_of(q, j);
    largest = std::max(largest, sum);
  }
  GatheredEmbeddingGrad g(*world);
  g.set_step(largest, /*per_microbatch=*/false);
  Tensor dtable = Tensor::zeros({kV, kC});
  for (int j = 0; j < count(r); ++j) backward_of(g, dtable, r, j);
  g.finish();
  std::vector<float> expect(kV * kC, 0.0f);
  for (int q = 0; q < P; ++q)
    for (int j = 0; j < count(q); ++j) add_rows(expect, q, j);
  EXPECT_EQ(dtable.to_vector<float>(), expect);
}

TEST_F(GatheredEmbeddingGradTest, RefusesRowsBeyondTheCapacity) {
  GatheredEmbeddingGrad g(*world);
  g.set_step(tokens_of(0) - 1, true);  // every rank is over: each refuses before any collective
  Tensor dtable = Tensor::zeros({kV, kC});
  EXPECT_THROW(backward_of(g, dtable, world->rank(), 0), Error);
}

TEST(GatherBeatsReduction, ComparesBytes) {
  // The 1B Llama (untied V 32000, C 2048, bf16 rows, 2 microbatches of 4 x 2048 tokens per replica): on 2
  // GPUs 67 MB gathered against a 262 MB all-reduce, but against ZeRO-1's 131 MB reduction to the owners
  // not half; on 4 GPUs 201 MB against 393 MB.
  EXPECT_TRUE(gather_beats_reduction(2, 2, 8192, 32000, 2048, 2, /*zero1=*/false));
  EXPECT_FALSE(gather_beats_reduction(2, 2, 8192, 32000, 2048, 2, /*zero1=*/true));
  EXPECT_FALSE(gather_beats_reduction(4, 2, 8192, 32000, 2048, 2, false));
  EXPECT_TRUE(gather_beats_reduction(4, 1, 8192, 32000, 2048, 2, false));  // one microbatch: 101 MB
  EXPECT_FALSE(gather_beats_reduction(1, 1, 16, 32000, 2048, 2, false));   // one replica: nothing to reduce
}

}  // namespace
}  // namespace ndt
