// cuDNN's fused attention (src/cuda/cudnn_attention.h) against the CPU twin (ndt::cpu::attention_*,
// plain causal form) on random bf16 inputs: equal-length sequences, MHA and GQA, D = 64 and 128, sequence
// lengths that are and are not multiples of 64. Outputs are NaN-poisoned first (every element must be
// written; backward overwrites). Backward is fed the GPU's own out and lse on both sides.
// Tolerances (relative L2 error, as for the built-in kernel in test_cuda_attention.cpp): 1e-2 for out,
// dq, dk, dv (bf16 inputs, P and dS rounded to bf16 for the tensor cores); 1e-4 for lse (fp32).
// Then the Tensor-level dispatch (ops::attention_forward/backward with accumulate = false) against the
// built-in kernel on the same inputs, and the dispatch's fall-back for unequal segments.
// Skips without a GPU, or when cuDNN cannot be loaded (cudnn_attention_status() says why).
// CudnnAttentionBench.DISABLED_* prints timings of both kernels (device runs only).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/cudnn_attention.h"
#include "cuda/flash_attention.h"
#include "gpu_test.h"
#include "ops/cpu_ops.h"
#include "ops/ops.h"
#include "parallel/cp/cp_shard.h"

namespace {

using bf16 = __nv_bfloat16;
using Vec = std::vector<float>;

#define NDT_REQUIRE_CUDNN()                                                                         \
  do {                                                                                              \
    NDT_REQUIRE_GPU();                                                                              \
    if (!ndt::cuda::cudnn_attention_enabled()) GTEST_SKIP() << ndt::cuda::cudnn_attention_status(); \
  } while (0)

Vec randv(size_t n, uint32_t seed, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-hi, hi);
  Vec v(n);
  for (auto& x : v) x = u(rng);
  return v;
}
Vec rounded(const Vec& v) {
  Vec r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = __bfloat162float(__float2bfloat16_rn(v[i]));
  return r;
}

template <typename E>
struct Dev {
  E* p = nullptr;
  size_t n;
  explicit Dev(size_t n_) : n(n_) {
    NDT_CUDA_CHECK(cudaMalloc(&p, sizeof(E) * n));
    NDT_CUDA_CHECK(cudaMemset(p, 0xFF, sizeof(E) * n));  // NaN poison
  }
  explicit Dev(const Vec& v) : Dev(v.size()) {
    std::vector<E> h(v.size());
    for (size_t i = 0; i < v.size(); ++i) h[i] = static_cast<E>(v[i]);
    NDT_CUDA_CHECK(cudaMemcpy(p, h.data(), sizeof(E) * n, cudaMemcpyHostToDevice));
  }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  Vec get() const {
    NDT_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<E> h(n);
    NDT_CUDA_CHECK(cudaMemcpy(h.data(), p, sizeof(E) * n, cudaMemcpyDeviceToHost));
    Vec v(n);
    for (size_t i = 0; i < n; ++i) v[i] = static_cast<float>(h[i]);
    return v;
  }
};

// A CUDA tensor's values as host floats.
Vec host_f32(const ndt::Tensor& t) {
  if (t.dtype() == ndt::DType::F32) return t.to_vector<float>();
  ndt::Tensor f = ndt::Tensor::empty(t.shape(), ndt::DType::F32, ndt::Device::CUDA);
  ndt::ops::cast_into(f, t);
  return f.to_vector<float>();
}

