#pragma once
// Device discovery. Safe to call on a machine without a GPU or driver (returns 0).
#include <string>

namespace ndt::cuda {

int device_count();
std::string device_name(int dev);

}  // namespace ndt::cuda
