// The CUPTI kernel trace (cuda/kernel_trace.h): name shortening, classes and the summary's interval
// arithmetic on made-up records (no GPU needed), then a real trace of known kernels on the GPU.
#include <nlohmann/json.hpp>

#include "cuda/kernel_trace.h"
#include "cuda/runtime.h"
#include "gpu_test.h"
#include "ops/ops.h"

namespace ndt::cuda {
namespace {

TEST(KernelTraceNames, ShortNameDropsParametersAndNamespaces) {
  EXPECT_EQ(short_kernel_name("void ndt::cuda::(anonymous namespace)::norm_forward_kernel<__nv_bfloat16, 8, "
                              "true>(__nv_bfloat16*, float*, long, float)"),
            "norm_forward_kernel<__nv_bfloat16, 8, true>");
  EXPECT_EQ(short_kernel_name("void ndt::cuda::fa::(anonymous namespace)::fwd_kernel<64>(fa::Params)"),
            "fa::fwd_kernel<64>");
  EXPECT_EQ(short_kernel_name("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT"),
            "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT");
  EXPECT_EQ(short_kernel_name("f(int (*)(int))"), "f");
}

TEST(KernelTraceNames, Classes) {
  EXPECT_EQ(classify_kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL"), KernelClass::Communication);
  EXPECT_EQ(classify_kernel("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3"),
            KernelClass::Attention);
  EXPECT_EQ(classify_kernel("fa::bwd_kernel<128, true>"), KernelClass::Attention);
  EXPECT_EQ(classify_kernel("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT"), KernelClass::Matmul);
  EXPECT_EQ(classify_kernel("sm90_xmma_gemm_bf16bf16_bf16f32"), KernelClass::Matmul);
  EXPECT_EQ(classify_kernel("norm_forward_kernel<float, 4, true>"), KernelClass::Other);
}

TEST(KernelTraceSummary, IntervalsOverlapAndShares) {
  // Compute kernels [0,10) and [12,20) ns (x1000), communication [5,15) on another stream:
  // communication union 10 us, of which [5,10) and [12,15) = 8 us beside compute, 2 us exposed.
  std::vector<TraceRecord> r = {
      {"gemm_a", 'k', 0, 10000, 0, 7, 0},
      {"ncclDevKernel_AllReduce", 'k', 5000, 15000, 0, 9, 0},
      {"norm_kernel", 'k', 12000, 20000, 0, 7, 0},
      {"memcpy", 'c', 20000, 21000, 0, 7, 4096},
  };
  const std::string s = trace_summary(r, 1);
  EXPECT_NE(s.find("window 0.021 ms"), std::string::npos) << s;
  EXPECT_NE(s.find("communication kernels 0.010 ms (union; 0.008 ms of it beside compute, 0.002 ms exposed)"),
            std::string::npos)
      << s;
  EXPECT_NE(s.find("matmul 0.010 ms (35.7%)"), std::string::npos) << s;  // 10 of 28 us of kernel time
  EXPECT_NE(s.find("copies/fills 0.001 ms"), std::string::npos) << s;
  EXPECT_NE(s.find("the GPU idle 0.000 ms (largest gap 0.000 ms"), std::string::npos) << s;
  // A gap of 5 us before a last kernel: idle 0.005 ms per step, largest gap 0.005 ms.
  std::vector<TraceRecord> gap = r;
  gap.push_back({"late", 'k', 26000, 27000, 0, 7, 0});
  EXPECT_NE(trace_summary(gap, 1).find("the GPU idle 0.005 ms (largest gap 0.005 ms"), std::string::npos)
      << trace_summary(gap, 1);
  // Per step over two steps: every time halves.
  EXPECT_NE(trace_summary(r, 2).find("communication kernels 0.005 ms"), std::string::npos);
  EXPECT_NE(s.find("gemm_a"), std::string::npos);
  EXPECT_EQ(trace_summary({}, 1), "no GPU activity recorded\n");
  // The table's row limit.
  EXPECT_NE(trace_summary(r, 1, 1).find("... 2 more kernels"), std::string::npos);
  // Idle gaps over 20 us, by the activity around them: the copy ending at 21 us, then "late" at 46 us and
  // again at 96 us (25 + 49 us, twice), and a 10 us gap that is not listed.
  std::vector<TraceRecord> idle = r;
  idle.push_back({"late", 'k', 46000, 47000, 0, 7, 0});
  idle.push_back({"late", 'k', 96000, 97000, 0, 7, 0});
  idle.push_back({"soon", 'k', 107000, 108000, 0, 7, 0});
  const std::string g = trace_summary(idle, 1);
  EXPECT_NE(g.find("    0.025      1  [copy] -> late"), std::string::npos) << g;
  EXPECT_NE(g.find("    0.049      1  late -> late"), std::string::npos) << g;
  EXPECT_EQ(g.find("late -> soon"), std::string::npos) << g;
}

TEST(KernelTraceSummary, ChromeJsonHasOneEventPerRecordAndNamedTracks) {
  std::vector<TraceRecord> r = {{"k1", 'k', 1000, 3000, 0, 7, 0}, {"memset", 'f', 3000, 4000, 0, 8, 64}};
  const nlohmann::json j = nlohmann::json::parse(trace_chrome_json(r, 3));
  int spans = 0, tracks = 0;
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] == "X") {
      ++spans;
      EXPECT_EQ(e["pid"], 3);
    }
    if (e["ph"] == "M" && e["name"] == "thread_name") ++tracks;
  }
  EXPECT_EQ(spans, 2);
  EXPECT_EQ(tracks, 2);
  EXPECT_DOUBLE_EQ(j["traceEvents"][0]["ts"].get<double>(), 0.0);
  EXPECT_DOUBLE_EQ(j["traceEvents"][0]["dur"].get<double>(), 2.0);
}

