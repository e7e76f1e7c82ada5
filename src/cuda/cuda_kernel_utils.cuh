#pragma once
// Internal helpers shared by the src/cuda/cuda_*.cu kernels: element conversions, 16-byte packs,
// warp reductions, an elementwise launcher and stream-ordered scratch memory. fmt-free (nvcc only).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "cuda/cuda_check.h"
#include "cuda/runtime.h"

namespace ndt {
// Declared in core/check.h (which .cu files cannot include: fmt); throws ndt::Error.
[[noreturn]] void check_failed(const char* file, int line, const char* cond, const std::string& msg);
}  // namespace ndt

// Host-side argument check for .cu files (fmt-free NDT_CHECK with a fixed message).
#define NDT_CUDA_REQUIRE(cond, msg)                                     \
  do {                                                                  \
    if (!(cond)) ::ndt::check_failed(__FILE__, __LINE__, #cond, (msg)); \
  } while (0)

namespace ndt::cuda::detail {

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename E>
__device__ __forceinline__ E from_f(float x);
template <>
__device__ __forceinline__ float from_f<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// N elements moved as one aligned access (N * sizeof(E) == 16 for the vector path, 1 element for scalar).
template <typename E, int N>
struct alignas(sizeof(E) * N) Pack {
  E v[N];
};
template <typename E>
constexpr int kVec = 16 / static_cast<int>(sizeof(E));

// Loads/stores N elements at p + i in accesses of at most 16 bytes (p + i must be aligned to them).
template <int N, typename E>
__device__ __forceinline__ void load(float (&out)[N], const E* p, int64_t i) {
  constexpr int kPer = sizeof(E) * N > 16 ? 16 / static_cast<int>(sizeof(E)) : N;
#pragma unroll
  for (int c = 0; c < N; c += kPer) {
    const Pack<E, kPer> pk = *reinterpret_cast<const Pack<E, kPer>*>(p + i + c);
#pragma unroll
    for (int k = 0; k < kPer; ++k) out[c + k] = to_f(pk.v[k]);
  }
}
template <int N, typename E>
__device__ __forceinline__ void store(E* p, int64_t i, const float (&in)[N]) {
  constexpr int kPer = sizeof(E) * N > 16 ? 16 / static_cast<int>(sizeof(E)) : N;
#pragma unroll
  for (int c = 0; c < N; c += kPer) {
    Pack<E, kPer> pk;
#pragma unroll
    for (int k = 0; k < kPer; ++k) pk.v[k] = from_f<E>(in[c + k]);
    *reinterpret_cast<Pack<E, kPer>*>(p + i + c) = pk;
  }
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
inline bool all_aligned16(std::initializer_list<const void*> ps) {
  for (const void* p : ps)
    if (p && !aligned16(p)) return false;
  return true;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// Programmatic dependent launch (sm_90+): a kernel started by launch_pdl may begin while the kernel before it
// on the stream is still finishing, so it must call pdl_prologue() before it reads or writes global memory.
// The prologue waits until that kernel has completed and its writes are visible (a no-op for a kernel
// launched the ordinary way), then lets the next such kernel be scheduled into this one's last wave.
__device__ __forceinline__ void pdl_prologue() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// Launches kernel(args...) on grid x block threads with smem bytes of dynamic shared memory on stream, with
// programmatic dependent launch where pdl_enabled(). Only for kernels that begin with pdl_prologue().
template <typename... Params, typename... Args>
void launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                Args&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = pdl_enabled() ? 1 : 0;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  NDT_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

// Grid for a grid-stride loop over `work` items: enough blocks to fill the GPU, never more than needed.
inline unsigned grid_for(int64_t work, int block) {
  const int64_t need = (work + block - 1) / block;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(need, 132 * 16)));
}

// Elementwise kernel: Op::apply<N>(i) handles elements [i, i + N). Vector part first, scalar tail after.
template <int VEC, typename Op>
__global__ void elementwise_kernel(Op op, int64_t n) {
  detail::pdl_prologue();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nv = n / VEC;
  for (int64_t i = tid; i < nv; i += stride) op.template apply<VEC>(i * VEC);
  if constexpr (VEC > 1)
    for (int64_t i = nv * VEC + tid; i < n; i += stride) op.template apply<1>(i);
}

// Launches Op over n elements with 16-byte packs when `vec_ok` (all pointers 16-byte aligned).
template <typename E, typename Op>
void launch_elementwise(const Op& op, int64_t n, bool vec_ok, cudaStream_t stream) {
  if (n <= 0) return;
  constexpr int kBlock = 256;
  if (vec_ok) {
    detail::launch_pdl(elementwise_kernel<kVec<E>, Op>, grid_for(n / kVec<E> + 1, kBlock), kBlock, 0, stream,
                       op, n);
  } else {
    detail::launch_pdl(elementwise_kernel<1, Op>, grid_for(n, kBlock), kBlock, 0, stream, op, n);
  }
  NDT_CUDA_CHECK_LAUNCH();
}

// ---- deterministic column sums over rows: out[c] += sum_t f(t, c), for parameter gradients ----
// Pass 1: block (32 cols x 8 row lanes) reduces a chunk of kColsumRows rows into partial[chunk][c] in a
// fixed order; pass 2 adds the chunks in order. Op::value(t, c, which) gives term `which` (0 or 1).
constexpr int kColsumRows = 256;

template <int NOUT, typename Op>
__global__ void colsum_partial_kernel(Op op, float* partial, int64_t T, int64_t C) {
  detail::pdl_prologue();
  __shared__ float sm[NOUT][8][33];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * kColsumRows;
  const int64_t t1 = t0 + kColsumRows < T ? t0 + kColsumRows : T;
  float acc[NOUT];
#pragma unroll
  for (int k = 0; k < NOUT; ++k) acc[k] = 0.f;
  if (c < C)
    for (int64_t t = t0 + threadIdx.y; t < t1; t += 8) {
#pragma unroll
      for (int k = 0; k < NOUT; ++k) acc[k] += op.value(t, c, k);
    }
#pragma unroll
  for (int k = 0; k < NOUT; ++k) sm[k][threadIdx.y][threadIdx.x] = acc[k];
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
#pragma unroll
    for (int k = 0; k < NOUT; ++k) {
      float s = 0.f;
      for (int y = 0; y < 8; ++y) s += sm[k][y][threadIdx.x];
      partial[(static_cast<int64_t>(k) * gridDim.y + blockIdx.y) * C + c] = s;
    }
  }
}

// out_k[c] += sum over j of partial[(k * nchunk + j) * C + c] for the outputs k = blockIdx.y that are set.
// A block takes 32 columns (a warp reads 128 contiguous bytes of a partial row) and its 32 warps the chunks
// w, w + 32, ... in order; their sums are then added in warp order: deterministic, and every load of a warp
// is in flight at once (one warp per column, reading a column down the chunks, took 11 us for GPT-2's
// norm partials).
constexpr int kFinishWarps = 32;
template <int WARPS>  // (a template: defined in a header included by several .cu files)
__global__ void __launch_bounds__(32 * WARPS)
    colsum_finish_kernel(float* out0, float* out1, float* out2, const float* partial, int64_t nchunk,
                         int64_t C) {
  detail::pdl_prologue();
  const int k = blockIdx.y;
  float* out = k == 0 ? out0 : k == 1 ? out1 : out2;
  if (!out) return;  // the whole block
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  float s = 0.f;
  if (c < C) {
#pragma unroll 4
    for (int64_t j = threadIdx.y; j < nchunk; j += WARPS) s += partial[(k * nchunk + j) * C + c];
  }
  __shared__ float sm[WARPS][33];
  sm[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float t = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) t += sm[w][threadIdx.x];
    out[c] += t;
  }
}

