#include "cuda/kernel_trace.h"

#include <cuda_runtime.h>
#include <cxxabi.h>
#include <dlfcn.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "cuda/cuda_check.h"
#include "cuda/dl_symbol.h"

#if __has_include(<cupti_activity.h>)
#include <cupti_activity.h>
#define NDT_HAVE_CUPTI_HEADERS 1
#endif

namespace ndt::cuda {

std::string short_kernel_name(const std::string& demangled) {
  std::string s = demangled;
  // The parameter list: the parenthesis matching the final ')'.
  if (!s.empty() && s.back() == ')') {
    int depth = 0;
    for (size_t i = s.size(); i-- > 0;) {
      if (s[i] == ')') ++depth;
      if (s[i] == '(' && --depth == 0) {
        s.resize(i);
        break;
      }
    }
  }
  for (const std::string cut : {"(anonymous namespace)::", "ndt::cuda::"})
    for (size_t at; (at = s.find(cut)) != std::string::npos;) s.erase(at, cut.size());
  if (s.rfind("void ", 0) == 0) s.erase(0, 5);
  return s;
}

KernelClass classify_kernel(const std::string& name) {
  std::string n = name;
  std::transform(n.begin(), n.end(), n.begin(), [](unsigned char c) { return std::tolower(c); });
  auto has = [&](const char* s) { return n.find(s) != std::string::npos; };
  if (has("nccl")) return KernelClass::Communication;
  // cuDNN's fused attention (sdpa), FlashAttention-style names, the built-in kernels (fa::, decode, the CP
  // merge of partial results).
  if (has("sdpa") || has("fmha") || has("flash") || has("attention") || n.rfind("fa::", 0) == 0 ||
      has("decode_kernel") || has("merge_kernel"))
    return KernelClass::Attention;
  if (has("gemm") || has("nvjet") || has("xmma") || has("cutlass") || has("cublas"))
    return KernelClass::Matmul;
  return KernelClass::Other;
}

const char* kernel_class_name(KernelClass c) {
  switch (c) {
    case KernelClass::Matmul:
      return "matmul";
    case KernelClass::Attention:
      return "attention";
    case KernelClass::Communication:
      return "communication";
    default:
      return "other";
  }
}

namespace {

using Interval = std::pair<uint64_t, uint64_t>;

std::vector<Interval> merged(std::vector<Interval> v) {
  std::sort(v.begin(), v.end());
  std::vector<Interval> out;
  for (const auto& iv : v) {
    if (!out.empty() && iv.first <= out.back().second)
      out.back().second = std::max(out.back().second, iv.second);
    else
      out.push_back(iv);
  }
  return out;
}

uint64_t length(const std::vector<Interval>& v) {
  uint64_t n = 0;
  for (const auto& [a, b] : v) n += b - a;
  return n;
}

// Total length of the intersection of two merged interval lists.
uint64_t overlap(const std::vector<Interval>& a, const std::vector<Interval>& b) {
  uint64_t n = 0;
  for (size_t i = 0, j = 0; i < a.size() && j < b.size();) {
    const uint64_t lo = std::max(a[i].first, b[j].first), hi = std::min(a[i].second, b[j].second);
    if (lo < hi) n += hi - lo;
    (a[i].second < b[j].second) ? ++i : ++j;
  }
  return n;
}

// The GPU's idle gaps longer than 20 us, grouped by the activity that ends before and starts after each
// (where the GPU waits for the host: a synchronization, a launch gap), the largest totals first.
std::string idle_gaps(const std::vector<TraceRecord>& records, double per) {
  std::vector<const TraceRecord*> order;
  for (const TraceRecord& r : records) order.push_back(&r);
  std::stable_sort(order.begin(), order.end(),
                   [](const TraceRecord* a, const TraceRecord* b) { return a->start_ns < b->start_ns; });
  auto label = [](const TraceRecord& r) {
    std::string n = r.kind == 'k' ? r.name : r.kind == 'c' ? "[copy]" : "[fill]";
    return n.size() > 48 ? n.substr(0, 45) + "..." : n;
  };
  std::map<std::string, std::pair<int64_t, uint64_t>> gaps;  // "before -> after" -> (count, ns)
  uint64_t end = 0;
  const TraceRecord* last = nullptr;
  for (const TraceRecord* r : order) {
    if (last && r->start_ns > end + 20000) {
      auto& g = gaps[label(*last) + " -> " + label(*r)];
      ++g.first;
      g.second += r->start_ns - end;
    }
    if (r->end_ns > end) end = r->end_ns, last = r;
  }
  std::vector<std::pair<std::string, std::pair<int64_t, uint64_t>>> sorted(gaps.begin(), gaps.end());
  std::stable_sort(sorted.begin(), sorted.end(),
                   [](const auto& a, const auto& b) { return a.second.second > b.second.second; });
  std::string s =
      "idle gaps over 20 us, by the activity before and after (ms per step, count over the window):\n";
  for (size_t i = 0; i < sorted.size() && i < 10; ++i)
    s += fmt::format("{:9.3f} {:6}  {}\n", static_cast<double>(sorted[i].second.second) * per,
                     sorted[i].second.first, sorted[i].first);
  return s;
}

}  // namespace

std::string trace_summary(const std::vector<TraceRecord>& records, int64_t steps, int top) {
  const double per = 1e-6 / static_cast<double>(std::max<int64_t>(steps, 1));  // ns -> ms per step
  struct Row {
    int64_t calls = 0;
    uint64_t ns = 0;
  };
  std::map<std::string, Row> rows;
  std::map<KernelClass, uint64_t> by_class;
  std::vector<Interval> comm, compute, all, everything;
  uint64_t kernel_ns = 0, first = UINT64_MAX, last = 0, copy_ns = 0;
  for (const TraceRecord& r : records) {
    first = std::min(first, r.start_ns);
    last = std::max(last, r.end_ns);
    const uint64_t d = r.end_ns - r.start_ns;
    everything.emplace_back(r.start_ns, r.end_ns);
    if (r.kind != 'k') {
      copy_ns += d;
      continue;
    }
    Row& row = rows[r.name];
    ++row.calls;
    row.ns += d;
    kernel_ns += d;
    const KernelClass c = classify_kernel(r.name);
    by_class[c] += d;
    (c == KernelClass::Communication ? comm : compute).emplace_back(r.start_ns, r.end_ns);
    all.emplace_back(r.start_ns, r.end_ns);
  }
  if (records.empty()) return "no GPU activity recorded\n";
  const auto m_comm = merged(comm), m_compute = merged(compute), m_all = merged(everything);
  uint64_t largest_gap = 0;
  for (size_t i = 1; i < m_all.size(); ++i)
    largest_gap = std::max(largest_gap, m_all[i].first - m_all[i - 1].second);
  const uint64_t comm_union = length(m_comm), hidden = overlap(m_comm, m_compute);
  std::string s = fmt::format(
      "GPU activity over {} step(s), per step: window {:.3f} ms, some kernel running {:.3f} ms, compute "
      "kernels {:.3f} ms (union), communication kernels {:.3f} ms (union; {:.3f} ms of it beside compute, "
      "{:.3f} ms exposed), copies/fills {:.3f} ms; the GPU idle {:.3f} ms (largest gap {:.3f} ms over the "
      "window: a trace opened after a host synchronization starts with one)\n",
      steps, static_cast<double>(last - first) * per, static_cast<double>(length(merged(all))) * per,
      static_cast<double>(length(m_compute)) * per, static_cast<double>(comm_union) * per,
      static_cast<double>(hidden) * per, static_cast<double>(comm_union - hidden) * per,
      static_cast<double>(copy_ns) * per, static_cast<double>(last - first - length(m_all)) * per,
      static_cast<double>(largest_gap) * 1e-6);
  s += "kernel time by class (summed over streams):";
  for (const auto& [c, ns] : by_class)
    s += fmt::format(" {} {:.3f} ms ({:.1f}%)", kernel_class_name(c), static_cast<double>(ns) * per,
                     100.0 * static_cast<double>(ns) / static_cast<double>(std::max<uint64_t>(kernel_ns, 1)));
  s += "\n";
  std::vector<std::pair<std::string, Row>> sorted(rows.begin(), rows.end());
  std::stable_sort(sorted.begin(), sorted.end(),
                   [](const auto& a, const auto& b) { return a.second.ns > b.second.ns; });
  s += fmt::format("{:>9} {:>7} {:>6} {:>9} {:>7}  {:<13} {}\n", "ms/step", "share", "calls", "mean us",
                   "cum", "class", "kernel");
  uint64_t cum = 0;
  int shown = 0;
  for (const auto& [name, row] : sorted) {
    if (top > 0 && shown++ >= top) {
      s += fmt::format("... {} more kernels\n", sorted.size() - static_cast<size_t>(top));
      break;
    }
    cum += row.ns;
    const double share = 100.0 * static_cast<double>(row.ns) / static_cast<double>(kernel_ns);
    s += fmt::format("{:9.3f} {:6.1f}% {:6} {:9.1f} {:6.1f}%  {:<13} {}\n", static_cast<double>(row.ns) * per,
                     share, row.calls / std::max<int64_t>(steps, 1),
                     static_cast<double>(row.ns) / 1e3 / static_cast<double>(row.calls),
                     100.0 * static_cast<double>(cum) / static_cast<double>(kernel_ns),
                     kernel_class_name(classify_kernel(name)), name);
  }
  s += idle_gaps(records, per);
  return s;
}

std::string trace_chrome_json(const std::vector<TraceRecord>& records, int rank) {
  nlohmann::json events = nlohmann::json::array();
  uint64_t t0 = UINT64_MAX;
  for (const TraceRecord& r : records) t0 = std::min(t0, r.start_ns);
  std::map<std::pair<uint32_t, uint32_t>, bool> tracks;
  for (const TraceRecord& r : records) {
    const char* cat = r.kind == 'k'   ? kernel_class_name(classify_kernel(r.name))
                      : r.kind == 'c' ? "copy"
                                      : "fill";
    nlohmann::json e = {{"name", r.name},
                        {"cat", cat},
                        {"ph", "X"},
                        {"ts", static_cast<double>(r.start_ns - t0) / 1e3},
                        {"dur", static_cast<double>(r.end_ns - r.start_ns) / 1e3},
                        {"pid", rank},
                        {"tid", static_cast<int64_t>(r.device) * 1000000 + r.stream}};
    if (r.bytes) e["args"] = {{"bytes", r.bytes}};
    events.push_back(std::move(e));
    tracks[{r.device, r.stream}] = true;
  }
  events.push_back({{"name", "process_name"},
                    {"ph", "M"},
                    {"pid", rank},
                    {"args", {{"name", fmt::format("rank {}", rank)}}}});
  for (const auto& [k, _] : tracks)
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", rank},
                      {"tid", static_cast<int64_t>(k.first) * 1000000 + k.second},
                      {"args", {{"name", fmt::format("gpu {} stream {}", k.first, k.second)}}}});
  return nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump();
}

