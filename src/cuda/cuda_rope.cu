// Rotary position embedding, rotate_half layout. One block per token: the D/2 angles are computed once in
// double (as on CPU: positions can be large, and fp32 angles would drift by pos * 6e-8 rad) into shared
// memory, then every head of the token is rotated. Backward accumulates the inverse rotation.
#include "cuda/cuda_kernel_utils.cuh"
#include "cuda/cuda_ops.h"

namespace ndt::cuda {

namespace {
using detail::from_f;
using detail::kVec;
using detail::load;
using detail::Pack;
using detail::store;
using detail::to_f;

// cs_sn[i] = cos(pos * theta^(-2i/D)), cs_sn[D/2 + i] = sign * sin(...), by the whole block, which then
// syncs.
__device__ void rope_angles(float* cs_sn, int32_t pos, int64_t D, double log_theta, float sign) {
  const int64_t half = D / 2;
  for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
    // theta^(-2i/D) = exp(-2i/D * log theta); pow() in double on CPU, exp/log in double here (~1 ulp).
    const double inv_freq = exp(-2.0 * static_cast<double>(i) / static_cast<double>(D) * log_theta);
    double s, c;
    sincos(static_cast<double>(pos) * inv_freq, &s, &c);
    cs_sn[i] = static_cast<float>(c);
    cs_sn[half + i] = sign * static_cast<float>(s);
  }
  __syncthreads();
}

template <typename E, bool ACCUMULATE>
__global__ void rope_kernel(E* out, const E* inp, const int32_t* pos, int64_t H, int64_t D, double log_theta,
                            float sign) {
  detail::pdl_prologue();
  extern __shared__ float cs_sn[];  // cos[half], then sin[half]
  const int64_t t = blockIdx.x;
  const int64_t half = D / 2;
  rope_angles(cs_sn, pos[t], D, log_theta, sign);
  const E* x = inp + t * H * D;
  E* o = out + t * H * D;
  for (int64_t idx = threadIdx.x; idx < H * half; idx += blockDim.x) {
    const int64_t h = idx / half, i = idx - h * half;
    const int64_t j = h * D + i;
    const float x1 = to_f(x[j]), x2 = to_f(x[j + half]);  // read both before writing: inp may alias out
    const float c = cs_sn[i], s = cs_sn[half + i];
    float y1 = x1 * c - x2 * s;
    float y2 = x2 * c + x1 * s;
    if (ACCUMULATE) {
      y1 += to_f(o[j]);
      y2 += to_f(o[j + half]);
    }
    o[j] = from_f<E>(y1);
    o[j + half] = from_f<E>(y2);
  }
}

// One block per token: its row of the fused projection [q (H*D) | k (KV*D) | v (KV*D)] becomes the rows of
// q and k, rotated with the same angles as rope_kernel, and of v, copied. Each thread takes C consecutive
// pairs (C = 1, or a 16-byte pack when the head's half and the pointers allow): memory-bound, so the wide
// accesses are what sets its speed; the arithmetic per element is the same either way.
template <typename E, int C>
__global__ void qkv_split_rope_kernel(E* q, E* k, E* v, const E* qkv, const int32_t* pos, const int32_t* rows,
                                      int H, int KV, int D, double log_theta) {
  detail::pdl_prologue();
  extern __shared__ float cs_sn[];
  const int64_t t = blockIdx.x, r = rows ? rows[t] : t;  // r: the k/v row of token t
  const int half = D / 2, per_head = half / C;
  rope_angles(cs_sn, pos[t], D, log_theta, 1.0f);
  const E* x = qkv + t * (H + 2 * KV) * D;
  E* qt = q + t * H * D;
  E* kt = k + r * KV * D;
  for (int idx = threadIdx.x; idx < (H + KV) * per_head; idx += blockDim.x) {
    const int h = idx / per_head, i = (idx - h * per_head) * C;
    const int j = h * D + i;
    E* o = h < H ? qt + j : kt + (j - H * D);
    float x1[C], x2[C], y1[C], y2[C];
    load<C>(x1, x, j);
    load<C>(x2, x, j + half);
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const float cs = cs_sn[i + c], sn = cs_sn[half + i + c];
      y1[c] = x1[c] * cs - x2[c] * sn;
      y2[c] = x2[c] * cs + x1[c] * sn;
    }
    store<C>(o, 0, y1);
    store<C>(o, half, y2);
  }
  const E* xv = x + (H + KV) * D;
  E* vt = v + r * KV * D;
  for (int idx = threadIdx.x * C; idx < KV * D; idx += blockDim.x * C)
    *reinterpret_cast<Pack<E, C>*>(vt + idx) = *reinterpret_cast<const Pack<E, C>*>(xv + idx);
}

