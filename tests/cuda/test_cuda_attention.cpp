// Flash attention on the GPU (src/cuda/flash_attention.h) against its CPU twin, the general-form
// ndt::cpu::attention_forward/backward (explicit cu_q/cu_k/pos_q/pos_k), in fp32 and bf16, D = 64 and 128,
// GQA and MHA, on packed varlen segments (lengths 1, 37, 64, 130, 200 and an empty one) plus padding rows
// past cu[nseq], and training-length sequences (2051, 1024, 700, 1 tokens):
//  - plain causal: device positions null (row offsets inside the segment), CPU given those offsets; and
//    the same with the offsets passed explicitly;
//  - context parallel: query rows = chunks r and 2cp-1-r of each sequence (global positions), keys = the
//    whole sequence (all-gather form) or another rank's two chunks (one ring step, where some query rows
//    see no key: out 0, lse -inf).
// Inputs are random and never zero; out/lse are poisoned with NaN before the forward (every element
// must be written); backward starts from random non-zero dq/dk/dv and must ACCUMULATE (+=). Backward is
// fed the GPU's own out and lse, on both sides, so its check does not inherit forward rounding.
// Tolerances, relative L2 error ||gpu - cpu|| / ||cpu||:
//   fp32: 1e-5 for out, lse, dq, dk, dv (exact fp32 math on both sides);
//   bf16: 1e-2 for out, dq, dk, dv (CPU reference on the bf16-rounded inputs; the kernels round P and dS
//         to bf16 for the tensor cores and the results once), 1e-4 for lse (fp32 statistics).
// The increments (gpu - initial) are checked against the CPU gradients too, with the same tolerance.
// CudaAttentionBench.DISABLED_* prints timings (device runs only, never assertions).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/device.h"
#include "cuda/flash_attention.h"
#include "gpu_test.h"
#include "ops/cpu_ops.h"

namespace {

using bf16 = __nv_bfloat16;
using Vec = std::vector<float>;
using IVec = std::vector<int32_t>;

// Values in +-[lo, hi], never zero.
Vec randv(size_t n, uint32_t seed, float lo = 0.1f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mag(lo, hi);
  std::bernoulli_distribution neg(0.5);
  Vec v(n);
  for (auto& x : v) x = neg(rng) ? -mag(rng) : mag(rng);
  return v;
}

template <typename E>
E to_e(float x) {
  if constexpr (std::is_same_v<E, float>)
    return x;
  else
    return __float2bfloat16_rn(x);
}
template <typename E>
float from_e(E x) {
  if constexpr (std::is_same_v<E, float>)
    return x;
  else
    return __bfloat162float(x);
}
template <typename E>
Vec rounded(const Vec& v) {
  Vec r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = from_e<E>(to_e<E>(v[i]));
  return r;
}

// Device buffer of n elements of E, NaN-poisoned (all-ones bytes) on creation.
template <typename E>
struct Dev {
  E* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t n_) : n(n_) {
    NDT_CUDA_CHECK(cudaMalloc(&p, sizeof(E) * std::max<size_t>(1, n)));
    poison();
  }
  explicit Dev(const Vec& v) : Dev(v.size()) { upload(v); }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  void poison() { NDT_CUDA_CHECK(cudaMemset(p, 0xFF, sizeof(E) * std::max<size_t>(1, n))); }
  void upload(const Vec& v) {
    std::vector<E> h(v.size());
    for (size_t i = 0; i < v.size(); ++i) h[i] = to_e<E>(v[i]);
    NDT_CUDA_CHECK(cudaMemcpy(p, h.data(), sizeof(E) * h.size(), cudaMemcpyHostToDevice));
  }
  Vec get() const {
    NDT_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<E> h(n);
    NDT_CUDA_CHECK(cudaMemcpy(h.data(), p, sizeof(E) * n, cudaMemcpyDeviceToHost));
    Vec v(n);
    for (size_t i = 0; i < n; ++i) v[i] = from_e<E>(h[i]);
    return v;
  }
};

