// Token and learned-position embeddings. Backward is deterministic without float atomics: token indices
// are stably radix-sorted by id (cub), then each id's dout rows are summed in a fixed order, in pieces of at
// most kChunk sorted positions, and the sum is added to the table row once.
#include <cub/device/device_radix_sort.cuh>

#include "cuda/cuda_kernel_utils.cuh"
#include "cuda/cuda_ops.h"

namespace ndt::cuda {

namespace {
using detail::load;
using detail::store;
using detail::to_f;

// out(T, C)[t] = (ACCUMULATE ? out : 0) + table[ids[t] - start] when the row is in [0, V), else unchanged/0.
template <typename E, int VEC, bool ACCUMULATE>
__global__ void gather_rows_kernel(E* out, const int32_t* ids, const E* table, int64_t T, int64_t V,
                                   int64_t C, int64_t start) {
  detail::pdl_prologue();
  const int64_t nv = T * C / VEC;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < nv; idx += stride) {
    const int64_t i = idx * VEC, t = i / C, c = i - t * C;
    const int64_t row = static_cast<int64_t>(ids[t]) - start;
    const bool inside = row >= 0 && row < V;
    float v[VEC];
    if (inside) {
      load<VEC>(v, table, row * C + c);
    } else {
#pragma unroll
      for (int k = 0; k < VEC; ++k) v[k] = 0.f;
    }
    if (ACCUMULATE) {
      if (!inside) continue;
      float o[VEC];
      load<VEC>(o, out, i);
#pragma unroll
      for (int k = 0; k < VEC; ++k) v[k] += o[k];
    }
    store<VEC>(out, i, v);
  }
}

template <typename E, bool ACCUMULATE>
void gather_rows(E* out, const int32_t* ids, const E* table, int64_t T, int64_t V, int64_t C, int64_t start,
                 cudaStream_t stream) {
  if (T <= 0 || C <= 0) return;
  constexpr int kBlock = 256;
  if (C % detail::kVec<E> == 0 && detail::all_aligned16({out, table})) {
    constexpr int kV = detail::kVec<E>;
    detail::launch_pdl(gather_rows_kernel<E, kV, ACCUMULATE>, detail::grid_for(T * C / kV, kBlock), kBlock, 0,
                       stream, out, ids, table, T, V, C, start);
  } else {
    detail::launch_pdl(gather_rows_kernel<E, 1, ACCUMULATE>, detail::grid_for(T * C, kBlock), kBlock, 0,
                       stream, out, ids, table, T, V, C, start);
  }
  NDT_CUDA_CHECK_LAUNCH();
}

__global__ void iota_kernel(int32_t* x, int64_t n) {
  detail::pdl_prologue();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] = static_cast<int32_t>(i);
}

// The sorted positions are cut into chunks of kChunk; block b sums the dout rows of each run of equal ids
// inside its chunk (token order, 8 interleaved partial sums combined in a fixed order). A run inside one
// chunk goes straight into dtable; a run that crosses a chunk boundary leaves its pieces in `partial`: slot
// 2b + 1 for the piece that starts the run (the chunk's last run), slot 2b for a piece that continues one
// (the chunk's first run). Frequent ids (Zipf-like text, a byte vocabulary) spread over many blocks this way
// instead of one block summing thousands of rows.
constexpr int64_t kChunk = 32;

template <typename E>
__device__ float sum_rows(const E* dout, const int32_t* tokens, int64_t j, int64_t end, int64_t C,
                          int64_t c) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (; j + 8 <= end; j += 8) {
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[k] += to_f(dout[static_cast<int64_t>(tokens[j + k]) * C + c]);
  }
  for (int k = 0; j < end; ++j, ++k) acc[k] += to_f(dout[static_cast<int64_t>(tokens[j]) * C + c]);
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

template <typename E>
__global__ void scatter_chunks_kernel(float* dtable, float* partial, const E* dout, const int32_t* keys,
                                      const int32_t* tokens, int64_t T, int64_t V, int64_t C, int64_t start) {
  detail::pdl_prologue();
  const int64_t b = blockIdx.x, lo = b * kChunk, hi = min(T, lo + kChunk);
  for (int64_t s = lo; s < hi;) {
    const int32_t key = keys[s];
    int64_t e = s + 1;
    while (e < hi && keys[e] == key) ++e;
    const bool continued = s == lo && lo > 0 && keys[lo - 1] == key;
    const bool continues = e == hi && hi < T && keys[hi] == key;
    const int64_t row = static_cast<int64_t>(key) - start;
    if (row >= 0 && row < V) {
      float* to = continued || continues ? partial + (2 * b + (continued ? 0 : 1)) * C : dtable + row * C;
      const bool add = !continued && !continues;
      for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
        const float v = sum_rows(dout, tokens, s, e, C, c);
        to[c] = add ? to[c] + v : v;
      }
    }
    s = e;
  }
}

