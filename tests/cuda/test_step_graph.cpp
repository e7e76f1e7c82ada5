// StepGraph's policy on real graphs (train/step_graph.h), with a small stand-in for a step: the work gathers
// table rows by the microbatch's token ids, and the loss gradient (scale * mask), into buffers that outlive
// it. A replay must read each step's own ids and loss scale; a new shape runs eagerly, then is captured anew
// once it repeats; a work that uploads host data inside the capture runs eagerly, is reported, and is not
// captured again.
#include <gtest/gtest.h>

#include <vector>

#include "core/rng.h"
#include "cuda/runtime.h"
#include "data/dataset.h"
#include "gpu_test.h"
#include "ops/ops.h"
#include "train/step_graph.h"

namespace ndt {
namespace {

constexpr int64_t kV = 50, kC = 8, kMaxT = 16;

std::vector<Microbatch> batch(int64_t T, uint64_t seed) {
  std::vector<int32_t> t(static_cast<size_t>(T + 1));
  for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<int32_t>(philox_u64(seed, 0, i) % kV);
  return {make_microbatch({Sample{t, std::vector<uint8_t>(t.size(), 1), {}}}, T, 0)};
}

// Rows of `table` (host) at the microbatch's ids, row-major (T, C).
std::vector<float> expected(const Tensor& table, const Microbatch& mb) {
  std::vector<float> out;
  for (int64_t t = 0; t < mb.num_tokens(); ++t) {
    const float* row = table.f32() + static_cast<int64_t>(mb.tokens.i32()[t]) * kC;
    out.insert(out.end(), row, row + kC);
  }
  return out;
}

TEST(StepGraph, ReplaysEachStepsInputsAndCapturesNewShapes) {
  NDT_REQUIRE_GPU();
  Tensor table = Tensor::empty({kV, kC});
  for (int64_t i = 0; i < kV * kC; ++i) table.f32()[i] = static_cast<float>(i) * 0.25f;
  const Tensor dtable = table.to(Device::CUDA);
  Tensor out = Tensor::zeros({kMaxT, kC}, DType::F32, Device::CUDA);
  Tensor dloss = Tensor::zeros({kMaxT}, DType::F32, Device::CUDA);
  bool upload_inside = false;
  const std::vector<Microbatch>* host = nullptr;  // this step's microbatches as given (ids on the host)
  auto work = [&](const std::vector<Microbatch>& dev) {
    const int64_t T = dev[0].num_tokens();
    EXPECT_EQ(dev[0].tokens.device(), Device::CUDA);
    Tensor rows = out.rows(0, T);
    // A host tensor here is uploaded by the op: refused under capture.
    ops::embedding_forward(rows, upload_inside ? (*host)[0].tokens : dev[0].tokens, dtable, 0);
    Tensor d = dloss.rows(0, T);
    ops::fill_dloss(d, dev[0].loss_mask, dev[0].loss_scale);
  };
  StepGraph g(/*seqlens_on_host=*/true);
  int step = 0;
  auto check = [&](int64_t T, bool replayed, int64_t captures) {
    const std::vector<Microbatch> mbs = batch(T, 100 + step);
    host = &mbs;
    const float scale = 1.0f / static_cast<float>(step + 2);
    EXPECT_EQ(g.run(mbs, scale, work), replayed) << "step " << step;
    EXPECT_EQ(g.captures(), captures) << "step " << step;
    EXPECT_EQ(out.rows(0, T).to_vector<float>(), expected(table, mbs[0])) << "step " << step;
    EXPECT_EQ(dloss.rows(0, T).to_vector<float>(), std::vector<float>(static_cast<size_t>(T), scale))
        << "step " << step;
    ++step;
  };
  check(12, false, 0);  // first step: eager
  check(12, true, 1);   // same shape: captured, replayed with this step's ids
  check(12, true, 1);
  check(10, false, 1);  // another shape: eager (new buffers drop the graph)
  check(10, true, 2);   // repeated: captured anew
  check(12, false, 2);
  EXPECT_TRUE(g.failure().empty());
  upload_inside = true;
  check(12, false, 2);  // would be captured, but the work uploads inside: eager, reported
  EXPECT_NE(g.failure().find("inside a CUDA graph capture"), std::string::npos) << g.failure();
  check(12, false, 2);  // not tried again
  EXPECT_EQ(g.replays(), 3);
  EXPECT_EQ(g.eager_steps(), 5);
}

// The extra signature (the gathered embedding gradient's agreed sizes) decides like the microbatches' shapes;
// buffers the work allocates under capture count as device memory (NCCL's buffer checks ask), offsets too.
TEST(StepGraph, ExtraSignatureAndCaptureAllocations) {
  NDT_REQUIRE_GPU();
  Tensor out = Tensor::zeros({kMaxT}, DType::F32, Device::CUDA);
  int64_t device_checks = 0;
  auto work = [&](const std::vector<Microbatch>& dev) {
    Tensor tmp = Tensor::empty({kMaxT, kC}, DType::F32, Device::CUDA);
    const float* inside = tmp.f32() + 3 * kC + 1;
    EXPECT_TRUE(cuda::is_device_pointer(tmp.data_ptr()));
    EXPECT_TRUE(cuda::is_device_pointer(inside));
    ++device_checks;
    Tensor d = out.rows(0, dev[0].num_tokens());
    ops::fill_dloss(d, dev[0].loss_mask, dev[0].loss_scale);
  };
  std::vector<float> host_row(4);
  EXPECT_FALSE(cuda::is_device_pointer(host_row.data()));
  StepGraph g(/*seqlens_on_host=*/true);
  const std::vector<Microbatch> mbs = batch(12, 7);
  EXPECT_FALSE(g.run(mbs, 0.5f, work, {64, 1}));  // eager
  EXPECT_TRUE(g.run(mbs, 0.5f, work, {64, 1}));   // captured (the work allocates inside), replayed
  EXPECT_TRUE(g.failure().empty()) << g.failure();
  EXPECT_FALSE(g.run(mbs, 0.5f, work, {80, 1}));  // same microbatches, other agreed sizes: eager
  EXPECT_TRUE(g.run(mbs, 0.5f, work, {80, 1}));   // repeated: captured anew
  EXPECT_EQ(g.captures(), 2);
  EXPECT_EQ(device_checks, 4);  // 2 eager runs + 2 captures; replays skip the host code
  EXPECT_EQ(out.rows(0, 12).to_vector<float>(), std::vector<float>(12, 0.5f));
}

}  // namespace
}  // namespace ndt
