// NCCL communicator against the MPI one on random (never zero) data: every collective and P2P call in
// every dtype, subgroups and splits, the stream contract (work enqueued on the caller's stream before a
// call is seen by it; async handles), host buffers routed over MPI, agree(). Runs under mpirun with
// one rank per GPU; every test skips when the machine has fewer GPUs than ranks (CI has none). The
// skip decision is the same on every rank, and tests never ASSERT before a collective.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/device.h"
#include "cuda/runtime.h"
#include "dist/communicator.h"
#include "dist/copy_engine_reduction.h"
#include "dist/nccl_communicator.h"
#include "model/params.h"
#include "ops/ops.h"
#include "parallel/dp/gathered_embedding_grad.h"
#include "train/optimizer.h"

namespace ndt {
namespace {

// One NCCL communicator for the whole binary (bootstrap costs ~1 s), destroyed before MPI_Finalize.
struct NcclEnv : ::testing::Environment {
  void TearDown() override {
    nccl.reset();
    mpi.reset();
  }
  std::unique_ptr<Communicator> mpi, nccl;
};
NcclEnv* const g_env = static_cast<NcclEnv*>(::testing::AddGlobalTestEnvironment(new NcclEnv));

uint16_t to_bf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}
float from_bf16(uint16_t h) {
  const uint32_t b = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// Random never-zero values. bf16 holds small integers when `exact_sum` (sums of a few ranks stay exact,
// so NCCL's bf16 reduction can be compared with MPI's f32 one bit for bit).
template <typename T>
std::vector<T> random_vec(int64_t n, uint64_t seed, bool exact_sum = false) {
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<double> u(0.1, 1.0);
  std::uniform_int_distribution<int> sign(0, 1);
  std::vector<T> v(static_cast<size_t>(n));
  for (auto& x : v) {
    const double s = sign(g) ? 1.0 : -1.0;
    if constexpr (std::is_same_v<T, float>) x = static_cast<float>(s * u(g));
    if constexpr (std::is_same_v<T, double>) x = s * u(g);
    if constexpr (std::is_same_v<T, int32_t>) x = static_cast<int32_t>(s * std::ceil(u(g) * 1e6));
    if constexpr (std::is_same_v<T, int64_t>) x = static_cast<int64_t>(s * std::ceil(u(g) * 1e15));
    if constexpr (std::is_same_v<T, uint16_t>)
      x = to_bf16(exact_sum ? static_cast<float>(s * std::ceil(u(g) * 16)) : static_cast<float>(s * u(g)));
  }
  return v;
}

double as_double(float x) { return x; }
double as_double(double x) { return x; }
double as_double(int32_t x) { return static_cast<double>(x); }
double as_double(int64_t x) { return static_cast<double>(x); }
double as_double(uint16_t x) { return from_bf16(x); }

// tol = 0: bit-exact; else relative L2 error ||got - ref|| / ||ref|| <= tol.
template <typename T>
void expect_match(const std::vector<T>& got, const std::vector<T>& ref, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  if (tol == 0) {
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < got.size(); ++i)
      if (std::memcmp(&got[i], &ref[i], sizeof(T)) != 0 && bad++ == 0) first = i;
    EXPECT_EQ(bad, 0u) << what << ": first mismatch at " << first << ": " << as_double(got[first]) << " vs "
                       << as_double(ref[first]);
    return;
  }
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = as_double(got[i]) - as_double(ref[i]);
    num += d * d;
    den += as_double(ref[i]) * as_double(ref[i]);
  }
  EXPECT_LE(std::sqrt(num / den), tol) << what;
}

// Device memory, poisoned (all bytes 0xFF: NaN for floats) so that unwritten elements show.
template <typename T>
struct DevBuf {
  explicit DevBuf(int64_t n) : n(n) {
    NDT_CUDA_CHECK(cudaMalloc(&p, static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(T)));
    NDT_CUDA_CHECK(cudaMemset(p, 0xFF, static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(T)));
  }
  explicit DevBuf(const std::vector<T>& v) : DevBuf(static_cast<int64_t>(v.size())) { upload(v); }
  ~DevBuf() { cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  void upload(const std::vector<T>& v) {
    NDT_CUDA_CHECK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> v(static_cast<size_t>(n));
    NDT_CUDA_CHECK(cudaMemcpy(v.data(), p, v.size() * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
  }
  T* p = nullptr;
  int64_t n;
};

const char* op_name(ReduceOp op) { return op == ReduceOp::Sum ? "sum" : op == ReduceOp::Max ? "max" : "min"; }

class Nccl : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!g_env->mpi) g_env->mpi = make_mpi_world();
    mpi = g_env->mpi.get();
    rank = mpi->rank();
    size = mpi->size();
    const int gpus = cuda::device_count();
    if (gpus < size)
      GTEST_SKIP() << "NCCL tests need one GPU per rank: " << gpus << " GPU(s) for " << size << " rank(s)";
    if (!g_env->nccl) g_env->nccl = make_nccl_communicator(*mpi, rank % gpus);
    nc = g_env->nccl.get();
  }
  uint64_t seed(uint64_t test) const { return test * 1000 + static_cast<uint64_t>(rank); }