struct DevI {
  int32_t* p = nullptr;
  explicit DevI(const IVec& v) {
    NDT_CUDA_CHECK(cudaMalloc(&p, sizeof(int32_t) * std::max<size_t>(1, v.size())));
    if (!v.empty())
      NDT_CUDA_CHECK(cudaMemcpy(p, v.data(), sizeof(int32_t) * v.size(), cudaMemcpyHostToDevice));
  }
  ~DevI() { cudaFree(p); }
  DevI(const DevI&) = delete;
};

// Relative L2 error; any non-finite output (poison left, NaN) where the reference is finite fails. -inf
// entries (lse of rows without keys) must match exactly and are then left out of the sums.
double rel_l2(const Vec& out, const Vec& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isinf(ref[i]) || std::isinf(out[i])) {
      if (out[i] != ref[i]) return INFINITY;
      continue;
    }
    if (!std::isfinite(out[i])) return INFINITY;
    num += (double(out[i]) - ref[i]) * (double(out[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

Vec sub(const Vec& a, const Vec& b) {
  Vec r(a);
  for (size_t i = 0; i < r.size(); ++i) r[i] -= b[i];
  return r;
}
Vec add(const Vec& a, const Vec& b) {
  Vec r(a);
  for (size_t i = 0; i < r.size(); ++i) r[i] += b[i];
  return r;
}
double rms(const Vec& a) {
  double s = 0;
  for (float x : a) s += double(x) * x;
  return a.empty() ? 0.0 : std::sqrt(s / a.size());
}

template <typename E>
const char* tname() {
  return std::is_same_v<E, float> ? "f32" : "bf16";
}

// One problem: segments, CPU positions (always explicit) and whether the device gets them.
struct Case {
  std::string name;
  IVec cu_q, cu_k, pos_q, pos_k;
  bool device_pos = true;  // false: null positions on the device (plain causal)
  int64_t Tq = 0, Tk = 0;
};

// Plain causal on packed segments with `pad` spare rows past the last one.
Case plain_case(const IVec& lens, int pad, bool device_pos) {
  Case c;
  c.name = device_pos ? "causal(pos given)" : "causal(pos null)";
  c.cu_q = {0};
  for (int l : lens) {
    for (int i = 0; i < l; ++i) c.pos_q.push_back(i);
    c.cu_q.push_back(c.cu_q.back() + l);
  }
  for (int i = 0; i < pad; ++i) c.pos_q.push_back(0);  // past cu[nseq]: never read
  c.cu_k = c.cu_q;
  c.pos_k = c.pos_q;
  c.Tq = c.Tk = static_cast<int64_t>(c.pos_q.size());
  c.device_pos = device_pos;
  return c;
}

// Context parallel over cp ranks: sequence s (length 2cp * chunks[s]) is cut into 2cp chunks, rank r holds
// chunks r and 2cp-1-r. Queries: rank `rank`'s chunks. Keys: src < 0, the whole sequence (all-gather);
// else rank `src`'s chunks (one ring step).
Case cp_case(const IVec& chunks, int cp, int rank, int src, int pad) {
  Case c;
  c.name = src < 0 ? "cp allgather r" + std::to_string(rank)
                   : "cp ring r" + std::to_string(rank) + "<-" + std::to_string(src);
  c.cu_q = {0};
  c.cu_k = {0};
  for (int n : chunks) {
    for (int ch : {rank, 2 * cp - 1 - rank})
      for (int i = 0; i < n; ++i) c.pos_q.push_back(ch * n + i);
    if (src < 0) {
      for (int i = 0; i < 2 * cp * n; ++i) c.pos_k.push_back(i);
    } else {
      for (int ch : {src, 2 * cp - 1 - src})
        for (int i = 0; i < n; ++i) c.pos_k.push_back(ch * n + i);
    }
    c.cu_q.push_back(static_cast<int32_t>(c.pos_q.size()));
    c.cu_k.push_back(static_cast<int32_t>(c.pos_k.size()));
  }
  for (int i = 0; i < pad; ++i) c.pos_q.push_back(0);
  c.Tq = static_cast<int64_t>(c.pos_q.size());
  c.Tk = static_cast<int64_t>(c.pos_k.size());
  return c;
}

template <typename E>
void expect_close(const std::string& what, const Vec& out, const Vec& ref, double tolerance) {
  const double e = rel_l2(out, ref);
  std::printf("[err] %-52s %-4s %.3e (tol %.0e)\n", what.c_str(), tname<E>(), e, tolerance);
  EXPECT_LE(e, tolerance) << what << " " << tname<E>();
}

template <typename E>
void check_case(const Case& c, int64_t H, int64_t KV, int64_t D, uint32_t seed) {
  const double tol = std::is_same_v<E, float> ? 1e-5 : 1e-2;
  const double tol_lse = std::is_same_v<E, float> ? 1e-5 : 1e-4;
  const int64_t nseq = static_cast<int64_t>(c.cu_q.size()) - 1, Tq = c.Tq, Tk = c.Tk;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const std::string tag =
      c.name + " D" + std::to_string(D) + " H" + std::to_string(H) + "/KV" + std::to_string(KV);
  // q spans a wider range than k so that softmax rows are peaked and the online rescaling matters.
  const Vec q = rounded<E>(randv(Tq * H * D, seed, 0.1f, 3.0f));
  const Vec k = rounded<E>(randv(Tk * KV * D, seed + 1));
  const Vec v = rounded<E>(randv(Tk * KV * D, seed + 2));
  const Vec dout = rounded<E>(randv(Tq * H * D, seed + 3));
  Dev<E> d_q(q), d_k(k), d_v(v), d_dout(dout), d_out(Tq * H * D);
  Dev<float> d_lse(Tq * H);
  DevI cu_q(c.cu_q), cu_k(c.cu_k), pos_q(c.pos_q), pos_k(c.pos_k);
  const int32_t* pq = c.device_pos ? pos_q.p : nullptr;
  const int32_t* pk = c.device_pos ? pos_k.p : nullptr;

  // ---- forward ----
  ndt::cuda::attention_forward<E>(d_out.p, d_lse.p, d_q.p, d_k.p, d_v.p, cu_q.p, cu_k.p, pq, pk, nseq, Tq, Tk,
                                  H, KV, D, scale);
  NDT_CUDA_CHECK(cudaGetLastError());
  Vec ref_out(Tq * H * D), ref_lse(Tq * H);
  ndt::cpu::attention_forward(ref_out.data(), ref_lse.data(), q.data(), k.data(), v.data(), c.cu_q.data(),
                              c.cu_k.data(), c.pos_q.data(), c.pos_k.data(), nseq, Tq, Tk, H, KV, D, scale);
  const Vec out = d_out.get(), lse = d_lse.get();
  expect_close<E>(tag + " out", out, ref_out, tol);
  expect_close<E>(tag + " lse", lse, ref_lse, tol_lse);

  // ---- backward: CPU gradients alone first (their size sets the initial d-values), then += ----
  Vec gq(Tq * H * D, 0.f), gk(Tk * KV * D, 0.f), gv(Tk * KV * D, 0.f);
  ndt::cpu::attention_backward(gq.data(), gk.data(), gv.data(), dout.data(), q.data(), k.data(), v.data(),
                               out.data(), lse.data(), c.cu_q.data(), c.cu_k.data(), c.pos_q.data(),
                               c.pos_k.data(), nseq, Tq, Tk, H, KV, D, scale);
  auto init_like = [&](const Vec& g, uint32_t s) {
    Vec r = randv(g.size(), s);
    const float a = static_cast<float>(std::max(0.5 * rms(g), 1e-3));
    for (auto& x : r) x *= a;
    return rounded<E>(r);
  };
  const Vec iq = init_like(gq, seed + 4), ik = init_like(gk, seed + 5), iv = init_like(gv, seed + 6);
  Dev<E> gdq(iq), gdk(ik), gdv(iv);
  ndt::cuda::attention_backward<E>(gdq.p, gdk.p, gdv.p, d_dout.p, d_q.p, d_k.p, d_v.p, d_out.p, d_lse.p,
                                   cu_q.p, cu_k.p, pq, pk, nseq, Tq, Tk, H, KV, D, scale);
  NDT_CUDA_CHECK(cudaGetLastError());
  const Vec rdq = gdq.get(), rdk = gdk.get(), rdv = gdv.get();
  expect_close<E>(tag + " dq(+=)", rdq, add(iq, gq), tol);
  expect_close<E>(tag + " dk(+=)", rdk, add(ik, gk), tol);
  expect_close<E>(tag + " dv(+=)", rdv, add(iv, gv), tol);
  expect_close<E>(tag + " dq increment", sub(rdq, iq), gq, tol);
  expect_close<E>(tag + " dk increment", sub(rdk, ik), gk, tol);
  expect_close<E>(tag + " dv increment", sub(rdv, iv), gv, tol);
  if constexpr (std::is_same_v<E,
                               float>) {  // fp32 sums each row in a fixed order: a rerun gives the same bits
    gdq.upload(iq);
    gdk.upload(ik);
    gdv.upload(iv);
    ndt::cuda::attention_backward<E>(gdq.p, gdk.p, gdv.p, d_dout.p, d_q.p, d_k.p, d_v.p, d_out.p, d_lse.p,
                                     cu_q.p, cu_k.p, pq, pk, nseq, Tq, Tk, H, KV, D, scale);
    EXPECT_TRUE(gdq.get() == rdq && gdk.get() == rdk && gdv.get() == rdv)
        << tag << ": fp32 backward not bit-reproducible";
  }

  // Null d-pointers are skipped: dk alone (no dq scratch on the bf16 path).
  gdk.upload(ik);
  ndt::cuda::attention_backward<E>(nullptr, gdk.p, nullptr, d_dout.p, d_q.p, d_k.p, d_v.p, d_out.p, d_lse.p,
                                   cu_q.p, cu_k.p, pq, pk, nseq, Tq, Tk, H, KV, D, scale);
  NDT_CUDA_CHECK(cudaGetLastError());
  expect_close<E>(tag + " dk only(+=)", gdk.get(), add(ik, gk), tol);
}

template <typename E>
class CudaAttention : public ::testing::Test {};
using Types = ::testing::Types<float, bf16>;
TYPED_TEST_SUITE(CudaAttention, Types);

const IVec kLens = {1, 37, 0, 64, 130, 200};  // incl. an empty segment and lengths not multiples of 64

TYPED_TEST(CudaAttention, PlainCausalVarlen) {
  NDT_REQUIRE_GPU();
  uint32_t seed = 100;
  for (int64_t D : {64, 128})
    for (auto [H, KV] : {std::pair<int64_t, int64_t>{4, 2}, {4, 4}})
      for (bool device_pos : {false, true}) {
        check_case<TypeParam>(plain_case(kLens, 5, device_pos), H, KV, D, seed);
        seed += 10;
      }
}

TYPED_TEST(CudaAttention, ContextParallelChunks) {
  NDT_REQUIRE_GPU();
  // chunk sizes 1, 37, 64, 130: sequences of 4, 148, 256, 520 tokens over cp = 2 (4 chunks)
  const IVec chunks = {1, 37, 64, 130};
  uint32_t seed = 500;
  for (int64_t D : {64, 128})
    for (auto [H, KV] : {std::pair<int64_t, int64_t>{4, 2}, {4, 4}}) {
      for (int rank : {0, 1}) {
        check_case<TypeParam>(cp_case(chunks, 2, rank, -1, 3), H, KV, D, seed);
        seed += 10;
      }
      // ring steps: r0 <- r1 (chunk 0 queries see no key), r1 <- r0 (chunk 3 keys seen by no query)
      check_case<TypeParam>(cp_case(chunks, 2, 0, 1, 3), H, KV, D, seed);
      seed += 10;
      check_case<TypeParam>(cp_case(chunks, 2, 1, 0, 0), H, KV, D, seed);
      seed += 10;
    }
}

// Training-length sequences (many query and key tiles per segment, as in the GPT-2 benchmark shape).
TYPED_TEST(CudaAttention, LongSequences) {
  NDT_REQUIRE_GPU();
  const IVec lens = {2051, 1024, 700, 1};
  uint32_t seed = 900;
  for (int64_t D : {64, 128}) {
    check_case<TypeParam>(plain_case(lens, 0, false), 8, 2, D, seed);
    seed += 10;
  }
}

// ---- timings (device runs only: --gtest_also_run_disabled_tests --gtest_filter='CudaAttentionBench*') ----
using ndt::testing::time_ms;

// GPT-2 124M attention: 16 sequences x 1024 tokens packed, causal, bf16. FLOPs: forward 4*S*S*D*H/2 per
// sequence (causal half), backward 2.5x forward.
void bench_shape(int64_t nseq, int64_t S, int64_t H, int64_t KV, int64_t D) {
  const int64_t T = nseq * S;
  Dev<bf16> q(randv(T * H * D, 1)), k(randv(T * KV * D, 2)), v(randv(T * KV * D, 3)),
      dout(randv(T * H * D, 4));
  Dev<bf16> out(T * H * D), dq(T * H * D), dk(T * KV * D), dv(T * KV * D);
  Dev<float> lse(T * H);
  for (auto* d : {&dq, &dk, &dv}) NDT_CUDA_CHECK(cudaMemset(d->p, 0, sizeof(bf16) * d->n));
  IVec cu(nseq + 1);
  for (int64_t s = 0; s <= nseq; ++s) cu[s] = static_cast<int32_t>(s * S);
  DevI dcu(cu);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  auto fwd = [&] {
    ndt::cuda::attention_forward<bf16>(out.p, lse.p, q.p, k.p, v.p, dcu.p, dcu.p, nullptr, nullptr, nseq, T,
                                       T, H, KV, D, scale);
  };
  auto bwd = [&] {
    ndt::cuda::attention_backward<bf16>(dq.p, dk.p, dv.p, dout.p, q.p, k.p, v.p, out.p, lse.p, dcu.p, dcu.p,
                                        nullptr, nullptr, nseq, T, T, H, KV, D, scale);
  };
  const double f_fwd = 4.0 * S * S * D * H / 2 * nseq, f_bwd = 2.5 * f_fwd;
  const double t_fwd = time_ms(fwd);
  fwd();
  const double t_bwd = time_ms(bwd);
  const double t_fb = time_ms([&] {
    fwd();
    bwd();
  });
  std::printf(
      "[time] attention bf16 causal %lldx%lld H=%lld KV=%lld D=%lld: fwd %.3f ms %.1f TFLOP/s | bwd %.3f ms "
      "%.1f TFLOP/s | fwd+bwd %.3f ms %.1f TFLOP/s\n",
      (long long)nseq, (long long)S, (long long)H, (long long)KV, (long long)D, t_fwd, f_fwd / t_fwd * 1e-9,
      t_bwd, f_bwd / t_bwd * 1e-9, t_fb, (f_fwd + f_bwd) / t_fb * 1e-9);
}

TEST(CudaAttentionBench, DISABLED_Gpt2Shape) {
  NDT_REQUIRE_GPU();
  std::printf("device: %s\n", ndt::cuda::device_name(0).c_str());
  // As in training (cuda/runtime.cpp): freed scratch stays in the pool, no driver call per step.
  cudaMemPool_t pool;
  NDT_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, 0));
  uint64_t threshold = UINT64_MAX;
  NDT_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
  bench_shape(16, 1024, 12, 12, 64);  // GPT-2 124M
  bench_shape(16, 1024, 6, 6, 128);   // same tokens and width, D = 128
  bench_shape(8, 2048, 16, 4, 128);   // Llama-style GQA
}

}  // namespace
