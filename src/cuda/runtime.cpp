#include "cuda/runtime.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/blocking_wait.h"
#include "core/check.h"
#include "cuda/cuda_check.h"
#include "cuda/side_streams.h"

namespace ndt::cuda {
namespace {

constexpr int kMaxDevices = 64;

struct DeviceState {
  std::once_flag once;
  cudaStream_t stream = nullptr;
  cudaMemPool_t pool = nullptr;
  std::vector<cudaStream_t> side;  // side_streams.h, created on first use
  std::vector<cudaEvent_t> side_done;
  cudaEvent_t fork = nullptr;
};

thread_local cudaStream_t g_override = nullptr;  // OnSideStream

// Live bytes of the graph being captured (its allocations are graph-owned, outside the pool's counters):
// sizes by pointer, the running sum and its high-water mark; and the highest pool-plus-graph peak so far.
struct CaptureMemory {
  bool active = false;
  std::map<void*, size_t> sizes;
  uint64_t now = 0, high = 0, base = 0;
  uint64_t peak = 0;
};
CaptureMemory g_capture_mem;

void track_alloc(void* p, size_t bytes) {
  if (!g_capture_mem.active) return;
  g_capture_mem.sizes[p] = bytes;
  g_capture_mem.high = std::max(g_capture_mem.high, g_capture_mem.now += bytes);
}

void track_free(void* p) noexcept {
  if (!g_capture_mem.active) return;
  auto it = g_capture_mem.sizes.find(p);
  if (it == g_capture_mem.sizes.end()) return;
  g_capture_mem.now -= it->second;
  g_capture_mem.sizes.erase(it);
}

DeviceState& state() {
  static DeviceState states[kMaxDevices];
  int dev = 0;
  NDT_CUDA_CHECK(cudaGetDevice(&dev));
  NDT_CHECK(dev < kMaxDevices, "device index {} beyond {}", dev, kMaxDevices);
  DeviceState& s = states[dev];
  std::call_once(s.once, [&] {
    NDT_CUDA_CHECK(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking));
    NDT_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&s.pool, dev));
    // Keep freed memory in the pool: the next step's tensors reuse it without a driver call.
    uint64_t threshold = UINT64_MAX;
    NDT_CUDA_CHECK(cudaMemPoolSetAttribute(s.pool, cudaMemPoolAttrReleaseThreshold, &threshold));
  });
  return s;
}

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

}  // namespace

cudaStream_t stream() { return g_override ? g_override : state().stream; }

void fork_side_streams(int n) {
  DeviceState& s = state();
  if (!s.fork) NDT_CUDA_CHECK(cudaEventCreateWithFlags(&s.fork, cudaEventDisableTiming));
  while (static_cast<int>(s.side.size()) < n) {
    cudaStream_t st = nullptr;
    cudaEvent_t ev = nullptr;
    NDT_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    NDT_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    s.side.push_back(st);
    s.side_done.push_back(ev);
  }
  NDT_CUDA_CHECK(cudaEventRecord(s.fork, s.stream));
  for (int i = 0; i < n; ++i) NDT_CUDA_CHECK(cudaStreamWaitEvent(s.side[static_cast<size_t>(i)], s.fork, 0));
}

void join_side_streams(int n) {
  DeviceState& s = state();
  for (int i = 0; i < n && i < static_cast<int>(s.side.size()); ++i) {
    NDT_CUDA_CHECK(cudaEventRecord(s.side_done[static_cast<size_t>(i)], s.side[static_cast<size_t>(i)]));
    NDT_CUDA_CHECK(cudaStreamWaitEvent(s.stream, s.side_done[static_cast<size_t>(i)], 0));
  }
}

OnSideStream::OnSideStream(int i) : prev_(g_override) {
  DeviceState& s = state();
  NDT_CHECK(i >= 0 && i < static_cast<int>(s.side.size()), "side stream {} used before fork_side_streams", i);
  g_override = s.side[static_cast<size_t>(i)];
}
OnSideStream::~OnSideStream() { g_override = prev_; }