  // The copy-engine reductions' checks. Fills `flat` (fp32 on the device) with fresh random values (seed
  // `test`) and returns what a reduction over [lo, hi) must leave there: the host's left-to-right sum of
  // every rank's values in rank order inside, this rank's own values outside.
  std::vector<float> fill_and_rank_order_sums(Tensor& flat, uint64_t test, int64_t lo, int64_t hi) {
    const int64_t total = flat.numel();
    std::vector<float> x = random_vec<float>(total, seed(test));
    NDT_CUDA_CHECK(cudaMemcpy(flat.data_ptr(), x.data(), total * sizeof(float), cudaMemcpyHostToDevice));
    std::vector<float> all(static_cast<size_t>(total) * size), ref = x;
    mpi->all_gather(x.data(), all.data(), total, DType::F32);
    for (int64_t i = lo; i < hi; ++i) {
      float acc = all[i];
      for (int q = 1; q < size; ++q) acc += all[q * total + i];
      ref[i] = acc;
    }
    return ref;
  }
  // Runs `enqueue` (work on cuda::stream() that ends with the stream waiting for it) twice eagerly, then
  // twice replayed from one graph captured from it, each time on fresh values (seeds test, test + 1, then
  // test + 10, test + 11), and compares `flat` bit for bit with the rank-order sums over [lo, hi).
  void expect_rank_order_sums_eager_and_replayed(Tensor& flat, int64_t lo, int64_t hi, uint64_t test,
                                                 const std::function<void()>& enqueue,
                                                 const std::string& what) {
    for (uint64_t step = 0; step < 2; ++step) {
      const std::vector<float> ref = fill_and_rank_order_sums(flat, test + step, lo, hi);
      enqueue();
      NDT_CUDA_CHECK(cudaStreamSynchronize(cuda::stream()));
      expect_match(flat.to(Device::CPU).to_vector<float>(), ref, 0, what + ", eager");
    }
    cudaGraph_t graph = nullptr;
    NDT_CUDA_CHECK(cudaStreamBeginCapture(cuda::stream(), cudaStreamCaptureModeRelaxed));
    enqueue();
    NDT_CUDA_CHECK(cudaStreamEndCapture(cuda::stream(), &graph));
    cudaGraphExec_t exec = nullptr;
    NDT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (uint64_t step = 0; step < 2; ++step) {
      const std::vector<float> ref = fill_and_rank_order_sums(flat, test + 10 + step, lo, hi);
      NDT_CUDA_CHECK(cudaGraphLaunch(exec, cuda::stream()));
      NDT_CUDA_CHECK(cudaStreamSynchronize(cuda::stream()));
      expect_match(flat.to(Device::CPU).to_vector<float>(), ref, 0, what + ", replayed");
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }

  // all_reduce of random data in dtype T: NCCL (device) vs MPI (host). bf16 is compared with MPI's f32
  // reduction of the same values (MPI cannot reduce bf16).
  template <typename T>
  void check_all_reduce(DType dt, ReduceOp op, int64_t n, double tol, uint64_t test) {
    const bool exact_sum = std::is_same_v<T, uint16_t> && op == ReduceOp::Sum;
    std::vector<T> x = random_vec<T>(n, seed(test), exact_sum);
    DevBuf<T> d(x);
    nc->all_reduce(d.p, n, dt, op);
    std::vector<T> ref = x;
    if constexpr (std::is_same_v<T, uint16_t>) {
      std::vector<float> f(x.size());
      for (size_t i = 0; i < x.size(); ++i) f[i] = from_bf16(x[i]);
      mpi->all_reduce(f.data(), n, DType::F32, op);
      for (size_t i = 0; i < x.size(); ++i) ref[i] = to_bf16(f[i]);
    } else {
      mpi->all_reduce(ref.data(), n, dt, op);
    }
    expect_match(d.download(), ref, tol, fmt_what("all_reduce", dt, op, n));
  }

  template <typename T>
  void check_all_gather(DType dt, int64_t n, uint64_t test, bool in_place) {
    std::vector<T> x = random_vec<T>(n, seed(test));
    DevBuf<T> out(n * size);
    if (in_place) {
      NDT_CUDA_CHECK(cudaMemcpy(out.p + rank * n, x.data(), n * sizeof(T), cudaMemcpyHostToDevice));
      nc->all_gather(out.p + rank * n, out.p, n, dt);
    } else {
      DevBuf<T> in(x);
      nc->all_gather(in.p, out.p, n, dt);
    }
    std::vector<T> ref(static_cast<size_t>(n * size));
    mpi->all_gather(x.data(), ref.data(), n, dt);
    expect_match(out.download(), ref, 0,
                 fmt_what(in_place ? "all_gather in place" : "all_gather", dt, ReduceOp::Sum, n));
  }

  // mode 0: separate buffers; 1: NCCL's in-place form (recv = own block of send); 2: recv at the start of
  // send (overlapping but not in place on ranks > 0: the backend copies).
  template <typename T>
  void check_reduce_scatter(DType dt, ReduceOp op, int64_t n, double tol, uint64_t test, int mode) {
    const bool exact_sum = std::is_same_v<T, uint16_t> && op == ReduceOp::Sum;
    std::vector<T> x = random_vec<T>(n * size, seed(test), exact_sum);
    DevBuf<T> in(x), out(n);
    T* recv = mode == 0 ? out.p : mode == 1 ? in.p + rank * n : in.p;
    nc->reduce_scatter(in.p, recv, n, dt, op);
    std::vector<T> got(static_cast<size_t>(n));
    NDT_CUDA_CHECK(cudaMemcpy(got.data(), recv, n * sizeof(T), cudaMemcpyDeviceToHost));
    std::vector<T> ref(static_cast<size_t>(n));
    if constexpr (std::is_same_v<T, uint16_t>) {
      std::vector<float> f(x.size()), r(static_cast<size_t>(n));
      for (size_t i = 0; i < x.size(); ++i) f[i] = from_bf16(x[i]);
      mpi->reduce_scatter(f.data(), r.data(), n, DType::F32, op);
      for (size_t i = 0; i < r.size(); ++i) ref[i] = to_bf16(r[i]);
    } else {
      mpi->reduce_scatter(x.data(), ref.data(), n, dt, op);
    }
    expect_match(got, ref, tol,
                 fmt_what(mode == 0   ? "reduce_scatter"
                          : mode == 1 ? "reduce_scatter in place"
                                      : "reduce_scatter overlapping",
                          dt, op, n));
  }

  static std::string fmt_what(const char* call, DType dt, ReduceOp op, int64_t n) {
    static const char* names[] = {"f32", "bf16", "i32", "i64", "f64"};
    return std::string(call) + " " + names[static_cast<int>(dt)] + " " + op_name(op) +
           " n=" + std::to_string(n);
  }

  Communicator* mpi = nullptr;
  Communicator* nc = nullptr;
  int rank = 0, size = 1;
};

TEST_F(Nccl, BootstrapMatchesMpi) {
  EXPECT_EQ(nc->rank(), rank);
  EXPECT_EQ(nc->size(), size);
  EXPECT_EQ(nc->world_ranks(), mpi->world_ranks());
  NcclCommunicator* n = as_nccl(nc);
  ASSERT_NE(n, nullptr);
  EXPECT_EQ(as_nccl(mpi), nullptr);
  int dev = -1;
  NDT_CUDA_CHECK(cudaGetDevice(&dev));
  EXPECT_EQ(n->device(), dev);
  EXPECT_NE(n->stream(), nullptr);
  EXPECT_EQ(n->host().size(), size);
}

TEST_F(Nccl, AllReduceEveryDtypeAndOp) {
  const int64_t n = 1037;  // odd: no alignment assumptions
  uint64_t t = 1;
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min}) {
    const bool sum = op == ReduceOp::Sum;
    // Float sums may add in another order than MPI: relative L2 tolerances; max/min and integers exact.
    check_all_reduce<float>(DType::F32, op, n, sum ? 1e-6 : 0, t++);
    check_all_reduce<double>(DType::F64, op, n, sum ? 1e-14 : 0, t++);
    check_all_reduce<int32_t>(DType::I32, op, n, 0, t++);
    check_all_reduce<int64_t>(DType::I64, op, n, 0, t++);
    check_all_reduce<uint16_t>(DType::BF16, op, n, 0, t++);
  }
}

