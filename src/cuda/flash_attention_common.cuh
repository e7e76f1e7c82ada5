#pragma once
// Internals shared by flash_attention_fwd.cu and flash_attention_bwd.cu: tensor-core and async-copy
// wrappers (sm_80+ PTX, used on sm_90), the segment -> tile mapping and host-side argument checks.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <string>

#include "cuda/cuda_check.h"
#include "cuda/runtime.h"

namespace ndt::cuda::fa {

using bf16 = __nv_bfloat16;
constexpr float kLog2e = 1.4426950408889634f;

// ---- PTX wrappers ----
// 16-byte global -> shared copy; `valid` false zero-fills the destination (src is then not read).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void* p) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// c(16x8, fp32) += a(16x16, bf16, row) * b(16x8, bf16, col). Fragment layout (g = lane/4, t = lane%4):
// a: {(g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..)}; b: {(k 2t..2t+1, n g), (k 2t+8.., n g)};
// c: {(g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)}.
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low half) = lo
  return *reinterpret_cast<uint32_t*>(&v);
}

// 2^x; ex2.approx maps -inf to +0, which is how masked scores vanish.
__device__ __forceinline__ float exp2_fast(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// An accumulator pair (rows g / g+8 of two adjacent n-tiles) as the A operand of the next mma.
__device__ __forceinline__ void acc_to_a(uint32_t (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
  a[0] = pack_bf16(c0[0], c0[1]);
  a[1] = pack_bf16(c0[2], c0[3]);
  a[2] = pack_bf16(c1[0], c1[1]);
  a[3] = pack_bf16(c1[2], c1[3]);
}

// ---- positions: null arrays mean "row offset inside the segment" ----
__device__ __forceinline__ int pos_of(const int32_t* pos, int row, int seg_start) {
  return pos ? pos[row] : row - seg_start;
}
// First row r in [lo, hi) with pos(r) > x (positions non-decreasing), i.e. how far x reaches.
__device__ __forceinline__ int pos_upper_bound(const int32_t* pos, int lo, int hi, int seg_start, int x) {
  if (!pos) return max(lo, min(hi, seg_start + x + 1));
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (pos[mid] <= x) lo = mid + 1; else hi = mid;
  }
  return lo;
}
// First row r in [lo, hi) with pos(r) >= x.
__device__ __forceinline__ int pos_lower_bound(const int32_t* pos, int lo, int hi, int seg_start, int x) {
  if (!pos) return max(lo, min(hi, seg_start + x));
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (pos[mid] < x) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// ---- segment -> tile mapping ----
// Launches a one-block scan: blk[s] = sum over s' < s of ceil(len(s') / tile), for s = 0..nseq
// (defined in flash_attention_fwd.cu).
void segment_tiles(int32_t* blk, const int32_t* cu, int nseq, int tile, cudaStream_t stream);
// Largest s with blk[s] <= b (b < blk[nseq]); empty segments are never chosen.
__device__ __forceinline__ int find_segment(const int32_t* blk, int nseq, int b) {
  int lo = 0, hi = nseq - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (blk[mid] <= b) lo = mid; else hi = mid - 1;
  }
  return lo;
}
// Upper bound on sum_s ceil(len_s / tile) + ceil(padding rows / tile): the grid size in tiles.
inline int64_t tile_bound(int64_t rows, int64_t nseq, int tile) { return (rows + tile - 1) / tile + nseq + 1; }

// Host-side argument checks; throw ndt::Error (through cuda_failed) with the message as the expression.
[[noreturn]] inline void arg_error(const std::string& msg) {
  ::ndt::cuda::cuda_failed(cudaErrorInvalidValue, msg.c_str(), __FILE__, __LINE__);
}
inline void check_args(int64_t nseq, int64_t Tq, int64_t Tk, int64_t H, int64_t KV, int64_t D) {
  if (D != 64 && D != 128)
    arg_error("cuda attention: head dim D must be 64 or 128, got " + std::to_string(D));
  if (KV <= 0 || H <= 0 || H % KV != 0)
    arg_error("cuda attention: H = " + std::to_string(H) + " not a positive multiple of KV = " +
              std::to_string(KV));
  if (nseq < 0 || Tq < 0 || Tk < 0 || Tq > INT_MAX / 2 || Tk > INT_MAX / 2 || nseq > INT_MAX / 2 ||
      H > 65535)
    arg_error("cuda attention: sizes out of range (nseq " + std::to_string(nseq) + ", Tq " +
              std::to_string(Tq) + ", Tk " + std::to_string(Tk) + ", H " + std::to_string(H) + ")");
}
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace ndt::cuda::fa
