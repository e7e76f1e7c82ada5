// GPT-2's MLP GELU fused into cuBLASLt epilogues (ops::linear_gelu_forward / linear_dgelu_backward) against
// the CPU composite (linear_forward + gelu_forward; linear_backward + gelu_backward) on random inputs
// rounded to the device type, so both sides start from the same values. GPU outputs are NaN-poisoned first.
// Tolerance: relative L2 error ||gpu - cpu|| / ||cpu||: bf16 <= 1e-2 (act and dpre are rounded once to bf16,
// and the fused GELU reads the fp32 accumulator where the CPU reads fp32 too; the aux pre-activation is the
// bf16 rounding of it), fp32 <= 1e-5 (never fused: the exact-fp32 kernels). dweight is an fp32 output of
// bf16 inputs: 1e-5 for both types. gemm_gelu_count() tells whether the fused path ran.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "cuda/cublaslt.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_ops.h"
#include "cuda/runtime.h"
#include "gpu_test.h"
#include "ops/ops.h"

namespace ndt {
namespace {

// Normal values of standard deviation sd (weights ~ 1/sqrt(fan_in): pre-activations of order 1, where the
// GELU bends).
Tensor randn(Shape s, uint32_t seed, float sd) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.f, sd);
  Tensor t = Tensor::empty(std::move(s));
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = d(rng);
  return t;
}

// The host values a device tensor of type dt holds (bf16 rounding).
Tensor rounded(const Tensor& host, DType dt) { return ops::to_host_f32(testing::to_device_as(host, dt)); }

Tensor poisoned(Shape s, DType dt) {
  Tensor t = Tensor::empty(std::move(s), dt, Device::CUDA);
  NDT_CUDA_CHECK(cudaMemsetAsync(t.data_ptr(), 0xFF, t.nbytes(), cuda::stream()));  // NaN in f32 and bf16
  return t;
}

using testing::expect_close;

// One MLP: x(T, C) -> pre = x @ W1^T + b1 (T, F), act = gelu(pre), out = act @ W2^T; backward from dout(T,
// C). fused: whether the bf16 epilogues must run (forward and backward one fused matmul each).
void check_mlp(DType dt, int64_t T, int64_t C, int64_t F, bool with_bias, bool fused) {
  char label[96];
  std::snprintf(label, sizeof(label), "%s T=%lld C=%lld F=%lld%s", dt == DType::BF16 ? "bf16" : "f32",
                static_cast<long long>(T), static_cast<long long>(C), static_cast<long long>(F),
                with_bias ? "" : " nobias");
  SCOPED_TRACE(label);
  const double tol = dt == DType::BF16 ? 1e-2 : 1e-5;
  const float w_sd = 1.0f / std::sqrt(static_cast<float>(C)), w2_sd = 1.0f / std::sqrt(static_cast<float>(F));
  const Tensor x = rounded(randn({T, C}, 1, 1.f), dt), w1 = rounded(randn({F, C}, 2, w_sd), dt),
               b1 = rounded(randn({F}, 3, 0.5f), dt), w2 = rounded(randn({C, F}, 4, w2_sd), dt),
               dout = rounded(randn({T, C}, 5, 1.f), dt);
  const Tensor* bias = with_bias ? &b1 : nullptr;
  const int64_t before = cuda::gemm_gelu_count();

  // Forward
  Tensor pre = Tensor::empty({T, F}), act = Tensor::empty({T, F});
  ops::linear_gelu_forward(act, pre, x, w1, bias);  // CPU: exactly linear_forward + gelu_forward
  const Tensor dx = testing::to_device_as(x, dt), dw1 = testing::to_device_as(w1, dt),
               db1 = testing::to_device_as(b1, dt), dw2 = testing::to_device_as(w2, dt),
               ddout = testing::to_device_as(dout, dt);
  Tensor gpre = poisoned({T, F}, dt), gact = poisoned({T, F}, dt);
  ops::linear_gelu_forward(gact, gpre, dx, dw1, with_bias ? &db1 : nullptr);
  char what[160];
  std::snprintf(what, sizeof(what), "linear_gelu_fwd pre %s", label);
  expect_close(what, gpre, pre, tol);
  std::snprintf(what, sizeof(what), "linear_gelu_fwd act %s", label);
  expect_close(what, gact, act, tol);
  EXPECT_EQ(cuda::gemm_gelu_count() - before, fused ? 1 : 0) << "forward fused";

  // Backward from the CPU activations (rounded), so that only the backward is measured.
  const Tensor rpre = rounded(pre, dt), ract = rounded(act, dt);
  const Tensor w2grad0 = randn({C, F}, 6, 0.1f);  // dweight accumulates
  Tensor dpre = Tensor::empty({T, F}), w2grad = w2grad0.clone();
  ops::linear_dgelu_backward(dpre, w2grad, dout, ract, w2, rpre);
  Tensor gdpre = poisoned({T, F}, dt), gw2grad = w2grad0.to(Device::CUDA);
  ops::linear_dgelu_backward(gdpre, gw2grad, ddout, testing::to_device_as(ract, dt), dw2,
                             testing::to_device_as(rpre, dt));
  std::snprintf(what, sizeof(what), "linear_dgelu_bwd dpre %s", label);
  expect_close(what, gdpre, dpre, tol);
  std::snprintf(what, sizeof(what), "linear_dgelu_bwd dweight(+=) %s", label);
  expect_close(what, gw2grad, w2grad, 1e-5);
  EXPECT_EQ(cuda::gemm_gelu_count() - before, fused ? 2 : 0) << "backward fused";
}

