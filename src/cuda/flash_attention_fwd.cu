// Attention forward (contract in flash_attention.h). bf16: FA2 structure, one CTA per (query tile, head),
// 4 warps of 16*MT query rows each, a loop over key tiles of 64 double-buffered in shared memory through
// cp.async, S = QK^T and O += PV on mma.sync tensor cores, online softmax in registers (P never leaves
// them). fp32: one warp per (row, head), exact fp32 math, for tests.
#include <cmath>
#include <type_traits>

#include "cuda/flash_attention.h"
#include "cuda/flash_attention_common.cuh"

namespace ndt::cuda {
namespace fa {

__global__ void segment_tiles_kernel(int32_t* blk, const int32_t* cu, int nseq, int tile) {
  __shared__ int32_t warp_sums[32];
  __shared__ int32_t carry;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int base = 0; base < nseq; base += blockDim.x) {
    const int s = base + threadIdx.x;
    const int n = s < nseq ? max(0, (cu[s + 1] - cu[s] + tile - 1) / tile) : 0;
    int x = n;  // inclusive scan: warp, then across warps
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += y;
    }
    if (lane == 31) warp_sums[w] = x;
    __syncthreads();
    if (w == 0) {
      int ws = lane < nw ? warp_sums[lane] : 0;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, ws, o);
        if (lane >= o) ws += y;
      }
      if (lane < nw) warp_sums[lane] = ws;
    }
    __syncthreads();
    const int incl = x + (w > 0 ? warp_sums[w - 1] : 0);
    const int c = carry;
    if (s < nseq) blk[s] = c + incl - n;
    __syncthreads();
    if (threadIdx.x == blockDim.x - 1) carry = c + incl;
    __syncthreads();
  }
  if (threadIdx.x == 0) blk[nseq] = carry;
}

void segment_tiles(int32_t* blk, const int32_t* cu, int nseq, int tile, cudaStream_t stream) {
  segment_tiles_kernel<<<1, 1024, 0, stream>>>(blk, cu, nseq, tile);
  NDT_CUDA_CHECK_LAUNCH();
}

namespace {

template <int D, int MT>
struct Fwd {
  static constexpr int kThreads = 128;
  static constexpr int BM = 16 * MT * 4, BN = 64;
  static constexpr int LD = D + 8;  // smem row stride (elements): +16 B keeps ldmatrix conflict-free
  static constexpr int kSmem = (BM + 4 * BN) * LD * 2 + 2 * BN * 4;
};

struct FwdArgs {
  bf16* out;
  float* lse;
  const bf16 *q, *k, *v;
  const int32_t *cu_q, *cu_k, *pos_q, *pos_k, *blk;
  int nseq, Tq, H, KV, group;
  int64_t ntiles;
  float scale;
};

template <int D, int MT>
__global__ void __launch_bounds__(128) fwd_kernel(const FwdArgs a) {
  using C = Fwd<D, MT>;
  constexpr int BM = C::BM, BN = C::BN, LD = C::LD, NT = BN / 8, DT = D / 8, KD = D / 16;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem);              // [BM][LD]; reused to stage the output
  bf16* sK = sQ + BM * LD;                               // [2][BN][LD]
  bf16* sV = sK + 2 * BN * LD;                           // [2][BN][LD]
  int* sPk = reinterpret_cast<int*>(sV + 2 * BN * LD);  // [2][BN] key positions, INT_MAX past the segment

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int h = static_cast<int>(blockIdx.x % a.H);
  const int b = static_cast<int>(a.ntiles - 1 - blockIdx.x / a.H);  // last (heaviest) tiles first
  const int64_t rs_q = static_cast<int64_t>(a.H) * D, rs_k = static_cast<int64_t>(a.KV) * D;
  const int total = a.blk[a.nseq];
  if (b >= total) {  // rows past cu_q[nseq]: out 0, lse 0
    const int r0 = a.cu_q[a.nseq] + (b - total) * BM;
    for (int e = tid; e < BM * DT; e += C::kThreads) {
      const int r = r0 + e / DT;
      if (r < a.Tq) *reinterpret_cast<uint4*>(a.out + r * rs_q + h * D + (e % DT) * 8) = make_uint4(0, 0, 0, 0);
    }
    for (int r = r0 + tid; r < min(r0 + BM, a.Tq); r += C::kThreads) a.lse[static_cast<int64_t>(r) * a.H + h] = 0.f;
    return;
  }
  const int s = find_segment(a.blk, a.nseq, b);
  const int qs = a.cu_q[s], qe = a.cu_q[s + 1], ks = a.cu_k[s], ke = a.cu_k[s + 1];
  const int q0 = qs + (b - a.blk[s]) * BM, nq = min(BM, qe - q0);
  const int qpos_first = pos_of(a.pos_q, q0, qs), qpos_last = pos_of(a.pos_q, q0 + nq - 1, qs);
  // Keys past the last query's position are never visible: stop there.
  const int nkb = (pos_upper_bound(a.pos_k, ks, ke, ks, qpos_last) - ks + BN - 1) / BN;
  const bf16* qg = a.q + h * D;
  const bf16* kg = a.k + (h / a.group) * D;
  const bf16* vg = a.v + (h / a.group) * D;

