#pragma once
// Shared by the GPU tests: skip with a clear message when this machine has no CUDA device.
#include <gtest/gtest.h>

#include "cuda/device.h"

#define NDT_REQUIRE_GPU()                                                                      \
  do {                                                                                         \
    if (::ndt::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device on this machine"; \
  } while (0)