void* device_alloc(size_t bytes) {
  DeviceState& s = state();
  void* p = nullptr;
  cudaError_t err = cudaMallocFromPoolAsync(&p, bytes, s.pool, stream());
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    MemoryStats m = memory_stats();
    NDT_FAIL(
        "CUDA out of memory allocating {:.3f} GiB (device: {:.2f} of {:.2f} GiB in use, tensor peak {:.2f} "
        "GiB)",
        static_cast<double>(bytes) / kGiB, m.device_used_gib, m.device_total_gib, m.peak_allocated_gib);
  }
  NDT_CUDA_CHECK(err);
  track_alloc(p, bytes);
  return p;
}

void device_free(void* p) noexcept {
  if (!p) return;
  track_free(p);
  try {
    if (cudaFreeAsync(p, stream()) != cudaSuccess) cudaGetLastError();  // teardown: runtime may be gone
  } catch (...) {
  }
}

void copy_h2d(void* dst, const void* src, size_t bytes) {
  if (!bytes) return;
  // A graph would replay the host data of the capture: inputs that change must sit in device buffers.
  NDT_CHECK(!capturing(), "a host-to-device copy of {} bytes inside a CUDA graph capture", bytes);
  // From pageable memory the driver may wait for the stream before staging: a wait the watchdog watches.
  BlockingWait wait("host-to-device copy", 1);
  NDT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream()));
}

void copy_d2h(void* dst, const void* src, size_t bytes) { copy_d2h_on(dst, src, bytes, stream()); }

void copy_d2h_on(void* dst, const void* src, size_t bytes, cudaStream_t s) {
  if (!bytes) return;
  // Into pageable memory the copy itself blocks until the stream reaches it.
  BlockingWait wait("device-to-host copy", 1);
  NDT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s));
  NDT_CUDA_CHECK(cudaStreamSynchronize(s));
}

void copy_d2d(void* dst, const void* src, size_t bytes) {
  if (bytes) NDT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream()));
}

void copy_d2d_2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width_bytes, size_t rows) {
  if (width_bytes && rows)
    NDT_CUDA_CHECK(
        cudaMemcpy2DAsync(dst, dpitch, src, spitch, width_bytes, rows, cudaMemcpyDeviceToDevice, stream()));
}

bool capturing() {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  NDT_CUDA_CHECK(cudaStreamIsCapturing(stream(), &st));
  return st != cudaStreamCaptureStatusNone;
}

void release_cached_memory() {
  DeviceState& s = state();
  sync_stream(s.stream);  // (the frees in flight complete first)
  NDT_CUDA_CHECK(cudaMemPoolTrimTo(s.pool, 0));
}

std::unique_ptr<Graph> Graph::capture(const std::function<void()>& enqueue, std::string* why) {
  DeviceState& s = state();
  uint64_t pool_now = 0;
  NDT_CUDA_CHECK(cudaMemPoolGetAttribute(s.pool, cudaMemPoolAttrUsedMemCurrent, &pool_now));
  g_capture_mem = {true, {}, 0, 0, pool_now, g_capture_mem.peak};
  NDT_CUDA_CHECK(cudaStreamBeginCapture(stream(), cudaStreamCaptureModeThreadLocal));
  bool ok = true;
  try {
    enqueue();
  } catch (const std::exception& e) {
    ok = false;  // e.g. an op that synchronizes: the capture is invalidated
    if (why) *why = e.what();
  } catch (...) {
    ok = false;
    if (why) *why = "unknown exception";
  }
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(stream(), &graph);
  std::unique_ptr<Graph> g;
  if (ok && end != cudaSuccess && why) *why = cudaGetErrorString(end);
  g_capture_mem.active = false;
  if (ok && end == cudaSuccess)  // what the graph's launches hold at most, beside the pool's tensors now
    g_capture_mem.peak = std::max(g_capture_mem.peak, g_capture_mem.base + g_capture_mem.high);
  if (ok && end == cudaSuccess && graph) {
    g.reset(new Graph());
    if (cudaGraphInstantiateWithFlags(&g->exec_, graph, cudaGraphInstantiateFlagAutoFreeOnLaunch) !=
        cudaSuccess)
      g.reset();
  }
  if (graph) cudaGraphDestroy(graph);
  cudaGetLastError();  // a failed capture leaves its error pending: clear it
  return g;
}

