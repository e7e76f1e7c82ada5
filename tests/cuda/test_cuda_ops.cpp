// CUDA ops against their CPU twins (ndt::cpu), in fp32 and bf16, on random never-zero inputs with odd
// sizes. Outputs are poisoned with NaN (all-ones bytes) before each forward call, so an element left
// unwritten fails; backward d-outputs are pre-filled with random values to check accumulation (+=).
// Tolerance: relative L2 error ||gpu - cpu|| / ||cpu||: fp32 <= 1e-5 (matmuls too: no TF32), bf16 <= 1e-2
// (the reference runs on the bf16-rounded inputs, so the error is the bf16 rounding of results).
// CudaKernelBench.DISABLED_* prints timings (device runs only, never assertions).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <type_traits>
#include <vector>

#include "cuda/cublaslt.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_ops.h"
#include "gpu_test.h"
#include "ops/cpu_ops.h"

namespace {

using bf16 = __nv_bfloat16;
using Vec = std::vector<float>;

// Values in +-[lo, hi], never zero.
Vec randv(size_t n, uint32_t seed, float lo = 0.1f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mag(lo, hi);
  std::bernoulli_distribution neg(0.5);
  Vec v(n);
  for (auto& x : v) x = neg(rng) ? -mag(rng) : mag(rng);
  return v;
}

std::vector<int32_t> randi(size_t n, uint32_t seed, int32_t lo, int32_t hi) {  // [lo, hi)
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> d(lo, hi - 1);
  std::vector<int32_t> v(n);
  for (auto& x : v) x = d(rng);
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

// The values a kernel on E actually sees (bf16 rounding), for the CPU reference.
template <typename E>
Vec rounded(const Vec& v) {
  Vec r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = from_e<E>(to_e<E>(v[i]));
  return r;
}

// Device buffer of n elements of E (+ `pad` spare elements, for offset-pointer tests), NaN-poisoned.
template <typename E>
struct Dev {
  E* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t n_, size_t pad = 0) : n(n_) {
    NDT_CUDA_CHECK(cudaMalloc(&p, sizeof(E) * (n + pad + 1)));
    poison(pad);
  }
  Dev(const Vec& v) : Dev(v.size()) { upload(v); }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  void poison(size_t pad = 0) { NDT_CUDA_CHECK(cudaMemset(p, 0xFF, sizeof(E) * (n + pad + 1))); }
  void upload(const Vec& v, size_t offset = 0) {
    std::vector<E> h(v.size());
    for (size_t i = 0; i < v.size(); ++i) h[i] = to_e<E>(v[i]);
    NDT_CUDA_CHECK(cudaMemcpy(p + offset, h.data(), sizeof(E) * h.size(), cudaMemcpyHostToDevice));
  }
  Vec get(size_t offset = 0) const {
    NDT_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<E> h(n);
    NDT_CUDA_CHECK(cudaMemcpy(h.data(), p + offset, sizeof(E) * n, cudaMemcpyDeviceToHost));
    Vec v(n);
    for (size_t i = 0; i < n; ++i) v[i] = from_e<E>(h[i]);
    return v;
  }
};

struct DevI {
  int32_t* p = nullptr;
  explicit DevI(const std::vector<int32_t>& v) {
    NDT_CUDA_CHECK(cudaMalloc(&p, sizeof(int32_t) * std::max<size_t>(1, v.size())));
    NDT_CUDA_CHECK(cudaMemcpy(p, v.data(), sizeof(int32_t) * v.size(), cudaMemcpyHostToDevice));
  }
  ~DevI() { cudaFree(p); }
};

double rel_l2(const Vec& out, const Vec& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(out[i])) return INFINITY;  // unwritten (poison) or broken
    num += (double(out[i]) - ref[i]) * (double(out[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

template <typename E>
double tol() {
  return std::is_same_v<E, float> ? 1e-5 : 1e-2;
}
template <typename E>
const char* tname() {
  return std::is_same_v<E, float> ? "f32" : "bf16";
}

// Checks and prints one comparison: "[err] <op> <type> <rel L2>" (the device log keeps the worst per op).
template <typename E>
void expect_close(const char* op, const Vec& out, const Vec& ref, double tolerance = -1) {
  const double t = tolerance > 0 ? tolerance : tol<E>();
  const double e = rel_l2(out, ref);
  std::printf("[err] %-28s %-4s %.3e (tol %.0e)\n", op, tname<E>(), e, t);
  EXPECT_LE(e, t) << op << " " << tname<E>();
}

Vec add(const Vec& a, const Vec& b) {
  Vec r(a);
  for (size_t i = 0; i < r.size(); ++i) r[i] += b[i];
  return r;
}

template <typename E>
class CudaOps : public ::testing::Test {};
using Types = ::testing::Types<float, bf16>;
TYPED_TEST_SUITE(CudaOps, Types);

constexpr int64_t T = 37, C = 96, V = 259;

TYPED_TEST(CudaOps, Activations) {
  NDT_REQUIRE_GPU();
  using E = TypeParam;
  const int64_t N = T * C + 5;  // vector body + scalar tail
  const Vec x = rounded<E>(randv(N, 1, 0.1f, 3.f)), u = rounded<E>(randv(N, 2)), g = rounded<E>(randv(N, 3));
  const Vec pre = rounded<E>(randv(N, 4)), pre2 = rounded<E>(randv(N, 5));
  Dev<E> dx(x), du(u), dg(g), out(N, 1);
  Vec ref(N);
  // gelu forward, vector path and (pointer offset by one element) scalar path
  ndt::cuda::gelu_forward<E>(out.p, dx.p, N);
  ndt::cpu::gelu_forward(ref.data(), x.data(), N);
  expect_close<E>("gelu_forward", out.get(), ref);
  Dev<E> xs(N, 1);
  xs.upload(x, 1);
  out.poison(1);
  ndt::cuda::gelu_forward<E>(out.p + 1, xs.p + 1, N);
  expect_close<E>("gelu_forward(unaligned)", out.get(1), ref);
  // gelu backward accumulates
  out.upload(pre);
  ref = pre;
  ndt::cuda::gelu_backward<E>(out.p, dg.p, dx.p, N);
  ndt::cpu::gelu_backward(ref.data(), g.data(), x.data(), N);
  expect_close<E>("gelu_backward(+=)", out.get(), ref);
  out.poison();  // overwrite: the poison is not read
  std::fill(ref.begin(), ref.end(), 0.f);
  ndt::cuda::gelu_backward<E>(out.p, dg.p, dx.p, N, 0, /*accumulate=*/false);
  ndt::cpu::gelu_backward(ref.data(), g.data(), x.data(), N);
  expect_close<E>("gelu_backward(=)", out.get(), ref);
  // swiglu
  out.poison();
  ndt::cuda::swiglu_forward<E>(out.p, dx.p, du.p, N);
  ndt::cpu::swiglu_forward(ref.data(), x.data(), u.data(), N);
  expect_close<E>("swiglu_forward", out.get(), ref);
  Dev<E> dgate(pre), dup(pre2);
  Vec rg = pre, ru = pre2;
  ndt::cuda::swiglu_backward<E>(dgate.p, dup.p, dg.p, dx.p, du.p, N);
  ndt::cpu::swiglu_backward(rg.data(), ru.data(), g.data(), x.data(), u.data(), N);
  expect_close<E>("swiglu_backward dgate(+=)", dgate.get(), rg);
  expect_close<E>("swiglu_backward dup(+=)", dup.get(), ru);
  ndt::cuda::swiglu_backward<E>(nullptr, dup.p, dg.p, dx.p, du.p, N);  // null d-pointer: skipped
  ndt::cpu::swiglu_backward(nullptr, ru.data(), g.data(), x.data(), u.data(), N);
  expect_close<E>("swiglu_backward dup only", dup.get(), ru);
  dgate.poison();
  dup.poison();
  std::fill(rg.begin(), rg.end(), 0.f);
  std::fill(ru.begin(), ru.end(), 0.f);
  ndt::cuda::swiglu_backward<E>(dgate.p, dup.p, dg.p, dx.p, du.p, N, 0, /*accumulate=*/false);
  ndt::cpu::swiglu_backward(rg.data(), ru.data(), g.data(), x.data(), u.data(), N);
  expect_close<E>("swiglu_backward dgate(=)", dgate.get(), rg);
  expect_close<E>("swiglu_backward dup(=)", dup.get(), ru);
  // residual, add_inplace, scale_inplace
  out.poison();
  ndt::cuda::residual_forward<E>(out.p, dx.p, du.p, N);
  expect_close<E>("residual_forward", out.get(), add(x, u));
  // ... with a row bias (x + (u + bias)): vector path (C % 8 == 0) and scalar path (rows of 37)
  for (const int64_t bc : {C, int64_t{37}}) {
    const int64_t n = T * bc;
    const Vec bias = rounded<E>(randv(bc, 6, -1.f, 1.f));
    Dev<E> db(bias), ob(n);
    Vec want(n);
    for (int64_t i = 0; i < n; ++i) want[i] = x[i] + (u[i] + bias[i % bc]);
    ndt::cuda::residual_forward<E>(ob.p, dx.p, du.p, n, 0, db.p, bc);
    expect_close<E>(bc == C ? "residual_forward+bias vec" : "residual_forward+bias", ob.get(), want);
  }
  Dev<E> y(pre);
  ndt::cuda::add_inplace<E>(y.p, dx.p, N);
  Vec ry = pre;
  ndt::cpu::add_inplace(ry.data(), x.data(), N);
  expect_close<E>("add_inplace", y.get(), ry);
  ndt::cuda::scale_inplace<E>(y.p, 0.37f, N);
  ndt::cpu::scale_inplace(ry.data(), 0.37f, N);
  expect_close<E>("scale_inplace", y.get(), ry);
}

// The norms' forward takes a block per row up to 256 rows (Norms above, T = 37) and a warp per row beyond:
// the warp kernel against the CPU too.
TYPED_TEST(CudaOps, NormForwardManyRows) {
  NDT_REQUIRE_GPU();
  using E = TypeParam;
  const int64_t rows = 300, n = rows * C;
  const Vec x = rounded<E>(randv(n, 20, 0.1f, 2.f)), w = rounded<E>(randv(C, 21)),
            b = rounded<E>(randv(C, 22));
  Dev<E> dx(x), dw(w), db(b), out(n);
  Dev<float> mean(rows), rstd(rows);
  Vec ro(n), rm(rows), rr(rows);
  out.poison();
  ndt::cuda::layernorm_forward<E>(out.p, mean.p, rstd.p, dx.p, dw.p, db.p, rows, C, 1e-5f);
  ndt::cpu::layernorm_forward(ro.data(), rm.data(), rr.data(), x.data(), w.data(), b.data(), rows, C, 1e-5f);
  expect_close<E>("layernorm_forward (warp per row)", out.get(), ro);
  expect_close<E>("layernorm_forward mean (warp per row)", mean.get(), rm, 1e-5);
  out.poison();
  ndt::cuda::rmsnorm_forward<E>(out.p, rstd.p, dx.p, dw.p, rows, C, 1e-6f);
  ndt::cpu::rmsnorm_forward(ro.data(), rr.data(), x.data(), w.data(), rows, C, 1e-6f);
  expect_close<E>("rmsnorm_forward (warp per row)", out.get(), ro);
  expect_close<E>("rmsnorm_forward rstd (warp per row)", rstd.get(), rr, 1e-5);
}

// The bias gradient (column sums of dout, added into an fp32 dbias) over many rows: bf16 rows of a multiple
// of 8 take the 16-byte-load kernel, others (and fp32) the general column sum. Against sums in double:
// relative L2 <= 1e-5 (fp32 sums of exactly rounded inputs).
TYPED_TEST(CudaOps, BiasBackwardManyRows) {
  NDT_REQUIRE_GPU();
  using E = TypeParam;
  for (auto [rows, oc] : {std::pair<int64_t, int64_t>{16384, 768}, {1000, 2304}, {777, 72}, {300, 259}}) {
    const Vec g = rounded<E>(randv(rows * oc, 70, -1.f, 1.f)), pre = randv(oc, 71);
    Vec ref = pre;
    for (int64_t c = 0; c < oc; ++c) {
      double sum = 0;
      for (int64_t t = 0; t < rows; ++t) sum += g[t * oc + c];
      ref[c] += static_cast<float>(sum);
    }
    Dev<E> dg(g);
    Dev<float> db(pre);
    ndt::cuda::bias_backward<E>(db.p, dg.p, rows, oc);
    char label[64];
    std::snprintf(label, sizeof(label), "bias_backward %lldx%lld", static_cast<long long>(rows),
                  static_cast<long long>(oc));
    expect_close<E>(label, db.get(), ref, 1e-5);
  }
}

// The norms' backward with the residual gradient and both parameter gradients at once, as the transformer
// calls it: bf16 rows of a multiple of 8 up to 2048 columns take the fused kernel (dinp and the parameter
// column sums in one pass; more rows than its 512 blocks x 8 warps, so warps loop), others the dinp kernel
// plus a column sum. Tolerances as above: bf16 dinp 1e-2, fp32 parameter gradients 1e-5. The optional
// column sums of dinp (the layer below's bias gradient) are checked against the sums, in double, of the
// values the kernel wrote (bf16-rounded), added to a prior value, 1e-5.
TYPED_TEST(CudaOps, NormBackwardWithResidualManyRows) {
  NDT_REQUIRE_GPU();
  using E = TypeParam;
  for (auto [rows, c] : {std::pair<int64_t, int64_t>{5000, 768}, {700, 2048}, {300, 2056}, {37, 96}}) {
    const int64_t n = rows * c;
    const Vec x = rounded<E>(randv(n, 60, 0.1f, 2.f)), w = rounded<E>(randv(c, 61)),
              g = rounded<E>(randv(n, 62)), res = rounded<E>(randv(n, 63)), prew = randv(c, 64),
              preb = randv(c, 65), pres = randv(c, 66);
    Vec rm(rows), rr(rows), ro(n), rb(c, 0.f);
    ndt::cpu::layernorm_forward(ro.data(), rm.data(), rr.data(), x.data(), w.data(), rb.data(), rows, c,
                                1e-5f);
    Dev<E> dx(x), dw(w), dg(g), dres(res), dinp(n);
    Dev<float> mean(rm), rstd(rr), dweight(prew), dbias(preb), dsum(pres);
    const auto colsum_ref = [&](const Vec& written) {
      Vec r(static_cast<size_t>(c));
      for (int64_t j = 0; j < c; ++j) {
        double acc = pres[static_cast<size_t>(j)];
        for (int64_t t = 0; t < rows; ++t) acc += written[static_cast<size_t>(t * c + j)];
        r[static_cast<size_t>(j)] = static_cast<float>(acc);
      }
      return r;
    };
    for (bool rms : {false, true}) {
      for (bool with_sum : {false, true}) {
        char label[80];
        std::snprintf(label, sizeof(label), "%s %lldx%lld%s", rms ? "rmsnorm" : "layernorm",
                      static_cast<long long>(rows), static_cast<long long>(c), with_sum ? " +colsum" : "");
        float* sum = with_sum ? dsum.p : nullptr;
        Vec rdi = res, rdw = prew, rdb = preb;
        dinp.poison();
        dweight.upload(prew);
        dbias.upload(preb);
        dsum.upload(pres);
        if (rms) {
          ndt::cuda::rmsnorm_backward<E>(dinp.p, dweight.p, dg.p, dx.p, dw.p, rstd.p, rows, c, 0, dres.p,
                                         sum);
          ndt::cpu::rmsnorm_backward(rdi.data(), rdw.data(), g.data(), x.data(), w.data(), rr.data(), rows,
                                     c);
        } else {
          ndt::cuda::layernorm_backward<E>(dinp.p, dweight.p, dbias.p, dg.p, dx.p, dw.p, mean.p, rstd.p, rows,
                                           c, 0, dres.p, sum);
          ndt::cpu::layernorm_backward(rdi.data(), rdw.data(), rdb.data(), g.data(), x.data(), w.data(),
                                       rm.data(), rr.data(), rows, c);
          expect_close<E>((std::string(label) + " dbias(+=)").c_str(), dbias.get(), rdb, 1e-5);
        }
        const Vec written = dinp.get();
        expect_close<E>((std::string(label) + " dinp = dres +").c_str(), written, rdi);
        expect_close<E>((std::string(label) + " dweight(+=)").c_str(), dweight.get(), rdw, 1e-5);
        expect_close<E>((std::string(label) + " dinp column sums").c_str(), dsum.get(),
                        with_sum ? colsum_ref(written) : pres, 1e-5);
        if (rms) continue;
        // No residual pointer: the gradient is added to what dinp holds (here the same residual).
        dinp.upload(res);
        dweight.upload(prew);
        dbias.upload(preb);
        dsum.upload(pres);
        ndt::cuda::layernorm_backward<E>(dinp.p, dweight.p, dbias.p, dg.p, dx.p, dw.p, mean.p, rstd.p, rows,
                                         c, 0, nullptr, sum);
        const Vec added = dinp.get();
        expect_close<E>((std::string(label) + " dinp +=").c_str(), added, rdi);
        expect_close<E>((std::string(label) + " dweight(+=), dinp +=").c_str(), dweight.get(), rdw, 1e-5);
        expect_close<E>((std::string(label) + " dbias(+=), dinp +=").c_str(), dbias.get(), rdb, 1e-5);
        expect_close<E>((std::string(label) + " dinp column sums, dinp +=").c_str(), dsum.get(),
                        with_sum ? colsum_ref(added) : pres, 1e-5);
      }
    }
  }
}

TYPED_TEST(CudaOps, Norms) {
  NDT_REQUIRE_GPU();
  using E = TypeParam;
  for (int64_t c : {C, int64_t{37}}) {  // vector path, scalar path
    const int64_t n = T * c;
    const Vec x = rounded<E>(randv(n, 10, 0.1f, 2.f)), w = rounded<E>(randv(c, 11)),
              b = rounded<E>(randv(c, 12));
    const Vec g = rounded<E>(randv(n, 13)), pre = rounded<E>(randv(n, 14)), prew = randv(c, 15),
              preb = randv(c, 16);
    Dev<E> dx(x), dw(w), db(b), dg(g), out(n);
    Dev<float> mean(T), rstd(T);
    Vec ro(n), rm(T), rr(T);
    ndt::cuda::layernorm_forward<E>(out.p, mean.p, rstd.p, dx.p, dw.p, db.p, T, c, 1e-5f);
    ndt::cpu::layernorm_forward(ro.data(), rm.data(), rr.data(), x.data(), w.data(), b.data(), T, c, 1e-5f);
    expect_close<E>("layernorm_forward", out.get(), ro);
    expect_close<E>("layernorm_forward mean", mean.get(), rm, 1e-5);
    expect_close<E>("layernorm_forward rstd", rstd.get(), rr, 1e-5);
    Dev<E> dinp(pre);
    Dev<float> dweight(prew), dbias(preb);
    Vec rdi = pre, rdw = prew, rdb = preb;
    // Backward from the CPU statistics, so that only the backward kernel is measured.
    mean.upload(rm);
    rstd.upload(rr);
    ndt::cuda::layernorm_backward<E>(dinp.p, dweight.p, dbias.p, dg.p, dx.p, dw.p, mean.p, rstd.p, T, c);
    ndt::cpu::layernorm_backward(rdi.data(), rdw.data(), rdb.data(), g.data(), x.data(), w.data(), rm.data(),
                                 rr.data(), T, c);
    expect_close<E>("layernorm_backward dinp(+=)", dinp.get(), rdi);
    expect_close<E>("layernorm_backward dweight(+=)", dweight.get(), rdw, 1e-5);
    expect_close<E>("layernorm_backward dbias(+=)", dbias.get(), rdb, 1e-5);
    // dinp = dres + gradient: the (poisoned) dinp is not read.
    Dev<E> dres(pre);
    dinp.poison();
    ndt::cuda::layernorm_backward<E>(dinp.p, nullptr, nullptr, dg.p, dx.p, dw.p, mean.p, rstd.p, T, c, 0,
                                     dres.p);
    expect_close<E>("layernorm_backward dres+", dinp.get(), rdi);

    out.poison();
    rstd.poison();
    ndt::cuda::rmsnorm_forward<E>(out.p, rstd.p, dx.p, dw.p, T, c, 1e-6f);
    ndt::cpu::rmsnorm_forward(ro.data(), rr.data(), x.data(), w.data(), T, c, 1e-6f);
    expect_close<E>("rmsnorm_forward", out.get(), ro);
    expect_close<E>("rmsnorm_forward rstd", rstd.get(), rr, 1e-5);
    dinp.upload(pre);
    dweight.upload(prew);
    rdi = pre;
    rdw = prew;
    rstd.upload(rr);
    ndt::cuda::rmsnorm_backward<E>(dinp.p, dweight.p, dg.p, dx.p, dw.p, rstd.p, T, c);
    ndt::cpu::rmsnorm_backward(rdi.data(), rdw.data(), g.data(), x.data(), w.data(), rr.data(), T, c);
    expect_close<E>("rmsnorm_backward dinp(+=)", dinp.get(), rdi);
    expect_close<E>("rmsnorm_backward dweight(+=)", dweight.get(), rdw, 1e-5);
    dinp.poison();
    ndt::cuda::rmsnorm_backward<E>(dinp.p, nullptr, dg.p, dx.p, dw.p, rstd.p, T, c, 0, dres.p);
    expect_close<E>("rmsnorm_backward dres+", dinp.get(), rdi);
  }
}

TYPED_TEST(CudaOps, Rope) {
  NDT_REQUIRE_GPU();
  using E = TypeParam;
  const int64_t H = 3;
  for (int64_t D : {int64_t{16}, int64_t{64}}) {
    const int64_t n = T * H * D;
    const Vec x = rounded<E>(randv(n, 20)), pre = rounded<E>(randv(n, 21));
    const auto pos = randi(T, 22, 0, 5000);  // large positions: angles need double precision
    DevI dpos(pos);
    Dev<E> dx(x), out(n);
    Vec ref(n);
    ndt::cuda::rope_forward<E>(out.p, dx.p, dpos.p, T, H, D, 10000.f);
    ndt::cpu::rope_forward(ref.data(), x.data(), pos.data(), T, H, D, 10000.f);
    expect_close<E>("rope_forward", out.get(), ref);
    ndt::cuda::rope_forward<E>(dx.p, dx.p, dpos.p, T, H, D, 10000.f);  // in place
    expect_close<E>("rope_forward(in place)", dx.get(), ref);
    dx.upload(x);
    Dev<E> d(pre);
    Vec rd = pre;
    ndt::cuda::rope_backward<E>(d.p, dx.p, dpos.p, T, H, D, 10000.f);
    ndt::cpu::rope_backward(rd.data(), x.data(), pos.data(), T, H, D, 10000.f);
    expect_close<E>("rope_backward(+=)", d.get(), rd);
  }
}

// Decode steps' fusions: the q/k/v split with RoPE, and SwiGLU from the fused gate/up rows.
TYPED_TEST(CudaOps, QkvSplitRopeAndFusedSwiglu) {
  NDT_REQUIRE_GPU();
  using E = TypeParam;
  const int64_t H = 4, KV = 2, F = 96;
  // D = 64: 16-byte packs of pairs; D = 36 (half 18): one pair per thread.
  for (const int64_t D : {int64_t{64}, int64_t{36}}) {
    SCOPED_TRACE("D = " + std::to_string(D));
    const int64_t W = (H + 2 * KV) * D;
    const Vec qkv = rounded<E>(randv(T * W, 70));
    const auto pos = randi(T, 71, 0, 5000);
    DevI dpos(pos);
    Dev<E> dqkv(qkv), q(T * H * D), k(T * KV * D), v(T * KV * D);
    ndt::cuda::qkv_split_rope<E>(q.p, k.p, v.p, dqkv.p, dpos.p, T, H, KV, D, 10000.f);
    Vec rq(T * H * D), rk(T * KV * D), rv(T * KV * D);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < W; ++j) {
        const float x = qkv[t * W + j];
        if (j < H * D)
          rq[t * H * D + j] = x;
        else if (j < (H + KV) * D)
          rk[t * KV * D + j - H * D] = x;
        else
          rv[t * KV * D + j - (H + KV) * D] = x;
      }
    ndt::cpu::rope_forward(rq.data(), rq.data(), pos.data(), T, H, D, 10000.f);
    ndt::cpu::rope_forward(rk.data(), rk.data(), pos.data(), T, KV, D, 10000.f);
    expect_close<E>("qkv_split_rope q", q.get(), rq);
    expect_close<E>("qkv_split_rope k", k.get(), rk);
    expect_close<E>("qkv_split_rope v", v.get(), rv);
    // Stored by row into a KV cache of 3T rows (row 3t + 1 for token t; the other rows keep their values).
    std::vector<int32_t> rows(T);
    for (int64_t t = 0; t < T; ++t) rows[t] = static_cast<int32_t>(3 * t + 1);
    const Vec cache0 = rounded<E>(randv(3 * T * KV * D, 73));
    Dev<E> kc(cache0), vc(cache0), q2(T * H * D);
    DevI drows(rows);
    ndt::cuda::qkv_split_rope<E>(q2.p, kc.p, vc.p, dqkv.p, dpos.p, T, H, KV, D, 10000.f, 0, drows.p);
    Vec rkc = cache0, rvc = cache0;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < KV * D; ++j) {
        rkc[(3 * t + 1) * KV * D + j] = rk[t * KV * D + j];
        rvc[(3 * t + 1) * KV * D + j] = rv[t * KV * D + j];
      }
    expect_close<E>("qkv_split_rope q (k/v stored by row)", q2.get(), rq);
    expect_close<E>("qkv_split_rope k stored by row", kc.get(), rkc);
    expect_close<E>("qkv_split_rope v stored by row", vc.get(), rvc);
  }
  const Vec h13 = rounded<E>(randv(T * 2 * F, 72));
  Dev<E> dh(h13), out(T * F);
  ndt::cuda::swiglu_forward_fused<E>(out.p, dh.p, T, F);
  Vec ro(T * F);
  for (int64_t t = 0; t < T; ++t)
    ndt::cpu::swiglu_forward(ro.data() + t * F, h13.data() + t * 2 * F, h13.data() + t * 2 * F + F, F);
  expect_close<E>("swiglu_forward_fused", out.get(), ro);
}

// The training backward of the split: [dq | dk | dv] with dq and dk rotated back, against the CPU's
// rope_backward of each and the row-by-row layout.
TYPED_TEST(CudaOps, QkvMergeRopeBackward) {
  NDT_REQUIRE_GPU();
  using E = TypeParam;
  const int64_t H = 4, KV = 2;
  for (const int64_t D : {int64_t{64}, int64_t{36}}) {  // 16-byte packs; one pair per thread
    SCOPED_TRACE("D = " + std::to_string(D));
    const int64_t W = (H + 2 * KV) * D;
    const Vec dq = rounded<E>(randv(T * H * D, 74)), dk = rounded<E>(randv(T * KV * D, 75)),
              dv = rounded<E>(randv(T * KV * D, 76));
    const auto pos = randi(T, 77, 0, 5000);
    DevI dpos(pos);
    Dev<E> ddq(dq), ddk(dk), ddv(dv), dqkv(T * W);
    ndt::cuda::qkv_merge_rope_backward<E>(dqkv.p, ddq.p, ddk.p, ddv.p, dpos.p, T, H, KV, D, 10000.f);
    Vec rq(T * H * D, 0.0f), rk(T * KV * D, 0.0f), ref(T * W);
    ndt::cpu::rope_backward(rq.data(), dq.data(), pos.data(), T, H, D, 10000.f);
    ndt::cpu::rope_backward(rk.data(), dk.data(), pos.data(), T, KV, D, 10000.f);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < W; ++j)
        ref[t * W + j] = j < H * D          ? rq[t * H * D + j]
                         : j < (H + KV) * D ? rk[t * KV * D + j - H * D]
                                            : dv[t * KV * D + j - (H + KV) * D];
    expect_close<E>("qkv_merge_rope_backward", dqkv.get(), ref);
    EXPECT_EQ(ddq.get(), dq);  // the inputs are left as they were
  }
}

// The fused q/k/v backward's operand: [dq | dk | dv] row by row, an exact copy (compared bit for bit with
// the row-by-row layout), on the 16-byte path (widths multiples of 8) and the element path.
TYPED_TEST(CudaOps, ConcatCols3) {
  NDT_REQUIRE_GPU();
  using E = TypeParam;
  for (auto [wa, wb] : {std::pair<int64_t, int64_t>{256, 64}, {24, 8}, {13, 5}}) {
    const int64_t rows = 300, w = wa + 2 * wb;
    const Vec a = rounded<E>(randv(rows * wa, 80)), b = rounded<E>(randv(rows * wb, 81)),
              c = rounded<E>(randv(rows * wb, 82));
    Dev<E> da(a), db(b), dc(c), out(rows * w);
    out.poison();
    ndt::cuda::concat_cols3<E>(out.p, da.p, wa, db.p, wb, dc.p, wb, rows);
    Vec ref(rows * w);
    for (int64_t t = 0; t < rows; ++t)
      for (int64_t j = 0; j < w; ++j)
        ref[t * w + j] = j < wa ? a[t * wa + j] : j < wa + wb ? b[t * wb + j - wa] : c[t * wb + j - wa - wb];
    EXPECT_EQ(out.get(), ref) << wa << " + 2 x " << wb;
  }
}

TYPED_TEST(CudaOps, Embeddings) {
  NDT_REQUIRE_GPU();
  using E = TypeParam;
  const int64_t vstart = 100, P = 64;
  // ids in [60, 400): many repeats, some below and above this shard [100, 359)
  const auto ids = randi(T * 3, 30, 60, 400);
  const int64_t Tn = T * 3;
  const Vec table = rounded<E>(randv(V * C, 31)), ptable = rounded<E>(randv(P * C, 32));
  const Vec g = rounded<E>(randv(Tn * C, 33)), pre = rounded<E>(randv(Tn * C, 34));
  const Vec pre_t = randv(V * C, 35), pre_p = randv(P * C, 36);
  DevI did(ids);
  Dev<E> dtab(table), out(Tn * C), dg(g);
  Vec ref(Tn * C);
  ndt::cuda::embedding_forward<E>(out.p, did.p, dtab.p, Tn, V, C, vstart);
  ndt::cpu::embedding_forward(ref.data(), ids.data(), table.data(), Tn, V, C, vstart);
  expect_close<E>("embedding_forward", out.get(), ref);
  // The backward against the CPU (accumulating onto pre_t), and deterministic: a second run from the same
  // start gives the same bits.
  auto check_backward = [&](const std::vector<int32_t>& bids, const Vec& bg, const char* label) {
    const int64_t n = static_cast<int64_t>(bids.size());
    DevI dbids(bids);
    Dev<E> dbg(bg);
    Dev<float> dtable(pre_t);
    Vec rdt = pre_t;
    ndt::cuda::embedding_backward<E>(dtable.p, dbg.p, dbids.p, n, V, C, vstart);
    ndt::cpu::embedding_backward(rdt.data(), bg.data(), bids.data(), n, V, C, vstart);
    expect_close<E>(label, dtable.get(), rdt, 1e-5);
    const Vec first = dtable.get();
    dtable.upload(pre_t);
    ndt::cuda::embedding_backward<E>(dtable.p, dbg.p, dbids.p, n, V, C, vstart);
    EXPECT_EQ(first, dtable.get()) << label << " is not deterministic";
  };
  check_backward(ids, g, "embedding_backward(+=)");
  // Skewed ids: runs of equal ids from 1 to ~1800 tokens, crossing many of the backward's 32-row pieces.
  auto skewed = randi(3001, 38, 0, 1000);
  for (auto& id : skewed) id = id < 600 ? 100 : id < 800 ? 358 : id < 850 ? 40 : 60 + id % 340;
  check_backward(skewed, rounded<E>(randv(3001 * C, 39)), "embedding_backward(+=), skewed ids");

  const auto pos = randi(Tn, 37, 0, P);
  DevI dpos(pos);
  out.upload(pre);
  Vec rp = pre;
  Dev<E> dpt(ptable);
  ndt::cuda::add_position_embedding_forward<E>(out.p, dpos.p, dpt.p, Tn, P, C);
  ndt::cpu::add_position_embedding_forward(rp.data(), pos.data(), ptable.data(), Tn, P, C);
  expect_close<E>("add_position_embedding_fwd(+=)", out.get(), rp);
  Dev<float> dptab(pre_p);
  Vec rdp = pre_p;
  ndt::cuda::add_position_embedding_backward<E>(dptab.p, dg.p, dpos.p, Tn, P, C);
  ndt::cpu::add_position_embedding_backward(rdp.data(), g.data(), pos.data(), Tn, P, C);
  expect_close<E>("add_position_embedding_bwd(+=)", dptab.get(), rdp, 1e-5);
}

// One linear problem: forward (bias epilogue / no bias) and backward (accumulating) against OpenBLAS.
template <typename E>
void check_linear(const char* label, int64_t t, int64_t ic, int64_t oc, bool offset_bias) {
  const Vec x = rounded<E>(randv(t * ic, 40)), w = rounded<E>(randv(oc * ic, 41)),
            b = rounded<E>(randv(oc, 42));
  const Vec g = rounded<E>(randv(t * oc, 43)), pre = rounded<E>(randv(t * ic, 44));
  const Vec prew = randv(oc * ic, 45), preb = randv(oc, 46);
  Dev<E> dx(x), dw(w), out(t * oc), dg(g), db(oc, 1);
  db.upload(b, offset_bias ? 1 : 0);
  const E* bias = db.p + (offset_bias ? 1 : 0);
  Vec ref(t * oc);
  char name[96];
  ndt::cuda::linear_forward<E>(out.p, dx.p, dw.p, bias, t, ic, oc);
  ndt::cpu::linear_forward(ref.data(), x.data(), w.data(), b.data(), t, ic, oc);
  std::snprintf(name, sizeof(name), "linear_fwd %s", label);
  expect_close<E>(name, out.get(), ref);
  out.poison();
  ndt::cuda::linear_forward<E>(out.p, dx.p, dw.p, nullptr, t, ic, oc);
  ndt::cpu::linear_forward(ref.data(), x.data(), w.data(), nullptr, t, ic, oc);
  std::snprintf(name, sizeof(name), "linear_fwd nobias %s", label);
  expect_close<E>(name, out.get(), ref);
  // accumulate: out = residual + product (the residual rounded to E, as the device holds it)
  const Vec res = rounded<E>(randv(t * oc, 47));
  Dev<E> acc(res);
  ndt::cuda::linear_forward<E>(acc.p, dx.p, dw.p, nullptr, t, ic, oc, 0, /*accumulate=*/true);
  for (int64_t i = 0; i < t * oc; ++i) ref[i] += res[i];
  std::snprintf(name, sizeof(name), "linear_fwd accumulate %s", label);
  expect_close<E>(name, acc.get(), ref);
  // accumulating in place with a bias is refused (an unaligned bias or the fallback would pre-fill C with it,
  // dropping what C holds), and C is left as it was
  EXPECT_THROW(ndt::cuda::linear_forward<E>(acc.p, dx.p, dw.p, bias, t, ic, oc, 0, /*accumulate=*/true),
               std::exception)
      << label;
  expect_close<E>(name, acc.get(), ref);
  // residual: out = residual + product + bias, the residual read by the matmul (out poisoned: not read);
  // the unaligned bias and cublasGemmEx's cases add it by a kernel of their own.
  Dev<E> resid(res);
  out.poison();
  ndt::cuda::linear_forward<E>(out.p, dx.p, dw.p, bias, t, ic, oc, 0, /*accumulate=*/false, resid.p);
  ndt::cpu::linear_forward(ref.data(), x.data(), w.data(), b.data(), t, ic, oc);
  for (int64_t i = 0; i < t * oc; ++i) ref[i] += res[i];
  std::snprintf(name, sizeof(name), "linear_fwd residual %s", label);
  expect_close<E>(name, out.get(), ref);
  EXPECT_EQ(resid.get(), res) << "linear_fwd residual: the residual input was written, " << label;
  Dev<E> dinp(pre);
  Dev<float> dweight(prew), dbias(preb);
  Vec rdi = pre, rdw = prew, rdb = preb;
  ndt::cuda::linear_backward<E>(dinp.p, dweight.p, dbias.p, dg.p, dx.p, dw.p, t, ic, oc);
  ndt::cpu::linear_backward(rdi.data(), rdw.data(), rdb.data(), g.data(), x.data(), w.data(), t, ic, oc);
  std::snprintf(name, sizeof(name), "linear_bwd dinp(+=) %s", label);
  expect_close<E>(name, dinp.get(), rdi);
  // dweight/dbias are fp32 outputs of exactly rounded bf16 inputs: fp32 tolerance for both types.
  std::snprintf(name, sizeof(name), "linear_bwd dweight(+=) %s", label);
  expect_close<E>(name, dweight.get(), rdw, 1e-5);
  std::snprintf(name, sizeof(name), "linear_bwd dbias(+=) %s", label);
  expect_close<E>(name, dbias.get(), rdb, 1e-5);
  // Overwriting dinp (beta = 0): the NaN poison in it must not be read.
  dinp.poison();
  Vec rdo(t * ic, 0.f), scratch_w = prew;
  ndt::cuda::linear_backward<E>(dinp.p, nullptr, nullptr, dg.p, dx.p, dw.p, t, ic, oc, 0,
                                /*accumulate_dinp=*/false);
  ndt::cpu::linear_backward(rdo.data(), scratch_w.data(), nullptr, g.data(), x.data(), w.data(), t, ic, oc);
  std::snprintf(name, sizeof(name), "linear_bwd dinp(=) %s", label);
  expect_close<E>(name, dinp.get(), rdo);
}

TYPED_TEST(CudaOps, Linear) {
  NDT_REQUIRE_GPU();
  using E = TypeParam;
  const int64_t fb0 = ndt::cuda::gemm_fallback_count();
  check_linear<E>("37x96->64", T, C, 64, false);
  check_linear<E>("37x96->67", T, C, 67, false);     // OC not a multiple of 8
  check_linear<E>("37x50->40 ub", T, 50, 40, true);  // odd IC, unaligned bias pointer
  check_linear<E>("300x768->259", 300, 768, 259, false);
  std::printf("[info] %s gemm fallbacks (cublasGemmEx) in these cases: %lld\n", tname<E>(),
              static_cast<long long>(ndt::cuda::gemm_fallback_count() - fb0));
}

// Row counts that change from call to call (MoE experts) reuse one algorithm per power-of-two class with
// the call's own sizes (cublaslt.cpp): each size against OpenBLAS, the class's first size first, then
// smaller and larger ones of the same class, and sizes of neighbouring classes.
TYPED_TEST(CudaOps, LinearVaryingRows) {
  NDT_REQUIRE_GPU();
  using E = TypeParam;
  for (int64_t t : {700, 513, 1000, 1024, 650, 129, 1, 3, 2, 64, 65, 2047, 1500})
    check_linear<E>(("rows " + std::to_string(t) + "x176->96").c_str(), t, 176, 96, false);
}

// The loss and gradient in one kernel (one TP rank): the same log-probabilities and gradient as the CPU's
// statistics + backward, at V = 259, 50257 (GPT-2's) and 120001. Rows start at every 16-byte phase (odd V).
TYPED_TEST(CudaOps, CrossEntropyLossBackwardFused) {
  NDT_REQUIRE_GPU();
  using E = TypeParam;
  // (1000 rows: more than the 3 x SMs blocks of the grid, which stride over the rows)
  for (auto [rows, v] : {std::pair<int64_t, int64_t>{T, V}, {9, 50257}, {5, 120001}, {1000, 1031}}) {
    SCOPED_TRACE("V = " + std::to_string(v));
    const Vec logits = rounded<E>(randv(rows * v, 60, 0.1f, 4.f));
    auto targets = randi(rows, 61, 0, static_cast<int32_t>(v + 40));  // a few out of range: target logit 0
    Vec dloss = randv(rows, 62);
    dloss[1] = 0.f;  // a masked row: logprob still computed, gradient 0
    Vec rm(rows), rs(rows), rtl(rows), rlp(rows), rd(rows * v, 0.f);
    ndt::cpu::xent_rowmax(rm.data(), logits.data(), rows, v);
    ndt::cpu::xent_sumexp(rs.data(), logits.data(), rm.data(), rows, v);
    ndt::cpu::xent_target_logit(rtl.data(), logits.data(), targets.data(), rows, v, 0);
    ndt::cpu::xent_logprob(rlp.data(), rtl.data(), rm.data(), rs.data(), rows);
    ndt::cpu::xent_backward(rd.data(), logits.data(), rm.data(), rs.data(), targets.data(), dloss.data(),
                            rows, v, 0);
    DevI dt(targets);
    Dev<E> dl(logits);
    Dev<float> lp(rows), ddl(dloss);
    lp.poison();
    ndt::cuda::xent_loss_backward_inplace<E>(dl.p, lp.p, dt.p, ddl.p, rows, v);
    expect_close<E>("xent_loss_backward_inplace logprob", lp.get(), rlp, 1e-5);
    expect_close<E>("xent_loss_backward_inplace dlogits", dl.get(), rd);
  }
}

// The fused loss-and-gradient kernel against the separate statistics, log-probability and in-place backward
// kernels, bit for bit (the same block shape and per-thread order: a one-rank run and a TP run sum a row
// alike), over more rows than one grid of blocks (which then strides over them).
TYPED_TEST(CudaOps, CrossEntropyFusedEqualsSeparateKernels) {
  NDT_REQUIRE_GPU();
  using E = TypeParam;
  const int64_t rows = 1500, v = 2053;
  const Vec logits = rounded<E>(randv(rows * v, 70, 0.1f, 4.f));
  const auto targets = randi(rows, 71, 0, static_cast<int32_t>(v));
  Vec dloss = randv(rows, 72);
  dloss[7] = dloss[1200] = 0.f;
  DevI dt(targets);
  Dev<E> fused(logits), sep(logits);
  Dev<float> lp(rows), rowmax(rows), sumexp(rows), tl(rows), lp2(rows), ddl(dloss);
  ndt::cuda::xent_loss_backward_inplace<E>(fused.p, lp.p, dt.p, ddl.p, rows, v);
  ndt::cuda::xent_rowmax_sumexp<E>(rowmax.p, sumexp.p, sep.p, rows, v);
  ndt::cuda::xent_target_logit<E>(tl.p, sep.p, dt.p, rows, v, 0);
  ndt::cuda::xent_logprob(lp2.p, tl.p, rowmax.p, sumexp.p, rows);
  ndt::cuda::xent_backward_inplace<E>(sep.p, rowmax.p, sumexp.p, dt.p, ddl.p, rows, v, 0);
  const Vec a = lp.get(), b = lp2.get();
  EXPECT_TRUE(a == b);
  const Vec ga = fused.get(), gb = sep.get();
  EXPECT_TRUE(ga == gb);
  Vec rm(rows), rs(rows), rz(rows * v, 0.f);
  ndt::cpu::xent_rowmax(rm.data(), logits.data(), rows, v);
  ndt::cpu::xent_sumexp(rs.data(), logits.data(), rm.data(), rows, v);
  ndt::cpu::xent_backward(rz.data(), logits.data(), rm.data(), rs.data(), targets.data(), dloss.data(), rows,
                          v, 0);
  expect_close<E>("fused dlogits over many rows", ga, rz);
}

TYPED_TEST(CudaOps, CrossEntropy) {
  NDT_REQUIRE_GPU();
  using E = TypeParam;
  for (int64_t vstart : {int64_t{0}, int64_t{100}}) {
    const Vec logits = rounded<E>(randv(T * V, 50, 0.1f, 4.f));
    auto targets = randi(T, 51, 0, static_cast<int32_t>(vstart + V + 40));  // some outside the shard
    Vec dloss = randv(T, 52);
    dloss[3] = dloss[17] = 0.f;  // skipped rows
    DevI dt(targets);
    Dev<E> dl(logits);
    Dev<float> rowmax(T), sumexp(T), tl(T), lp(T), ddl(dloss);
    Vec rm(T), rs(T), rtl(T), rlp(T);
    ndt::cuda::xent_rowmax<E>(rowmax.p, dl.p, T, V);
    ndt::cpu::xent_rowmax(rm.data(), logits.data(), T, V);
    expect_close<E>("xent_rowmax", rowmax.get(), rm, 1e-6);
    ndt::cuda::xent_sumexp<E>(sumexp.p, dl.p, rowmax.p, T, V);
    ndt::cpu::xent_sumexp(rs.data(), logits.data(), rm.data(), T, V);
    expect_close<E>("xent_sumexp", sumexp.get(), rs, 1e-5);
    rowmax.poison();
    sumexp.poison();
    ndt::cuda::xent_rowmax_sumexp<E>(rowmax.p, sumexp.p, dl.p, T, V);
    expect_close<E>("xent_rowmax_sumexp max", rowmax.get(), rm, 1e-6);
    expect_close<E>("xent_rowmax_sumexp sum", sumexp.get(), rs, 1e-5);
    ndt::cuda::xent_target_logit<E>(tl.p, dl.p, dt.p, T, V, vstart);
    ndt::cpu::xent_target_logit(rtl.data(), logits.data(), targets.data(), T, V, vstart);
    expect_close<E>("xent_target_logit", tl.get(), rtl, 1e-6);
    ndt::cuda::xent_logprob(lp.p, tl.p, rowmax.p, sumexp.p, T);
    ndt::cpu::xent_logprob(rlp.data(), rtl.data(), rm.data(), rs.data(), T);
    expect_close<E>("xent_logprob", lp.get(), rlp, 1e-5);
    // backward from the CPU statistics; accumulating, then in place
    rowmax.upload(rm);
    sumexp.upload(rs);
    const Vec pre = rounded<E>(randv(T * V, 53, 0.01f, 0.1f));
    Dev<E> dlog(pre);
    Vec rd = pre;
    ndt::cuda::xent_backward<E>(dlog.p, dl.p, rowmax.p, sumexp.p, dt.p, ddl.p, T, V, vstart);
    ndt::cpu::xent_backward(rd.data(), logits.data(), rm.data(), rs.data(), targets.data(), dloss.data(), T,
                            V, vstart);
    expect_close<E>("xent_backward(+=)", dlog.get(), rd);
    Vec rz(T * V, 0.f);
    ndt::cpu::xent_backward(rz.data(), logits.data(), rm.data(), rs.data(), targets.data(), dloss.data(), T,
                            V, vstart);
    ndt::cuda::xent_backward_inplace<E>(dl.p, rowmax.p, sumexp.p, dt.p, ddl.p, T, V, vstart);
    expect_close<E>("xent_backward_inplace", dl.get(), rz);
  }
  // TP composition: two vocab shards, fused max/sumexp each, rebased to the global max, summed.
  const Vec logits = rounded<E>(randv(T * V, 54, 0.1f, 4.f));
  const int64_t V0 = 130, V1 = V - V0;
  Vec l0(T * V0), l1(T * V1);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < V; ++j) (j < V0 ? l0[t * V0 + j] : l1[t * V1 + j - V0]) = logits[t * V + j];
  Dev<E> d0(l0), d1(l1);
  Dev<float> m0(T), s0(T), m1(T), s1(T), gm(T);
  ndt::cuda::xent_rowmax_sumexp<E>(m0.p, s0.p, d0.p, T, V0);
  ndt::cuda::xent_rowmax_sumexp<E>(m1.p, s1.p, d1.p, T, V1);
  const Vec hm0 = m0.get(), hm1 = m1.get();
  Vec hg(T);
  for (int64_t t = 0; t < T; ++t) hg[t] = std::max(hm0[t], hm1[t]);
  gm.upload(hg);
  ndt::cuda::xent_rebase_sumexp(s0.p, m0.p, gm.p, T);
  ndt::cuda::xent_rebase_sumexp(s1.p, m1.p, gm.p, T);
  Vec rm(T), rs(T);
  ndt::cpu::xent_rowmax(rm.data(), logits.data(), T, V);
  ndt::cpu::xent_sumexp(rs.data(), logits.data(), rm.data(), T, V);
  expect_close<E>("xent_rebase_sumexp (2 shards)", add(s0.get(), s1.get()), rs, 1e-5);
  // One-rank convenience with a mask
  auto targets = randi(T, 55, 0, static_cast<int32_t>(V));
  Vec mask(T, 1.f);
  mask[5] = mask[20] = 0.f;
  DevI dt(targets);
  Dev<float> dmask(mask), losses(T);
  Dev<E> dl(logits);
  Vec rl(T);
  const double total = ndt::cuda::cross_entropy_forward<E>(losses.p, dl.p, dt.p, dmask.p, T, V);
  const double rtotal =
      ndt::cpu::cross_entropy_forward(rl.data(), logits.data(), targets.data(), mask.data(), T, V);
  expect_close<E>("cross_entropy_forward", losses.get(), rl, 1e-5);
  EXPECT_NEAR(total, rtotal, 1e-5 * std::abs(rtotal));
}

