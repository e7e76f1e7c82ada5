#pragma once
// The device side of Tensor storage: one compute stream per device, stream-ordered allocation from the
// device's default memory pool, copies, and memory statistics. fmt-free (usable from .cu files).
//
// Contract:
// - Every op of this process runs on stream() of the current device (one process drives one GPU;
//   select_device picks it). Kernels, copies and frees are ordered on that stream, so a tensor freed
//   right after the launch that reads it is safe (cudaFreeAsync is stream-ordered).
// - device_alloc() takes memory from the device's default pool with the release threshold raised to "never",
//   so memory freed by one step is reused by the next without going back to the driver (no cudaMalloc
//   per op and no implicit device synchronization).
// - Code that uses a tensor on ANOTHER stream (NCCL) must order that stream after stream() (event) before
//   use, and back before the tensor is freed.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace ndt::cuda {

// The compute stream of the current device (non-blocking, created on first use).
cudaStream_t stream();
// Stream-ordered allocation/free on stream(). device_free() never throws (it runs in destructors, possibly
// during process teardown).
void* device_alloc(size_t bytes);
void device_free(void* p) noexcept;
// Copies on stream(). h2d returns once a pageable source is staged (the host buffer may be reused); d2h
// waits for the copy (and therefore for all earlier work on the stream).
void copy_h2d(void* dst, const void* src, size_t bytes);
void copy_d2h(void* dst, const void* src, size_t bytes);
// copy_d2h on stream s.
void copy_d2h_on(void* dst, const void* src, size_t bytes, cudaStream_t s);
void copy_d2d(void* dst, const void* src, size_t bytes);
// rows x width_bytes from src (row pitch spitch bytes) to dst (row pitch dpitch), device to device, async.
void copy_d2d_2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width_bytes, size_t rows);
void memset_zero(void* p, size_t bytes);
void synchronize();
// Waits for the stream on the host, recorded as a blocking wait the collective watchdog watches
// (core/blocking_wait.h): every host wait on GPU work goes through here or through synchronize().
void sync_stream(cudaStream_t s);
// Whether p points to device (or managed) memory; host memory, pinned or not, is false.
bool is_device_pointer(const void* p);
// Whether stream() is being captured into a graph now.
bool capturing();
// Returns the pool's cached free memory to the device (after a graph capture: the graph holds its own).
void release_cached_memory();

// A CUDA graph of the work `enqueue` puts on stream() (stream capture, thread-local mode), replayed by
// launch() with the same pointers and sizes: the caller keeps every buffer the work reads or writes at a
// fixed address and rewrites its contents between launches. Memory the work allocates must be freed inside
// it (graph-owned). capture() does NOT run the work; it returns null, leaving no capture open and no error
// pending, when the work cannot be captured (an op that synchronizes, say): run it eagerly then.
class Graph {
 public:
  // `why`, when given, receives the reason a capture failed (the exception of the failing op).
  static std::unique_ptr<Graph> capture(const std::function<void()>& enqueue, std::string* why = nullptr);
  ~Graph();
  void launch();  // asynchronous on stream()
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

 private:
  Graph() = default;
  cudaGraphExec_t exec_ = nullptr;
};

// Temporary device memory from the stream-ordered pool (cudaMallocAsync on `stream`; graph-owned under
// stream capture), released on that stream when it goes out of scope. Kernels' workspaces.
class Scratch {
 public:
  Scratch(size_t bytes, cudaStream_t stream);
  ~Scratch();  // never throws: an error resurfaces at the next checked call
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  template <typename P>
  P* as() const {
    return static_cast<P*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_;
};

// Page-locked host memory: copies between it and the device (copy_*_async) are asynchronous on stream(),
// so the host can prepare the next inputs or read earlier results while the device works.
class PinnedBuffer {
 public:
  explicit PinnedBuffer(size_t bytes);
  ~PinnedBuffer();
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  template <typename P>
  P* as() const {
    return static_cast<P*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
};
void copy_h2d_async(void* dst, const PinnedBuffer& src, size_t bytes);
// An asynchronous copy on stream() from page-locked memory (inside a PinnedBuffer, say): the source must stay
// untouched until the stream has passed the copy.
void copy_h2d_pinned(void* dst, const void* src, size_t bytes);
void copy_d2h_async(PinnedBuffer& dst, const void* src, size_t bytes);

// A point on stream(): record() marks the work enqueued so far, wait() blocks the host until that work is
// done (a blocking wait the collective watchdog watches, as sync_stream).
class StreamEvent {
 public:
  StreamEvent();
  ~StreamEvent();
  StreamEvent(const StreamEvent&) = delete;
  StreamEvent& operator=(const StreamEvent&) = delete;
  void record();
  void wait();

