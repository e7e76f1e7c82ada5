// The collective watchdog on the GPU (dist/watchdog.h): a host wait behind a GPU kernel that never ends,
// and an NCCL collective queued behind one, each end the process with exit code 124 and a message naming
// the wait; the NCCL communicator names its operation and is aborted first. Death tests ("threadsafe":
// the child re-runs this binary, so it sets up CUDA itself).
#include <gtest/gtest.h>

#include <cstdlib>

#include "cuda/runtime.h"
#include "cuda/train_kernels.h"
#include "dist/communicator.h"
#include "dist/watchdog.h"
#include "gpu_test.h"
#ifdef NDT_HAVE_NCCL
#include "dist/nccl_communicator.h"
#endif

namespace ndt {
namespace {

void hang_in_device_wait() {
  Watchdog w(1.0, 0, 1);
  cuda::hang_stream(cuda::stream());
  cuda::synchronize();
  std::_Exit(0);  // not reached when the watchdog works
}

TEST(GpuWatchdog, EndsAHungDeviceWait) {
  NDT_REQUIRE_GPU();
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(hang_in_device_wait(), ::testing::ExitedWithCode(124),
              "watchdog: device synchronize on a group of 1 rank\\(s\\) has not returned after 1 s");
}

#ifdef NDT_HAVE_NCCL
void hang_in_nccl_all_reduce() {
  auto self = make_self_communicator();
  Watchdog w(1.0, 0, 1);
  auto comm = make_nccl_communicator(*self, 0);  // registers its hook with the watchdog
  Tensor buf = Tensor::zeros({16}, DType::F32, Device::CUDA);
  cuda::hang_stream(cuda::stream());
  comm->all_reduce(buf.data_ptr(), 16, DType::F32, ReduceOp::Sum);  // waits behind the hung kernel
  std::_Exit(0);
}

TEST(GpuWatchdog, AbortsAHungNcclCollective) {
  NDT_REQUIRE_GPU();
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      hang_in_nccl_all_reduce(), ::testing::ExitedWithCode(124),
      "watchdog: all_reduce on a group of 1 rank\\(s\\) has not returned(.|\n)*NCCL all_reduce on a "
      "group of 1 rank\\(s\\) \\(world ranks [0-9,]*\\), issued at step -1, has not completed; aborting");
}
#endif

}  // namespace
}  // namespace ndt