// The optimizer's one launch over many runs against one adamw_update per run, bit for bit: runs with and
// without weight decay, an unaligned start (element path), a run of 3, runs longer than one chunk, the
// bf16 copy on some runs only, and the clip factor.
TEST(CudaOpsOptim, AdamwRunsEqualOneLaunchPerRun) {
  NDT_REQUIRE_GPU();
  const int64_t n = 3 * ndt::cuda::kAdamwChunk + 5001;
  const Vec p = randv(n, 64), g = randv(n, 65, 0.001f, 0.1f), m = randv(n, 66, 0.001f, 0.01f);
  Vec v = randv(n, 67, 0.0001f, 0.001f);
  for (auto& x : v) x = std::abs(x);
  struct Span {
    int64_t b, e;
    bool decay, copy;
  };
  const Span spans[] = {{0, 1000, true, true},
                        {1000, 1003, false, true},
                        {1003, 2 * ndt::cuda::kAdamwChunk + 7, true, false},
                        {2 * ndt::cuda::kAdamwChunk + 7, n, false, true}};
  Dev<float> p1(p), g1(g), m1(m), v1(v), p2(p), g2(g), m2(m), v2(v);
  Dev<bf16> c1(n), c2(n);
  NDT_CUDA_CHECK(cudaMemset(c1.p, 0, n * sizeof(bf16)));
  NDT_CUDA_CHECK(cudaMemset(c2.p, 0, n * sizeof(bf16)));
  std::vector<ndt::cuda::AdamwRun> runs;
  for (const Span& sp : spans) {
    ndt::cuda::adamw_update(p1.p + sp.b, g1.p + sp.b, m1.p + sp.b, v1.p + sp.b, sp.e - sp.b, 1e-3f, 0.9f,
                            0.95f, 1e-8f, sp.decay ? 0.1f : 0.0f, 3, sp.copy ? c1.p + sp.b : nullptr, 0.5f);
    runs.push_back({p2.p + sp.b, g2.p + sp.b, m2.p + sp.b, v2.p + sp.b, sp.copy ? c2.p + sp.b : nullptr,
                    sp.e - sp.b, 0, sp.decay ? 1 : 0, 0});
  }
  const int64_t chunks = ndt::cuda::adamw_plan_runs(runs.data(), static_cast<int>(runs.size()));
  EXPECT_EQ(runs[2].vec, 0);  // starts at element 1003: not 16-byte aligned
  EXPECT_EQ(runs[0].vec, 1);
  ndt::cuda::AdamwRun* dev_runs = nullptr;
  NDT_CUDA_CHECK(cudaMalloc(&dev_runs, runs.size() * sizeof(ndt::cuda::AdamwRun)));
  NDT_CUDA_CHECK(
      cudaMemcpy(dev_runs, runs.data(), runs.size() * sizeof(ndt::cuda::AdamwRun), cudaMemcpyHostToDevice));
  ndt::cuda::adamw_update_runs(dev_runs, static_cast<int>(runs.size()), chunks, 1e-3f, 0.9f, 0.95f, 1e-8f,
                               0.1f, 3, 0.5f);
  EXPECT_EQ(p2.get(), p1.get());
  EXPECT_EQ(m2.get(), m1.get());
  EXPECT_EQ(v2.get(), v1.get());
  EXPECT_EQ(c2.get(), c1.get());
  NDT_CUDA_CHECK(cudaFree(dev_runs));
}