#ifdef NDT_HAVE_CUPTI_HEADERS
namespace {

struct Cupti {
  decltype(&cuptiActivityEnable) enable = nullptr;
  decltype(&cuptiActivityDisable) disable = nullptr;
  decltype(&cuptiActivityRegisterCallbacks) register_callbacks = nullptr;
  decltype(&cuptiActivityFlushAll) flush_all = nullptr;
  decltype(&cuptiActivityGetNextRecord) next_record = nullptr;
  decltype(&cuptiGetResultString) result_string = nullptr;
  std::string status;  // empty when loaded
};

const Cupti& cupti() {
  static const Cupti api = [] {
    Cupti c;
    const char* env = std::getenv("NDT_CUPTI_LIB");
    std::vector<std::string> paths;
    if (env && *env) {
      paths = {env};
    } else {  // the toolkit's lib directory is often not on the loader's path
      paths = {"libcupti.so.13", "libcupti.so", "/usr/local/cuda/lib64/libcupti.so.13",
               "/usr/local/cuda/lib/libcupti.so.13", "/usr/local/cuda/extras/CUPTI/lib64/libcupti.so.13"};
    }
    void* lib = nullptr;
    std::string errors;
    for (const std::string& p : paths) {
      if ((lib = dlopen(p.c_str(), RTLD_NOW | RTLD_LOCAL))) break;
      errors += fmt::format("{}{}", errors.empty() ? "" : "; ", dlerror());
    }
    if (!lib) {
      c.status = "CUPTI not loaded (set NDT_CUPTI_LIB to libcupti.so of the CUDA toolkit): " + errors;
      return c;
    }
    const bool ok = load_symbol(lib, "cuptiActivityEnable", c.enable) &&
                    load_symbol(lib, "cuptiActivityDisable", c.disable) &&
                    load_symbol(lib, "cuptiActivityRegisterCallbacks", c.register_callbacks) &&
                    load_symbol(lib, "cuptiActivityFlushAll", c.flush_all) &&
                    load_symbol(lib, "cuptiActivityGetNextRecord", c.next_record) &&
                    load_symbol(lib, "cuptiGetResultString", c.result_string);
    if (!ok) c.status = "the loaded CUPTI lacks the activity API";
    return c;
  }();
  return api;
}

void check(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return;
  const char* msg = "?";
  cupti().result_string(r, &msg);
  NDT_CHECK(false, "CUPTI {} failed: {}", what, msg);
}

constexpr size_t kBufferBytes = size_t{8} << 20;
constexpr CUpti_ActivityKind kKinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
                                         CUPTI_ACTIVITY_KIND_MEMSET};

