// The residual add fused with the next norm (ops::add_layernorm_forward / add_rmsnorm_forward) on random
// inputs rounded to the device type:
// - against the two GPU ops it replaces (ops::add, then the norm): bit for bit, h, out, mean and rstd;
// - against the CPU twin: h = add(a, b, rbias) within relative L2 error 1e-2 in bf16 (one rounding), 1e-5 in
//   fp32; the norm against the CPU norm of h as the device holds it (rounded to bf16), since the device's
//   norm reads the stored h: out within 1e-2 (bf16) / 1e-5 (fp32), mean and rstd (fp32 statistics) 1e-5.
// Shapes cover the block-per-row kernel (T <= 256, decode steps), the warp-per-row kernel, a row length
// that is not a multiple of the vector width, and the residual bias present or absent.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <tuple>

#include "cuda/runtime.h"
#include "gpu_test.h"
#include "ops/ops.h"

namespace ndt {
namespace {

Tensor randn(Shape s, uint32_t seed, float mean, float sd) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(mean, sd);
  Tensor t = Tensor::empty(std::move(s));
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = d(rng);
  return t;
}

using testing::expect_close;

void expect_same_bits(const char* what, const Tensor& a, const Tensor& b) {
  const Tensor ha = a.to(Device::CPU), hb = b.to(Device::CPU);
  ASSERT_EQ(ha.nbytes(), hb.nbytes()) << what;
  EXPECT_EQ(std::memcmp(ha.data_ptr(), hb.data_ptr(), ha.nbytes()), 0)
      << what << ": fused differs from add + norm";
}

void check(DType dt, int64_t T, int64_t C, bool rms, bool with_bias) {
  SCOPED_TRACE(::testing::Message() << (dt == DType::BF16 ? "bf16" : "f32") << " T=" << T << " C=" << C
                                    << (rms ? " rmsnorm" : " layernorm") << (with_bias ? " +bias" : ""));
  const double tol = dt == DType::BF16 ? 1e-2 : 1e-5;
  auto rounded = [&](const Tensor& h) { return ops::to_host_f32(testing::to_device_as(h, dt)); };
  // A residual stream with an offset (LayerNorm's mean matters) plus a smaller branch output.
  const Tensor a = rounded(randn({T, C}, 1, 0.5f, 1.f)), b = rounded(randn({T, C}, 2, 0.f, 0.3f)),
               rb = rounded(randn({C}, 3, 0.f, 0.1f)), w = rounded(randn({C}, 4, 1.f, 0.2f)),
               nb = rounded(randn({C}, 5, 0.f, 0.2f));
  const Tensor* rbias = with_bias ? &rb : nullptr;
  // CPU twin.
  Tensor h, out = Tensor::empty({T, C}), mean = Tensor::empty({T}), rstd = Tensor::empty({T});
  // GPU inputs.
  const Tensor da = testing::to_device_as(a, dt), db = testing::to_device_as(b, dt),
               drb = testing::to_device_as(rb, dt), dw = testing::to_device_as(w, dt),
               dnb = testing::to_device_as(nb, dt);
  const Tensor* drbias = with_bias ? &drb : nullptr;
  Tensor gh, gout = Tensor::empty({T, C}, dt, Device::CUDA),
             gmean = Tensor::zeros({T}, DType::F32, Device::CUDA),
             grstd = Tensor::empty({T}, DType::F32, Device::CUDA);
  Tensor rout = Tensor::empty({T, C}, dt, Device::CUDA), rmean = Tensor::zeros({T}, DType::F32, Device::CUDA),
         rrstd = Tensor::empty({T}, DType::F32, Device::CUDA);
  h = ops::add(a, b, rbias);
  const Tensor h_dev = rounded(h);  // what the device stores and its norm reads
  if (rms) {
    ops::rmsnorm_forward(out, rstd, h_dev, w, 1e-6f);
    ops::add_rmsnorm_forward(gh, gout, grstd, da, db, drbias, dw, 1e-6f);
    const Tensor rh = ops::add(da, db, drbias);
    ops::rmsnorm_forward(rout, rrstd, rh, dw, 1e-6f);
    expect_same_bits("h", gh, rh);
  } else {
    ops::layernorm_forward(out, mean, rstd, h_dev, w, nb, 1e-5f);
    ops::add_layernorm_forward(gh, gout, gmean, grstd, da, db, drbias, dw, dnb, 1e-5f);
    const Tensor rh = ops::add(da, db, drbias);
    ops::layernorm_forward(rout, rmean, rrstd, rh, dw, dnb, 1e-5f);
    expect_same_bits("h", gh, rh);
    expect_same_bits("mean", gmean, rmean);
    expect_close("mean", gmean, mean, 1e-5);
  }
  expect_same_bits("out", gout, rout);
  expect_same_bits("rstd", grstd, rrstd);
  expect_close("h", gh, h, tol);
  expect_close("out", gout, out, tol);
  expect_close("rstd", grstd, rstd, 1e-5);
}

TEST(CudaAddNorm, EqualsAddThenNormAndMatchesCpuTwin) {
  NDT_REQUIRE_GPU();
  for (DType dt : {DType::BF16, DType::F32})
    for (auto [T, C] : {std::pair<int64_t, int64_t>{3, 2048}, {64, 768}, {300, 768}, {1000, 100}})
      for (bool rms : {true, false})
        for (bool with_bias : {true, false}) check(dt, T, C, rms, with_bias);
}

TEST(CudaAddNorm, MismatchedShapesAreErrors) {
  NDT_REQUIRE_GPU();
  Tensor a = Tensor::zeros({4, 8}, DType::BF16, Device::CUDA),
         b = Tensor::zeros({4, 6}, DType::BF16, Device::CUDA);
  Tensor w = Tensor::zeros({8}, DType::BF16, Device::CUDA), h,
         out = Tensor::empty({4, 8}, DType::BF16, Device::CUDA),
         rstd = Tensor::empty({4}, DType::F32, Device::CUDA);
  EXPECT_THROW(ops::add_rmsnorm_forward(h, out, rstd, a, b, nullptr, w, 1e-6f), Error);
  Tensor bad_bias = Tensor::zeros({6}, DType::BF16, Device::CUDA);
  EXPECT_THROW(ops::add_rmsnorm_forward(h, out, rstd, a, a, &bad_bias, w, 1e-6f), Error);
}

}  // namespace
}  // namespace ndt

