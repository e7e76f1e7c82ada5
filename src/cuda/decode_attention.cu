// Decode attention: one query row per segment (a decode step over a KV cache), the twin of the general
// CPU attention restricted to that case (contract in flash_attention.h). One block per (segment, kv head)
// serves every query head of the group, so each cached K/V row is read once per step instead of once per
// query head (the flash kernel's 64-row query tiles would also sit 63/64 empty here).
//
// Inside a block: lanes_per_key = D / 8 lanes hold one key row (8 elements each, one 16-byte load in bf16),
// a warp works on 32 / lanes_per_key keys at a time, the warps stride over the segment's visible keys,
// each key slot keeps its own online-softmax state (base-2 exponent, fp32), and the states are merged at
// the end (across the key slots of a warp by shuffles, across warps through shared memory).
#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "cuda/cuda_check.h"
#include "cuda/cuda_kernel_utils.cuh"
#include "cuda/flash_attention.h"
#include "cuda/runtime.h"

namespace ndt::cuda {
namespace {

using detail::to_f;
constexpr int kWarps = 4;
constexpr int kUnroll = 2;  // key groups whose loads are in flight together

constexpr float kLog2e = 1.4426950408889634f;

// 8 elements of a row as loaded (16 bytes of bf16 or 32 of fp32), converted to float after the loads of
// several keys are in flight.
template <typename T>
struct Raw8 {
  uint4 w[sizeof(T) == 2 ? 1 : 2];
};
template <typename T>
__device__ __forceinline__ Raw8<T> load_raw(const T* src) {
  Raw8<T> r;
#pragma unroll
  for (int i = 0; i < (sizeof(T) == 2 ? 1 : 2); ++i) r.w[i] = reinterpret_cast<const uint4*>(src)[i];
  return r;
}
template <typename T>
__device__ __forceinline__ void to_float8(float* dst, const Raw8<T>& r) {
  if constexpr (sizeof(T) == 2) {
    const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&r.w[0]);
#pragma unroll
    for (int i = 0; i < 8; ++i) dst[i] = __bfloat162float(h[i]);
  } else {
    const float* f = reinterpret_cast<const float*>(&r.w[0]);
#pragma unroll
    for (int i = 0; i < 8; ++i) dst[i] = f[i];
  }
}
template <typename T>
__device__ __forceinline__ void load8(float* dst, const T* src) {
  to_float8<T>(dst, load_raw(src));
}

// (m, l, acc) of one online softmax; merging rescales both sides to the larger exponent.
__device__ __forceinline__ void merge_state(float& m, float& l, float* acc, float m2, float l2,
                                            const float* acc2) {
  const float mn = fmaxf(m, m2);
  if (mn == -INFINITY) return;  // both empty
  const float a = exp2f(m - mn), b = exp2f(m2 - mn);
  l = l * a + l2 * b;
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = acc[i] * a + acc2[i] * b;
  m = mn;
}

// G (query heads per kv head) is a template parameter so that the per-head state stays in registers.
// parts == nullptr: one part, out and lse written here. Otherwise parts holds per (row, split) the state
// (m, l, acc[D]) of this block's keys, row = s * H + head, D + 2 floats each.
template <typename T, int D, int G>
// bf16 with up to 4 query heads per block: at most 128 registers (4 blocks per SM), so 64 sequences x 8 kv
// heads fit in one round (at 153 registers, 3 blocks per SM, 512 blocks took 1.3 rounds at 19% occupancy);
// with kUnroll 2 nothing spills (ptxas: 127 registers). 8 heads keep 16 floats of q and accumulator per
// head and lane (201 registers), and fp32 rows take twice the load registers (a cap spills there): no cap.
__global__ void __launch_bounds__(kWarps * 32, sizeof(T) == 2 && G <= 4 ? 4 : 1)
    decode_kernel(T* out, float* lse, float* parts, const T* q, const T* k, const T* v, const int32_t* cu_k,
                  const int32_t* pos_q, const int32_t* pos_k, int H, int KV, float scale) {
  constexpr int LPK = D / 8;     // lanes per key
  constexpr int KPW = 32 / LPK;  // keys per warp at a time
  const int s = blockIdx.x, g = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int slot = lane / LPK, part = lane % LPK;
  // Visible keys: positions are non-decreasing in a segment, so they are a prefix [k0, k0 + n), n the
  // count of positions <= pq, counted by the whole block in one round of loads (a binary search would be
  // a chain of dependent loads, several microseconds at this size).
  const int k0 = cu_k[s], k1 = cu_k[s + 1], pq = pos_q[s];
  __shared__ int visible;
  if (threadIdx.x == 0) visible = 0;
  __syncthreads();
  int cnt = 0;
  for (int j = k0 + threadIdx.x; j < k1; j += blockDim.x) cnt += pos_k[j] <= pq;
  atomicAdd(&visible, cnt);  // integer: exact in any order
  __syncthreads();
  // This block's part of the visible keys [k0, k0 + visible).
  const int splits = gridDim.z, per = (visible + splits - 1) / splits;
  const int kbeg = k0 + min(visible, static_cast<int>(blockIdx.z) * per);
  const int kend = k0 + min(visible, (static_cast<int>(blockIdx.z) + 1) * per);
  float qf[G][8];
#pragma unroll
  for (int h = 0; h < G; ++h) {
    load8(qf[h], q + (static_cast<int64_t>(s) * H + g * G + h) * D + part * 8);
#pragma unroll
    for (int i = 0; i < 8; ++i) qf[h][i] *= scale * kLog2e;
  }
  float m[G], l[G], acc[G][8];
#pragma unroll
  for (int h = 0; h < G; ++h) {
    m[h] = -INFINITY, l[h] = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[h][i] = 0.0f;
  }
  // kUnroll key groups per iteration: their loads are all issued before any is used (memory-level
  // parallelism; a decode step reads little per block, so latency, not bandwidth, bounds a lone load).
  constexpr int kStride = kWarps * KPW;
  for (int base = kbeg + warp * KPW; base < kend; base += kStride * kUnroll) {  // uniform per warp
    Raw8<T> kr[kUnroll], vr[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = base + u * kStride + slot;
      if (j < kend) {
        const int64_t off = (static_cast<int64_t>(j) * KV + g) * D + part * 8;
        kr[u] = load_raw(k + off);
        vr[u] = load_raw(v + off);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * kStride >= kend) break;  // uniform: no key of this group in the warp
      const bool valid = base + u * kStride + slot < kend;
      float kf[8], vf[8];
      if (valid) {
        to_float8<T>(kf, kr[u]);
        to_float8<T>(vf, vr[u]);
      }
#pragma unroll
      for (int h = 0; h < G; ++h) {
        float sc = 0.0f;
        if (valid)
#pragma unroll
          for (int i = 0; i < 8; ++i) sc += qf[h][i] * kf[i];
#pragma unroll
        for (int o = LPK / 2; o > 0; o >>= 1) sc += __shfl_xor_sync(0xffffffffu, sc, o);
        if (!valid) continue;
        const float mn = fmaxf(m[h], sc), a = exp2f(m[h] - mn), p = exp2f(sc - mn);
        l[h] = l[h] * a + p;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[h][i] = acc[h][i] * a + p * vf[i];
        m[h] = mn;
      }
    }
  }
  // Merge the key slots of the warp (lanes with the same part), then the warps.
  __shared__ float sm[kWarps][G], sl[kWarps][G], sacc[kWarps][G][D];
#pragma unroll
  for (int h = 0; h < G; ++h) {
    for (int o = LPK; o < 32; o <<= 1) {
      float acc2[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) acc2[i] = __shfl_xor_sync(0xffffffffu, acc[h][i], o);
      const float m2 = __shfl_xor_sync(0xffffffffu, m[h], o), l2 = __shfl_xor_sync(0xffffffffu, l[h], o);
      merge_state(m[h], l[h], acc[h], m2, l2, acc2);
    }
    if (slot == 0) {
#pragma unroll
      for (int i = 0; i < 8; ++i) sacc[warp][h][part * 8 + i] = acc[h][i];
      if (part == 0) sm[warp][h] = m[h], sl[warp][h] = l[h];
    }
  }
  __syncthreads();
  // Thread t finishes element d = t % D of head h = t / D (looping when G * D exceeds the block).
  for (int t = threadIdx.x; t < G * D; t += blockDim.x) {
    const int h = t / D, d = t % D;
    float mm = -INFINITY;
    for (int w = 0; w < kWarps; ++w) mm = fmaxf(mm, sm[w][h]);
    float ll = 0.0f, a = 0.0f;
    if (mm != -INFINITY)
      for (int w = 0; w < kWarps; ++w) {
        const float f = exp2f(sm[w][h] - mm);
        ll += sl[w][h] * f;
        a += sacc[w][h][d] * f;
      }
    const int64_t row = static_cast<int64_t>(s) * H + g * G + h;
    if (parts) {
      float* p = parts + (row * splits + blockIdx.z) * (D + 2);
      p[2 + d] = a;
      if (d == 0) p[0] = mm, p[1] = ll;
      continue;
    }
    if constexpr (sizeof(T) == 2)
      out[row * D + d] = __float2bfloat16_rn(ll > 0.0f ? a / ll : 0.0f);
    else
      out[row * D + d] = ll > 0.0f ? a / ll : 0.0f;
    if (d == 0) lse[row] = ll > 0.0f ? (mm + log2f(ll)) / kLog2e : -INFINITY;
  }
}

// Merges the parts of each (row, d) in split order: out = sum_z acc_z 2^(m_z - m) / sum_z l_z 2^(m_z - m).
template <typename T, int D>
__global__ void decode_combine_kernel(T* out, float* lse, const float* part, int64_t rows, int splits) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= rows * D) return;
  const int64_t row = t / D;
  const int d = static_cast<int>(t % D);
  const float* p = part + row * splits * (D + 2);
  float mm = -INFINITY;
  for (int z = 0; z < splits; ++z) mm = fmaxf(mm, p[z * (D + 2)]);
  float ll = 0.0f, a = 0.0f;
  if (mm != -INFINITY)
    for (int z = 0; z < splits; ++z) {
      const float f = exp2f(p[z * (D + 2)] - mm);
      ll += p[z * (D + 2) + 1] * f;
      a += p[z * (D + 2) + 2 + d] * f;
    }
  if constexpr (sizeof(T) == 2)
    out[t] = __float2bfloat16_rn(ll > 0.0f ? a / ll : 0.0f);
  else
    out[t] = ll > 0.0f ? a / ll : 0.0f;
  if (d == 0) lse[row] = ll > 0.0f ? (mm + log2f(ll)) / kLog2e : -INFINITY;
}