Graph::~Graph() {
  if (exec_) cudaGraphExecDestroy(exec_);
}

void Graph::launch() { NDT_CUDA_CHECK(cudaGraphLaunch(exec_, stream())); }

void memset_zero(void* p, size_t bytes) {
  if (bytes) NDT_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream()));
}

Scratch::Scratch(size_t bytes, cudaStream_t stream) : stream_(stream) {
  if (bytes) NDT_CUDA_CHECK(cudaMallocAsync(&ptr_, bytes, stream));
  track_alloc(ptr_, bytes);
}

Scratch::~Scratch() {
  track_free(ptr_);
  if (ptr_) cudaFreeAsync(ptr_, stream_);
}

PinnedBuffer::PinnedBuffer(size_t bytes) {
  if (bytes) NDT_CUDA_CHECK(cudaMallocHost(&ptr_, bytes));
}

PinnedBuffer::~PinnedBuffer() {
  if (ptr_) cudaFreeHost(ptr_);
}

void copy_h2d_async(void* dst, const PinnedBuffer& src, size_t bytes) {
  if (bytes) NDT_CUDA_CHECK(cudaMemcpyAsync(dst, src.as<void>(), bytes, cudaMemcpyHostToDevice, stream()));
}

void copy_h2d_pinned(void* dst, const void* src, size_t bytes) {
  NDT_CHECK(!capturing(), "a host-to-device copy of {} bytes inside a CUDA graph capture", bytes);
  if (bytes) NDT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream()));
}

void copy_d2h_async(PinnedBuffer& dst, const void* src, size_t bytes) {
  if (bytes) NDT_CUDA_CHECK(cudaMemcpyAsync(dst.as<void>(), src, bytes, cudaMemcpyDeviceToHost, stream()));
}

StreamEvent::StreamEvent() { NDT_CUDA_CHECK(cudaEventCreateWithFlags(&ev_, cudaEventDisableTiming)); }

StreamEvent::~StreamEvent() {
  if (ev_) cudaEventDestroy(ev_);
}

void StreamEvent::record() { NDT_CUDA_CHECK(cudaEventRecord(ev_, stream())); }

void StreamEvent::wait() {
  BlockingWait wait("device event", 1);
  NDT_CUDA_CHECK(cudaEventSynchronize(ev_));
}

void synchronize() { sync_stream(stream()); }

void sync_stream(cudaStream_t s) {
  BlockingWait wait("device synchronize", 1);
  NDT_CUDA_CHECK(cudaStreamSynchronize(s));
}

bool is_device_pointer(const void* p) {
  if (!p) return false;
  if (g_capture_mem.active) {  // memory the capture allocated is not yet known to cudaPointerGetAttributes
    auto it = g_capture_mem.sizes.upper_bound(const_cast<void*>(p));
    if (it != g_capture_mem.sizes.begin()) {
      --it;
      if (static_cast<const char*>(p) < static_cast<const char*>(it->first) + it->second) return true;
    }
  }
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();  // older runtimes report unregistered host memory as an error
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

int select_device(int fallback_rank) {
  int n = 0;
  NDT_CUDA_CHECK(cudaGetDeviceCount(&n));
  NDT_CHECK(n > 0, "train.device=cuda but no CUDA device is visible");
  int local = fallback_rank;
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "LOCAL_RANK"})
    if (const char* v = std::getenv(var)) {
      local = std::atoi(v);
      break;
    }
  const int dev = local % n;
  NDT_CUDA_CHECK(cudaSetDevice(dev));
  state();
  return dev;
}