struct State {
  std::mutex mu;
  std::vector<TraceRecord> records;
  std::map<const char*, std::string> names;  // CUPTI's name pointers stay valid; demangle each once
  bool registered = false, running = false;
} g_state;

std::string demangled(const char* mangled) {
  auto [it, fresh] = g_state.names.try_emplace(mangled);
  if (fresh) {
    int status = 0;
    char* d = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
    it->second = short_kernel_name(status == 0 && d ? d : mangled);
    std::free(d);
  }
  return it->second;
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = kBufferBytes;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  std::lock_guard<std::mutex> lock(g_state.mu);
  CUpti_Activity* rec = nullptr;
  while (cupti().next_record(buffer, valid, &rec) == CUPTI_SUCCESS) {
    TraceRecord t;
    if (rec->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
      t = {demangled(k->name), 'k', k->start, k->end, k->deviceId, k->streamId, 0};
    } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
      t = {"memcpy", 'c', m->start, m->end, m->deviceId, m->streamId, m->bytes};
    } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(rec);
      t = {"memset", 'f', m->start, m->end, m->deviceId, m->streamId, m->bytes};
    } else {
      continue;
    }
    if (t.end_ns > t.start_ns) g_state.records.push_back(std::move(t));
  }
  std::free(buffer);
}

}  // namespace

