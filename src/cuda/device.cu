#include "cuda/cuda_check.h"
#include "cuda/device.h"

namespace ndt::cuda {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device / no driver" error
    return 0;
  }
  return n;
}

std::string device_name(int dev) {
  cudaDeviceProp prop{};
  NDT_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  return prop.name;
}

}  // namespace ndt::cuda
