// Attention backward (contract in flash_attention.h). bf16, FA2 structure:
//  1. pre-pass: Dsum = rowsum(dout * out), lse2 = lse * log2(e) (+inf where lse = -inf, so P = 0), and
//     the fp32 dq scratch zeroed;
//  2. one CTA per (key tile of 64, kv head); each warp owns 16 keys and keeps their dK, dV in registers
//     while the CTA streams the (query tile, head) pairs of the group that can see the tile (Q, dO
//     double-buffered through cp.async). Per pair: S^T = K Q^T, P^T = exp2(S^T - lse2), dV += P^T dO,
//     dP^T = V dO^T, dS^T = P^T (dP^T - Dsum), dK += dS^T Q on tensor cores; dS goes through shared
//     memory so that dQ = dS K is split over the warps by query rows and added with fp32 atomics;
//  3. dq += scale * scratch.
// fp32: one warp per (query row, head) with fp32 atomics into dk, dv (for tests).
#include <cmath>
#include <type_traits>

#include "cuda/flash_attention.h"
#include "cuda/flash_attention_common.cuh"

namespace ndt::cuda {
namespace fa {
namespace {

__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool valid) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int n = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}

template <int D>
struct Bwd {
  static constexpr int kThreads = 128;
  static constexpr int BN = 64;                   // keys per CTA, 16 per warp
  static constexpr int BM = D == 64 ? 64 : 32;    // queries per step (fewer at D = 128: registers)
  static constexpr int LD = D + 8, LDS = BM + 8;  // padded smem strides (elements)
  static constexpr bool kKVRegs = D == 64;        // K/V A-fragments held in registers
  static constexpr int WR = BM / 16, WC = 4 / WR, DQC = D / WC;  // dQ step: warp grid over (rows, cols)
  static constexpr int kSmem = 2 * BN * LD * 2 + 4 * BM * LD * 2 + BN * LDS * 2 + 2 * BM * 12;
};

struct BwdArgs {
  float* dq_acc;
  bf16 *dk, *dv;
  const bf16 *dout, *q, *k, *v;
  const float *lse2, *dsum;
  const int32_t *cu_q, *cu_k, *pos_q, *pos_k, *blk;
  int nseq, H, KV, group;
  float scale;
};

template <int D>
__global__ void bwd_pre_kernel(float* dsum, float* lse2, float* dq_acc, const bf16* dout, const bf16* out,
                               const float* lse, int64_t rows) {
  const int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 3;
  const int l8 = threadIdx.x & 7;
  const unsigned gmask = 0xffu << (threadIdx.x & 24);
  if (r >= rows) return;  // whole 8-lane groups leave together
  float acc = 0.f;
#pragma unroll
  for (int c = l8; c < D / 8; c += 8) {
    const uint4 x = *reinterpret_cast<const uint4*>(dout + r * D + c * 8);
    const uint4 y = *reinterpret_cast<const uint4*>(out + r * D + c * 8);
    const bf16* px = reinterpret_cast<const bf16*>(&x);
    const bf16* py = reinterpret_cast<const bf16*>(&y);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc += __bfloat162float(px[e]) * __bfloat162float(py[e]);
    if (dq_acc) {
      float4* z = reinterpret_cast<float4*>(dq_acc + r * D + c * 8);
      z[0] = make_float4(0.f, 0.f, 0.f, 0.f);
      z[1] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
  acc += __shfl_xor_sync(gmask, acc, 1);
  acc += __shfl_xor_sync(gmask, acc, 2);
  acc += __shfl_xor_sync(gmask, acc, 4);
  if (l8 == 0) {
    dsum[r] = acc;
    const float L = lse[r];
    lse2[r] = L == -INFINITY ? INFINITY : L * kLog2e;
  }
}

template <int D>
__global__ void __launch_bounds__(128) bwd_kernel(const BwdArgs a) {
  using C = Bwd<D>;
  constexpr int BN = C::BN, BM = C::BM, LD = C::LD, LDS = C::LDS, DT = D / 8, KD = D / 16, NQ = BM / 8;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sK = reinterpret_cast<bf16*>(smem);              // [BN][LD]
  bf16* sV = sK + BN * LD;                               // [BN][LD]
  bf16* sQ = sV + BN * LD;                               // [2][BM][LD]
  bf16* sdO = sQ + 2 * BM * LD;                          // [2][BM][LD]
  bf16* sdS = sdO + 2 * BM * LD;                         // [BN][LDS]: dS^T, key rows
  float* sL = reinterpret_cast<float*>(sdS + BN * LDS);  // [2][BM] lse2
  float* sDs = sL + 2 * BM;                              // [2][BM] Dsum
  int* sPq = reinterpret_cast<int*>(sDs + 2 * BM);       // [2][BM] query positions (pos_q given)

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int kvh = static_cast<int>(blockIdx.x % a.KV);
  const int b = static_cast<int>(blockIdx.x / a.KV);  // early key tiles (seen by most queries) first
  if (b >= a.blk[a.nseq]) return;
  const int s = find_segment(a.blk, a.nseq, b);
  const int qs = a.cu_q[s], qe = a.cu_q[s + 1], ks = a.cu_k[s], ke = a.cu_k[s + 1];
  const int k0 = ks + (b - a.blk[s]) * BN, nk = min(BN, ke - k0);
  const int kpos_first = pos_of(a.pos_k, k0, ks), kpos_last = pos_of(a.pos_k, k0 + nk - 1, ks);
  // Queries before the first key's position see nothing of this tile.
  const int q_lo = pos_lower_bound(a.pos_q, qs, qe, qs, kpos_first);
  const int nqb = (qe - q_lo + BM - 1) / BM, niter = nqb * a.group;
  if (niter == 0) return;  // nothing to add
  const int64_t rs_q = static_cast<int64_t>(a.H) * D, rs_k = static_cast<int64_t>(a.KV) * D;

  int kp[2];  // positions of this thread's keys (rows g, g+8 of the warp's 16); INT_MAX past the segment
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = warp * 16 + g + 8 * r;
    kp[r] = row < nk ? pos_of(a.pos_k, k0 + row, ks) : INT_MAX;
  }

#pragma unroll
  for (int it = 0; it < BN * DT / C::kThreads; ++it) {
    const int e = tid + it * C::kThreads, r = e / DT, c = (e % DT) * 8;
    const bool ok = r < nk;
    const int64_t off = (k0 + r) * rs_k + kvh * D + c;
    cp_async16(sK + r * LD + c, ok ? a.k + off : a.k, ok);
    cp_async16(sV + r * LD + c, ok ? a.v + off : a.v, ok);
  }
  auto load_q = [&](int iter, int buf) {
    const int hq = kvh * a.group + iter / nqb, i0 = q_lo + (iter % nqb) * BM;
#pragma unroll
    for (int it = 0; it < BM * DT / C::kThreads; ++it) {
      const int e = tid + it * C::kThreads, r = e / DT, c = (e % DT) * 8;
      const bool ok = i0 + r < qe;
      const int64_t off = (i0 + r) * rs_q + hq * D + c;
      cp_async16(sQ + (buf * BM + r) * LD + c, ok ? a.q + off : a.q, ok);
      cp_async16(sdO + (buf * BM + r) * LD + c, ok ? a.dout + off : a.dout, ok);
    }
    // Rows past the segment load zeros; the mask removes them.
    for (int r = tid; r < BM; r += C::kThreads) {
      const bool ok = i0 + r < qe;
      const int64_t idx = ok ? static_cast<int64_t>(i0 + r) * a.H + hq : 0;
      cp_async4(sL + buf * BM + r, a.lse2 + idx, ok);
      cp_async4(sDs + buf * BM + r, a.dsum + idx, ok);
      if (a.pos_q) cp_async4(sPq + buf * BM + r, a.pos_q + (ok ? i0 + r : 0), ok);
    }
  };

  float dk[DT][4], dv[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[dt][e] = dv[dt][e] = 0.f;
  uint32_t kf[C::kKVRegs ? KD : 1][4], vf[C::kKVRegs ? KD : 1][4];
  const float sl2 = a.scale * kLog2e;

  load_q(0, 0);
  cp_async_commit();  // one group: K, V and the first Q/dO tile
  for (int iter = 0; iter < niter; ++iter) {
    const int buf = iter & 1;
    if (iter + 1 < niter) {
      load_q(iter + 1, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if constexpr (C::kKVRegs) {
      if (iter == 0) {
#pragma unroll
        for (int kk = 0; kk < KD; ++kk) {
          ldsm_x4(kf[kk], sK + (warp * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
          ldsm_x4(vf[kk], sV + (warp * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
        }
      }
    }
    const int hq = kvh * a.group + iter / nqb, i0 = q_lo + (iter % nqb) * BM;
    const bf16* sQb = sQ + buf * BM * LD;
    const bf16* sdOb = sdO + buf * BM * LD;
    const float* sLb = sL + buf * BM;
    const float* sDsb = sDs + buf * BM;
    const int* sPqb = sPq + buf * BM;
    auto qpos = [&](int c) { return a.pos_q ? sPqb[c] : i0 + c - qs; };

    // S^T = K_w Q^T (16 keys x BM queries)
    float st[NQ][4];
#pragma unroll
    for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
      uint32_t ka[4];
      if constexpr (C::kKVRegs) {
#pragma unroll
        for (int e = 0; e < 4; ++e) ka[e] = kf[kk][e];
      } else {
        ldsm_x4(ka, sK + (warp * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
      }
#pragma unroll
      for (int np = 0; np < NQ / 2; ++np) {
        uint32_t bq[4];
        ldsm_x4(bq,
                sQb + (np * 16 + ((lane >> 4) << 3) + (lane & 7)) * LD + kk * 16 + (((lane >> 3) & 1) << 3));
        mma16816(st[2 * np], ka, bq[0], bq[1]);
        mma16816(st[2 * np + 1], ka, bq[2], bq[3]);
      }
    }
    // Mask (diagonal tiles, segment ends), then P^T = exp2(S^T * scale * log2e - lse2).
    if (nk < BN || i0 + BM > qe || kpos_last > qpos(0)) {
#pragma unroll
      for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = nt * 8 + 2 * t + e;
          const bool okq = i0 + c < qe;
          const int p = qpos(c);
#pragma unroll
          for (int r = 0; r < 2; ++r)
            if (!okq || kp[r] > p) st[nt][2 * r + e] = -INFINITY;
        }
    }
#pragma unroll
    for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float L = sLb[nt * 8 + 2 * t + e];
#pragma unroll
        for (int r = 0; r < 2; ++r) st[nt][2 * r + e] = exp2_fast(fmaf(st[nt][2 * r + e], sl2, -L));
      }
      // dV += P^T dO
#pragma unroll
    for (int kk = 0; kk < NQ / 2; ++kk) {
      uint32_t pa[4];
      acc_to_a(pa, st[2 * kk], st[2 * kk + 1]);
#pragma unroll
      for (int dp = 0; dp < DT / 2; ++dp) {
        uint32_t bo[4];
        ldsm_x4_t(
            bo, sdOb + (kk * 16 + (((lane >> 3) & 1) << 3) + (lane & 7)) * LD + dp * 16 + ((lane >> 4) << 3));
        mma16816(dv[2 * dp], pa, bo[0], bo[1]);
        mma16816(dv[2 * dp + 1], pa, bo[2], bo[3]);
      }
    }
    // dP^T = V_w dO^T
    float dpt[NQ][4];
#pragma unroll
    for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) dpt[nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
      uint32_t va[4];
      if constexpr (C::kKVRegs) {
#pragma unroll
        for (int e = 0; e < 4; ++e) va[e] = vf[kk][e];
      } else {
        ldsm_x4(va, sV + (warp * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
      }
#pragma unroll
      for (int np = 0; np < NQ / 2; ++np) {
        uint32_t bo[4];
        ldsm_x4(bo,
                sdOb + (np * 16 + ((lane >> 4) << 3) + (lane & 7)) * LD + kk * 16 + (((lane >> 3) & 1) << 3));
        mma16816(dpt[2 * np], va, bo[0], bo[1]);
        mma16816(dpt[2 * np + 1], va, bo[2], bo[3]);
      }
    }
    // dS^T = P^T (dP^T - Dsum), kept in dpt
#pragma unroll
    for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float Ds = sDsb[nt * 8 + 2 * t + e];
#pragma unroll
        for (int r = 0; r < 2; ++r) dpt[nt][2 * r + e] = st[nt][2 * r + e] * (dpt[nt][2 * r + e] - Ds);
      }
      // dK += dS^T Q; dS^T to shared memory for the dQ step
#pragma unroll
    for (int kk = 0; kk < NQ / 2; ++kk) {
      uint32_t da[4];
      acc_to_a(da, dpt[2 * kk], dpt[2 * kk + 1]);
      *reinterpret_cast<uint32_t*>(sdS + (warp * 16 + g) * LDS + kk * 16 + 2 * t) = da[0];
      *reinterpret_cast<uint32_t*>(sdS + (warp * 16 + g + 8) * LDS + kk * 16 + 2 * t) = da[1];
      *reinterpret_cast<uint32_t*>(sdS + (warp * 16 + g) * LDS + kk * 16 + 8 + 2 * t) = da[2];
      *reinterpret_cast<uint32_t*>(sdS + (warp * 16 + g + 8) * LDS + kk * 16 + 8 + 2 * t) = da[3];
#pragma unroll
      for (int dp = 0; dp < DT / 2; ++dp) {
        uint32_t bq[4];
        ldsm_x4_t(
            bq, sQb + (kk * 16 + (((lane >> 3) & 1) << 3) + (lane & 7)) * LD + dp * 16 + ((lane >> 4) << 3));
        mma16816(dk[2 * dp], da, bq[0], bq[1]);
        mma16816(dk[2 * dp + 1], da, bq[2], bq[3]);
      }
    }
    __syncthreads();  // dS^T complete
    // dQ (BM x D) = dS (BM x BN) K (BN x D); this warp: 16 query rows x DQC columns, fp32 atomics out.
    if (a.dq_acc) {
      constexpr int NC = C::DQC / 8;
      const int qr0 = (warp % C::WR) * 16, dc0 = (warp / C::WR) * C::DQC;
      float dqa[NC][4];
#pragma unroll
      for (int nt = 0; nt < NC; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) dqa[nt][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        uint32_t sa[4];
        ldsm_x4_t(sa,
                  sdS + (kk * 16 + ((lane >> 4) << 3) + (lane & 7)) * LDS + qr0 + (((lane >> 3) & 1) << 3));
#pragma unroll
        for (int dp = 0; dp < NC / 2; ++dp) {
          uint32_t bk[4];
          ldsm_x4_t(bk, sK + (kk * 16 + (((lane >> 3) & 1) << 3) + (lane & 7)) * LD + dc0 + dp * 16 +
                            ((lane >> 4) << 3));
          mma16816(dqa[2 * dp], sa, bk[0], bk[1]);
          mma16816(dqa[2 * dp + 1], sa, bk[2], bk[3]);
        }
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int i = i0 + qr0 + g + 8 * r;
        if (i < qe) {
          float* dst = a.dq_acc + static_cast<int64_t>(i) * a.H * D + hq * D + dc0 + 2 * t;
#pragma unroll
          for (int nt = 0; nt < NC; ++nt)
            atomicAdd(reinterpret_cast<float2*>(dst + nt * 8),
                      make_float2(dqa[nt][2 * r], dqa[nt][2 * r + 1]));
        }
      }
    }
  }

  // dk += scale * dK, dv += dV (bf16 read, fp32 add, one rounding).
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = warp * 16 + g + 8 * r;
    if (row >= nk) continue;
    const int64_t base = (k0 + row) * rs_k + kvh * D + 2 * t;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      if (a.dk) {
        __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(a.dk + base + dt * 8);
        const float2 old = __bfloat1622float2(*p);
        *p = __floats2bfloat162_rn(old.x + a.scale * dk[dt][2 * r], old.y + a.scale * dk[dt][2 * r + 1]);
      }
      if (a.dv) {
        __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(a.dv + base + dt * 8);
        const float2 old = __bfloat1622float2(*p);
        *p = __floats2bfloat162_rn(old.x + dv[dt][2 * r], old.y + dv[dt][2 * r + 1]);
      }
    }
  }
}

// dq += scale * dq_acc, 8 elements per thread.
__global__ void dq_finish_kernel(bf16* dq, const float* acc, float scale, int64_t n8) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n8) return;
  uint4 x = reinterpret_cast<const uint4*>(dq)[i];
  const float4 a0 = reinterpret_cast<const float4*>(acc)[2 * i],
               a1 = reinterpret_cast<const float4*>(acc)[2 * i + 1];
  __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(&x);
  const float add[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 f = __bfloat1622float2(p[e]);
    p[e] = __floats2bfloat162_rn(f.x + scale * add[2 * e], f.y + scale * add[2 * e + 1]);
  }
  reinterpret_cast<uint4*>(dq)[i] = x;
}

template <int D>
void launch_bwd(bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q, const bf16* k, const bf16* v,
                const bf16* out, const float* lse, const int32_t* cu_q, const int32_t* cu_k,
                const int32_t* pos_q, const int32_t* pos_k, int nseq, int64_t Tq, int64_t Tk, int H, int KV,
                float scale, cudaStream_t stream) {
  using C = Bwd<D>;
  const int64_t rows = Tq * H;
  Scratch stats(sizeof(float) * 2 * rows, stream);
  Scratch dq_acc(dq ? sizeof(float) * rows * D : 0, stream);
  float* dsum = stats.as<float>();
  float* lse2 = dsum + rows;
  bwd_pre_kernel<D><<<static_cast<unsigned>((rows * 8 + 255) / 256), 256, 0, stream>>>(
      dsum, lse2, dq_acc.as<float>(), dout, out, lse, rows);
  NDT_CUDA_CHECK_LAUNCH();

  const int64_t ntiles = tile_bound(Tk, nseq, C::BN);
  if (ntiles * KV > INT_MAX) arg_error("cuda attention: too many key tiles");
  Scratch blk(sizeof(int32_t) * (nseq + 1), stream);
  segment_tiles(blk.as<int32_t>(), cu_k, nseq, C::BN, stream);
  BwdArgs a{dq_acc.as<float>(), dk,   dv, dout, q,      k,    v, lse2, dsum, cu_q, cu_k, pos_q, pos_k,
            blk.as<int32_t>(),  nseq, H,  KV,   H / KV, scale};
  NDT_CUDA_CHECK(cudaFuncSetAttribute(bwd_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem));
  bwd_kernel<D><<<static_cast<unsigned>(ntiles * KV), C::kThreads, C::kSmem, stream>>>(a);
  NDT_CUDA_CHECK_LAUNCH();

  if (dq) {
    const int64_t n8 = rows * D / 8;
    dq_finish_kernel<<<static_cast<unsigned>((n8 + 255) / 256), 256, 0, stream>>>(dq, dq_acc.as<float>(),
                                                                                  scale, n8);
    NDT_CUDA_CHECK_LAUNCH();
  }
}

// ---- fp32: dQ with one warp per (query row, head), then dK and dV with one warp per (key row, kv head) ----
// No atomics: each output row is summed by one warp in a fixed order, so the fp32 backward (what `ndtrain
// verify` compares on the GPU) gives the same bits on every run. di (dO . O per query row and head) is
// written by the first kernel for the second.
__global__ void bwd_simple_kernel(float* dq, float* di_out, const float* dout, const float* q, const float* k,
                                  const float* v, const float* out, const float* lse, const int32_t* cu_q,
                                  const int32_t* cu_k, const int32_t* pos_q, const int32_t* pos_k, int nseq,
                                  int Tq, int H, int KV, int D, float scale) {
  const int64_t w = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (w >= static_cast<int64_t>(Tq) * H) return;
  const int i = static_cast<int>(w / H), h = static_cast<int>(w % H);
  if (i >= cu_q[nseq] || i < cu_q[0]) return;
  const float L = lse[w];
  if (L == -INFINITY) return;  // the row saw no key of this set
  const int s = find_segment(cu_q, nseq, i);
  const int qs = cu_q[s], ks = cu_k[s], ke = cu_k[s + 1], kvh = h / (H / KV);
  const int pq = pos_of(pos_q, i, qs);
  float qr[4], dor[4], dqa[4], di = 0.f;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int d = lane + 32 * e;
    qr[e] = d < D ? q[w * D + d] : 0.f;
    dor[e] = d < D ? dout[w * D + d] : 0.f;
    di += d < D ? dor[e] * out[w * D + d] : 0.f;
    dqa[e] = 0.f;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) di += __shfl_xor_sync(0xffffffffu, di, o);
  if (lane == 0) di_out[w] = di;
  if (!dq) return;
  for (int j = ks; j < ke; ++j) {
    if (pos_of(pos_k, j, ks) > pq) continue;
    const int64_t kr = (static_cast<int64_t>(j) * KV + kvh) * D;
    float sc = 0.f, dp = 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (lane + 32 * e < D) {
        sc += qr[e] * k[kr + lane + 32 * e];
        dp += dor[e] * v[kr + lane + 32 * e];
      }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      sc += __shfl_xor_sync(0xffffffffu, sc, o);
      dp += __shfl_xor_sync(0xffffffffu, dp, o);
    }
    const float p = expf(sc * scale - L), ds = p * (dp - di) * scale;
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (lane + 32 * e < D) dqa[e] += ds * k[kr + lane + 32 * e];
  }
#pragma unroll
  for (int e = 0; e < 4; ++e)
    if (lane + 32 * e < D) dq[w * D + lane + 32 * e] += dqa[e];
}

__global__ void bwd_simple_dkv_kernel(float* dk, float* dv, const float* dout, const float* q, const float* k,
                                      const float* v, const float* lse, const float* di_rows,
                                      const int32_t* cu_q, const int32_t* cu_k, const int32_t* pos_q,
                                      const int32_t* pos_k, int nseq, int Tk, int H, int KV, int D,
                                      float scale) {
  const int64_t w = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (w >= static_cast<int64_t>(Tk) * KV) return;
  const int j = static_cast<int>(w / KV), kvh = static_cast<int>(w % KV);
  if (j >= cu_k[nseq] || j < cu_k[0]) return;
  const int s = find_segment(cu_k, nseq, j);
  const int qs = cu_q[s], qe = cu_q[s + 1], G = H / KV;
  const int pk = pos_of(pos_k, j, cu_k[s]);
  float kr[4], vr[4], dka[4], dva[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int d = lane + 32 * e;
    kr[e] = d < D ? k[w * D + d] : 0.f;
    vr[e] = d < D ? v[w * D + d] : 0.f;
    dka[e] = dva[e] = 0.f;
  }
  for (int i = qs; i < qe; ++i) {
    if (pos_of(pos_q, i, qs) < pk) continue;  // the query does not see this key
    for (int hh = 0; hh < G; ++hh) {
      const int64_t qw = static_cast<int64_t>(i) * H + kvh * G + hh;
      const float L = lse[qw];
      if (L == -INFINITY) continue;
      float qv[4], dov[4], sc = 0.f, dp = 0.f;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int d = lane + 32 * e;
        qv[e] = d < D ? q[qw * D + d] : 0.f;
        dov[e] = d < D ? dout[qw * D + d] : 0.f;
        sc += qv[e] * kr[e];
        dp += dov[e] * vr[e];
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        sc += __shfl_xor_sync(0xffffffffu, sc, o);
        dp += __shfl_xor_sync(0xffffffffu, dp, o);
      }
      const float p = expf(sc * scale - L), ds = p * (dp - di_rows[qw]) * scale;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        dka[e] += ds * qv[e];
        dva[e] += p * dov[e];
      }
    }
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int d = lane + 32 * e;
    if (d >= D) continue;
    if (dk) dk[w * D + d] += dka[e];
    if (dv) dv[w * D + d] += dva[e];
  }
}

}  // namespace
}  // namespace fa