double rel_l2(const Vec& out, const Vec& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(out[i])) return INFINITY;
    num += (out[i] - ref[i]) * (out[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

void expect_close(const std::string& what, const Vec& out, const Vec& ref, double tol) {
  const double e = rel_l2(out, ref);
  std::printf("[err] %-44s %.3e (tol %.0e)\n", what.c_str(), e, tol);
  EXPECT_LE(e, tol) << what;
}

// Returns false when cuDNN refused the shape (allowed only where `must` is false).
bool check_shape(int64_t B, int64_t S, int64_t H, int64_t KV, int64_t D, uint32_t seed, bool must) {
  const int64_t T = B * S;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const std::string tag = "B" + std::to_string(B) + " S" + std::to_string(S) + " H" + std::to_string(H) +
                          "/KV" + std::to_string(KV) + " D" + std::to_string(D);
  const Vec q = rounded(randv(T * H * D, seed, 3.0f)), k = rounded(randv(T * KV * D, seed + 1));
  const Vec v = rounded(randv(T * KV * D, seed + 2)), dout = rounded(randv(T * H * D, seed + 3));
  Dev<bf16> dq_(q), dk_(k), dv_(v), ddout(dout), dout_(T * H * D), gq(T * H * D), gk(T * KV * D),
      gv(T * KV * D);
  Dev<float> dlse(T * H);
  std::vector<int32_t> cu(B + 1);
  for (int64_t b = 0; b <= B; ++b) cu[b] = static_cast<int32_t>(b * S);

  const bool fwd = ndt::cuda::cudnn_attention_forward(dout_.p, dlse.p, dq_.p, dk_.p, dv_.p, B, S, H, KV, D,
                                                      scale, nullptr);
  if (!fwd) {
    EXPECT_FALSE(must) << tag << ": cuDNN refused a shape it must take";
    return false;
  }
  Vec ref_out(T * H * D), ref_lse(T * H);
  ndt::cpu::attention_forward(ref_out.data(), ref_lse.data(), q.data(), k.data(), v.data(), cu.data(), B, T,
                              H, KV, D, scale);
  const Vec out = dout_.get(), lse = dlse.get();
  expect_close(tag + " out", out, ref_out, 1e-2);
  expect_close(tag + " lse", lse, ref_lse, 1e-4);

  Vec rq(T * H * D, 0.f), rk(T * KV * D, 0.f), rv(T * KV * D, 0.f);
  ndt::cpu::attention_backward(rq.data(), rk.data(), rv.data(), dout.data(), q.data(), k.data(), v.data(),
                               out.data(), lse.data(), cu.data(), B, T, H, KV, D, scale);
  const bool bwd = ndt::cuda::cudnn_attention_backward(gq.p, gk.p, gv.p, ddout.p, dq_.p, dk_.p, dv_.p,
                                                       dout_.p, dlse.p, B, S, H, KV, D, scale, nullptr);
  if (!bwd) {
    EXPECT_FALSE(must) << tag << ": cuDNN refused the backward of a shape it must take";
    return false;
  }
  expect_close(tag + " dq", gq.get(), rq, 1e-2);
  expect_close(tag + " dk", gk.get(), rk, 1e-2);
  expect_close(tag + " dv", gv.get(), rv, 1e-2);
  return true;
}

TEST(CudnnAttention, MatchesCpuTwin) {
  NDT_REQUIRE_CUDNN();
  std::printf("%s\n", ndt::cuda::cudnn_attention_status().c_str());
  uint32_t seed = 1;
  check_shape(4, 256, 4, 4, 64, seed++, true);
  check_shape(2, 512, 8, 2, 128, seed++, true);    // GQA
  check_shape(3, 128, 6, 1, 64, seed++, true);     // MQA
  check_shape(2, 1024, 12, 12, 64, seed++, true);  // GPT-2 124M heads
  check_shape(3, 200, 4, 2, 64, seed++, false);    // not a multiple of 64: used only if right
}

// The block form (cudnn_attention_*_blocks) on context parallelism's ring steps, against the CPU's general
// form with the chunks' global positions (cp = 2, two sequences of 4 chunks of c rows): rank r's local rows
// are chunks r and 3 - r of each sequence, owner o's keys chunks o and 3 - o. Step o == r is causal over the
// local rows; o < r: every query row sees the owner's first chunk whole; o > r: the second chunk's queries
// see all of the owner's keys, the first chunk's none (the CPU gives them lse -inf).
TEST(CudnnAttention, RingBlocksMatchCpuGeneralForm) {
  NDT_REQUIRE_CUDNN();
  const int64_t cp = 2, nseq = 2, c = 128, H = 4, KV = 2, D = 64, T = nseq * 2 * c;
  const float scale = 0.125f;
  const ndt::Tensor local_cu = ndt::Tensor::from_vector(std::vector<int32_t>{0, 2 * c, 4 * c}, {nseq + 1});
  uint32_t seed = 40;
  for (int64_t r = 0; r < cp; ++r)
    for (int64_t o = 0; o < cp; ++o) {
      const std::string tag = "ring r" + std::to_string(r) + " o" + std::to_string(o);
      const std::vector<int32_t> pq = ndt::cp_positions(local_cu, cp, r),
                                 pk = ndt::cp_positions(local_cu, cp, o);
      const Vec q = rounded(randv(T * H * D, seed++, 2.f)), k = rounded(randv(T * KV * D, seed++));
      const Vec v = rounded(randv(T * KV * D, seed++)), dout = rounded(randv(T * H * D, seed++));
      ndt::cuda::AttentionBlocks b{nseq, 2 * c, 2 * c, 2 * c, 2 * c, true};
      int64_t q_off = 0;
      if (o < r) b = {nseq, 2 * c, c, 2 * c, 2 * c, false};
      if (o > r) b = {nseq, c, 2 * c, 2 * c, 2 * c, false}, q_off = c;
      Dev<bf16> gq_(q), gk_(k), gv_(v), gdout(dout), gout(T * H * D), dq(T * H * D), dk(T * KV * D),
          dv(T * KV * D);
      Dev<float> glse(T * H);
      ASSERT_TRUE(ndt::cuda::cudnn_attention_forward_blocks(gout.p + q_off * H * D, glse.p + q_off * H,
                                                            gq_.p + q_off * H * D, gk_.p, gv_.p, b, H, KV, D,
                                                            scale, nullptr))
          << tag;
      Vec ref_out(T * H * D), ref_lse(T * H);
      const std::vector<int32_t> cu = {0, static_cast<int32_t>(2 * c), static_cast<int32_t>(4 * c)};
      ndt::cpu::attention_forward(ref_out.data(), ref_lse.data(), q.data(), k.data(), v.data(), cu.data(),
                                  cu.data(), pq.data(), pk.data(), nseq, T, T, H, KV, D, scale);
      // The rows the block covers (the rest stay NaN-poisoned on the GPU and see no key on the CPU).
      Vec out = gout.get(), lse = glse.get(), cov_out, ref_cov_out, cov_lse, ref_cov_lse;
      for (int64_t t = 0; t < T; ++t) {
        const bool covered = (t % (2 * c)) >= q_off && (t % (2 * c)) < q_off + b.Sq;
        for (int64_t h = 0; h < H; ++h) {
          if (!covered) {
            EXPECT_EQ(ref_lse[t * H + h], -INFINITY) << tag << " row " << t;
            lse[t * H + h] = -INFINITY;
            for (int64_t d = 0; d < D; ++d) out[(t * H + h) * D + d] = 0.f;
            continue;
          }
          cov_lse.push_back(lse[t * H + h]), ref_cov_lse.push_back(ref_lse[t * H + h]);
          for (int64_t d = 0; d < D; ++d)
            cov_out.push_back(out[(t * H + h) * D + d]), ref_cov_out.push_back(ref_out[(t * H + h) * D + d]);
        }
      }
      expect_close(tag + " out", cov_out, ref_cov_out, 1e-2);
      expect_close(tag + " lse", cov_lse, ref_cov_lse, 1e-4);
      // Backward from the GPU's out and lse on both sides (uncovered rows: out 0, lse -inf, no key).
      Vec rq(T * H * D, 0.f), rk(T * KV * D, 0.f), rv(T * KV * D, 0.f);
      ndt::cpu::attention_backward(rq.data(), rk.data(), rv.data(), dout.data(), q.data(), k.data(), v.data(),
                                   out.data(), lse.data(), cu.data(), cu.data(), pq.data(), pk.data(), nseq,
                                   T, T, H, KV, D, scale);
      // (rows outside the blocks are not written: 0 like the CPU's)
      NDT_CUDA_CHECK(cudaMemset(dq.p, 0, sizeof(bf16) * T * H * D));
      NDT_CUDA_CHECK(cudaMemset(dk.p, 0, sizeof(bf16) * T * KV * D));
      NDT_CUDA_CHECK(cudaMemset(dv.p, 0, sizeof(bf16) * T * KV * D));
      ASSERT_TRUE(ndt::cuda::cudnn_attention_backward_blocks(
          dq.p + q_off * H * D, dk.p, dv.p, gdout.p + q_off * H * D, gq_.p + q_off * H * D, gk_.p, gv_.p,
          gout.p + q_off * H * D, glse.p + q_off * H, b, H, KV, D, scale, nullptr))
          << tag;
      expect_close(tag + " dq", dq.get(), rq, 1e-2);
      expect_close(tag + " dk", dk.get(), rk, 1e-2);
      expect_close(tag + " dv", dv.get(), rv, 1e-2);
    }
}

// Tensor level: ops::attention_* take cuDNN for equal-length segments and agree with the built-in
// kernel; unequal segments fall back to it.
TEST(CudnnAttention, OpsDispatchAgreesWithBuiltInKernel) {
  NDT_REQUIRE_CUDNN();
  using ndt::DType;
  using ndt::Tensor;
  const int64_t H = 4, KV = 2, D = 64;
  for (const std::vector<int32_t>& cu_v : {std::vector<int32_t>{0, 256, 512, 768}, {0, 100, 512, 768}}) {
    const int64_t T = cu_v.back(), nseq = static_cast<int64_t>(cu_v.size()) - 1;
    auto dev = [&](const Vec& x, ndt::Shape s) {
      return ndt::testing::to_device_as(Tensor::from_vector(x, s), DType::BF16);
    };
    Tensor q = dev(randv(T * H * D, 11, 2.f), {T, H, D}), k = dev(randv(T * KV * D, 12), {T, KV, D});
    Tensor v = dev(randv(T * KV * D, 13), {T, KV, D}), dout = dev(randv(T * H * D, 14), {T, H, D});
    Tensor cu = Tensor::from_vector(cu_v, {nseq + 1});
    Vec res[2][5];
    for (int use_cudnn : {0, 1}) {
      ndt::cuda::set_cudnn_attention_enabled(use_cudnn == 1);
      Tensor out = Tensor::empty({T, H, D}, DType::BF16, ndt::Device::CUDA);
      Tensor lse = Tensor::empty({T, H}, DType::F32, ndt::Device::CUDA);
      ndt::ops::attention_forward(out, lse, q, k, v, cu, 0.125f);
      Tensor dq = Tensor::empty(q.shape(), DType::BF16, ndt::Device::CUDA);
      Tensor dk = Tensor::empty(k.shape(), DType::BF16, ndt::Device::CUDA);
      Tensor dv = Tensor::empty(v.shape(), DType::BF16, ndt::Device::CUDA);
      ndt::ops::attention_backward(dq, dk, dv, dout, q, k, v, out, lse, cu, 0.125f, /*accumulate=*/false);
      int i = 0;
      for (const Tensor* t : {&out, &lse, &dq, &dk, &dv}) res[use_cudnn][i++] = host_f32(*t);
    }
    ndt::cuda::set_cudnn_attention_enabled(true);
    const char* names[] = {"out", "lse", "dq", "dk", "dv"};
    for (int i = 0; i < 5; ++i)
      expect_close(std::string("dispatch ") + (cu_v[1] == 256 ? "equal " : "unequal ") + names[i], res[1][i],
                   res[0][i], i == 1 ? 1e-4 : 1e-2);
  }
}

// The backward written straight into the column blocks of a fused [dq | dk | dv] gradient (strided cuDNN
// outputs) against the separate tensors merged after, with cuDNN and with the built-in kernel.
TEST(CudnnAttention, BackwardIntoFusedQkv) {
  NDT_REQUIRE_CUDNN();
  using ndt::DType;
  using ndt::Tensor;
  for (auto [H, KV] : {std::pair<int64_t, int64_t>{4, 2}, {12, 12}}) {
    const int64_t D = 64, S = 256, B = 3, T = B * S, W = (H + 2 * KV) * D;
    auto dev = [&](const Vec& x, ndt::Shape s) {
      return ndt::testing::to_device_as(Tensor::from_vector(x, s), DType::BF16);
    };
    Tensor q = dev(randv(T * H * D, 21, 2.f), {T, H, D}), k = dev(randv(T * KV * D, 22), {T, KV, D});
    Tensor v = dev(randv(T * KV * D, 23), {T, KV, D}), dout = dev(randv(T * H * D, 24), {T, H, D});
    Tensor cu = Tensor::from_vector(std::vector<int32_t>{0, 256, 512, 768}, {B + 1});
    Tensor out = Tensor::empty({T, H, D}, DType::BF16, ndt::Device::CUDA);
    Tensor lse = Tensor::empty({T, H}, DType::F32, ndt::Device::CUDA);
    ndt::ops::attention_forward(out, lse, q, k, v, cu, 0.125f);
    Tensor fused = Tensor::empty({T, W}, DType::BF16, ndt::Device::CUDA);
    ndt::ops::attention_backward_qkv(fused, dout, q, k, v, out, lse, cu, 0.125f);
    const Vec got = host_f32(fused);
    for (int use_cudnn : {1, 0}) {
      ndt::cuda::set_cudnn_attention_enabled(use_cudnn == 1);
      Tensor dq = Tensor::empty(q.shape(), DType::BF16, ndt::Device::CUDA);
      Tensor dk = Tensor::empty(k.shape(), DType::BF16, ndt::Device::CUDA);
      Tensor dv = Tensor::empty(v.shape(), DType::BF16, ndt::Device::CUDA);
      ndt::ops::attention_backward(dq, dk, dv, dout, q, k, v, out, lse, cu, 0.125f, /*accumulate=*/false);
      Tensor ref = Tensor::empty({T, W}, DType::BF16, ndt::Device::CUDA);
      ndt::ops::qkv_merge(ref, dq, dk, dv);
      expect_close("fused [dq | dk | dv] H" + std::to_string(H) + "/KV" + std::to_string(KV) + " vs " +
                       (use_cudnn ? "cuDNN, merged" : "built-in, merged"),
                   got, host_f32(ref), use_cudnn ? 1e-3 : 1e-2);
    }
    ndt::cuda::set_cudnn_attention_enabled(true);
  }
}

// ---- timings (device runs only: --gtest_also_run_disabled_tests --gtest_filter='CudnnAttentionBench*') ----
using ndt::testing::time_ms;

void bench(int64_t B, int64_t S, int64_t H, int64_t KV, int64_t D) {
  const int64_t T = B * S;
  Dev<bf16> q(randv(T * H * D, 1)), k(randv(T * KV * D, 2)), v(randv(T * KV * D, 3)),
      dout(randv(T * H * D, 4));
  Dev<bf16> out(T * H * D), dq(T * H * D), dk(T * KV * D), dv(T * KV * D);
  Dev<float> lse(T * H);
  std::vector<int32_t> cu(B + 1);
  for (int64_t b = 0; b <= B; ++b) cu[b] = static_cast<int32_t>(b * S);
  int32_t* dcu = nullptr;
  NDT_CUDA_CHECK(cudaMalloc(&dcu, sizeof(int32_t) * cu.size()));
  NDT_CUDA_CHECK(cudaMemcpy(dcu, cu.data(), sizeof(int32_t) * cu.size(), cudaMemcpyHostToDevice));
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const double f_fwd = 4.0 * S * S * D * H / 2 * B, f_bwd = 2.5 * f_fwd;
  auto report = [&](const char* who, const std::function<void()>& fwd, const std::function<void()>& bwd) {
    const double tf = time_ms(fwd);
    const double tb = time_ms(bwd);
    std::printf(
        "[time] %-8s B=%lld S=%lld H=%lld KV=%lld D=%lld: fwd %.3f ms %.0f TFLOP/s | bwd %.3f ms %.0f "
        "TFLOP/s\n",
        who, (long long)B, (long long)S, (long long)H, (long long)KV, (long long)D, tf, f_fwd / tf * 1e-9, tb,
        f_bwd / tb * 1e-9);
  };
  report(
      "built-in",
      [&] {
        ndt::cuda::attention_forward<bf16>(out.p, lse.p, q.p, k.p, v.p, dcu, dcu, nullptr, nullptr, B, T, T,
                                           H, KV, D, scale);
      },
      [&] {
        ndt::cuda::attention_backward<bf16>(dq.p, dk.p, dv.p, dout.p, q.p, k.p, v.p, out.p, lse.p, dcu, dcu,
                                            nullptr, nullptr, B, T, T, H, KV, D, scale);
      });
  report(
      "cuDNN",
      [&] {
        ndt::cuda::cudnn_attention_forward(out.p, lse.p, q.p, k.p, v.p, B, S, H, KV, D, scale, nullptr);
      },
      [&] {
        ndt::cuda::cudnn_attention_backward(dq.p, dk.p, dv.p, dout.p, q.p, k.p, v.p, out.p, lse.p, B, S, H,
                                            KV, D, scale, nullptr);
      });
  cudaFree(dcu);
}

TEST(CudnnAttentionBench, DISABLED_TrainingShapes) {
  NDT_REQUIRE_CUDNN();
  std::printf("device: %s, %s\n", ndt::cuda::device_name(0).c_str(),
              ndt::cuda::cudnn_attention_status().c_str());
  cudaMemPool_t pool;
  NDT_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, 0));
  uint64_t threshold = UINT64_MAX;
  NDT_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
  bench(16, 1024, 12, 12, 64);  // GPT-2 124M
  bench(8, 2048, 16, 4, 128);   // Llama-style 1B (GQA)
}

}  // namespace
