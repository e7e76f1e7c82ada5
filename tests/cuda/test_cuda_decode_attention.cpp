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
      Tensor outd = to_device_as(Tensor::full({nseq, sh.H, sh.D}, NAN), dt);
      Tensor lsed = Tensor::full({nseq, sh.H}, NAN).to(Device::CUDA);
      ops::attention_decode(outd, lsed, qd, kd, vd, cuk.to(Device::CUDA), pq.to(Device::CUDA),
                            pk.to(Device::CUDA), scale);
      const Tensor got = ops::to_host_f32(outd), got_lse = lsed.to(Device::CPU);
      EXPECT_LT(rel_l2(got, out), dt == DType::F32 ? 1e-5 : 1e-2);
      EXPECT_LT(rel_l2(got_lse, lse, /*skip_inf=*/true), dt == DType::F32 ? 1e-5 : 1e-4);
      for (int64_t h = 0; h < sh.H; ++h) {  // the fully masked slot
        EXPECT_TRUE(std::isinf(got_lse.f32()[3 * sh.H + h]) && got_lse.f32()[3 * sh.H + h] < 0);
        for (int64_t d = 0; d < sh.D; ++d) EXPECT_EQ(got.f32()[(3 * sh.H + h) * sh.D + d], 0.0f);
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

}  // namespace
}  // namespace ndt
