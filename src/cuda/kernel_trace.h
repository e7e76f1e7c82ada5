#pragma once
// GPU activity of a window of steps, from CUPTI's activity API: every kernel, copy and fill with its device
// start and end time and stream. CUPTI ships with the CUDA toolkit and is loaded with dlopen on first use
// (NDT_CUPTI_LIB overrides the path), so a binary runs without it; available() says why not.
// Nsight Systems is not needed and Nsight Compute's replay (one kernel at a time, ~75 s per GPT-2 step) is
// not involved: tracing costs a few percent while on, nothing while off.
#include <cstdint>
#include <string>
#include <vector>

namespace ndt::cuda {

struct TraceRecord {
  std::string name;  // kernels: demangled, without the parameter list
  char kind = 'k';   // 'k' kernel, 'c' copy, 'f' fill (memset)
  uint64_t start_ns = 0, end_ns = 0;
  uint32_t device = 0, stream = 0;
  uint64_t bytes = 0;  // copies and fills
};

// Coarse class of a kernel, for the per-class shares of a summary.
enum class KernelClass { Matmul, Attention, Communication, Other };
KernelClass classify_kernel(const std::string& name);
const char* kernel_class_name(KernelClass c);
// "void ns::(anonymous namespace)::k<float, 4>(float*, int)" -> "ns::k<float, 4>" (what a table shows).
std::string short_kernel_name(const std::string& demangled);

class KernelTrace {
 public:
  // Whether CUPTI can be loaded; `why` (optional) says why not.
  static bool available(std::string* why = nullptr);
  // Waits for the device, then starts recording (one trace at a time per process). Throws when CUPTI is
  // unavailable.
  static void start();
  // Waits for the device, stops recording and returns what was recorded since start(), sorted by start.
  static std::vector<TraceRecord> stop();
};

// Per-kernel table of `records` covering `steps` steps: calls, total and per-step time, share of the
// summed kernel time, mean; the classes' shares; the window's wall time, the time any kernel ran (union of
// intervals) and the compute time that overlapped communication kernels. `top` rows at most (0 = all).
std::string trace_summary(const std::vector<TraceRecord>& records, int64_t steps, int top = 0);
// Chrome trace JSON (Perfetto, chrome://tracing): one track per (device, stream) under process `rank`.
std::string trace_chrome_json(const std::vector<TraceRecord>& records, int rank);

}  // namespace ndt::cuda