// The launch for nout partial rows per chunk (1 to 3) into out0, out1, out2 (null outputs are skipped).
inline void colsum_finish(int nout, float* out0, float* out1, float* out2, const float* partial,
                          int64_t nchunk, int64_t C, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((C + 31) / 32), static_cast<unsigned>(nout));
  detail::launch_pdl(colsum_finish_kernel<kFinishWarps>, grid, dim3(32, kFinishWarps), 0, stream,
                     nout > 0 ? out0 : nullptr, nout > 1 ? out1 : nullptr, nout > 2 ? out2 : nullptr, partial,
                     nchunk, C);
  NDT_CUDA_CHECK_LAUNCH();
}

// out0[c] += sum_t op.value(t, c, 0); out1 (NOUT == 2) likewise with term 1. Null outputs are skipped.
template <int NOUT, typename Op>
void colsum(float* out0, float* out1, const Op& op, int64_t T, int64_t C, cudaStream_t stream) {
  if (T <= 0 || C <= 0 || (!out0 && !out1)) return;
  const int64_t nchunk = (T + kColsumRows - 1) / kColsumRows;
  Scratch partial(sizeof(float) * NOUT * nchunk * C, stream);
  const dim3 grid(static_cast<unsigned>((C + 31) / 32), static_cast<unsigned>(nchunk));
  detail::launch_pdl(colsum_partial_kernel<NOUT, Op>, grid, dim3(32, 8), 0, stream, op, partial.as<float>(),
                     T, C);
  NDT_CUDA_CHECK_LAUNCH();
  colsum_finish(NOUT, out0, out1, nullptr, partial.as<float>(), nchunk, C, stream);
}

}  // namespace ndt::cuda::detail
