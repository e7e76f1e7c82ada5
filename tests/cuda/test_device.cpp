#include <cuda_runtime.h>

#include "cuda/runtime.h"
#include "gpu_test.h"

TEST(CudaDevice, ReportsDevice) {
  NDT_REQUIRE_GPU();
  const std::string name = ndt::cuda::device_name(0);
  EXPECT_FALSE(name.empty());
  std::printf("device 0: %s\n", name.c_str());
}

// IntervalClock (the pipeline bubble on GPUs): the bracketed GPU work is counted, the unbracketed work
// between the brackets only in the span, and collect() waits for the GPU.
TEST(CudaDevice, IntervalClockCountsBracketedWorkOnly) {
  NDT_REQUIRE_GPU();
  const size_t bytes = size_t{256} << 20;
  void* buf = ndt::cuda::device_alloc(bytes);
  auto work = [&](int times) {
    for (int i = 0; i < times; ++i) ndt::cuda::memset_zero(buf, bytes);
  };
  ndt::cuda::IntervalClock clock;
  clock.start();
  clock.begin();
  work(4);
  clock.end();
  work(8);  // outside any interval: in the span only
  clock.begin();
  work(4);
  clock.end();
  const ndt::cuda::IntervalClock::Times t = clock.collect();
  EXPECT_GT(t.busy_s, 0);
  EXPECT_GT(t.span_s, t.busy_s * 1.5) << "busy " << t.busy_s << " s, span " << t.span_s << " s";
  EXPECT_LE(t.busy_s, t.span_s);
  ndt::cuda::device_free(buf);
  clock.start();  // reusable; nothing bracketed: zeros
  const ndt::cuda::IntervalClock::Times none = clock.collect();
  EXPECT_EQ(none.busy_s, 0);
  EXPECT_EQ(none.span_s, 0);
}