  auto load_kv = [&](int kb, int buf) {
    const int j0 = ks + kb * BN;
#pragma unroll
    for (int it = 0; it < BN * DT / C::kThreads; ++it) {
      const int e = tid + it * C::kThreads, r = e / DT, c = (e % DT) * 8;
      const bool ok = j0 + r < ke;
      const int64_t off = (j0 + r) * rs_k + c;
      cp_async16(sK + (buf * BN + r) * LD + c, ok ? kg + off : a.k, ok);
      cp_async16(sV + (buf * BN + r) * LD + c, ok ? vg + off : a.v, ok);
    }
    for (int r = tid; r < BN; r += C::kThreads)
      sPk[buf * BN + r] = j0 + r < ke ? pos_of(a.pos_k, j0 + r, ks) : INT_MAX;
  };

  int qp[MT][2];  // positions of this thread's rows (g, g+8 of each m-tile); INT_MIN past the segment
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = warp * 16 * MT + mt * 16 + g + 8 * r;
      qp[mt][r] = row < nq ? pos_of(a.pos_q, q0 + row, qs) : INT_MIN;
    }

  float o[MT][DT][4], m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][dt][e] = 0.f;
    m[mt][0] = m[mt][1] = -INFINITY;
    l[mt][0] = l[mt][1] = 0.f;
  }
  uint32_t qf[MT][KD][4];
  const float sl2 = a.scale * kLog2e;

  if (nkb > 0) {
#pragma unroll
    for (int it = 0; it < BM * DT / C::kThreads; ++it) {
      const int e = tid + it * C::kThreads, r = e / DT, c = (e % DT) * 8;
      const bool ok = r < nq;
      cp_async16(sQ + r * LD + c, ok ? qg + (q0 + r) * rs_q + c : a.q, ok);
    }
    load_kv(0, 0);
    cp_async_commit();
  }
  for (int kb = 0; kb < nkb; ++kb) {
    const int buf = kb & 1;
    if (kb + 1 < nkb) {
      load_kv(kb + 1, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (kb == 0) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int kk = 0; kk < KD; ++kk)
          ldsm_x4(qf[mt][kk], sQ + (warp * 16 * MT + mt * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
    }
    const bf16* sKb = sK + buf * BN * LD;
    const bf16* sVb = sV + buf * BN * LD;
    const int* pk = sPk + buf * BN;

    float sc[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[mt][nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KD; ++kk)
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t bk[4];
        ldsm_x4(bk, sKb + (np * 16 + ((lane >> 4) << 3) + (lane & 7)) * LD + kk * 16 + (((lane >> 3) & 1) << 3));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816(sc[mt][2 * np], qf[mt][kk], bk[0], bk[1]);
          mma16816(sc[mt][2 * np + 1], qf[mt][kk], bk[2], bk[3]);
        }
      }
    // Mask only tiles that reach past the first query's position (the diagonal) or the segment end.
    if (pk[BN - 1] > qpos_first) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int p0 = pk[nt * 8 + 2 * t], p1 = pk[nt * 8 + 2 * t + 1];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            if (p0 > qp[mt][r]) sc[mt][nt][2 * r] = -INFINITY;
            if (p1 > qp[mt][r]) sc[mt][nt][2 * r + 1] = -INFINITY;
          }
      }
    }
    // Online softmax; a row's 64 scores live in the 4 threads of a quad.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = m[mt][r];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(sc[mt][nt][2 * r], sc[mt][nt][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float mo = mx == -INFINITY ? 0.f : mx * sl2;  // fully masked so far: keep exp2 finite
        const float corr = exp2_fast(m[mt][r] * sl2 - mo);
        m[mt][r] = mx;
        float rs = 0.f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float p = exp2_fast(fmaf(sc[mt][nt][2 * r + e], sl2, -mo));
            sc[mt][nt][2 * r + e] = p;
            rs += p;
          }
        l[mt][r] = l[mt][r] * corr + rs;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
          o[mt][dt][2 * r] *= corr;
          o[mt][dt][2 * r + 1] *= corr;
        }
      }
    // O += P V, P straight from the score registers.
#pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk) {
      uint32_t pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) acc_to_a(pa[mt], sc[mt][2 * kk], sc[mt][2 * kk + 1]);
#pragma unroll
      for (int dp = 0; dp < DT / 2; ++dp) {
        uint32_t bv[4];
        ldsm_x4_t(bv, sVb + (kk * 16 + (((lane >> 3) & 1) << 3) + (lane & 7)) * LD + dp * 16 + ((lane >> 4) << 3));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816(o[mt][2 * dp], pa[mt], bv[0], bv[1]);
          mma16816(o[mt][2 * dp + 1], pa[mt], bv[2], bv[3]);
        }
      }
    }
    __syncthreads();  // this buffer is refilled by the next iteration's prefetch
  }

  // Epilogue: normalize, lse, stage this warp's rows in its own part of sQ, write with 16-byte stores.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float lt = l[mt][r];
      lt += __shfl_xor_sync(0xffffffffu, lt, 1);
      lt += __shfl_xor_sync(0xffffffffu, lt, 2);
      const float inv = lt > 0.f ? 1.f / lt : 0.f;
      const int row = warp * 16 * MT + mt * 16 + g + 8 * r;
      if (t == 0 && row < nq)
        a.lse[static_cast<int64_t>(q0 + row) * a.H + h] = lt > 0.f ? m[mt][r] * a.scale + logf(lt) : -INFINITY;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt)
        *reinterpret_cast<uint32_t*>(sQ + row * LD + dt * 8 + 2 * t) =
            pack_bf16(o[mt][dt][2 * r] * inv, o[mt][dt][2 * r + 1] * inv);
    }
  __syncwarp();
#pragma unroll
  for (int it = 0; it < 16 * MT * DT / 32; ++it) {
    const int e = lane + it * 32, row = warp * 16 * MT + e / DT, c = (e % DT) * 8;
    if (row < nq)
      *reinterpret_cast<uint4*>(a.out + (q0 + row) * rs_q + h * D + c) =
          *reinterpret_cast<const uint4*>(sQ + row * LD + c);
  }
}

template <int D, int MT>
void launch_fwd(FwdArgs a, cudaStream_t stream) {
  using C = Fwd<D, MT>;
  a.ntiles = tile_bound(a.Tq, a.nseq, C::BM);
  const int64_t grid = a.ntiles * a.H;
  if (grid > INT_MAX) arg_error("cuda attention: too many query tiles");
  Scratch blk(sizeof(int32_t) * (a.nseq + 1), stream);
  a.blk = blk.as<int32_t>();
  segment_tiles(blk.as<int32_t>(), a.cu_q, a.nseq, C::BM, stream);
  NDT_CUDA_CHECK(cudaFuncSetAttribute(fwd_kernel<D, MT>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem));
  fwd_kernel<D, MT><<<static_cast<unsigned>(grid), C::kThreads, C::kSmem, stream>>>(a);
  NDT_CUDA_CHECK_LAUNCH();
}