namespace ndt {
namespace {

// Timing (never an assertion): the fused kernel against add + norm at GPT-2's training shape (16 x 1024
// rows of 768, LayerNorm) and the 1B model's decode shape (64 rows of 2048, RMSNorm). Run with
// --gtest_also_run_disabled_tests --gtest_filter='CudaAddNormBench.*'.
TEST(CudaAddNormBench, DISABLED_FusedAgainstSeparate) {
  NDT_REQUIRE_GPU();
  for (auto [T, C, rms] : {std::tuple<int64_t, int64_t, bool>{16384, 768, false}, {64, 2048, true}}) {
    Tensor a = Tensor::zeros({T, C}, DType::BF16, Device::CUDA),
           b = Tensor::zeros({T, C}, DType::BF16, Device::CUDA);
    Tensor w = Tensor::zeros({C}, DType::BF16, Device::CUDA),
           nb = Tensor::zeros({C}, DType::BF16, Device::CUDA);
    Tensor h, out = Tensor::empty({T, C}, DType::BF16, Device::CUDA),
              mean = Tensor::empty({T}, DType::F32, Device::CUDA),
              rstd = Tensor::empty({T}, DType::F32, Device::CUDA);
    auto fused = [&] {
      if (rms)
        ops::add_rmsnorm_forward(h, out, rstd, a, b, &nb, w, 1e-6f);
      else
        ops::add_layernorm_forward(h, out, mean, rstd, a, b, &nb, w, nb, 1e-5f);
    };
    auto separate = [&] {
      h = ops::add(a, b, &nb);
      if (rms)
        ops::rmsnorm_forward(out, rstd, h, w, 1e-6f);
      else
        ops::layernorm_forward(out, mean, rstd, h, w, nb, 1e-5f);
    };
    const double tf = testing::time_ms(fused, 200, cuda::stream()),
                 ts = testing::time_ms(separate, 200, cuda::stream());
    std::printf("[time] add+%s (%lld x %lld) bf16: fused %.2f us, add then norm %.2f us\n",
                rms ? "rmsnorm" : "layernorm", static_cast<long long>(T), static_cast<long long>(C), tf * 1e3,
                ts * 1e3);
  }
}

}  // namespace
}  // namespace ndt