TEST_F(Nccl, AllReduceLargeAndBf16Rounding) {
  check_all_reduce<float>(DType::F32, ReduceOp::Sum, (int64_t{1} << 22) + 5, 1e-6, 20);
  // Non-integer bf16: NCCL rounds partial sums to bf16, MPI's f32 reference rounds once.
  check_all_reduce<uint16_t>(DType::BF16, ReduceOp::Sum, 4099, 1e-2, 21);
}

TEST_F(Nccl, AllGatherEveryDtype) {
  const int64_t n = 517;
  check_all_gather<float>(DType::F32, n, 30, false);
  check_all_gather<double>(DType::F64, n, 31, false);
  check_all_gather<int32_t>(DType::I32, n, 32, false);
  check_all_gather<int64_t>(DType::I64, n, 33, false);
  check_all_gather<uint16_t>(DType::BF16, n, 34, false);
  check_all_gather<float>(DType::F32, n, 35, true);
  check_all_gather<uint16_t>(DType::BF16, n, 36, true);
}

TEST_F(Nccl, ReduceScatter) {
  const int64_t n = 301;
  for (int mode : {0, 1, 2}) {
    check_reduce_scatter<float>(DType::F32, ReduceOp::Sum, n, 1e-6, 40 + mode, mode);
    check_reduce_scatter<int64_t>(DType::I64, ReduceOp::Max, n, 0, 43 + mode, mode);
  }
  check_reduce_scatter<uint16_t>(DType::BF16, ReduceOp::Sum, n, 0, 46, 0);
  check_reduce_scatter<double>(DType::F64, ReduceOp::Min, n, 0, 47, 0);
  check_reduce_scatter<int32_t>(DType::I32, ReduceOp::Sum, n, 0, 48, 0);
}

TEST_F(Nccl, BroadcastFromEveryRoot) {
  const int64_t n = 777;
  for (int root = 0; root < size; ++root) {
    std::vector<int64_t> xi = random_vec<int64_t>(n, seed(50 + root));
    std::vector<uint16_t> xb = random_vec<uint16_t>(n, seed(60 + root));
    DevBuf<int64_t> di(xi);
    DevBuf<uint16_t> db(xb);
    nc->broadcast(di.p, n, DType::I64, root);
    nc->broadcast(db.p, n, DType::BF16, root);
    mpi->broadcast(xi.data(), n, DType::I64, root);
    mpi->broadcast(xb.data(), n, DType::BF16, root);
    expect_match(di.download(), xi, 0, "broadcast i64 root " + std::to_string(root));
    expect_match(db.download(), xb, 0, "broadcast bf16 root " + std::to_string(root));
  }
}