int current_device() {
  int dev = 0;
  NDT_CUDA_CHECK(cudaGetDevice(&dev));
  return dev;
}

namespace {
// A device attribute of the current device, queried once per device (host code asks per launch).
int device_attribute(cudaDeviceAttr attr) {
  static std::mutex mu;
  static std::map<std::pair<int, int>, int> values;
  const int dev = current_device();
  std::lock_guard<std::mutex> lock(mu);
  auto it = values.find({dev, static_cast<int>(attr)});
  if (it == values.end()) {
    int v = 0;
    NDT_CUDA_CHECK(cudaDeviceGetAttribute(&v, attr, dev));
    it = values.emplace(std::make_pair(dev, static_cast<int>(attr)), v).first;
  }
  return it->second;
}

std::atomic<bool> g_pdl_on{[] {
  const char* e = std::getenv("NDT_PDL");
  return !(e && std::string(e) == "0");
}()};
}  // namespace

int sm_count() { return device_attribute(cudaDevAttrMultiProcessorCount); }

void set_pdl_enabled(bool on) { g_pdl_on = on; }

bool pdl_enabled() { return g_pdl_on && device_attribute(cudaDevAttrComputeCapabilityMajor) >= 9; }

namespace {
std::atomic<int64_t> g_external_bytes{0};
}
void add_external_bytes(int64_t delta) noexcept { g_external_bytes += delta; }

std::shared_ptr<uint8_t> adopt_external_zeroed(void* p, size_t bytes, void (*release)(void*)) {
  add_external_bytes(static_cast<int64_t>(bytes));
  std::shared_ptr<uint8_t> storage(static_cast<uint8_t*>(p), [bytes, release](uint8_t* q) {
    if (cudaDeviceSynchronize() != cudaSuccess) cudaGetLastError();  // (teardown: kernels may still read it)
    release(q);
    add_external_bytes(-static_cast<int64_t>(bytes));
  });
  memset_zero(p, bytes);
  return storage;
}

MemoryStats memory_stats() {
  DeviceState& s = state();
  MemoryStats m;
  uint64_t used_high = 0, reserved_high = 0;
  NDT_CUDA_CHECK(cudaMemPoolGetAttribute(s.pool, cudaMemPoolAttrUsedMemHigh, &used_high));
  used_high =
      std::max(used_high, g_capture_mem.peak) + static_cast<uint64_t>(std::max<int64_t>(g_external_bytes, 0));
  NDT_CUDA_CHECK(cudaMemPoolGetAttribute(s.pool, cudaMemPoolAttrReservedMemHigh, &reserved_high));
  size_t free_b = 0, total_b = 0;
  NDT_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  m.peak_allocated_gib = static_cast<double>(used_high) / kGiB;
  m.peak_reserved_gib = static_cast<double>(reserved_high) / kGiB;
  m.device_used_gib = static_cast<double>(total_b - free_b) / kGiB;
  m.device_total_gib = static_cast<double>(total_b) / kGiB;
  return m;
}

void reset_peak_memory() {
  DeviceState& s = state();
  uint64_t zero = 0;
  NDT_CUDA_CHECK(cudaMemPoolSetAttribute(s.pool, cudaMemPoolAttrUsedMemHigh, &zero));
  NDT_CUDA_CHECK(cudaMemPoolSetAttribute(s.pool, cudaMemPoolAttrReservedMemHigh, &zero));
  g_capture_mem.peak = 0;
}

// ---- phase timing ----
namespace {
struct Marks {
  std::vector<std::pair<std::string, cudaEvent_t>> events;
  std::vector<cudaEvent_t> free_events;
};
Marks& marks() {
  static Marks m;
  return m;
}
}  // namespace

