// A source rule no run can check reliably: a kernel started by programmatic dependent launch
// (detail::launch_pdl, src/cuda/cuda_kernel_utils.cuh) may run beside the kernel before it, so it must wait
// for it (detail::pdl_prologue()) before touching memory; a missing wait is a race that tests catch only by
// luck. Rule: in every CUDA source that calls launch_pdl (and the header that defines it), each __global__
// function's body starts with that call. Reads the sources; needs no GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace {

std::string read(const std::filesystem::path& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// The __global__ functions of `src` whose body does not begin with the prologue (their signatures).
std::vector<std::string> kernels_without_prologue(const std::string& src) {
  std::vector<std::string> bad;
  for (size_t at = src.find("__global__"); at != std::string::npos; at = src.find("__global__", at + 1)) {
    const size_t open = src.find_first_of("{;", at);
    if (open == std::string::npos || src[open] == ';') continue;  // a declaration
    const size_t first = src.find_first_not_of(" \t\n", open + 1);
    const auto starts = [&](const std::string& call) { return src.compare(first, call.size(), call) == 0; };
    if (!starts("detail::pdl_prologue();") && !starts("pdl_prologue();"))
      bad.push_back(src.substr(at, std::min<size_t>(open - at, 120)));
  }
  return bad;
}

TEST(KernelLaunchRules, EveryKernelInALaunchPdlFileWaitsFirst) {
  const std::filesystem::path dir = std::filesystem::path(NDT_SOURCE_DIR) / "src" / "cuda";
  ASSERT_TRUE(std::filesystem::is_directory(dir)) << dir;
  int files = 0, kernels = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string ext = entry.path().extension().string();
    if (ext != ".cu" && ext != ".cuh") continue;
    const std::string src = read(entry.path());
    if (src.find("launch_pdl(") == std::string::npos) continue;
    ++files;
    for (size_t at = src.find("__global__"); at != std::string::npos; at = src.find("__global__", at + 1))
      ++kernels;
    for (const std::string& k : kernels_without_prologue(src))
      ADD_FAILURE() << entry.path().filename()
                    << ": a kernel does not begin with detail::pdl_prologue(): " << k;
  }
  EXPECT_GE(files, 10);  // the kernels of the training step
  EXPECT_GE(kernels, 40);
}

// The checker itself: a kernel that touches memory first is found, one that waits first is not.
TEST(KernelLaunchRules, CheckerFindsAMissingPrologue) {
  const std::string ok = "__global__ void a(float* x) {\n  detail::pdl_prologue();\n  x[0] = 1;\n}\n";
  const std::string missing = "template <typename E>\n__global__ void b(E* x) {\n  x[0] = 1;\n}\n";
  const std::string declared = "__global__ void c(float* x);\n";
  EXPECT_TRUE(kernels_without_prologue(ok + declared).empty());
  ASSERT_EQ(kernels_without_prologue(ok + missing).size(), 1u);
  EXPECT_NE(kernels_without_prologue(ok + missing)[0].find("void b(E* x)"), std::string::npos);
}

}  // namespace