TEST_F(Nccl, BlockingSendRecvBetweenPairs) {
  if (size < 2) GTEST_SKIP() << "blocking send/recv needs two ranks (NCCL does not buffer a send to self)";
  const int64_t n = 12345;
  // Pairs (0,1), (2,3), ...: the even rank sends first, then the odd one; tags are ignored by NCCL.
  const int partner = rank ^ 1;
  std::vector<float> mine = random_vec<float>(n, seed(70));
  std::vector<float> ref(static_cast<size_t>(n), 0.0f);
  DevBuf<float> s(mine), r(n);
  if (partner < size) {
    for (int phase = 0; phase < 2; ++phase) {
      const bool sender = (rank % 2) == phase;
      if (sender) {
        nc->send(s.p, n, DType::F32, partner, 7);
        mpi->send(mine.data(), n, DType::F32, partner, 7);
      } else {
        nc->recv(r.p, n, DType::F32, partner, 7);
        mpi->recv(ref.data(), n, DType::F32, partner, 7);
      }
    }
    expect_match(r.download(), ref, 0, "send/recv");
  }
}

TEST_F(Nccl, BatchP2PRing) {
  // Two messages of different dtypes to the next rank and from the previous one (self when one rank).
  const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
  const int64_t n1 = 4099, n2 = 33;
  std::vector<float> a = random_vec<float>(n1, seed(80));
  std::vector<int64_t> b = random_vec<int64_t>(n2, seed(81));
  DevBuf<float> da(a), ra(n1);
  DevBuf<int64_t> db(b), rb(n2);
  nc->batch_p2p({{P2POp::Recv, ra.p, n1, DType::F32, prev},
                 {P2POp::Recv, rb.p, n2, DType::I64, prev},
                 {P2POp::Send, da.p, n1, DType::F32, next},
                 {P2POp::Send, db.p, n2, DType::I64, next}});
  std::vector<float> ref_a(static_cast<size_t>(n1));
  std::vector<int64_t> ref_b(static_cast<size_t>(n2));
  mpi->batch_p2p({{P2POp::Recv, ref_a.data(), n1, DType::F32, prev, 1},
                  {P2POp::Recv, ref_b.data(), n2, DType::I64, prev, 2},
                  {P2POp::Send, a.data(), n1, DType::F32, next, 1},
                  {P2POp::Send, b.data(), n2, DType::I64, next, 2}});
  expect_match(ra.download(), ref_a, 0, "batch_p2p f32");
  expect_match(rb.download(), ref_b, 0, "batch_p2p i64");
}

TEST_F(Nccl, AllToAllV) {
  // Count matrix c[i][j] (i sends to j) from a seed every rank shares; some pairs send nothing.
  std::mt19937 g(90);
  std::uniform_int_distribution<int> cnt(0, 300);
  std::vector<std::vector<int64_t>> c(static_cast<size_t>(size),
                                      std::vector<int64_t>(static_cast<size_t>(size)));
  for (auto& row : c)
    for (auto& v : row) v = cnt(g) < 40 ? 0 : cnt(g);
  const auto r = static_cast<size_t>(rank);
  std::vector<int64_t> sc(static_cast<size_t>(size)), so(sc.size()), rc(sc.size()), ro(sc.size());
  int64_t stot = 0, rtot = 0;
  for (size_t j = 0; j < sc.size(); ++j) {
    // Gaps of 3 elements between blocks: offsets are honored, not assumed contiguous.
    sc[j] = c[r][j];
    so[j] = stot;
    stot += sc[j] + 3;
    rc[j] = c[j][r];
    ro[j] = rtot;
    rtot += rc[j] + 3;
  }
  std::vector<int32_t> x = random_vec<int32_t>(stot, seed(91));
  DevBuf<int32_t> dx(x), dy(rtot);
  nc->all_to_all_v(dx.p, sc, so, dy.p, rc, ro, DType::I32);
  std::vector<int32_t> got = dy.download(), ref(static_cast<size_t>(rtot), 0);
  mpi->all_to_all_v(x.data(), sc, so, ref.data(), rc, ro, DType::I32);
  // Gap elements are never written: compare the received blocks only.
  std::vector<int32_t> g_blocks, r_blocks;
  for (size_t j = 0; j < rc.size(); ++j)
    for (int64_t k = 0; k < rc[j]; ++k) {
      g_blocks.push_back(got[static_cast<size_t>(ro[j] + k)]);
      r_blocks.push_back(ref[static_cast<size_t>(ro[j] + k)]);
    }
  expect_match(g_blocks, r_blocks, 0, "all_to_all_v");
}

