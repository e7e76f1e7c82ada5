// Decode attention on the GPU (ops::attention_decode -> cuda::attention_decode) against its CPU twin, the
// general CPU attention with one query row per segment, on a KV-cache layout: slots of max_len rows, each
// filled to a random length (1..max_len), unfilled rows masked by a sentinel position, one slot fully
// masked (out 0, lse -inf), query positions at the slot's length. fp32 and bf16, D 64 and 128, groups of
// 1, 4 and 8 query heads per kv head, and a group of 12 (not taken by the decode kernel: the flash kernel
// serves it). Inputs random and never zero; outputs poisoned with NaN first. Tolerances (relative L2, as
// tests/cuda/test_cuda_attention.cpp): fp32 1e-5 for out and lse; bf16 1e-2 for out (CPU on the rounded
// inputs), 1e-4 for lse.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "cuda/flash_attention.h"
#include "cuda/runtime.h"
#include "gpu_test.h"
#include "ops/ops.h"

namespace ndt {
namespace {

Tensor randt(Shape s, std::mt19937& rng) {
  Tensor t = Tensor::empty(std::move(s));
  std::uniform_real_distribution<float> mag(0.1f, 1.0f);
  std::bernoulli_distribution neg(0.5);
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = neg(rng) ? -mag(rng) : mag(rng);
  return t;
}

using testing::to_device_as;

double rel_l2(const Tensor& a, const Tensor& b, bool skip_inf = false) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double x = a.f32()[i], y = b.f32()[i];
    if (skip_inf && std::isinf(y)) {
      if (!(std::isinf(x) && x < 0)) return INFINITY;
      continue;
    }
    num += (x - y) * (x - y);
    den += y * y;
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

struct Shape4 {
  int64_t H, KV, D;
};

TEST(CudaDecodeAttention, MatchesCpuTwinOnACacheLayout) {
  NDT_REQUIRE_GPU();
  constexpr int32_t kUnseen = std::numeric_limits<int32_t>::max() / 2;
  std::mt19937 rng(11);
  const int64_t nseq = 23, max_len = 300;
  for (DType dt : {DType::F32, DType::BF16})
    for (const Shape4 sh : {Shape4{8, 8, 64}, Shape4{8, 2, 128}, Shape4{16, 2, 64}, Shape4{12, 1, 64}}) {
      SCOPED_TRACE(::testing::Message()
                   << dtype_name(dt) << " H " << sh.H << " KV " << sh.KV << " D " << sh.D);
      const float scale = 1.0f / std::sqrt(static_cast<float>(sh.D));
      std::uniform_int_distribution<int> len_of(1, static_cast<int>(max_len));
      std::vector<int32_t> cu_k, pos_q, pos_k(static_cast<size_t>(nseq * max_len), kUnseen);
      for (int64_t s = 0; s < nseq; ++s) {
        cu_k.push_back(static_cast<int32_t>(s * max_len));
        const int len = s == 3 ? 0 : len_of(rng);  // slot 3: nothing visible
        for (int j = 0; j < len; ++j) pos_k[static_cast<size_t>(s * max_len + j)] = j;
        pos_q.push_back(len > 0 ? len - 1 : 0);
        if (s == 3) pos_k[static_cast<size_t>(s * max_len)] = 5;  // a key beyond the query's position
      }
      cu_k.push_back(static_cast<int32_t>(nseq * max_len));
      Tensor q = randt({nseq, sh.H, sh.D}, rng), k = randt({nseq * max_len, sh.KV, sh.D}, rng),
             v = randt({nseq * max_len, sh.KV, sh.D}, rng);
      const Tensor qd = to_device_as(q, dt), kd = to_device_as(k, dt), vd = to_device_as(v, dt);
      // The CPU sees the values the device holds (bf16-rounded where dt is bf16).
      q = ops::to_host_f32(qd), k = ops::to_host_f32(kd), v = ops::to_host_f32(vd);
      const Tensor cuk = Tensor::from_vector(cu_k, {nseq + 1}), pq = Tensor::from_vector(pos_q, {nseq}),
                   pk = Tensor::from_vector(pos_k, {nseq * max_len});
      Tensor out = Tensor::empty({nseq, sh.H, sh.D}), lse = Tensor::empty({nseq, sh.H});
      ops::attention_decode(out, lse, q, k, v, cuk, pq, pk, scale);
      // splits 0: through ops (the automatic split); 1 and 7 (parts of unequal fill, some empty) directly.
      for (int splits : {0, 1, 7}) {
        SCOPED_TRACE(::testing::Message() << "splits " << splits);
        Tensor outd = to_device_as(Tensor::full({nseq, sh.H, sh.D}, NAN), dt);
        Tensor lsed = Tensor::full({nseq, sh.H}, NAN).to(Device::CUDA);
        const Tensor cukd = cuk.to(Device::CUDA), pqd = pq.to(Device::CUDA), pkd = pk.to(Device::CUDA);
        if (splits == 0) {
          ops::attention_decode(outd, lsed, qd, kd, vd, cukd, pqd, pkd, scale);
        } else if (dt == DType::F32) {
          ASSERT_EQ(sh.H / sh.KV <= 8,
                    cuda::attention_decode<float>(outd.f32(), lsed.f32(), qd.f32(), kd.f32(), vd.f32(),
                                                  cukd.i32(), pqd.i32(), pkd.i32(), nseq, sh.H, sh.KV, sh.D,
                                                  scale, cuda::stream(), splits));
        } else {
          using B = __nv_bfloat16;
          ASSERT_EQ(sh.H / sh.KV <= 8, cuda::attention_decode<B>(static_cast<B*>(outd.data_ptr()), lsed.f32(),
                                                                 static_cast<const B*>(qd.data_ptr()),
                                                                 static_cast<const B*>(kd.data_ptr()),
                                                                 static_cast<const B*>(vd.data_ptr()),
                                                                 cukd.i32(), pqd.i32(), pkd.i32(), nseq, sh.H,
                                                                 sh.KV, sh.D, scale, cuda::stream(), splits));
        }
        if (splits != 0 && sh.H / sh.KV > 8) continue;  // not taken: nothing written
        const Tensor got = ops::to_host_f32(outd), got_lse = lsed.to(Device::CPU);
        EXPECT_LT(rel_l2(got, out), dt == DType::F32 ? 1e-5 : 1e-2);
        EXPECT_LT(rel_l2(got_lse, lse, /*skip_inf=*/true), dt == DType::F32 ? 1e-5 : 1e-4);
        for (int64_t h = 0; h < sh.H; ++h) {  // the fully masked slot
          EXPECT_TRUE(std::isinf(got_lse.f32()[3 * sh.H + h]) && got_lse.f32()[3 * sh.H + h] < 0);
          for (int64_t d = 0; d < sh.D; ++d) EXPECT_EQ(got.f32()[(3 * sh.H + h) * sh.D + d], 0.0f);
        }
      }
    }
}

// ops::scatter_rows (how a forward's K/V rows enter the cache) on the GPU against its host loop, f32 and
// bf16: rows land at scattered distinct positions, everything else untouched.
TEST(CudaDecodeAttention, ScatterRowsMatchesHost) {
  NDT_REQUIRE_GPU();
  std::mt19937 rng(3);
  for (DType dt : {DType::F32, DType::BF16}) {
    Tensor dst = randt({50, 3, 8}, rng), src = randt({7, 3, 8}, rng);
    std::vector<int32_t> rows = {49, 0, 17, 18, 3, 30, 8};
    const Tensor r = Tensor::from_vector(rows, {7});
    Tensor dd = to_device_as(dst, dt), sd = to_device_as(src, dt);
    dst = ops::to_host_f32(dd), src = ops::to_host_f32(sd);
    ops::scatter_rows(dst, r, src);
    ops::scatter_rows(dd, r.to(Device::CUDA), sd);
    const Tensor got = ops::to_host_f32(dd);
    for (int64_t i = 0; i < dst.numel(); ++i)
      ASSERT_EQ(got.f32()[i], dst.f32()[i]) << dtype_name(dt) << " " << i;
  }
}

// ops::decode_advance on the GPU against its host twin: random tokens, positions and rows, exact.
TEST(CudaDecodeAttention, DecodeAdvanceMatchesHost) {
  NDT_REQUIRE_GPU();
  std::mt19937 rng(9);
  const int64_t n = 37, rows_k = 40 * 16;
  std::uniform_int_distribution<int32_t> id(0, 50000), at(0, 14);
  std::vector<int32_t> tok(n), pos(n), sampled(n), rows(n), pos_q(n), pos_k(rows_k);
  for (int64_t s = 0; s < n; ++s) {
    const int32_t p = at(rng);
    tok[s] = id(rng), sampled[s] = id(rng), pos[s] = p, pos_q[s] = p;
    rows[s] = static_cast<int32_t>(s * 16 + p);
  }
  for (auto& p : pos_k) p = id(rng);
  std::vector<Tensor> host = {Tensor::from_vector(tok, {n}),     Tensor::from_vector(pos, {n}),
                              Tensor::from_vector(sampled, {n}), Tensor::from_vector(rows, {n}),
                              Tensor::from_vector(pos_q, {n}),   Tensor::from_vector(pos_k, {rows_k})};
  std::vector<Tensor> dev;
  for (const Tensor& t : host) dev.push_back(t.to(Device::CUDA));
  ops::decode_advance(host[0], host[1], host[2], host[3], host[4], host[5]);
  ops::decode_advance(dev[0], dev[1], dev[2], dev[3], dev[4], dev[5]);
  for (size_t i = 0; i < host.size(); ++i)
    EXPECT_EQ(dev[i].to(Device::CPU).to_vector<int32_t>(), host[i].to_vector<int32_t>()) << "tensor " << i;
  EXPECT_EQ(host[0].to_vector<int32_t>(), sampled);
}

// Timing (run with --gtest_also_run_disabled_tests; prints, asserts nothing): nseq sequences of 32 query
// heads on 8 kv heads of 64, a max_len-row cache per sequence, bf16, at several filled lengths, by number
// of key splits; bandwidth counts the visible K and V rows once.
void decode_timing(int64_t nseq, int64_t max_len, const std::vector<int64_t>& lens) {
  constexpr int32_t kUnseen = std::numeric_limits<int32_t>::max() / 2;
  const int64_t H = 32, KV = 8, D = 64;
  std::mt19937 rng(5);
  using B = __nv_bfloat16;
  const Tensor q = to_device_as(randt({nseq, H, D}, rng), DType::BF16);
  const Tensor k = to_device_as(randt({nseq * max_len, KV, D}, rng), DType::BF16);
  const Tensor v = to_device_as(randt({nseq * max_len, KV, D}, rng), DType::BF16);
  Tensor out = Tensor::empty({nseq, H, D}, DType::BF16, Device::CUDA);
  Tensor lse = Tensor::empty({nseq, H}, DType::F32, Device::CUDA);
  for (int64_t len : lens) {
    std::vector<int32_t> cu_k, pos_q, pos_k(static_cast<size_t>(nseq * max_len), kUnseen);
    for (int64_t s = 0; s < nseq; ++s) {
      cu_k.push_back(static_cast<int32_t>(s * max_len));
      for (int64_t j = 0; j < len; ++j) pos_k[static_cast<size_t>(s * max_len + j)] = static_cast<int32_t>(j);
      pos_q.push_back(static_cast<int32_t>(len - 1));
    }
    cu_k.push_back(static_cast<int32_t>(nseq * max_len));
    const Tensor cuk = Tensor::from_vector(cu_k, {nseq + 1}).to(Device::CUDA);
    const Tensor pq = Tensor::from_vector(pos_q, {nseq}).to(Device::CUDA);
    const Tensor pk = Tensor::from_vector(pos_k, {nseq * max_len}).to(Device::CUDA);
    const double bytes = 2.0 * nseq * len * KV * D * sizeof(B);
    for (int splits : {1, 2, 3, 4, 6, 8, 0}) {
      const double ms = testing::time_ms(
          [&] {
            cuda::attention_decode<B>(
                static_cast<B*>(out.data_ptr()), lse.f32(), static_cast<const B*>(q.data_ptr()),
                static_cast<const B*>(k.data_ptr()), static_cast<const B*>(v.data_ptr()), cuk.i32(), pq.i32(),
                pk.i32(), nseq, H, KV, D, 0.125f, cuda::stream(), splits, nseq * max_len);
          },
          50, cuda::stream());
      std::printf("[time] decode attention nseq %2lld len %4lld splits %d%s: %7.2f us, %6.0f GB/s\n",
                  static_cast<long long>(nseq), static_cast<long long>(len),
                  splits == 0 ? cuda::decode_splits(nseq, KV, nseq * max_len) : splits,
                  splits == 0 ? " (auto)" : "", 1e3 * ms, bytes / (ms * 1e-3) / 1e9);
    }
  }
}

TEST(CudaDecodeAttention, DISABLED_Timing) {
  NDT_REQUIRE_GPU();
  decode_timing(64, 288, {32, 96, 160, 224, 288});  // the decode benchmark's batch
  decode_timing(4, 4096, {512, 2048, 4096});        // a few long sequences: few blocks
}
}  // namespace
}  // namespace ndt
