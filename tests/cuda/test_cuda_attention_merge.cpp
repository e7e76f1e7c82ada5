// The ring-CP log-sum-exp merge on the GPU against its CPU twin: random partial results, some rows of
// either side without keys (lse -inf). fp32 to 1e-6 relative L2, bf16 outputs to 1e-2 (one rounding).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "gpu_test.h"
#include "ops/cpu_ops.h"
#include "ops/ops.h"

namespace ndt {
namespace {

double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

TEST(CudaAttentionMerge, MatchesCpuTwin) {
  NDT_REQUIRE_GPU();
  const int64_t T = 37, H = 3, D = 64, rows = T * H;
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  std::vector<float> out(rows * D), o(rows * D), lse(rows), l(rows);
  for (auto* v : {&out, &o})
    for (float& x : *v) x = u(gen);
  for (auto* v : {&lse, &l})
    for (float& x : *v) x = u(gen) * 3.0f;
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < rows; i += 7) lse[i] = ninf;  // only the partial saw keys
  for (int64_t i = 3; i < rows; i += 11) l[i] = ninf;   // only the accumulated side saw keys
  lse[5] = l[5] = ninf;                                 // neither
  for (DType dt : {DType::F32, DType::BF16}) {
    // The reference starts from the same (rounded) inputs the device sees.
    auto round = [&](const std::vector<float>& v) {
      Tensor t = Tensor::from_vector(v, {T, H, D});
      if (dt == DType::F32) return v;
      Tensor d = Tensor::empty({T, H, D}, DType::BF16, Device::CUDA);
      ops::cast_into(d, t.to(Device::CUDA));
      return ops::to_host_f32(d).to_vector<float>();
    };
    std::vector<float> ref_out = round(out), ref_o = round(o), ref_lse = lse;
    cpu::attention_merge(ref_out.data(), ref_lse.data(), ref_o.data(), l.data(), rows, D);

    auto dev = [&](const std::vector<float>& v) {
      Tensor h = Tensor::from_vector(v, {T, H, D}).to(Device::CUDA);
      if (dt == DType::F32) return h;
      Tensor d = Tensor::empty({T, H, D}, DType::BF16, Device::CUDA);
      ops::cast_into(d, h);
      return d;
    };
    Tensor d_out = dev(out), d_o = dev(o);
    Tensor d_lse = Tensor::from_vector(lse, {T, H}).to(Device::CUDA);
    Tensor d_l = Tensor::from_vector(l, {T, H}).to(Device::CUDA);
    ops::attention_merge(d_out, d_lse, d_o, d_l);
    const std::vector<float> got = ops::to_host_f32(d_out).to_vector<float>();
    const std::vector<float> got_lse = d_lse.to_vector<float>();
    EXPECT_LT(rel_l2(got, ref_out), dt == DType::F32 ? 1e-6 : 1e-2) << dtype_name(dt);
    for (int64_t i = 0; i < rows; ++i) {
      if (std::isinf(ref_lse[i])) {
        EXPECT_TRUE(std::isinf(got_lse[i]) && got_lse[i] < 0) << "row " << i;
      } else {
        EXPECT_NEAR(got_lse[i], ref_lse[i], 1e-5f * (1.0f + std::abs(ref_lse[i]))) << "row " << i;
      }
    }
  }
}

}  // namespace
}  // namespace ndt