template <typename T>
void attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v, const T* out,
                        const float* lse, const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k,
                        const int32_t* pos_q, const int32_t* pos_k, int64_t nseq, int64_t Tq, int64_t Tk,
                        int64_t H, int64_t KV, int64_t D, float scale, cudaStream_t stream) {
  fa::check_args(nseq, Tq, Tk, H, KV, D);
  if (Tq == 0 || Tk == 0 || nseq == 0 || (!dq && !dk && !dv)) return;
  if constexpr (std::is_same_v<T, float>) {
    Scratch di(sizeof(float) * static_cast<size_t>(Tq * H), stream);
    const int64_t threads = Tq * H * 32;
    fa::bwd_simple_kernel<<<static_cast<unsigned>((threads + 255) / 256), 256, 0, stream>>>(
        dq, di.as<float>(), dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, pos_q, pos_k,
        static_cast<int>(nseq), static_cast<int>(Tq), static_cast<int>(H), static_cast<int>(KV),
        static_cast<int>(D), scale);
    NDT_CUDA_CHECK_LAUNCH();
    if (dk || dv) {
      const int64_t kthreads = Tk * KV * 32;
      fa::bwd_simple_dkv_kernel<<<static_cast<unsigned>((kthreads + 255) / 256), 256, 0, stream>>>(
          dk, dv, dout, q, k, v, lse, di.as<float>(), cu_seqlens_q, cu_seqlens_k, pos_q, pos_k,
          static_cast<int>(nseq), static_cast<int>(Tk), static_cast<int>(H), static_cast<int>(KV),
          static_cast<int>(D), scale);
      NDT_CUDA_CHECK_LAUNCH();
    }
  } else {
    for (const void* p :
         {static_cast<const void*>(dq), static_cast<const void*>(dk), static_cast<const void*>(dv),
          static_cast<const void*>(dout), static_cast<const void*>(q), static_cast<const void*>(k),
          static_cast<const void*>(v), static_cast<const void*>(out)})
      if (p && !fa::aligned16(p)) fa::arg_error("cuda attention: bf16 tensors must be 16-byte aligned");
    if (D == 64)
      fa::launch_bwd<64>(dq, dk, dv, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, pos_q, pos_k,
                         static_cast<int>(nseq), Tq, Tk, static_cast<int>(H), static_cast<int>(KV), scale,
                         stream);
    else
      fa::launch_bwd<128>(dq, dk, dv, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, pos_q, pos_k,
                          static_cast<int>(nseq), Tq, Tk, static_cast<int>(H), static_cast<int>(KV), scale,
                          stream);
  }
}

template void attention_backward<float>(float*, float*, float*, const float*, const float*, const float*,
                                        const float*, const float*, const float*, const int32_t*,
                                        const int32_t*, const int32_t*, const int32_t*, int64_t, int64_t,
                                        int64_t, int64_t, int64_t, int64_t, float, cudaStream_t);
template void attention_backward<__nv_bfloat16>(__nv_bfloat16*, __nv_bfloat16*, __nv_bfloat16*,
                                                const __nv_bfloat16*, const __nv_bfloat16*,
                                                const __nv_bfloat16*, const __nv_bfloat16*,
                                                const __nv_bfloat16*, const float*, const int32_t*,
                                                const int32_t*, const int32_t*, const int32_t*, int64_t,
                                                int64_t, int64_t, int64_t, int64_t, int64_t, float,
                                                cudaStream_t);

}  // namespace ndt::cuda
