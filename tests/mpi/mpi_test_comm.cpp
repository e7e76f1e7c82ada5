// Communicator tests on N ranks (run with 3 and 4). Data depends on the rank and the index, so a
// block landing in the wrong place or a missing contribution shows up. Tests never ASSERT before a
// collective (a rank leaving early would hang the others).
#include <gtest/gtest.h>
#include <mpi.h>

#include <numeric>

#include "dist/communicator.h"
#include "dist/mpi_testing.h"

namespace ndt {
namespace {

class Comm : public ::testing::Test {
 protected:
  void SetUp() override {
    world = make_mpi_world();
    rank = world->rank();
    size = world->size();
    // Run as a singleton (no mpirun) only the SelfComm tests mean something.
    if (size < 2) GTEST_SKIP() << "run this binary with mpirun -np N, N >= 2";
  }
  std::unique_ptr<Communicator> world;
  int rank = 0, size = 1;
};

// Lowers the MPI chunk limit for one scope, so that tiny buffers take the chunked code paths.
struct ChunkLimit {
  explicit ChunkLimit(int64_t n) { set_mpi_max_chunk_for_testing(n); }
  ~ChunkLimit() { set_mpi_max_chunk_for_testing(0); }
};

TEST_F(Comm, RankSizeAndWorldRanks) {
  int r = -1, s = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  MPI_Comm_size(MPI_COMM_WORLD, &s);
  EXPECT_EQ(rank, r);
  EXPECT_EQ(size, s);
  std::vector<int> expect(static_cast<size_t>(size));
  std::iota(expect.begin(), expect.end(), 0);
  EXPECT_EQ(world->world_ranks(), expect);
}

void check_all_reduce_f32(Communicator& world, int rank, int size, int64_t n) {
  std::vector<float> sum(n), mx(n), mn(n);
  for (int64_t i = 0; i < n; ++i) {
    sum[i] = static_cast<float>(rank * 100 + i);
    mx[i] = mn[i] = static_cast<float>((rank * 7 + i) % size) - 0.5f * static_cast<float>(rank);
  }
  world.all_reduce(sum.data(), n, DType::F32, ReduceOp::Sum);
  world.all_reduce(mx.data(), n, DType::F32, ReduceOp::Max);
  world.all_reduce(mn.data(), n, DType::F32, ReduceOp::Min);
  for (int64_t i = 0; i < n; ++i) {
    float es = 0, emax = -1e30f, emin = 1e30f;
    for (int r = 0; r < size; ++r) {
      es += static_cast<float>(r * 100 + i);
      const float v = static_cast<float>((r * 7 + i) % size) - 0.5f * static_cast<float>(r);
      emax = std::max(emax, v);
      emin = std::min(emin, v);
    }
    EXPECT_EQ(sum[i], es) << "i=" << i;
    EXPECT_EQ(mx[i], emax) << "i=" << i;
    EXPECT_EQ(mn[i], emin) << "i=" << i;
  }
}

TEST_F(Comm, AllReduceF32SumMaxMin) { check_all_reduce_f32(*world, rank, size, 37); }

TEST_F(Comm, AllReduceIntegersAndDouble) {
  std::vector<int32_t> a(11);
  std::vector<int64_t> b(11);
  std::vector<double> c(11);
  for (int i = 0; i < 11; ++i) {
    a[i] = (rank + 1) * (i - 5);
    b[i] = (int64_t{rank + 1} << 35) + i;  // beyond 32 bits: catches a narrowing dtype
    c[i] = 0.25 * rank + i;
  }
  world->all_reduce(a.data(), 11, DType::I32, ReduceOp::Sum);
  world->all_reduce(b.data(), 11, DType::I64, ReduceOp::Max);
  world->all_reduce(c.data(), 11, DType::F64, ReduceOp::Sum);
  const int tri = size * (size + 1) / 2;
  for (int i = 0; i < 11; ++i) {
    EXPECT_EQ(a[i], tri * (i - 5));
    EXPECT_EQ(b[i], (int64_t{size} << 35) + i);
    EXPECT_DOUBLE_EQ(c[i], 0.25 * size * (size - 1) / 2 + size * i);
  }
}

TEST_F(Comm, TensorConvenience) {
  Tensor t = Tensor::full({2, 3}, static_cast<float>(rank));
  world->all_reduce(t);
  for (float v : t.to_vector<float>()) EXPECT_EQ(v, size * (size - 1) / 2.0f);
}

TEST_F(Comm, Bf16ReductionIsRejected) {
  std::vector<uint16_t> w(4, 0x3f80);
  EXPECT_THROW(world->all_reduce(w.data(), 4, DType::BF16, ReduceOp::Sum), Error);
  EXPECT_THROW(world->all_reduce(w.data(), 4, DType::BF16, ReduceOp::Max), Error);
}

TEST_F(Comm, Bf16MovesAsRawWords) {
  std::vector<uint16_t> w(3, static_cast<uint16_t>(rank == 1 ? 0xbf80 : 0));
  world->broadcast(w.data(), 3, DType::BF16, 1);
  for (uint16_t v : w) EXPECT_EQ(v, 0xbf80);
}

void check_all_gather(Communicator& world, int rank, int size, int64_t count, bool in_place) {
  std::vector<int32_t> send(count), recv(static_cast<size_t>(size * count), -1);
  for (int64_t j = 0; j < count; ++j) send[j] = rank * 1000 + static_cast<int32_t>(j);
  if (in_place) {
    std::copy(send.begin(), send.end(), recv.begin() + rank * count);
    world.all_gather(recv.data() + rank * count, recv.data(), count, DType::I32);
  } else {
    world.all_gather(send.data(), recv.data(), count, DType::I32);
  }
  for (int i = 0; i < size; ++i)
    for (int64_t j = 0; j < count; ++j) EXPECT_EQ(recv[i * count + j], i * 1000 + j) << "block " << i;
}

TEST_F(Comm, AllGather) { check_all_gather(*world, rank, size, 5, false); }
TEST_F(Comm, AllGatherInPlace) { check_all_gather(*world, rank, size, 5, true); }

void check_reduce_scatter(Communicator& world, int rank, int size, int64_t count) {
  const auto f = [](int r, int64_t k) { return static_cast<float>(r * 3 + k * (r % 2 ? -1 : 1)); };
  std::vector<float> send(static_cast<size_t>(size * count)), sum(count), mx(count);
  for (int64_t k = 0; k < size * count; ++k) send[k] = f(rank, k);
  world.reduce_scatter(send.data(), sum.data(), count, DType::F32, ReduceOp::Sum);
  world.reduce_scatter(send.data(), mx.data(), count, DType::F32, ReduceOp::Max);
  for (int64_t j = 0; j < count; ++j) {
    const int64_t k = rank * count + j;
    float es = 0, em = -1e30f;
    for (int r = 0; r < size; ++r) es += f(r, k), em = std::max(em, f(r, k));
    EXPECT_EQ(sum[j], es) << "j=" << j;
    EXPECT_EQ(mx[j], em) << "j=" << j;
  }
}

TEST_F(Comm, ReduceScatter) { check_reduce_scatter(*world, rank, size, 6); }

TEST_F(Comm, ReduceScatterAliasedBuffers) {
  // recv inside send (a ZeRO-style "reduce my shard in place"): the backend must not alias MPI buffers.
  const int64_t count = 4;
  std::vector<int64_t> buf(static_cast<size_t>(size * count));
  for (int64_t k = 0; k < size * count; ++k) buf[k] = (rank + 1) * 10 + k;
  world->reduce_scatter(buf.data(), buf.data() + rank * count, count, DType::I64, ReduceOp::Sum);
  for (int64_t j = 0; j < count; ++j)
    EXPECT_EQ(buf[rank * count + j], 10 * size * (size + 1) / 2 + size * (rank * count + j));
}

TEST_F(Comm, BroadcastFromNonZeroRoots) {
  for (int root : {size - 1, 1}) {
    std::vector<int64_t> v(9);
    for (int i = 0; i < 9; ++i) v[i] = rank == root ? root * 100 + i : -1;
    world->broadcast(v.data(), 9, DType::I64, root);
    for (int i = 0; i < 9; ++i) EXPECT_EQ(v[i], root * 100 + i) << "root " << root;
  }
}

TEST_F(Comm, SendRecvEcho) {
  // Rank 0 sends to the last rank, which echoes the data back doubled (two tags in flight).
  const int last = size - 1;
  std::vector<float> v(8);
  if (rank == 0) {
    for (int i = 0; i < 8; ++i) v[i] = 1.5f * i;
    world->send(v.data(), 8, DType::F32, last, 7);
    world->recv(v.data(), 8, DType::F32, last, 8);
    for (int i = 0; i < 8; ++i) EXPECT_EQ(v[i], 3.0f * i);
  } else if (rank == last) {
    world->recv(v.data(), 8, DType::F32, 0, 7);
    for (float& x : v) x *= 2;
    world->send(v.data(), 8, DType::F32, 0, 8);
  }
  world->barrier();
}

void check_ring(Communicator& world, int rank, int size, int64_t n) {
  // Every rank sends to both neighbours before receiving: with blocking sends of messages above the
  // eager limit this ordering deadlocks; batch_p2p must post everything first.
  const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
  std::vector<float> to_next(n), to_prev(n), from_prev(n, -1), from_next(n, -1);
  for (int64_t i = 0; i < n; ++i) {
    to_next[i] = static_cast<float>(rank * 10 + i % 1000);
    to_prev[i] = -static_cast<float>(rank * 10 + i % 1000);
  }
  world.batch_p2p({{P2POp::Send, to_next.data(), n, DType::F32, next, 1},
                   {P2POp::Send, to_prev.data(), n, DType::F32, prev, 2},
                   {P2POp::Recv, from_prev.data(), n, DType::F32, prev, 1},
                   {P2POp::Recv, from_next.data(), n, DType::F32, next, 2}});
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_EQ(from_prev[i], static_cast<float>(prev * 10 + i % 1000)) << "i=" << i;
    EXPECT_EQ(from_next[i], -static_cast<float>(next * 10 + i % 1000)) << "i=" << i;
    if (from_prev[i] != static_cast<float>(prev * 10 + i % 1000)) break;
  }
}

TEST_F(Comm, BatchP2PRing) { check_ring(*world, rank, size, 1 << 17); }  // 512 KiB per message

void check_all_to_all_v(Communicator& world, int rank, int size) {
  // Rank r sends (r + q) % 3 elements to rank q (zero for some pairs), with a gap of one element
  // between blocks on both sides so that offsets are really used.
  auto cnt = [](int from, int to) { return static_cast<int64_t>((from + to) % 3); };
  std::vector<int64_t> sc(size), so(size), rc(size), ro(size);
  int64_t s_total = 0, r_total = 0;
  for (int q = 0; q < size; ++q) {
    sc[q] = cnt(rank, q), so[q] = s_total, s_total += sc[q] + 1;
    rc[q] = cnt(q, rank), ro[q] = r_total, r_total += rc[q] + 1;
  }
  std::vector<int32_t> send(s_total, -7), recv(r_total, -9);
  for (int q = 0; q < size; ++q)
    for (int64_t j = 0; j < sc[q]; ++j) send[so[q] + j] = rank * 1000 + q * 100 + static_cast<int32_t>(j);
  world.all_to_all_v(send.data(), sc, so, recv.data(), rc, ro, DType::I32);
  for (int q = 0; q < size; ++q) {
    for (int64_t j = 0; j < rc[q]; ++j) EXPECT_EQ(recv[ro[q] + j], q * 1000 + rank * 100 + j) << "from " << q;
    EXPECT_EQ(recv[ro[q] + rc[q]], -9) << "gap after block from " << q << " was written";
  }
}

TEST_F(Comm, AllToAllV) { check_all_to_all_v(*world, rank, size); }

TEST_F(Comm, ChunkedPathsMatch) {
  // With at most 3 elements per MPI call every operation above is split into several calls (the
  // strided all_gather, per-owner reductions for reduce_scatter); the results must not change.
  ChunkLimit limit(3);
  check_all_reduce_f32(*world, rank, size, 11);
  check_all_gather(*world, rank, size, 7, false);
  check_all_gather(*world, rank, size, 7, true);
  check_reduce_scatter(*world, rank, size, 8);
  check_ring(*world, rank, size, 10);
  std::vector<int64_t> v(10, rank == 1 ? 42 : 0);
  world->broadcast(v.data(), 10, DType::I64, 1);
  for (int64_t x : v) EXPECT_EQ(x, 42);
}

TEST_F(Comm, SubgroupMembersAndOutsiders) {
  // Members in a non-sorted order: the new rank is the position in the list.
  const std::vector<int> members = {size - 1, 0};
  std::unique_ptr<Communicator> g = world->subgroup(members);
  const bool inside = rank == 0 || rank == size - 1;
  EXPECT_EQ(g != nullptr, inside);
  if (g) {
    EXPECT_EQ(g->size(), 2);
    EXPECT_EQ(g->rank(), rank == 0 ? 1 : 0);
    EXPECT_EQ(g->world_ranks(), members);
    int32_t wr = rank;
    g->all_reduce(&wr, 1, DType::I32, ReduceOp::Sum);
    EXPECT_EQ(wr, size - 1);
    // A subgroup of a subgroup: world ranks still refer to MPI_COMM_WORLD.
    std::unique_ptr<Communicator> h = g->subgroup({1});
    EXPECT_EQ(h != nullptr, rank == 0);
    if (h) EXPECT_EQ(h->world_ranks(), std::vector<int>{0});
  }
}

TEST_F(Comm, SplitByColorOrderedByKey) {
  std::unique_ptr<Communicator> g = world->split(rank % 2, -rank);  // keys reverse the order
  ASSERT_NE(g, nullptr);
  std::vector<int> expect;
  for (int r = size - 1; r >= 0; --r)
    if (r % 2 == rank % 2) expect.push_back(r);
  EXPECT_EQ(g->world_ranks(), expect);
  EXPECT_EQ(g->world_ranks()[static_cast<size_t>(g->rank())], rank);
  std::unique_ptr<Communicator> none = world->split(rank == 0 ? -1 : 0, 0);
  EXPECT_EQ(none == nullptr, rank == 0);
}

// Forwards everything but split(), so that the generic Communicator::split (built on subgroup) runs.
class NoNativeSplit final : public Communicator {
 public:
  explicit NoNativeSplit(Communicator& c) : c_(c) {}
  int rank() const override { return c_.rank(); }
  int size() const override { return c_.size(); }
  const std::vector<int>& world_ranks() const override { return c_.world_ranks(); }
  void all_reduce(void* b, int64_t n, DType dt, ReduceOp op) override { c_.all_reduce(b, n, dt, op); }
  void all_gather(const void* s, void* r, int64_t n, DType dt) override { c_.all_gather(s, r, n, dt); }
  void reduce_scatter(const void* s, void* r, int64_t n, DType dt, ReduceOp op) override {
    c_.reduce_scatter(s, r, n, dt, op);
  }
  void broadcast(void* b, int64_t n, DType dt, int root) override { c_.broadcast(b, n, dt, root); }
  void send(const void* b, int64_t n, DType dt, int p, int t) override { c_.send(b, n, dt, p, t); }
  void recv(void* b, int64_t n, DType dt, int p, int t) override { c_.recv(b, n, dt, p, t); }
  void batch_p2p(const std::vector<P2POp>& ops) override { c_.batch_p2p(ops); }
  void all_to_all_v(const void* s, const std::vector<int64_t>& sc, const std::vector<int64_t>& so, void* r,
                    const std::vector<int64_t>& rc, const std::vector<int64_t>& ro, DType dt) override {
    c_.all_to_all_v(s, sc, so, r, rc, ro, dt);
  }
  void barrier() override { c_.barrier(); }
  std::unique_ptr<Communicator> subgroup(const std::vector<int>& m) override { return c_.subgroup(m); }