// The step decided on the device (core/step_control.h): the one-thread kernel against the same function on
// the host, field for field and bit for bit, over finite, clipped, non-finite and stopping steps; then AdamW
// reading its scalars from the control block against the host's step and clip factor (bit for bit), and
// changing nothing where the control says skip.
TEST(CudaOpsOptim, DecideStepKernelEqualsHost) {
  NDT_REQUIRE_GPU();
  std::vector<double> bc(2 * 16, 0.0);
  for (int k = 1; k < 16; ++k) {
    bc[2 * k] = 1.0 - std::pow(static_cast<double>(0.9f), 3.0 + k);
    bc[2 * k + 1] = 1.0 - std::pow(static_cast<double>(0.95f), 3.0 + k);
  }
  double* dbc = nullptr;
  NDT_CUDA_CHECK(cudaMalloc(&dbc, bc.size() * sizeof(double)));
  NDT_CUDA_CHECK(cudaMemcpy(dbc, bc.data(), bc.size() * sizeof(double), cudaMemcpyHostToDevice));
  ndt::StepDecision d;
  d.lr = 2.5e-3f;
  d.clip = 1.0;
  d.base = 3;
  d.max_consecutive = 2;
  ndt::StepControl host;
  host.opt_steps = 3;
  ndt::StepControl* dev_control = nullptr;
  ndt::StepRecord* dev_record = nullptr;
  NDT_CUDA_CHECK(cudaMalloc(&dev_control, sizeof(ndt::StepControl)));
  NDT_CUDA_CHECK(cudaMalloc(&dev_record, sizeof(ndt::StepRecord)));
  NDT_CUDA_CHECK(cudaMemcpy(dev_control, &host, sizeof(host), cudaMemcpyHostToDevice));
  const double squares[] = {0.37, 17.25, 1.0, NAN, 4.0e-3, INFINITY, 2.0, 9.0};
  const double losses[] = {3.5, 2.25, 1.0, 1.0, NAN, 1.0, 1.0, 1.0};
  for (int i = 0; i < 8; ++i) {
    host.sum_squares = squares[i];
    host.loss_sum = losses[i];
    NDT_CUDA_CHECK(cudaMemcpy(dev_control, &host, 2 * sizeof(double), cudaMemcpyHostToDevice));
    ndt::StepRecord want, got;
    ndt::StepDecision dd = d;
    dd.bias_corrections = dbc;
    ndt::cuda::decide_step(dev_control, dd, dev_record);
    dd.bias_corrections = bc.data();
    ndt::decide_step(host, dd, want);
    ndt::StepControl got_control;
    NDT_CUDA_CHECK(cudaMemcpy(&got, dev_record, sizeof(got), cudaMemcpyDeviceToHost));
    NDT_CUDA_CHECK(cudaMemcpy(&got_control, dev_control, sizeof(got_control), cudaMemcpyDeviceToHost));
    EXPECT_EQ(std::memcmp(&got, &want, sizeof(got)), 0) << i;
    EXPECT_EQ(std::memcmp(&got_control, &host, sizeof(host)), 0) << i;
  }
  EXPECT_EQ(host.stopped, 1);  // steps 3 and 4 non-finite in a row (the limit 2), so step 5 on skips
  EXPECT_EQ(host.opt_steps, 6);

  // AdamW under a control block of a finite, clipped step 4 against the host's scalars.
  const int64_t n = 2 * ndt::cuda::kAdamwChunk + 333;
  const Vec p = randv(n, 70), g = randv(n, 71, 0.001f, 0.1f), m = randv(n, 72, 0.001f, 0.01f);
  Vec v = randv(n, 73, 0.0001f, 0.001f);
  for (auto& x : v) x = std::abs(x);
  ndt::StepControl c;
  c.opt_steps = 3;
  c.sum_squares = 6.25;  // norm 2.5: clipped
  c.loss_sum = 1.0;
  ndt::StepRecord r;
  d.bias_corrections = bc.data();
  ndt::decide_step(c, d, r);
  ASSERT_EQ(c.skip, 0);
  ASSERT_EQ(c.clipped, 1);
  Dev<float> p1(p), g1(g), m1(m), v1(v), p2(p), g2(g), m2(m), v2(v);
  std::vector<ndt::cuda::AdamwRun> runs1 = {{p1.p, g1.p, m1.p, v1.p, nullptr, n, 0, 1, 0}};
  std::vector<ndt::cuda::AdamwRun> runs2 = {{p2.p, g2.p, m2.p, v2.p, nullptr, n, 0, 1, 0}};
  const int64_t chunks = ndt::cuda::adamw_plan_runs(runs1.data(), 1);
  ndt::cuda::adamw_plan_runs(runs2.data(), 1);
  ndt::cuda::AdamwRun* dev_runs = nullptr;
  NDT_CUDA_CHECK(cudaMalloc(&dev_runs, 2 * sizeof(ndt::cuda::AdamwRun)));
  NDT_CUDA_CHECK(cudaMemcpy(dev_runs, runs1.data(), sizeof(ndt::cuda::AdamwRun), cudaMemcpyHostToDevice));
  NDT_CUDA_CHECK(cudaMemcpy(dev_runs + 1, runs2.data(), sizeof(ndt::cuda::AdamwRun), cudaMemcpyHostToDevice));
  ndt::cuda::adamw_update_runs(dev_runs, 1, chunks, d.lr, 0.9f, 0.95f, 1e-8f, 0.1f, 4, c.grad_scale);
  NDT_CUDA_CHECK(cudaMemcpy(dev_control, &c, sizeof(c), cudaMemcpyHostToDevice));
  ndt::cuda::adamw_update_runs(dev_runs + 1, 1, chunks, d.lr, 0.9f, 0.95f, 1e-8f, 0.1f, 0, 1.0f, 0,
                               dev_control);
  EXPECT_EQ(p2.get(), p1.get());
  EXPECT_EQ(m2.get(), m1.get());
  EXPECT_EQ(v2.get(), v1.get());
  c.skip = 1;  // a skipped step: nothing changes
  NDT_CUDA_CHECK(cudaMemcpy(dev_control, &c, sizeof(c), cudaMemcpyHostToDevice));
  ndt::cuda::adamw_update_runs(dev_runs + 1, 1, chunks, d.lr, 0.9f, 0.95f, 1e-8f, 0.1f, 0, 1.0f, 0,
                               dev_control);
  EXPECT_EQ(p2.get(), p1.get());
  EXPECT_EQ(m2.get(), m1.get());
  NDT_CUDA_CHECK(cudaFree(dev_runs));
  NDT_CUDA_CHECK(cudaFree(dev_control));
  NDT_CUDA_CHECK(cudaFree(dev_record));
  NDT_CUDA_CHECK(cudaFree(dbc));
}