// Block b owns the run that starts in its chunk and crosses into the next: adds its pieces in chunk order.
__global__ void scatter_finish_kernel(float* dtable, const float* partial, const int32_t* keys, int64_t T,
                                      int64_t V, int64_t C, int64_t start) {
  detail::pdl_prologue();
  const int64_t b = blockIdx.x, lo = b * kChunk, hi = min(T, lo + kChunk);
  const int32_t key = keys[hi - 1];
  if (hi >= T || keys[hi] != key) return;                        // the chunk's last run ends here
  if (keys[lo] == key && lo > 0 && keys[lo - 1] == key) return;  // ... or started before it
  const int64_t row = static_cast<int64_t>(key) - start;
  if (row < 0 || row >= V) return;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    float acc = partial[(2 * b + 1) * C + c];
    for (int64_t q = b + 1;; ++q) {
      acc += partial[2 * q * C + c];
      const int64_t qhi = min(T, (q + 1) * kChunk);
      if (qhi >= T || keys[qhi] != key || keys[qhi - 1] != key) break;
    }
    dtable[row * C + c] += acc;
  }
}

template <typename E>
void scatter_add_rows(float* dtable, const E* dout, const int32_t* ids, int64_t T, int64_t V, int64_t C,
                      int64_t start, cudaStream_t stream) {
  if (!dtable || T <= 0 || C <= 0) return;
  NDT_CUDA_REQUIRE(T <= INT32_MAX, "embedding backward: more than 2^31 tokens");
  const int n = static_cast<int>(T);
  Scratch buf(sizeof(int32_t) * 3 * T, stream);
  int32_t* tok_in = buf.as<int32_t>();
  int32_t* keys_out = tok_in + T;
  int32_t* tok_out = keys_out + T;
  detail::launch_pdl(iota_kernel, static_cast<unsigned>((T + 255) / 256), 256, 0, stream, tok_in, T);
  NDT_CUDA_CHECK_LAUNCH();
  size_t temp_bytes = 0;
  NDT_CUDA_CHECK(
      cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, ids, keys_out, tok_in, tok_out, n, 0, 32, stream));
  Scratch temp(temp_bytes, stream);
  NDT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.as<void>(), temp_bytes, ids, keys_out, tok_in, tok_out,
                                                 n, 0, 32, stream));
  const int block = C >= 256 ? 256 : static_cast<int>((C + 31) / 32 * 32);
  const int64_t nchunk = (T + kChunk - 1) / kChunk;
  Scratch partial(sizeof(float) * 2 * nchunk * C, stream);
  detail::launch_pdl(scatter_chunks_kernel<E>, static_cast<unsigned>(nchunk), block, 0, stream, dtable,
                     partial.as<float>(), dout, keys_out, tok_out, T, V, C, start);
  NDT_CUDA_CHECK_LAUNCH();
  detail::launch_pdl(scatter_finish_kernel, static_cast<unsigned>(nchunk), block, 0, stream, dtable,
                     partial.as<float>(), keys_out, T, V, C, start);
  NDT_CUDA_CHECK_LAUNCH();
}
}  // namespace

template <typename E>
void embedding_forward(E* out, const int32_t* ids, const E* table, int64_t T, int64_t V, int64_t C,
                       int64_t vocab_start, cudaStream_t stream) {
  gather_rows<E, false>(out, ids, table, T, V, C, vocab_start, stream);
}

template <typename E>
void embedding_backward(float* dtable, const E* dout, const int32_t* ids, int64_t T, int64_t V, int64_t C,
                        int64_t vocab_start, cudaStream_t stream) {
  scatter_add_rows<E>(dtable, dout, ids, T, V, C, vocab_start, stream);
}

template <typename E>
void add_position_embedding_forward(E* out, const int32_t* pos, const E* pos_table, int64_t T, int64_t P,
                                    int64_t C, cudaStream_t stream) {
  gather_rows<E, true>(out, pos, pos_table, T, P, C, 0, stream);
}

template <typename E>
void add_position_embedding_backward(float* dpos_table, const E* dout, const int32_t* pos, int64_t T,
                                     int64_t P, int64_t C, cudaStream_t stream) {
  scatter_add_rows<E>(dpos_table, dout, pos, T, P, C, 0, stream);
}

#define NDT_INSTANTIATE(E)                                                                                  \
  template void embedding_forward<E>(E*, const int32_t*, const E*, int64_t, int64_t, int64_t, int64_t,      \
                                     cudaStream_t);                                                         \
  template void embedding_backward<E>(float*, const E*, const int32_t*, int64_t, int64_t, int64_t, int64_t, \
                                      cudaStream_t);                                                        \
  template void add_position_embedding_forward<E>(E*, const int32_t*, const E*, int64_t, int64_t, int64_t,  \
                                                  cudaStream_t);                                            \
  template void add_position_embedding_backward<E>(float*, const E*, const int32_t*, int64_t, int64_t,      \
                                                   int64_t, cudaStream_t);
NDT_INSTANTIATE(float)
NDT_INSTANTIATE(__nv_bfloat16)
#undef NDT_INSTANTIATE

}  // namespace ndt::cuda