TEST(CudaLinearGelu, Bf16Fused) {
  NDT_REQUIRE_GPU();
  check_mlp(DType::BF16, 64, 96, 256, true, true);
  check_mlp(DType::BF16, 37, 96, 64, true, true);  // odd token count
  check_mlp(DType::BF16, 40, 64, 128, false, true);
  check_mlp(DType::BF16, 256, 768, 3072, true, true);  // a GPT-2 small layer
}

// MLP widths that are not multiples of 8: no fused epilogue (aux leading dim), the composite instead.
TEST(CudaLinearGelu, Bf16OddWidthFallsBack) {
  NDT_REQUIRE_GPU();
  check_mlp(DType::BF16, 37, 50, 67, true, false);
  check_mlp(DType::BF16, 16, 24, 36, false, false);
}

// fp32 keeps the exact-fp32 composite (never fused).
TEST(CudaLinearGelu, F32Composite) {
  NDT_REQUIRE_GPU();
  check_mlp(DType::F32, 37, 96, 64, true, false);
  check_mlp(DType::F32, 37, 50, 67, true, false);
}

// Misaligned aux (pre) or bias pointers: the cuda entry points refuse (return false) and write nothing.
TEST(CudaLinearGelu, UnalignedPointersRefused) {
  NDT_REQUIRE_GPU();
  const int64_t T = 8, IC = 16, OC = 32;
  Tensor inp = poisoned({T, IC}, DType::BF16), w = poisoned({OC, IC}, DType::BF16);
  Tensor b = poisoned({OC + 8}, DType::BF16), out = poisoned({T * OC + 8}, DType::BF16),
         pre = poisoned({T * OC + 8}, DType::BF16);
  using bf = __nv_bfloat16;
  auto* po = static_cast<bf*>(out.data_ptr());
  auto* pp = static_cast<bf*>(pre.data_ptr());
  auto* pb = static_cast<bf*>(b.data_ptr());
  const auto* pi = static_cast<const bf*>(inp.data_ptr());
  const auto* pw = static_cast<const bf*>(w.data_ptr());
  const int64_t before = cuda::gemm_gelu_count();
  cudaStream_t st = cuda::stream();
  EXPECT_FALSE(cuda::linear_gelu_forward(po, pp + 1, pi, pw, pb, T, IC, OC, st));  // aux off by one element
  EXPECT_FALSE(cuda::linear_gelu_forward(po, pp, pi, pw, pb + 1, T, IC, OC, st));  // bias off by one element
  EXPECT_FALSE(cuda::linear_dgelu_backward(po, pi, pw, pp + 1, T, OC, IC, st));    // aux off by one element
  EXPECT_EQ(cuda::gemm_gelu_count(), before);
  // Nothing was written: the outputs still hold the poison.
  const std::vector<uint16_t> expect(static_cast<size_t>(T * OC + 8), 0xFFFF);
  for (Tensor* t : {&out, &pre}) {
    std::vector<uint16_t> h(expect.size());
    cuda::synchronize();
    NDT_CUDA_CHECK(cudaMemcpy(h.data(), t->data_ptr(), h.size() * 2, cudaMemcpyDeviceToHost));
    EXPECT_EQ(h, expect);
  }
}

}  // namespace
}  // namespace ndt