bool KernelTrace::available(std::string* why) {
  const std::string& s = cupti().status;
  if (why) *why = s;
  return s.empty();
}

void KernelTrace::start() {
  std::string why;
  NDT_CHECK(available(&why), "kernel trace: {}", why);
  std::lock_guard<std::mutex> lock(g_state.mu);
  NDT_CHECK(!g_state.running, "kernel trace: already recording");
  if (!g_state.registered) {
    check(cupti().register_callbacks(buffer_requested, buffer_completed), "cuptiActivityRegisterCallbacks");
    g_state.registered = true;
  }
  g_state.records.clear();
  NDT_CUDA_CHECK(cudaDeviceSynchronize());  // nothing enqueued before the window lands in it
  for (CUpti_ActivityKind k : kKinds) check(cupti().enable(k), "cuptiActivityEnable");
  g_state.running = true;
}

std::vector<TraceRecord> KernelTrace::stop() {
  NDT_CHECK(g_state.running, "kernel trace: stop() without start()");
  NDT_CUDA_CHECK(cudaDeviceSynchronize());
  for (CUpti_ActivityKind k : kKinds) check(cupti().disable(k), "cuptiActivityDisable");
  check(cupti().flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll");
  std::lock_guard<std::mutex> lock(g_state.mu);
  g_state.running = false;
  std::vector<TraceRecord> out = std::move(g_state.records);
  g_state.records.clear();
  std::sort(out.begin(), out.end(),
            [](const TraceRecord& a, const TraceRecord& b) { return a.start_ns < b.start_ns; });
  return out;
}

#else  // no CUPTI headers at build time

bool KernelTrace::available(std::string* why) {
  if (why) *why = "built without CUPTI's headers (cupti_activity.h of the CUDA toolkit)";
  return false;
}
void KernelTrace::start() { NDT_CHECK(false, "kernel trace: built without CUPTI's headers"); }
std::vector<TraceRecord> KernelTrace::stop() { return {}; }

#endif

}  // namespace ndt::cuda
