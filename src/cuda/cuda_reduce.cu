// Reductions: sum of squares (double, deterministic two-pass), linear bias gradient (deterministic column
// sum), and the row broadcast used by the cublasGemmEx fallback for a bias.
#include <type_traits>

#include "cuda/cuda_kernel_utils.cuh"
#include "cuda/cuda_ops.h"
#include "cuda/runtime.h"

namespace ndt::cuda {

namespace {
using detail::to_f;
constexpr int kSsBlock = 256;
constexpr int64_t kSsChunk = 1 << 16;  // elements per partial: fixed, so the sum order never changes

__device__ double block_sum_double(double x, double* sm) {
  sm[threadIdx.x] = x;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (static_cast<int>(threadIdx.x) < s) sm[threadIdx.x] += sm[threadIdx.x + s];
    __syncthreads();
  }
  return sm[0];
}

template <bool VEC>
__global__ void sumsq_partial_kernel(double* partial, const float* x, int64_t n) {
  detail::pdl_prologue();
  __shared__ double sm[kSsBlock];
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kSsChunk;
  const int64_t i1 = i0 + kSsChunk < n ? i0 + kSsChunk : n;
  double acc = 0.0;
  if (VEC) {  // i0 is a multiple of 4 and x is 16-byte aligned
    const int64_t nv = (i1 - i0) / 4;
    for (int64_t v = threadIdx.x; v < nv; v += kSsBlock) {
      const float4 q = *reinterpret_cast<const float4*>(x + i0 + 4 * v);
      acc += static_cast<double>(q.x) * q.x + static_cast<double>(q.y) * q.y +
             static_cast<double>(q.z) * q.z + static_cast<double>(q.w) * q.w;
    }
    for (int64_t i = i0 + 4 * nv + threadIdx.x; i < i1; i += kSsBlock)
      acc += static_cast<double>(x[i]) * x[i];
  } else {
    for (int64_t i = i0 + threadIdx.x; i < i1; i += kSsBlock) acc += static_cast<double>(x[i]) * x[i];
  }
  const double s = block_sum_double(acc, sm);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

__global__ void sumsq_finish_kernel(double* result, const double* partial, int64_t nblk, bool accumulate) {
  detail::pdl_prologue();
  __shared__ double sm[kSsBlock];
  double acc = 0.0;
  for (int64_t b = threadIdx.x; b < nblk; b += kSsBlock) acc += partial[b];
  const double s = block_sum_double(acc, sm);
  if (threadIdx.x == 0) *result = accumulate ? *result + s : s;
}

template <typename E>
struct ColumnOf {  // dbias term: dout itself
  const E* dout;
  int64_t C;
  __device__ float value(int64_t t, int64_t c, int) const { return to_f(dout[t * C + c]); }
};

template <typename E>
__global__ void broadcast_rows_kernel(E* out, const E* row, int64_t rows, int64_t cols) {
  detail::pdl_prologue();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * cols; i += stride)
    out[i] = row[i % cols];
}
}  // namespace

void sum_squares_device(double* result, const float* x, int64_t n, bool accumulate, cudaStream_t stream) {
  const int64_t nblk = n > 0 ? (n + kSsChunk - 1) / kSsChunk : 0;
  Scratch partial(sizeof(double) * (nblk > 0 ? nblk : 1), stream);
  if (nblk > 0) {
    if (detail::aligned16(x))
      detail::launch_pdl(sumsq_partial_kernel<true>, static_cast<unsigned>(nblk), kSsBlock, 0, stream,
                         partial.as<double>(), x, n);
    else
      detail::launch_pdl(sumsq_partial_kernel<false>, static_cast<unsigned>(nblk), kSsBlock, 0, stream,
                         partial.as<double>(), x, n);
    NDT_CUDA_CHECK_LAUNCH();
  }
  detail::launch_pdl(sumsq_finish_kernel, 1, kSsBlock, 0, stream, result, partial.as<double>(), nblk,
                     accumulate);
  NDT_CUDA_CHECK_LAUNCH();
}

namespace {
__global__ void add_f64_kernel(double* dst, const double* src) {
  detail::pdl_prologue();
  *dst += *src;
}
}  // namespace

void add_f64(double* dst, const double* src, cudaStream_t stream) {
  detail::launch_pdl(add_f64_kernel, 1, 1, 0, stream, dst, src);
  NDT_CUDA_CHECK_LAUNCH();
}

