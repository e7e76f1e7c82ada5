#pragma once
// A GPU phase boundary for NDT_CUDA_PROFILE=1 (cuda/runtime.h mark()): the label names the phase that
// starts here; the trainer prints the step's time per label. A no-op off the GPU and when profiling is off.
#include "core/tensor.h"

#ifdef NDT_HAVE_CUDA
#include "cuda/runtime.h"
#endif

namespace ndt {

inline void phase_mark(Device dev, const char* label) {
#ifdef NDT_HAVE_CUDA
  if (dev == Device::CUDA) cuda::mark(label);
#else
  (void)dev;
  (void)label;
#endif
}

}  // namespace ndt