TEST_F(Nccl, SplitAndSubgroupMatchMpi) {
  // Split by parity, ordered by descending rank.
  auto ns = nc->split(rank % 2, size - rank);
  auto ms = mpi->split(rank % 2, size - rank);
  ASSERT_TRUE(ns && ms);
  EXPECT_NE(as_nccl(ns.get()), nullptr);
  EXPECT_EQ(ns->rank(), ms->rank());
  EXPECT_EQ(ns->size(), ms->size());
  EXPECT_EQ(ns->world_ranks(), ms->world_ranks());
  std::vector<float> x = random_vec<float>(999, seed(100)), ref = x;
  DevBuf<float> d(x);
  ns->all_reduce(d.p, 999, DType::F32, ReduceOp::Sum);
  ms->all_reduce(ref.data(), 999, DType::F32, ReduceOp::Sum);
  expect_match(d.download(), ref, 1e-6, "all_reduce in a split");
  // A subgroup of a subgroup, members in reverse order; ranks outside get nullptr.
  std::vector<int> members;
  for (int i = ns->size() - 1; i >= 0; i -= 2) members.push_back(i);
  auto nss = ns->subgroup(members);
  auto mss = ms->subgroup(members);
  EXPECT_EQ(nss == nullptr, mss == nullptr);
  if (nss && mss) {
    EXPECT_EQ(nss->world_ranks(), mss->world_ranks());
    std::vector<int64_t> y = random_vec<int64_t>(77, seed(101)), yref = y;
    DevBuf<int64_t> dy(y);
    nss->all_reduce(dy.p, 77, DType::I64, ReduceOp::Max);
    mss->all_reduce(yref.data(), 77, DType::I64, ReduceOp::Max);
    expect_match(dy.download(), yref, 0, "all_reduce in a nested subgroup");
    nss->barrier();
  }
  auto none = nc->split(rank == 0 ? 0 : -1, 0);
  EXPECT_EQ(none != nullptr, rank == 0);
}

TEST_F(Nccl, HostBuffersGoOverMpiAndAgreeWorks) {
  std::vector<double> x = random_vec<double>(64, seed(110)), ref = x;
  nc->all_reduce(x.data(), 64, DType::F64, ReduceOp::Sum);
  mpi->all_reduce(ref.data(), 64, DType::F64, ReduceOp::Sum);
  expect_match(x, ref, 0, "host all_reduce");  // same MPI path: bit-exact
  int64_t tokens = 1000 + rank;
  nc->all_reduce(&tokens, 1, DType::I64, ReduceOp::Sum);
  EXPECT_EQ(tokens, 1000 * size + size * (size - 1) / 2);
  // agree(): the lowest failing rank's message reaches everyone (over MPI: statuses are host data).
  const int bad = size - 1;
  Status st = agree(rank == bad ? Status::error("boom") : Status::ok(), *nc);
  EXPECT_FALSE(st.is_ok());
  EXPECT_EQ(st.message(), size == 1 ? std::string("boom") : "rank " + std::to_string(bad) + ": boom");
  EXPECT_TRUE(agree(Status::ok(), *nc).is_ok());
  nc->barrier();
}

void CUDART_CB sleep_host(void* ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(reinterpret_cast<intptr_t>(ms)));
}

TEST_F(Nccl, StreamContractBlockingAndAsync) {
  NcclCommunicator* n = as_nccl(nc);
  ASSERT_NE(n, nullptr);
  cudaStream_t s;
  NDT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  n->set_compute_stream(s);
  const int64_t cnt = 1 << 20;
  float* pinned = nullptr;
  NDT_CUDA_CHECK(cudaMallocHost(&pinned, cnt * sizeof(float)));
  DevBuf<float> d(cnt);
  for (int round = 0; round < 3; ++round) {
    std::vector<float> x = random_vec<float>(cnt, seed(120 + round)), ref = x;
    std::memcpy(pinned, x.data(), cnt * sizeof(float));
    // The data reaches the buffer only after a 50 ms stall of the compute stream: a collective that did
    // not wait for the caller's stream would reduce the poison/previous contents instead.
    NDT_CUDA_CHECK(cudaLaunchHostFunc(s, sleep_host, reinterpret_cast<void*>(intptr_t{50})));
    NDT_CUDA_CHECK(cudaMemcpyAsync(d.p, pinned, cnt * sizeof(float), cudaMemcpyHostToDevice, s));
    std::vector<float> got(static_cast<size_t>(cnt));
    if (round == 0) {  // blocking: the result is complete when the call returns
      nc->all_reduce(d.p, cnt, DType::F32, ReduceOp::Sum);
      NDT_CUDA_CHECK(cudaMemcpy(got.data(), d.p, cnt * sizeof(float), cudaMemcpyDeviceToHost));
    } else {  // async: the compute stream waits on the handle, the host does not
      auto h = n->all_reduce_async(d.p, cnt, DType::F32, ReduceOp::Sum);
      if (round == 1)
        h->wait();
      else
        h.reset();  // destroyed unwaited: behaves like wait()
      NDT_CUDA_CHECK(cudaMemcpyAsync(pinned, d.p, cnt * sizeof(float), cudaMemcpyDeviceToHost, s));
      NDT_CUDA_CHECK(cudaStreamSynchronize(s));
      std::memcpy(got.data(), pinned, cnt * sizeof(float));
    }
    mpi->all_reduce(ref.data(), cnt, DType::F32, ReduceOp::Sum);
    expect_match(got, ref, 1e-6, "stream contract round " + std::to_string(round));
  }
  // reduce_scatter_async, with synchronize() and done().
  std::vector<float> x = random_vec<float>(cnt, seed(130));
  const int64_t blk = cnt / size;
  DevBuf<float> in(x), out(blk);
  auto h = n->reduce_scatter_async(in.p, out.p, blk, DType::F32, ReduceOp::Sum);
  h->synchronize();
  EXPECT_TRUE(h->done());
  std::vector<float> ref(static_cast<size_t>(blk));
  mpi->reduce_scatter(x.data(), ref.data(), blk, DType::F32, ReduceOp::Sum);
  expect_match(out.download(), ref, 1e-6, "reduce_scatter_async");
  // reduce_async to each root in turn (ZeRO-1's per-owner reduction): the root holds the sum, the others
  // keep their own values.
  for (int root = 0; root < size; ++root) {
    std::vector<float> mine = random_vec<float>(cnt, seed(140 + root));
    DevBuf<float> buf(mine);
    auto hr = n->reduce_async(buf.p, cnt, DType::F32, ReduceOp::Sum, root);
    hr->synchronize();
    std::vector<float> sum = mine;
    mpi->all_reduce(sum.data(), cnt, DType::F32, ReduceOp::Sum);
    expect_match(buf.download(), mpi->rank() == root ? sum : mine, 1e-6,
                 "reduce_async to root " + std::to_string(root));
  }
  EXPECT_THROW(n->reduce_async(in.p, 1, DType::F32, ReduceOp::Sum, size), Error);
  // all_gather_async in place (this rank's block of the output is its input), as ZeRO-1 gathers updated
  // parameters.
  {
    std::vector<float> all =
        random_vec<float>(blk * size, seed(150));  // every rank's copy; only its block counts
    std::vector<float> ref(static_cast<size_t>(blk * size));
    std::vector<float> mine(all.begin() + blk * mpi->rank(), all.begin() + blk * (mpi->rank() + 1));
    mpi->all_gather(mine.data(), ref.data(), blk, DType::F32);
    DevBuf<float> buf(all);
    auto hg = n->all_gather_async(buf.p + blk * mpi->rank(), buf.p, blk, DType::F32);
    hg->synchronize();
    expect_match(buf.download(), ref, 0, "all_gather_async in place");
  }
  n->set_compute_stream(0);
  NDT_CUDA_CHECK(cudaFreeHost(pinned));
  NDT_CUDA_CHECK(cudaStreamDestroy(s));
}