// A real trace: one matmul and one norm, three times; both show up with three calls each and the
// summary names them; stopping twice is an error rather than a silent empty trace.
TEST(KernelTrace, RecordsKnownKernels) {
  NDT_REQUIRE_GPU();
  std::string why;
  if (!KernelTrace::available(&why)) GTEST_SKIP() << why;
  const int64_t T = 256, C = 512;
  Tensor x = Tensor::zeros({T, C}, DType::BF16, Device::CUDA);
  Tensor w = Tensor::zeros({C, C}, DType::BF16, Device::CUDA);
  Tensor nw = Tensor::zeros({C}, DType::BF16, Device::CUDA);
  Tensor y = Tensor::empty({T, C}, DType::BF16, Device::CUDA);
  Tensor n = Tensor::empty({T, C}, DType::BF16, Device::CUDA);
  Tensor rstd = Tensor::empty({T}, DType::F32, Device::CUDA);
  ops::linear_forward(y, x, w, nullptr);  // plans and loads modules outside the window
  ops::rmsnorm_forward(n, rstd, y, nw, 1e-5f);
  KernelTrace::start();
  for (int i = 0; i < 3; ++i) {
    ops::linear_forward(y, x, w, nullptr);
    ops::rmsnorm_forward(n, rstd, y, nw, 1e-5f);
  }
  const std::vector<TraceRecord> recs = KernelTrace::stop();
  int matmuls = 0, norms = 0;
  for (const TraceRecord& r : recs) {
    EXPECT_GT(r.end_ns, r.start_ns);
    if (r.kind != 'k') continue;
    matmuls += classify_kernel(r.name) == KernelClass::Matmul;
    norms += r.name.find("norm_forward") != std::string::npos;
  }
  EXPECT_GE(matmuls, 3);  // a split-K plan adds a reduction kernel per call
  EXPECT_EQ(matmuls % 3, 0);
  EXPECT_EQ(norms, 3);
  EXPECT_NE(trace_summary(recs, 3).find("norm_forward"), std::string::npos);
  EXPECT_THROW(KernelTrace::stop(), Error);
}

}  // namespace
}  // namespace ndt::cuda