bool profiling_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("NDT_CUDA_PROFILE");
    return v && *v && std::string(v) != "0";
  }();
  return on;
}

void mark(const char* label) {
  if (!profiling_enabled()) return;
  Marks& m = marks();
  cudaEvent_t e;
  if (!m.free_events.empty()) {
    e = m.free_events.back();
    m.free_events.pop_back();
  } else {
    NDT_CUDA_CHECK(cudaEventCreate(&e));
  }
  NDT_CUDA_CHECK(cudaEventRecord(e, stream()));
  m.events.emplace_back(label, e);
}

std::string profile_report() {
  if (!profiling_enabled()) return "";
  Marks& m = marks();
  synchronize();
  std::vector<std::pair<std::string, double>> total;  // first-appearance order
  for (size_t i = 0; i + 1 < m.events.size(); ++i) {
    float ms = 0;
    NDT_CUDA_CHECK(cudaEventElapsedTime(&ms, m.events[i].second, m.events[i + 1].second));
    bool found = false;
    for (auto& [name, t] : total)
      if (name == m.events[i].first) {
        t += ms;
        found = true;
      }
    if (!found) total.emplace_back(m.events[i].first, ms);
  }
  std::string out;
  for (auto& [name, t] : total) out += fmt::format("{}{} {:.2f} ms", out.empty() ? "" : " | ", name, t);
  for (auto& [name, e] : m.events) m.free_events.push_back(e);
  m.events.clear();
  return out;
}

// ---- interval clock, step clock ----
namespace {
// Records the next event of a reused pool on stream() (created the first time it is needed).
void record_pooled(std::vector<cudaEvent_t>& events, size_t& used) {
  if (used == events.size()) {
    cudaEvent_t e;
    NDT_CUDA_CHECK(cudaEventCreate(&e));
    events.push_back(e);
  }
  NDT_CUDA_CHECK(cudaEventRecord(events[used++], stream()));
}
void destroy_pool(std::vector<cudaEvent_t>& events) {
  for (cudaEvent_t e : events) cudaEventDestroy(e);  // no throw in a destructor
}
}  // namespace

StepClock::~StepClock() { destroy_pool(events_); }

void StepClock::mark() { record_pooled(events_, used_); }

std::vector<double> StepClock::collect() {
  std::vector<double> out;
  if (used_ == 0) return out;
  {
    BlockingWait wait("device synchronize", 1);
    NDT_CUDA_CHECK(cudaEventSynchronize(events_[used_ - 1]));
  }
  for (size_t i = 1; i < used_; ++i) {
    float ms = 0;
    NDT_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[i - 1], events_[i]));
    out.push_back(1e-3 * ms);
  }
  used_ = 0;
  return out;
}

IntervalClock::~IntervalClock() { destroy_pool(events_); }

void IntervalClock::record() { record_pooled(events_, used_); }

void IntervalClock::start() {
  used_ = 0;
  record();
}

void IntervalClock::begin() {
  if (used_ % 2 == 1) record();  // after start() or a closed interval
}

void IntervalClock::end() {
  if (used_ > 0 && used_ % 2 == 0) record();  // closes the interval begin() opened
}

IntervalClock::Times IntervalClock::collect() {
  Times t;
  if (used_ < 3) return t;
  const size_t last = used_ - (used_ % 2 == 0 ? 2 : 1);  // the last end() recorded
  {
    BlockingWait wait("device synchronize", 1);
    NDT_CUDA_CHECK(cudaEventSynchronize(events_[last]));
  }
  float ms = 0;
  for (size_t i = 1; i + 1 <= last; i += 2) {
    NDT_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[i], events_[i + 1]));
    t.busy_s += 1e-3 * ms;
  }
  NDT_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[0], events_[last]));
  t.span_s = 1e-3 * ms;
  return t;
}

}  // namespace ndt::cuda