 private:
  Communicator& c_;
};

TEST_F(Comm, GenericSplitMatchesNative) {
  NoNativeSplit wrapped(*world);
  // Three colors (one of them possibly empty), rank 1 opts out, keys reverse the order.
  const int color = rank == 1 ? -1 : rank % 3;
  std::unique_ptr<Communicator> g = wrapped.split(color, -rank);
  std::unique_ptr<Communicator> n = world->split(color, -rank);
  EXPECT_EQ(g == nullptr, rank == 1);
  EXPECT_EQ(n == nullptr, rank == 1);
  if (g && n) EXPECT_EQ(g->world_ranks(), n->world_ranks());
}

TEST_F(Comm, AgreeAllOk) {
  Status s = agree(Status::ok(), *world);
  EXPECT_TRUE(s.is_ok());
}

TEST_F(Comm, AgreeReportsLowestFailingRank) {
  if (size < 3) GTEST_SKIP() << "needs 3 ranks";
  Status local = rank == 2 ? Status::error("config: bad value for lr") : Status::ok();
  Status s = agree(local, *world);
  EXPECT_FALSE(s.is_ok());
  EXPECT_EQ(s.message(), "rank 2: config: bad value for lr");

  // Ranks 1 and 2 both fail, with messages of different lengths: rank 1 wins everywhere.
  local = rank == 1   ? Status::error("short")
          : rank == 2 ? Status::error("a much longer message")
                      : Status::ok();
  s = agree(local, *world);
  EXPECT_EQ(s.message(), "rank 1: short");
}

TEST_F(Comm, PeerOutOfRangeThrows) {
  float x = 0;
  EXPECT_THROW(world->send(&x, 1, DType::F32, size, 0), Error);
  EXPECT_THROW(world->broadcast(&x, 1, DType::F32, -1), Error);
}

// The one-rank communicator (no MPI underneath) used by single-process runs.
TEST(SelfComm, CollectivesAreCopies) {
  auto c = make_self_communicator();
  EXPECT_EQ(c->rank(), 0);
  EXPECT_EQ(c->size(), 1);
  std::vector<float> a = {1, 2, 3}, b(3);
  c->all_reduce(a.data(), 3, DType::F32, ReduceOp::Sum);
  EXPECT_EQ(a, (std::vector<float>{1, 2, 3}));
  c->all_gather(a.data(), b.data(), 3, DType::F32);
  EXPECT_EQ(b, a);
  std::fill(b.begin(), b.end(), 0.f);
  c->reduce_scatter(a.data(), b.data(), 3, DType::F32, ReduceOp::Max);
  EXPECT_EQ(b, a);
  std::fill(b.begin(), b.end(), 0.f);
  c->all_to_all_v(a.data(), {2}, {1}, b.data(), {2}, {0}, DType::F32);
  EXPECT_EQ(b, (std::vector<float>{2, 3, 0}));
  EXPECT_THROW(c->send(a.data(), 3, DType::F32, 0), Error);
  EXPECT_THROW(c->broadcast(a.data(), 3, DType::F32, 1), Error);
  EXPECT_TRUE(agree(Status::ok(), *c).is_ok());
  EXPECT_EQ(agree(Status::error("x"), *c).message(), "x");
}

TEST(SelfComm, BatchP2PToSelfCopiesByTag) {
  auto c = make_self_communicator();
  std::vector<int32_t> s1 = {1, 2}, s2 = {3, 4}, r1(2), r2(2);
  // Receives posted before sends, tags crossed: matching is by tag, not by position.
  c->batch_p2p({{P2POp::Recv, r2.data(), 2, DType::I32, 0, 2},
                {P2POp::Recv, r1.data(), 2, DType::I32, 0, 1},
                {P2POp::Send, s1.data(), 2, DType::I32, 0, 1},
                {P2POp::Send, s2.data(), 2, DType::I32, 0, 2}});
  EXPECT_EQ(r1, s1);
  EXPECT_EQ(r2, s2);
  EXPECT_THROW(c->batch_p2p({{P2POp::Send, s1.data(), 2, DType::I32, 0, 1}}), Error);
  EXPECT_THROW(c->batch_p2p({{P2POp::Send, s1.data(), 2, DType::I32, 0, 1},
                             {P2POp::Recv, r1.data(), 1, DType::I32, 0, 1}}),
               Error);
}

}  // namespace
}  // namespace ndt