// The backward of the split (training): one block per token writes its row of the fused gradient
// [dq rotated back | dk rotated back | dv], the rotation by the negated angles as in rope_backward, in one
// pass instead of rope_backward's zero-fill, rotation and copy per tensor and a merge after them. C as in
// the forward.
template <typename E, int C>
__global__ void qkv_merge_rope_backward_kernel(E* dqkv, const E* dq, const E* dk, const E* dv,
                                               const int32_t* pos, int H, int KV, int D, double log_theta) {
  detail::pdl_prologue();
  extern __shared__ float cs_sn[];
  const int64_t t = blockIdx.x;
  const int half = D / 2, per_head = half / C;
  rope_angles(cs_sn, pos[t], D, log_theta, -1.0f);
  E* o = dqkv + t * (H + 2 * KV) * D;
  const E* dqt = dq + t * H * D;
  const E* dkt = dk + t * KV * D;
  for (int idx = threadIdx.x; idx < (H + KV) * per_head; idx += blockDim.x) {
    const int h = idx / per_head, i = (idx - h * per_head) * C;
    const int j = h * D + i;
    const E* x = h < H ? dqt + j : dkt + (j - H * D);
    float x1[C], x2[C], y1[C], y2[C];
    load<C>(x1, x, 0);
    load<C>(x2, x, half);
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const float cs = cs_sn[i + c], sn = cs_sn[half + i + c];
      y1[c] = x1[c] * cs - x2[c] * sn;
      y2[c] = x2[c] * cs + x1[c] * sn;
    }
    store<C>(o, j, y1);
    store<C>(o, j + half, y2);
  }
  E* ov = o + (H + KV) * D;
  const E* dvt = dv + t * KV * D;
  for (int idx = threadIdx.x * C; idx < KV * D; idx += blockDim.x * C)
    *reinterpret_cast<Pack<E, C>*>(ov + idx) = *reinterpret_cast<const Pack<E, C>*>(dvt + idx);
}

// Threads of a one-block-per-token launch over `pairs` rotated pairs: whole warps, 32 to 256.
int token_block(int64_t pairs) {
  return static_cast<int>(std::min<int64_t>(256, std::max<int64_t>(32, (pairs + 31) / 32 * 32)));
}

template <typename E, bool ACCUMULATE>
void rope(E* out, const E* inp, const int32_t* pos, int64_t T, int64_t H, int64_t D, float theta, float sign,
          cudaStream_t stream) {
  if (T <= 0 || H <= 0 || D <= 0) return;
  NDT_CUDA_REQUIRE(D % 2 == 0, "rope: the head dim must be even");
  const int block = token_block(H * D / 2);
  const size_t smem = sizeof(float) * static_cast<size_t>(D);
  detail::launch_pdl(rope_kernel<E, ACCUMULATE>, static_cast<unsigned>(T), block, smem, stream, out, inp, pos,
                     H, D, log(static_cast<double>(theta)), sign);
  NDT_CUDA_CHECK_LAUNCH();
}
}  // namespace

template <typename E>
void rope_forward(E* out, const E* inp, const int32_t* pos, int64_t T, int64_t H, int64_t D, float theta,
                  cudaStream_t stream) {
  rope<E, false>(out, inp, pos, T, H, D, theta, 1.0f, stream);
}