double sum_squares(const float* x, int64_t n, cudaStream_t stream) {
  Scratch result(sizeof(double), stream);
  sum_squares_device(result.as<double>(), x, n, false, stream);
  double host = 0.0;
  copy_d2h_on(&host, result.as<double>(), sizeof(double), stream);
  return host;
}

namespace {
// The bias gradient of bf16 rows with 8 | OC and 16-byte alignment: like detail::colsum's first pass (a
// block reduces a chunk of rows of its columns into one partial row, in a fixed order) but with 16-byte
// loads, 8 columns per thread (a warp reads 512 contiguous bytes of a row instead of 64), chunks of 64 rows
// (4 x the blocks: GPT-2's 768 columns gave 192 blocks of 256 rows, too few loads in flight) and each
// thread's 8 rows loaded before they are added.
constexpr int kBiasChunkRows = 64;
__global__ void bias_grad_partial_vec_kernel(float* partial, const __nv_bfloat16* dout, int64_t T,
                                             int64_t C) {
  detail::pdl_prologue();
  constexpr int VEC = 8, SPAN = 32 * VEC, PER = kBiasChunkRows / 8;
  __shared__ float sm[8][SPAN];
  const int x = threadIdx.x & 31, y = threadIdx.x >> 5;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * SPAN + x * VEC;
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * kBiasChunkRows;
  float acc[VEC] = {};
  if (c < C) {
    float v[PER][VEC];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int64_t t = t0 + y + 8 * i;
      if (t < T) {
        detail::load<VEC>(v[i], dout + t * C, c);
      } else {
#pragma unroll
        for (int k = 0; k < VEC; ++k) v[i][k] = 0.f;
      }
    }
#pragma unroll
    for (int i = 0; i < PER; ++i)
#pragma unroll
      for (int k = 0; k < VEC; ++k) acc[k] += v[i][k];
  }
#pragma unroll
  for (int k = 0; k < VEC; ++k) sm[y][x * VEC + k] = acc[k];
  __syncthreads();
  const int64_t col = static_cast<int64_t>(blockIdx.x) * SPAN + threadIdx.x;
  if (col < C) {
    float sum = 0.f;
#pragma unroll
    for (int r = 0; r < 8; ++r) sum += sm[r][threadIdx.x];
    partial[static_cast<int64_t>(blockIdx.y) * C + col] = sum;
  }
}
}  // namespace

template <typename E>
void bias_backward(float* dbias, const E* dout, int64_t T, int64_t OC, cudaStream_t stream) {
  if constexpr (std::is_same_v<E, __nv_bfloat16>) {
    if (T > 0 && OC > 0 && OC % 8 == 0 && detail::aligned16(dout)) {
      const int64_t nchunk = (T + kBiasChunkRows - 1) / kBiasChunkRows;
      Scratch partial(sizeof(float) * nchunk * OC, stream);
      const dim3 grid(static_cast<unsigned>((OC + 255) / 256), static_cast<unsigned>(nchunk));
      detail::launch_pdl(bias_grad_partial_vec_kernel, grid, 256, 0, stream, partial.as<float>(), dout, T,
                         OC);
      NDT_CUDA_CHECK_LAUNCH();
      detail::colsum_finish(1, dbias, nullptr, nullptr, partial.as<float>(), nchunk, OC, stream);
      return;
    }
  }
  detail::colsum<1>(dbias, nullptr, ColumnOf<E>{dout, OC}, T, OC, stream);
}
template void bias_backward<float>(float*, const float*, int64_t, int64_t, cudaStream_t);
template void bias_backward<__nv_bfloat16>(float*, const __nv_bfloat16*, int64_t, int64_t, cudaStream_t);

namespace detail {
// out(rows, cols) = row broadcast; used by the gemm fallback (cublaslt.cpp) to pre-fill a bias.
void broadcast_rows(void* out, const void* row, bool bf16, int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  const unsigned grid = grid_for(rows * cols, 256);
  if (bf16)
    detail::launch_pdl(broadcast_rows_kernel<__nv_bfloat16>, grid, 256, 0, stream,
                       static_cast<__nv_bfloat16*>(out), static_cast<const __nv_bfloat16*>(row), rows, cols);
  else
    detail::launch_pdl(broadcast_rows_kernel<float>, grid, 256, 0, stream, static_cast<float*>(out),
                       static_cast<const float*>(row), rows, cols);
  NDT_CUDA_CHECK_LAUNCH();
}
}  // namespace detail

}  // namespace ndt::cuda