// parallel.dp_grad_window as the trainer runs it: one flat buffer from nccl_device_zeros (zeroed, counted in
// the memory statistics), a symmetric window over it, ranges of it all-reduced asynchronously (sizes that
// take NCCL's small- and large-message symmetric kernels, an odd length, an offset off any alignment), and
// a reduce to one root inside it. Each must equal MPI's sum of the same values.
TEST_F(Nccl, SymmetricWindowReductionsMatchMpi) {
  NcclCommunicator* n = as_nccl(nc);
  ASSERT_NE(n, nullptr);
  const int64_t total = (int64_t{1} << 23) + 777;
  const double before = cuda::memory_stats().peak_allocated_gib;
  Tensor flat = nccl_device_zeros({total}, DType::F32);
  EXPECT_GE(cuda::memory_stats().peak_allocated_gib - before, total * 4.0 / (1 << 30) * 0.999);
  {
    std::vector<float> zeros = flat.to(Device::CPU).to_vector<float>();
    EXPECT_TRUE(std::all_of(zeros.begin(), zeros.end(), [](float v) { return v == 0.f; }));
  }
  std::shared_ptr<void> win = n->register_window(flat.data_ptr(), flat.nbytes());
  ASSERT_NE(win, nullptr);
  const std::vector<std::pair<int64_t, int64_t>> ranges = {
      {0, 1536}, {1536, 1536 + 1001}, {4096, 4096 + (int64_t{1} << 22)}, {(int64_t{1} << 22) + 8192, total}};
  std::vector<float> x = random_vec<float>(total, seed(160));
  NDT_CUDA_CHECK(cudaMemcpy(flat.data_ptr(), x.data(), total * sizeof(float), cudaMemcpyHostToDevice));
  std::vector<std::unique_ptr<CommHandle>> hs;
  for (auto [b, e] : ranges)
    hs.push_back(n->all_reduce_async(flat.f32() + b, e - b, DType::F32, ReduceOp::Sum));
  for (auto& h : hs) h->synchronize();
  std::vector<float> ref = x;
  for (auto [b, e] : ranges) mpi->all_reduce(ref.data() + b, e - b, DType::F32, ReduceOp::Sum);
  expect_match(flat.to(Device::CPU).to_vector<float>(), ref, 1e-6, "all_reduce_async in a symmetric window");
  const int root = size - 1;
  std::vector<float> mine = random_vec<float>(4099, seed(161)), sum = mine;
  NDT_CUDA_CHECK(
      cudaMemcpy(flat.f32() + 3, mine.data(), mine.size() * sizeof(float), cudaMemcpyHostToDevice));
  n->reduce_async(flat.f32() + 3, 4099, DType::F32, ReduceOp::Sum, root)->synchronize();
  mpi->all_reduce(sum.data(), 4099, DType::F32, ReduceOp::Sum);
  std::vector<float> got(mine.size());
  NDT_CUDA_CHECK(cudaMemcpy(got.data(), flat.f32() + 3, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
  expect_match(got, rank == root ? sum : mine, 1e-6, "reduce_async in a symmetric window");
  win.reset();  // deregistered before the memory goes
}

// parallel.dp_reduction = copy_engine as the trainer runs it: a flat buffer from ipc_device_zeros, ranges of
// it (one over several pieces per part, one shorter than the group, aligned ones that add four at a time and
// ones off any alignment)
// reduced asynchronously, twice eagerly and then twice from one captured graph with new values. Every rank
// must hold the host's left-to-right sum in rank order, bit for bit.
TEST_F(Nccl, CopyEngineReductionSumsInRankOrder) {
  const int64_t big = 2 * CopyEngineReduction::kPieceElems + 8, total = big + 8192;
  const double before = cuda::memory_stats().peak_allocated_gib;
  Tensor flat = ipc_device_zeros(total);
  EXPECT_GE(cuda::memory_stats().peak_allocated_gib - before, total * 4.0 / (1 << 30) * 0.999);
  std::string why;
  std::unique_ptr<CopyEngineReduction> ce = CopyEngineReduction::create(*nc, flat, why);
  ASSERT_NE(ce, nullptr) << why;  // (one host, peer access: every rank alike)
  const std::vector<std::pair<int64_t, int64_t>> ranges = {
      {0, 1000},          {1000, 1003}, {1003, 1024}, {1024, big + 1024}, {big + 1024, big + 1031},
      {big + 1031, total}};
  expect_rank_order_sums_eager_and_replayed(
      flat, 0, total, 170,
      [&] {
        std::vector<std::unique_ptr<CommHandle>> hs;
        for (auto [b, e] : ranges) hs.push_back(ce->all_reduce_async(flat.f32() + b, e - b));
        for (auto& h : hs) h->wait();
      },
      "copy-engine all-reduce");
  ce.reset();  // before the memory goes
}

// ZeRO-1's reduction to the owners by copy engines: the flat buffer split into one part per rank, the same
// ranges as above (some inside one part, some across parts). Each rank's own part must hold the host's
// rank-order sum bit for bit and the rest its own values untouched; eagerly and replayed from a graph.
TEST_F(Nccl, CopyEngineReduceToOwnersSumsInRankOrder) {
  const int64_t part = CopyEngineReduction::kPieceElems + 1000, total = part * size;
  Tensor flat = ipc_device_zeros(total);
  std::string why;
  std::unique_ptr<CopyEngineReduction> ce = CopyEngineReduction::create(*nc, flat, why);
  ASSERT_NE(ce, nullptr) << why;
  const int64_t own_b = rank * part, own_e = own_b + part;
  std::vector<std::pair<int64_t, int64_t>> ranges = {{0, 1000}, {1000, 1003}, {1003, part + 17}};
  for (int64_t b = part + 17; b < total; b += part / 3 + 5)
    ranges.emplace_back(b, std::min(total, b + part / 3 + 5));
  expect_rank_order_sums_eager_and_replayed(
      flat, own_b, own_e, 190,
      [&] {
        std::vector<std::unique_ptr<CommHandle>> hs;
        for (auto [b, e] : ranges)
          hs.push_back(ce->reduce_to_owner_async(flat.f32() + b, e - b, own_b, own_e));
        for (auto& h : hs) h->wait();
      },
      "copy-engine reduce to owners");
  ce.reset();  // before the memory goes
}

// DP's gathered embedding gradient over NCCL as the trainer runs it: bf16 rows on the device, ids on the
// host, a vocabulary shard, lengths that differ per rank, frequent ids. Every rank must end with the host sum
// of all ranks' rows (small integers: exact in bf16 and in any fp32 order).
TEST_F(Nccl, GatheredEmbeddingGradAddsEveryRanksRows) {
  const int64_t V = 50, C = 40, start = 10;
  auto tokens_of = [](int q) { return int64_t{300} + 37 * q; };
  auto data_of = [&](int q, std::vector<int32_t>& ids, std::vector<float>& rows) {
    std::mt19937 g(static_cast<uint32_t>(900 + q));
    std::uniform_int_distribution<int> id(0, 69), val(-8, 8), hot(0, 3);
    ids.clear();
    rows.clear();
    for (int64_t t = 0; t < tokens_of(q); ++t) {
      ids.push_back(hot(g) == 0 ? 17 : id(g));  // id 17 on a quarter of the tokens (runs across chunks)
      for (int64_t c = 0; c < C; ++c) rows.push_back(static_cast<float>(val(g)));
    }
  };
  std::vector<int32_t> ids;
  std::vector<float> rows;
  data_of(rank, ids, rows);
  std::vector<float> table(V * C);
  for (int64_t i = 0; i < V * C; ++i) table[i] = static_cast<float>(i % 7);
  Tensor dtable = Tensor::from_vector(table, {V, C}).to(Device::CUDA);
  const Tensor dx_f32 = Tensor::from_vector(rows, {tokens_of(rank), C}).to(Device::CUDA);
  Tensor dx = Tensor::empty({tokens_of(rank), C}, DType::BF16, Device::CUDA);
  ops::cast_into(dx, dx_f32);
  as_nccl(nc)->set_compute_stream(cuda::stream());  // where the ops run (an earlier test may change it)
  GatheredEmbeddingGrad gather(*nc);
  gather.set_step(tokens_of(size - 1), /*per_microbatch=*/true);
  gather.backward(dtable, dx, Tensor::from_vector(ids, {tokens_of(rank)}), start);
  gather.finish();
  std::vector<float> expect = table;
  auto add_rank = [&](int q) {
    data_of(q, ids, rows);
    for (int64_t t = 0; t < tokens_of(q); ++t) {
      const int64_t row = ids[t] - start;
      if (row < 0 || row >= V) continue;
      for (int64_t c = 0; c < C; ++c) expect[row * C + c] += rows[t * C + c];
    }
  };
  for (int q = 0; q < size; ++q) add_rank(q);
  EXPECT_EQ(dtable.to_vector<float>(), expect);
  // Replica r runs 1 + r microbatches (the same rows each time): one gather in finish(), sized by the largest
  // sum; each replica's rows then count 1 + r times.
  int64_t largest = 0;
  for (int q = 0; q < size; ++q) largest = std::max(largest, (1 + q) * tokens_of(q));
  gather.set_step(largest, /*per_microbatch=*/false);
  data_of(rank, ids, rows);
  const Tensor host_ids = Tensor::from_vector(ids, {tokens_of(rank)});
  for (int j = 0; j <= rank; ++j) gather.backward(dtable, dx, host_ids, start);
  gather.finish();
  for (int q = 0; q < size; ++q)
    for (int j = 0; j <= q; ++j) add_rank(q);
  EXPECT_EQ(dtable.to_vector<float>(), expect);
}

// ZeRO-1 with the gathers deferred (the compute copy exchanged in pieces beside the update, the fp32 values
// gathered over a second communicator beside the next step) against the gathers at the end of the step: the
// same bits after three steps, the compute copy the rounding of the values, the values settled through
// with_host_values (the path checkpoints and full_weights take). Both again with the gradients in an NCCL
// window, as the trainer has them: the same bits as in ordinary memory.
TEST_F(Nccl, Zero1DeferredGatherMatchesGatherAtStep) {
  as_nccl(nc)->set_compute_stream(cuda::stream());
  TrainConfig cfg;
  cfg.weight_decay = 0.1;
  struct Result {
    std::vector<float> values;
    std::vector<uint16_t> compute;
  };
  auto run = [&](bool deferred, bool windows) {
    ParamStore ps;
    ps.add("a.weight", {37, 11}, InitKind::Normal, 0.02f, true);
    ps.add("a.bias", {101}, InitKind::Zeros, 0, false);
    ps.add("b.weight", {64, 9}, InitKind::Normal, 0.02f, true);
    ps.add("c.norm", {5}, InitKind::Ones, 0, false);
    ps.init(7);
    ps.flatten(size);
    Tensor grads;
    if (windows) grads = nccl_device_zeros(ps.flat_grads().shape(), DType::F32);
    ps.to_device(Device::CUDA, DType::BF16, grads);
    std::shared_ptr<void> win;
    if (windows) win = as_nccl(nc)->register_window(grads.data_ptr(), grads.nbytes());
    OptimizerComms oc;
    oc.dp = nc;
    oc.zero1 = true;
    oc.defer_zero1_gather = deferred;
    Result res;
    {
      Optimizer opt(ps, cfg, oc);
      const int64_t n = ps.flat_grads().numel();
      for (int step = 0; step < 3; ++step) {
        std::vector<float> g = random_vec<float>(n, 1000 + 10 * step + rank);
        ps.flat_grads().copy_from(Tensor::from_vector(g, {n}).to(Device::CUDA));
        const double norm = opt.reduce_grads();
        opt.clip_grads(norm, 0.5 * norm);  // clipped: the factor rides in the update
        opt.step(1e-2);
        EXPECT_EQ(ps.values_pending(), deferred) << "step " << step << " windows " << windows;
      }
      ps.with_host_values([&] { res.values = ps.flat_values().to_vector<float>(); }, false);
      EXPECT_FALSE(ps.values_pending());
      res.compute = ps.flat_compute().to_vector<uint16_t>();
    }
    return res;
  };
  std::vector<float> plain;
  for (bool windows : {false, true}) {
    const Result at_step = run(false, windows), deferred = run(true, windows);
    if (!windows) plain = at_step.values;
    if (windows && size == 2)  // (two ranks: a + b whatever NCCL's algorithm)
      EXPECT_EQ(at_step.values, plain) << "gradients in a window against ordinary memory";
    ASSERT_EQ(at_step.values.size(), deferred.values.size());
    EXPECT_EQ(deferred.values, at_step.values) << "windows " << windows;
    EXPECT_EQ(deferred.compute, at_step.compute) << "windows " << windows;
    int64_t off = 0;
    for (size_t i = 0; i < deferred.values.size(); ++i)
      off += deferred.compute[i] != to_bf16(deferred.values[i]);
    EXPECT_EQ(off, 0) << "compute copy elements that are not the rounding of their values";
    // Every rank holds the same values: rank 0's, broadcast.
    std::vector<float> first = deferred.values;
    mpi->broadcast(first.data(), static_cast<int64_t>(first.size()), DType::F32, 0);
    EXPECT_EQ(deferred.values, first) << "windows " << windows;
  }
}

}  // namespace
}  // namespace ndt