template <typename T, int D, int G>
void launch(T* out, float* lse, float* part, int splits, const T* q, const T* k, const T* v,
            const int32_t* cu_k, const int32_t* pos_q, const int32_t* pos_k, int64_t nseq, int64_t H,
            int64_t KV, float scale, cudaStream_t stream) {
  float* p = splits > 1 ? part : nullptr;
  decode_kernel<T, D, G>
      <<<dim3(static_cast<unsigned>(nseq), static_cast<unsigned>(KV), static_cast<unsigned>(splits)),
         kWarps * 32, 0, stream>>>(out, lse, p, q, k, v, cu_k, pos_q, pos_k, static_cast<int>(H),
                                   static_cast<int>(KV), scale);
  NDT_CUDA_CHECK(cudaGetLastError());
  if (!p) return;
  const int64_t n = nseq * H * D;
  decode_combine_kernel<T, D>
      <<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(out, lse, p, nseq * H, splits);
  NDT_CUDA_CHECK(cudaGetLastError());
}

template <typename T, int D>
bool launch_group(T* out, float* lse, float* part, int splits, const T* q, const T* k, const T* v,
                  const int32_t* cu_k, const int32_t* pos_q, const int32_t* pos_k, int64_t nseq, int64_t H,
                  int64_t KV, float scale, cudaStream_t stream) {
  switch (H / KV) {
    case 1:
      launch<T, D, 1>(out, lse, part, splits, q, k, v, cu_k, pos_q, pos_k, nseq, H, KV, scale, stream);
      return true;
    case 2:
      launch<T, D, 2>(out, lse, part, splits, q, k, v, cu_k, pos_q, pos_k, nseq, H, KV, scale, stream);
      return true;
    case 4:
      launch<T, D, 4>(out, lse, part, splits, q, k, v, cu_k, pos_q, pos_k, nseq, H, KV, scale, stream);
      return true;
    case 8:
      launch<T, D, 8>(out, lse, part, splits, q, k, v, cu_k, pos_q, pos_k, nseq, H, KV, scale, stream);
      return true;
    default:
      return false;
  }
}

}  // namespace