TEST(CudaOpsOptim, AdamwSumSquaresCast) {
  NDT_REQUIRE_GPU();
  const int64_t n = 1000003;  // odd: vector body + tail
  const Vec p = randv(n, 60), g = randv(n, 61, 0.001f, 0.1f), m = randv(n, 62, 0.001f, 0.01f);
  Vec v = randv(n, 63, 0.0001f, 0.001f);
  for (auto& x : v) x = std::abs(x);
  for (float gs : {1.0f, 0.5f}) {
    Dev<float> dp(p), dg(g), dm(m), dv(v);
    Dev<bf16> pb(n);
    Vec rp = p, rm = m, rv = v, rg = g;
    for (auto& x : rg) x *= gs;
    ndt::cuda::adamw_update(dp.p, dg.p, dm.p, dv.p, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 3,
                            gs == 1.0f ? pb.p : nullptr, gs);
    ndt::cpu::adamw_update(rp.data(), rg.data(), rm.data(), rv.data(), n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 3);
    expect_close<float>(gs == 1.0f ? "adamw param" : "adamw param (grad_scale)", dp.get(), rp);
    expect_close<float>("adamw m", dm.get(), rm);
    expect_close<float>("adamw v", dv.get(), rv);
    if (gs == 1.0f) expect_close<bf16>("adamw param_bf16", pb.get(), rounded<bf16>(rp), 1e-4);
  }
  // sum of squares (double; deterministic), device result with accumulate
  Dev<float> dx(p);
  const double ref = ndt::cpu::sum_squares(p.data(), n);
  const double got = ndt::cuda::sum_squares(dx.p, n);
  std::printf("[err] %-28s %-4s %.3e (tol 1e-12)\n", "sum_squares", "f64", std::abs(got - ref) / ref);
  EXPECT_NEAR(got, ref, 1e-12 * ref);
  Dev<double> acc(1);
  ndt::cuda::sum_squares_device(acc.p, dx.p, n);
  ndt::cuda::sum_squares_device(acc.p, dx.p + 1, n - 1, true);  // unaligned pointer, accumulated
  double h = 0;
  NDT_CUDA_CHECK(cudaMemcpy(&h, acc.p, sizeof(double), cudaMemcpyDeviceToHost));
  const double ref2 = ref + ndt::cpu::sum_squares(p.data() + 1, n - 1);
  EXPECT_NEAR(h, ref2, 1e-12 * ref2);
  // casts
  Dev<bf16> b(n);
  ndt::cuda::cast(b.p, dx.p, n);
  expect_close<bf16>("cast f32->bf16", b.get(), rounded<bf16>(p), 1e-7);
  Dev<float> f(n);
  ndt::cuda::cast(f.p, b.p, n);
  expect_close<float>("cast bf16->f32", f.get(), rounded<bf16>(p), 1e-7);
}