template <typename E>
void rope_backward(E* dinp, const E* dout, const int32_t* pos, int64_t T, int64_t H, int64_t D, float theta,
                   cudaStream_t stream) {
  if (!dinp) return;
  rope<E, true>(dinp, dout, pos, T, H, D, theta, -1.0f, stream);
}

// Launch shape of the split kernels: C pairs per thread (a 16-byte pack where the head's half holds whole
// packs and every pointer is 16-byte aligned, so every row and head offset is a whole number of packs; else
// 1), the block, the angles' shared memory, and the sizes as the kernels' 32-bit ints.
struct SplitLaunch {
  int C, block;
  size_t smem;
  double log_theta;
  int H, KV, D;
};

template <typename E>
SplitLaunch split_launch(const char* what, int64_t H, int64_t KV, int64_t D, float theta,
                         std::initializer_list<const void*> ptrs) {
  NDT_CUDA_REQUIRE(D % 2 == 0, std::string(what) + ": the head dim must be even");
  NDT_CUDA_REQUIRE((H + 2 * KV) * D < (int64_t{1} << 31),
                   std::string(what) + ": a token's row exceeds 2^31 elements");
  const int C = (D / 2) % kVec<E> == 0 && detail::all_aligned16(ptrs) ? kVec<E> : 1;
  return {C,
          token_block((H + KV) * D / 2 / C),
          sizeof(float) * static_cast<size_t>(D),
          log(static_cast<double>(theta)),
          static_cast<int>(H),
          static_cast<int>(KV),
          static_cast<int>(D)};
}

template <typename E>
void qkv_split_rope(E* q, E* k, E* v, const E* qkv, const int32_t* pos, int64_t T, int64_t H, int64_t KV,
                    int64_t D, float theta, cudaStream_t stream, const int32_t* kv_rows) {
  if (T <= 0) return;
  const SplitLaunch l = split_launch<E>("qkv_split_rope", H, KV, D, theta, {q, k, v, qkv});
  const auto kernel = l.C > 1 ? qkv_split_rope_kernel<E, kVec<E>> : qkv_split_rope_kernel<E, 1>;
  detail::launch_pdl(kernel, static_cast<unsigned>(T), l.block, l.smem, stream, q, k, v, qkv, pos, kv_rows,
                     l.H, l.KV, l.D, l.log_theta);
  NDT_CUDA_CHECK_LAUNCH();
}

template <typename E>
void qkv_merge_rope_backward(E* dqkv, const E* dq, const E* dk, const E* dv, const int32_t* pos, int64_t T,
                             int64_t H, int64_t KV, int64_t D, float theta, cudaStream_t stream) {
  if (T <= 0) return;
  const SplitLaunch l = split_launch<E>("qkv_merge_rope_backward", H, KV, D, theta, {dqkv, dq, dk, dv});
  const auto kernel =
      l.C > 1 ? qkv_merge_rope_backward_kernel<E, kVec<E>> : qkv_merge_rope_backward_kernel<E, 1>;
  detail::launch_pdl(kernel, static_cast<unsigned>(T), l.block, l.smem, stream, dqkv, dq, dk, dv, pos, l.H,
                     l.KV, l.D, l.log_theta);
  NDT_CUDA_CHECK_LAUNCH();
}

#define NDT_INSTANTIATE(E)                                                                                  \
  template void qkv_merge_rope_backward<E>(E*, const E*, const E*, const E*, const int32_t*, int64_t,       \
                                           int64_t, int64_t, int64_t, float, cudaStream_t);                 \
  template void qkv_split_rope<E>(E*, E*, E*, const E*, const int32_t*, int64_t, int64_t, int64_t, int64_t, \
                                  float, cudaStream_t, const int32_t*);                                     \
  template void rope_forward<E>(E*, const E*, const int32_t*, int64_t, int64_t, int64_t, float,             \
                                cudaStream_t);                                                              \
  template void rope_backward<E>(E*, const E*, const int32_t*, int64_t, int64_t, int64_t, float,            \
                                 cudaStream_t);
NDT_INSTANTIATE(float)
NDT_INSTANTIATE(__nv_bfloat16)
#undef NDT_INSTANTIATE

}  // namespace ndt::cuda