template <typename T>
bool attention_decode(T* out, float* lse, const T* q, const T* k, const T* v, const int32_t* cu_k,
                      const int32_t* pos_q, const int32_t* pos_k, int64_t nseq, int64_t H, int64_t KV,
                      int64_t D, float scale, cudaStream_t stream, int splits, int64_t rows_k) {
  if (nseq == 0) return true;
  if (KV <= 0 || H % KV != 0 || (D != 64 && D != 128)) return false;
  // 16-byte row loads need aligned rows (always so for D = 64/128 on allocator-aligned buffers).
  for (const void* p :
       {static_cast<const void*>(q), static_cast<const void*>(k), static_cast<const void*>(v)})
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  if (splits <= 0) splits = decode_splits(nseq, KV, rows_k);
  Scratch part(splits > 1 ? static_cast<size_t>(nseq * H * splits * (D + 2)) * sizeof(float) : 0, stream);
  return D == 64 ? launch_group<T, 64>(out, lse, part.as<float>(), splits, q, k, v, cu_k, pos_q, pos_k, nseq,
                                       H, KV, scale, stream)
                 : launch_group<T, 128>(out, lse, part.as<float>(), splits, q, k, v, cu_k, pos_q, pos_k, nseq,
                                        H, KV, scale, stream);
}