 private:
  cudaEvent_t ev_ = nullptr;
};

// Device of this process: local rank (OMPI/SLURM/MPI env, else `fallback_rank`) modulo the device
// count; sets it current and returns its index.
int select_device(int fallback_rank);
int current_device();
// Streaming multiprocessors of the current device (queried once per device).
int sm_count();
// Whether ndtrain's kernels are launched with programmatic dependent launch (a kernel's launch overlaps the
// end of the one before it on the stream; each such kernel waits for it before touching memory,
// cuda_kernel_utils.cuh's pdl_prologue): on devices of compute capability 9.0 and later, unless
// NDT_PDL=0 (A/B runs) or set_pdl_enabled(false). Applies to launches made from then on (a captured CUDA graph
// keeps the form it was captured with).
bool pdl_enabled();
void set_pdl_enabled(bool on);

struct MemoryStats {
  // High-water mark of live tensor bytes (as torch's max_memory_allocated): the pool's, or, where larger, the
  // pool's live bytes at a graph's capture plus the most the graph's own allocations hold at once.
  double peak_allocated_gib = 0;
  double peak_reserved_gib = 0;  // high-water mark of memory the pool held
  double device_used_gib = 0;    // total - free of the whole device now (context, cuBLAS workspaces, pool)
  double device_total_gib = 0;
};
MemoryStats memory_stats();
// Device memory held outside the pool (NCCL-registered buffers): memory_stats() adds the live total to the
// pool's peak (such buffers are made at start-up and live as long as the run).
void add_external_bytes(int64_t delta) noexcept;
// Takes device memory allocated outside the pool (ncclMemAlloc; a cudaMalloc that CUDA IPC exports): zeroes
// it and counts it (add_external_bytes) for as long as the returned storage lives; its deleter waits for the
// device, then calls `release` on it.
std::shared_ptr<uint8_t> adopt_external_zeroed(void* p, size_t bytes, void (*release)(void*));
void reset_peak_memory();

// Optional phase timing with CUDA events (for profiling; enabled by NDT_CUDA_PROFILE=1 in the
// environment, otherwise every call is a no-op). mark() records an event on stream() labelled with the
// phase that STARTS there; profile_report() synchronizes, returns "label ms | label ms ..." for the
// intervals between consecutive marks (same labels summed) and clears them.
bool profiling_enabled();
void mark(const char* label);
std::string profile_report();

// GPU time of intervals the host marks on stream() with events: a host timer around asynchronous
// launches measures only their enqueueing. start() opens a span (and forgets earlier intervals);
// begin()/end() bracket the work to count; collect() waits for the last event and returns the summed
// intervals and the span from start() to the last end().
class IntervalClock {
 public:
  IntervalClock() = default;
  ~IntervalClock();
  IntervalClock(const IntervalClock&) = delete;
  IntervalClock& operator=(const IntervalClock&) = delete;
  void start();
  void begin();
  void end();
  struct Times {
    double busy_s = 0, span_s = 0;
  };
  Times collect();

 private:
  void record();
  std::vector<cudaEvent_t> events_;  // reused across spans
  size_t used_ = 0;                  // events_[0] = start, then begin/end pairs
};

// Step boundaries on stream(): mark() records an event; collect() waits for the last one, returns the times
// between consecutive marks in seconds (one fewer than the marks) and forgets the marks. Steps the host
// launches ahead of the device are timed as the device ran them.
class StepClock {
 public:
  StepClock() = default;
  ~StepClock();
  StepClock(const StepClock&) = delete;
  StepClock& operator=(const StepClock&) = delete;
  void mark();
  std::vector<double> collect();

 private:
  std::vector<cudaEvent_t> events_;  // reused
  size_t used_ = 0;
};

}  // namespace ndt::cuda
