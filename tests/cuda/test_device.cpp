#include <cuda_runtime.h>

#include "gpu_test.h"

TEST(CudaDevice, ReportsDevice) {
  NDT_REQUIRE_GPU();
  const std::string name = ndt::cuda::device_name(0);
  EXPECT_FALSE(name.empty());
  std::printf("device 0: %s\n", name.c_str());
}
