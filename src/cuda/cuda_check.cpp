#include "cuda/cuda_check.h"

#include "core/check.h"

namespace ndt::cuda {

void cuda_failed(cudaError_t err, const char* expr, const char* file, int line) {
  check_failed(file, line, expr, fmt::format("CUDA error {} ({})", cudaGetErrorName(err), cudaGetErrorString(err)));
}

}  // namespace ndt::cuda
