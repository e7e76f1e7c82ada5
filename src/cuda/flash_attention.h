#pragma once
// Causal grouped-query attention on packed (THD) sequences, flash-attention style: the CUDA twin of the
// general-form ndt::cpu::attention_forward/backward (src/ops/cpu_ops.h), on raw DEVICE pointers.
//
// Layouts: q/out/dq (Tq, H, D), k/v/dk/dv (Tk, KV, D), lse (Tq, H) fp32; H % KV == 0 (query head h uses
// kv head h / (H / KV)). cu_seqlens_q/k (nseq + 1) and pos_q/pos_k (Tq / Tk) are DEVICE int32 arrays.
// Sequence s has query rows [cu_q[s], cu_q[s+1]) and key rows [cu_k[s], cu_k[s+1]); query i may attend
// key j of its sequence iff pos_k[j] <= pos_q[i]. Positions must be non-decreasing within each segment
// (key blocks past the last query position are skipped). pos_q == pos_k == null means plain causal:
// positions are row offsets inside the segment (q and k segments then have equal lengths); this is the
// training hot path. Rows with no allowed key get out 0 and lse -inf; rows past cu_q[nseq] get out 0 and
// lse 0.
//
// T = __nv_bfloat16: tensor-core kernels (mma.sync m16n8k16, bf16 operands, fp32 accumulation and fp32
// softmax). T = float: plain fp32 kernels (exact fp32 math, slow; for tests and fp32 runs).
// Head dim D must be 64 or 128 (checked on the host; throws ndt::Error otherwise).
//
// Backward ACCUMULATES (+=) into dq, dk, dv (a bf16 d-tensor is read, added to in fp32, rounded once);
// it recomputes P = exp(scale * q.k - lse) from the lse it is given, and D_i = rowsum(dout * out) from
// the out it is given (for ring attention: the final merged out and lse). Null d-pointers are skipped.
// dq goes through fp32 atomics into a scratch buffer (so its low bits are not run-to-run deterministic);
// dk, dv are deterministic. Scratch comes from the stream-ordered allocator (cudaMallocAsync on `stream`).
// All calls are asynchronous on `stream`.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace ndt::cuda {

template <typename T>
void attention_forward(T* out, float* lse, const T* q, const T* k, const T* v, const int32_t* cu_seqlens_q,
                       const int32_t* cu_seqlens_k, const int32_t* pos_q, const int32_t* pos_k, int64_t nseq,
                       int64_t Tq, int64_t Tk, int64_t H, int64_t KV, int64_t D, float scale,
                       cudaStream_t stream = 0);

template <typename T>
void attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v, const T* out,
                        const float* lse, const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k,
                        const int32_t* pos_q, const int32_t* pos_k, int64_t nseq, int64_t Tq, int64_t Tk,
                        int64_t H, int64_t KV, int64_t D, float scale, cudaStream_t stream = 0);

// Decode form (a step over a KV cache): query row s is the only query of segment s (nseq rows, cu_q =
// 0, 1, ..., nseq implied); otherwise the same contract as attention_forward (visible keys of segment s:
// pos_k[j] <= pos_q[s], positions non-decreasing in a segment). One block per (segment, kv head) serves
// the group's query heads, reading each cached row once. Returns false, launching nothing, for shapes it
// does not take (H / KV not 1, 2, 4 or 8, D not 64 or 128, q/k/v not 16-byte aligned): use attention_forward
// then.
// splits > 1 divides each segment's visible keys into that many parts run by separate blocks and merged
// by a second kernel (more loads in flight when nseq * KV blocks are few); 0 picks it from the device's SM
// count and rows_k (the key rows of all segments; rows_k / nseq bounds a segment's visible keys).
template <typename T>
bool attention_decode(T* out, float* lse, const T* q, const T* k, const T* v, const int32_t* cu_seqlens_k,
                      const int32_t* pos_q, const int32_t* pos_k, int64_t nseq, int64_t H, int64_t KV,
                      int64_t D, float scale, cudaStream_t stream = 0, int splits = 1, int64_t rows_k = 0);
// The parts attention_decode takes when given splits = 0.
int decode_splits(int64_t nseq, int64_t KV, int64_t rows_k);

}  // namespace ndt::cuda