// ---- timings (device runs only: --gtest_also_run_disabled_tests --gtest_filter='CudaKernelBench*') ----
using ndt::testing::time_ms;

TEST(CudaKernelBench, DISABLED_Timings) {
  NDT_REQUIRE_GPU();
  std::printf("device: %s\n", ndt::cuda::device_name(0).c_str());
  const int64_t t = 16384, ic = 768, oc = 3072;
  Dev<bf16> x(randv(t * ic, 1)), w(randv(oc * ic, 2)), bias(randv(oc, 3)), out(t * oc), g(randv(t * oc, 4));
  Dev<bf16> dx(t * ic);
  Dev<float> dw(oc * ic), db(oc);
  const double flop = 2.0 * t * ic * oc;
  double ms = time_ms([&] { ndt::cuda::linear_forward<bf16>(out.p, x.p, w.p, bias.p, t, ic, oc); });
  std::printf("[time] linear_fwd bf16 +bias  T=%lld IC=%lld OC=%lld: %.3f ms, %.1f TFLOP/s\n", (long long)t,
              (long long)ic, (long long)oc, ms, flop / ms * 1e-9);
  ms = time_ms([&] { ndt::cuda::linear_forward<bf16>(out.p, x.p, w.p, nullptr, t, ic, oc); });
  std::printf("[time] linear_fwd bf16 nobias: %.3f ms, %.1f TFLOP/s\n", ms, flop / ms * 1e-9);
  ms = time_ms([&] { ndt::cuda::linear_backward<bf16>(dx.p, nullptr, nullptr, g.p, x.p, w.p, t, ic, oc); });
  std::printf("[time] linear_bwd dinp bf16: %.3f ms, %.1f TFLOP/s\n", ms, flop / ms * 1e-9);
  ms = time_ms([&] { ndt::cuda::linear_backward<bf16>(nullptr, dw.p, nullptr, g.p, x.p, w.p, t, ic, oc); });
  std::printf("[time] linear_bwd dweight bf16->f32: %.3f ms, %.1f TFLOP/s\n", ms, flop / ms * 1e-9);
  ms = time_ms([&] { ndt::cuda::bias_backward<bf16>(db.p, g.p, t, oc); });
  std::printf("[time] bias_backward bf16 (T=%lld, OC=%lld): %.3f ms, %.0f GB/s\n", (long long)t,
              (long long)oc, ms, 2.0 * t * oc / ms * 1e-6);
  {  // norms and activations at GPT-2 small sizes
    Dev<bf16> h(randv(t * ic, 5)), hw(randv(ic, 6)), hb(randv(ic, 7)), ho(t * ic);
    Dev<float> mean(t), rstd(t);
    ms = time_ms(
        [&] { ndt::cuda::layernorm_forward<bf16>(ho.p, mean.p, rstd.p, h.p, hw.p, hb.p, t, ic, 1e-5f); });
    std::printf("[time] layernorm_fwd bf16 (%lldx%lld): %.3f ms, %.0f GB/s\n", (long long)t, (long long)ic,
                ms, 4.0 * t * ic / ms * 1e-6);
    ms = time_ms([&] {
      ndt::cuda::layernorm_backward<bf16>(ho.p, dw.p, db.p, h.p, h.p, hw.p, mean.p, rstd.p, t, ic);
    });
    std::printf("[time] layernorm_bwd bf16: %.3f ms\n", ms);
    // As in a step: the residual gradient added (dres) and dinp's column sums for the previous bias (dsum);
    // bytes: dout, inp, dres read and dinp written.
    Dev<bf16> hg(randv(t * ic, 13)), hd(t * ic);
    Dev<float> ds(ic);
    ms = time_ms([&] {
      ndt::cuda::layernorm_backward<bf16>(hd.p, dw.p, db.p, hg.p, h.p, hw.p, mean.p, rstd.p, t, ic, nullptr,
                                          ho.p, ds.p);
    });
    std::printf("[time] layernorm_bwd bf16 +dres +dsum (%lldx%lld): %.3f ms, %.0f GB/s\n", (long long)t,
                (long long)ic, ms, 8.0 * t * ic / ms * 1e-6);
    ms = time_ms([&] { ndt::cuda::gelu_forward<bf16>(out.p, g.p, t * oc); });
    std::printf("[time] gelu_fwd bf16 (%lld): %.3f ms, %.0f GB/s\n", (long long)(t * oc), ms,
                4.0 * t * oc / ms * 1e-6);
  }
  {  // the 1B Llama's RMSNorm backward (one microbatch of 4 x 2048 rows, d_model 2048)
    const int64_t tl = 8192, cl = 2048;
    Dev<bf16> h(randv(tl * cl, 14)), hg(randv(tl * cl, 15)), hr(randv(tl * cl, 16)), hw(randv(cl, 17)),
        hd(tl * cl);
    Dev<float> rstd(randv(tl, 18)), dwl(cl);
    ms = time_ms([&] {
      ndt::cuda::rmsnorm_backward<bf16>(hd.p, dwl.p, hg.p, h.p, hw.p, rstd.p, tl, cl, nullptr, hr.p, nullptr);
    });
    std::printf("[time] rmsnorm_bwd bf16 +dres (%lldx%lld): %.3f ms, %.0f GB/s\n", (long long)tl,
                (long long)cl, ms, 8.0 * tl * cl / ms * 1e-6);
  }
  {  // cross-entropy at GPT-2 vocab
    const int64_t v = 50257, tt = 8192;
    Dev<bf16> logits(randv(tt * v, 8));
    Dev<float> m(tt), s(tt), dl(randv(tt, 9));
    DevI tg(randi(tt, 10, 0, static_cast<int32_t>(v)));
    ms = time_ms([&] { ndt::cuda::xent_rowmax_sumexp<bf16>(m.p, s.p, logits.p, tt, v); });
    std::printf("[time] xent_rowmax_sumexp bf16 (%lldx%lld): %.3f ms, %.0f GB/s\n", (long long)tt,
                (long long)v, ms, 2.0 * tt * v / ms * 1e-6);
    ms = time_ms([&] { ndt::cuda::xent_backward_inplace<bf16>(logits.p, m.p, s.p, tg.p, dl.p, tt, v, 0); });
    std::printf("[time] xent_backward_inplace bf16: %.3f ms, %.0f GB/s\n", ms, 4.0 * tt * v / ms * 1e-6);
    Dev<float> lp(tt);
    ms = time_ms([&] { ndt::cuda::xent_loss_backward_inplace<bf16>(logits.p, lp.p, tg.p, dl.p, tt, v); });
    std::printf("[time] xent_loss_backward_inplace bf16 (one pass): %.3f ms, %.0f GB/s\n", ms,
                4.0 * tt * v / ms * 1e-6);
  }
  {  // embedding backward, GPT-2 sizes
    const int64_t v = 50257;
    Dev<float> dtab(v * ic);
    DevI ids(randi(t, 11, 0, static_cast<int32_t>(v)));
    ms = time_ms([&] { ndt::cuda::embedding_backward<bf16>(dtab.p, x.p, ids.p, t, v, ic, 0); });
    std::printf("[time] embedding_backward bf16 (T=%lld, C=%lld): %.3f ms\n", (long long)t, (long long)ic,
                ms);
    // Byte-level text: ~100 distinct ids, the most frequent (space) ~17% of the tokens.
    auto skew = randi(t, 12, 0, 1 << 20);
    for (auto& id : skew) id = static_cast<int32_t>(100.0 * std::pow(id / double(1 << 20), 3.0));
    DevI sk(skew);
    ms = time_ms([&] { ndt::cuda::embedding_backward<bf16>(dtab.p, x.p, sk.p, t, v, ic, 0); });
    std::printf("[time] embedding_backward bf16, skewed ids (T=%lld, C=%lld): %.3f ms\n", (long long)t,
                (long long)ic, ms);
  }
  {  // AdamW over GPT-2 124M parameters
    const int64_t n = 124439808;
    Dev<float> p(n), gr(n), m(n), v(n);
    Dev<bf16> pb(n);
    for (float* q : {p.p, gr.p, m.p, v.p}) NDT_CUDA_CHECK(cudaMemset(q, 0, sizeof(float) * n));
    ms = time_ms(
        [&] { ndt::cuda::adamw_update(p.p, gr.p, m.p, v.p, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 1, pb.p); });
    std::printf("[time] adamw 124M (+bf16 copy): %.3f ms, %.0f GB/s\n", ms, 30.0 * n / ms * 1e-6);
    ms =
        time_ms([&] { ndt::cuda::adamw_update(p.p, gr.p, m.p, v.p, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 1); });
    std::printf("[time] adamw 124M (fp32 only):  %.3f ms, %.0f GB/s\n", ms, 28.0 * n / ms * 1e-6);
    ms = time_ms([&] { ndt::cuda::sum_squares(gr.p, n); });
    std::printf("[time] sum_squares 124M (host result): %.3f ms, %.0f GB/s\n", ms, 4.0 * n / ms * 1e-6);
  }
}

}  // namespace