// ---- fp32: one warp per (query row, head), online softmax over the visible keys ----
__global__ void fwd_simple_kernel(float* out, float* lse, const float* q, const float* k, const float* v,
                                  const int32_t* cu_q, const int32_t* cu_k, const int32_t* pos_q,
                                  const int32_t* pos_k, int nseq, int Tq, int H, int KV, int D, float scale) {
  const int64_t w = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (w >= static_cast<int64_t>(Tq) * H) return;
  const int i = static_cast<int>(w / H), h = static_cast<int>(w % H);
  float* orow = out + w * D;
  if (i >= cu_q[nseq]) {
    for (int d = lane; d < D; d += 32) orow[d] = 0.f;
    if (lane == 0) lse[w] = 0.f;
    return;
  }
  if (i < cu_q[0]) return;  // before the first segment: untouched, as on the CPU
  const int s = find_segment(cu_q, nseq, i);
  const int qs = cu_q[s], ks = cu_k[s], ke = cu_k[s + 1], kvh = h / (H / KV);
  const int pq = pos_of(pos_q, i, qs);
  float qr[4], acc[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int d = lane + 32 * e;
    qr[e] = d < D ? q[w * D + d] : 0.f;
    acc[e] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  for (int j = ks; j < ke; ++j) {
    if (pos_of(pos_k, j, ks) > pq) continue;
    const float* kr = k + (static_cast<int64_t>(j) * KV + kvh) * D;
    const float* vr = v + (static_cast<int64_t>(j) * KV + kvh) * D;
    float dot = 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (lane + 32 * e < D) dot += qr[e] * kr[lane + 32 * e];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    const float sc = dot * scale, mn = fmaxf(m, sc), corr = expf(m - mn), p = expf(sc - mn);
    l = l * corr + p;
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (lane + 32 * e < D) acc[e] = acc[e] * corr + p * vr[lane + 32 * e];
    m = mn;
  }
  const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
  for (int e = 0; e < 4; ++e)
    if (lane + 32 * e < D) orow[lane + 32 * e] = acc[e] * inv;
  if (lane == 0) lse[w] = l > 0.f ? m + logf(l) : -INFINITY;
}

}  // namespace
}  // namespace fa

template <typename T>
void attention_forward(T* out, float* lse, const T* q, const T* k, const T* v, const int32_t* cu_seqlens_q,
                       const int32_t* cu_seqlens_k, const int32_t* pos_q, const int32_t* pos_k, int64_t nseq,
                       int64_t Tq, int64_t Tk, int64_t H, int64_t KV, int64_t D, float scale,
                       cudaStream_t stream) {
  fa::check_args(nseq, Tq, Tk, H, KV, D);
  if (Tq == 0) return;
  if constexpr (std::is_same_v<T, float>) {
    const int64_t threads = Tq * H * 32;
    fa::fwd_simple_kernel<<<static_cast<unsigned>((threads + 255) / 256), 256, 0, stream>>>(
        out, lse, q, k, v, cu_seqlens_q, cu_seqlens_k, pos_q, pos_k, static_cast<int>(nseq),
        static_cast<int>(Tq), static_cast<int>(H), static_cast<int>(KV), static_cast<int>(D), scale);
    NDT_CUDA_CHECK_LAUNCH();
  } else {
    for (const void* p : {static_cast<const void*>(out), static_cast<const void*>(q),
                          static_cast<const void*>(k), static_cast<const void*>(v)})
      if (!fa::aligned16(p)) fa::arg_error("cuda attention: bf16 q/k/v/out must be 16-byte aligned");
    fa::FwdArgs a{out,     lse,    q,        k,
                  v,       cu_seqlens_q, cu_seqlens_k, pos_q,
                  pos_k,   nullptr, static_cast<int>(nseq), static_cast<int>(Tq),
                  static_cast<int>(H), static_cast<int>(KV), static_cast<int>(H / KV), 0,
                  scale};
    if (D == 64)
      fa::launch_fwd<64, 2>(a, stream);
    else
      fa::launch_fwd<128, 1>(a, stream);
  }
}

template void attention_forward<float>(float*, float*, const float*, const float*, const float*, const int32_t*,
                                       const int32_t*, const int32_t*, const int32_t*, int64_t, int64_t, int64_t,
                                       int64_t, int64_t, int64_t, float, cudaStream_t);
template void attention_forward<__nv_bfloat16>(__nv_bfloat16*, float*, const __nv_bfloat16*,
                                               const __nv_bfloat16*, const __nv_bfloat16*, const int32_t*,
                                               const int32_t*, const int32_t*, const int32_t*, int64_t, int64_t,
                                               int64_t, int64_t, int64_t, int64_t, float, cudaStream_t);

}  // namespace ndt::cuda