template bool attention_decode<float>(float*, float*, const float*, const float*, const float*,
                                      const int32_t*, const int32_t*, const int32_t*, int64_t, int64_t,
                                      int64_t, int64_t, float, cudaStream_t, int, int64_t);
template bool attention_decode<__nv_bfloat16>(__nv_bfloat16*, float*, const __nv_bfloat16*,
                                              const __nv_bfloat16*, const __nv_bfloat16*, const int32_t*,
                                              const int32_t*, const int32_t*, int64_t, int64_t, int64_t,
                                              int64_t, float, cudaStream_t, int, int64_t);

int decode_splits(int64_t nseq, int64_t KV, int64_t rows_k) {
  // NDT_DECODE_SPLITS=n fixes the number (1: one block per segment and kv head), for measurements.
  static const int forced = [] {
    const char* env = std::getenv("NDT_DECODE_SPLITS");
    return env ? std::clamp(std::atoi(env), 0, 8) : 0;
  }();
  if (forced > 0) return forced;
  // Split only when the (segment, kv head) blocks do not fill every SM once (a few long sequences): then
  // into enough parts for two blocks per SM, up to 8 parts of at least 64 rows each. Measured on an H100
  // (docs/performance.md): 4 sequences of 4096 rows (32 blocks) take 171 us in one part and 39 us in 8,
  // while 64 sequences x 8 kv heads (512 blocks) are slower in any number of parts than in one, the parts'
  // extra prologue and merge costing more than the shorter key loop saves.
  const int sms = sm_count();
  const int64_t blocks = std::max<int64_t>(1, nseq * KV), per_seg = rows_k / std::max<int64_t>(1, nseq);
  if (blocks >= sms) return 1;
  const int64_t want = (2 * sms + blocks - 1) / blocks;
  return static_cast<int>(std::clamp<int64_t>(std::min(want, per_seg / 64), 1, 8));
}

}  // namespace ndt::cuda
