// The overlapped TP hooks (parallel/tp/comm_tp_hooks.h) against the plain collectives, on N ranks (run
// with 2, 3 and 4): the ring gather hands out every row block once, each only after its rows have
// arrived, and the ring reduce-scatter sums every rank's partial rows. Values are small integers, so
// every summation order gives the same floats and the comparisons are exact. Tests never ASSERT
// before a collective (a rank leaving early would hang the others).
#include <gtest/gtest.h>

#include <vector>

#include "dist/communicator.h"
#include "parallel/tp/comm_tp_hooks.h"

namespace ndt {
namespace {

constexpr int64_t kRows = 3, kCols = 5;  // rows per rank

class TpHooksTest : public ::testing::TestWithParam<bool> {  // sequence parallel?
 protected:
  void SetUp() override {
    world = make_mpi_world();
    if (world->size() < 2) GTEST_SKIP() << "run this binary with mpirun -np N, N >= 2";
  }
  // Rank r's (kRows, kCols) block: distinct per rank, row and column.
  Tensor local_block(int r) const {
    std::vector<float> v(kRows * kCols);
    for (int64_t i = 0; i < kRows * kCols; ++i) v[i] = static_cast<float>(100 * r + i);
    return Tensor::from_vector(v, {kRows, kCols});
  }
  std::unique_ptr<Communicator> world;
};

TEST_P(TpHooksTest, GatherHandsOutEachArrivedBlockOnce) {
  const bool sp = GetParam();
  const int P = world->size();
  CommTpHooks overlapped(*world, sp, /*overlap=*/true), plain(*world, sp, /*overlap=*/false);
  const Tensor x = local_block(world->rank());
  const Tensor expect = plain.enter_forward(x);
  std::vector<int> seen(static_cast<size_t>(expect.size(0)), 0);
  std::vector<float> snapshot(static_cast<size_t>(expect.numel()), -1.0f);
  const Tensor full = overlapped.gather_overlapped(x, [&](const Tensor& f, int64_t first, int64_t count) {
    const float* p = f.f32();
    for (int64_t t = first; t < first + count; ++t) {
      ++seen[static_cast<size_t>(t)];
      for (int64_t c = 0; c < kCols; ++c) snapshot[t * kCols + c] = p[t * kCols + c];  // as handed out
    }
  });
  EXPECT_EQ(full.size(0), sp ? P * kRows : kRows);
  EXPECT_EQ(full.to_vector<float>(), expect.to_vector<float>());
  EXPECT_EQ(snapshot, expect.to_vector<float>());
  for (size_t t = 0; t < seen.size(); ++t) EXPECT_EQ(seen[t], 1) << "row " << t;
}

TEST_P(TpHooksTest, ReduceSumsEveryRanksRowsOnce) {
  const bool sp = GetParam();
  const int P = world->size(), r = world->rank();
  CommTpHooks overlapped(*world, sp, /*overlap=*/true), plain(*world, sp, /*overlap=*/false);
  const int64_t T = sp ? P * kRows : kRows;
  // Rank r's partial sum for row t, column c.
  auto value = [&](int64_t t, int64_t c) { return static_cast<float>((r + 1) * (t * kCols + c) + 7 * r); };
  std::vector<float> whole(static_cast<size_t>(T * kCols));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < kCols; ++c) whole[t * kCols + c] = value(t, c);
  const Tensor expect = plain.exit_forward(Tensor::from_vector(whole, {T, kCols}));
  Tensor partial = Tensor::empty({T, kCols});
  std::vector<int> produced(static_cast<size_t>(T), 0);
  int meanwhile_calls = 0;
  const Tensor got = overlapped.reduce_overlapped(
      partial,
      [&](int64_t first, int64_t count, Tensor& rows) {
        EXPECT_EQ(rows.size(0), count);
        float* p = rows.f32();
        for (int64_t t = first; t < first + count; ++t) {
          ++produced[static_cast<size_t>(t)];
          for (int64_t c = 0; c < kCols; ++c) p[(t - first) * kCols + c] = value(t, c);
        }
      },
      [&] { ++meanwhile_calls; });
  EXPECT_EQ(got.size(0), sp ? kRows : T);
  EXPECT_EQ(got.to_vector<float>(), expect.to_vector<float>());
  for (size_t t = 0; t < produced.size(); ++t) EXPECT_EQ(produced[t], 1) << "row " << t;
  EXPECT_EQ(meanwhile_calls, 1);
}

INSTANTIATE_TEST_SUITE_P(SequenceParallel, TpHooksTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "sp" : "no_sp"; });

}  // namespace
}  // namespace ndt
