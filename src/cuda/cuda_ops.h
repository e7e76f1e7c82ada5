#pragma once
// CUDA twins of the CPU reference kernels (src/ops/cpu_ops.h), attention excepted (cuda_attention.h).
// Same names, argument order and semantics as ndt::cpu, on raw DEVICE pointers, plus a trailing
// `cudaStream_t stream = 0`. All launches are asynchronous on `stream` unless a function says it syncs.
//
// Element types. `E` is the activation type: float or __nv_bfloat16 (explicit instantiations only).
// - activations, activation gradients and parameter VALUES passed to kernels are E (the caller keeps a
//   bf16 compute copy of its fp32 master weights);
// - parameter GRADIENTS (dweight, dbias, norm dweight/dbias, dtable, dpos_table) are always float*;
// - per-row statistics (mean, rstd, rowmax, sumexp, target_logit, logprob, dloss) are float*.
// Every reduction accumulates in fp32 (sum_squares in double). Parameter-gradient reductions over rows
// (linear dbias, norm dweight/dbias, embedding dtable) are deterministic: fixed summation order, no
// float atomics, so two runs give bit-identical gradients.
//
// Gradient convention (as on CPU): every backward ACCUMULATES (+=) into all its d-outputs, including E
// ones (a bf16 dinp is read, added to in fp32 and rounded once); a null d-pointer means "not needed".
//
// Alignment: no requirement for correctness. Kernels take 16-byte vector paths when every pointer is
// 16-byte aligned and the row length is a multiple of 16/sizeof(E), scalar paths otherwise. Matmuls:
// see cublaslt.h (any leading dim works; multiples of 8 elements with 16-byte aligned pointers hit the
// fast tensor-core kernels).
//
// Scratch: deterministic reductions take temporary device memory from the stream-ordered allocator
// (cudaMallocAsync/cudaFreeAsync on `stream`), so they are graph-capturable only with a memory pool.
// Out-of-range ids: embedding ids outside [vocab_start, vocab_start + V) give 0 rows (another shard
// owns them), as on CPU. Positions outside [0, P) cannot throw on the device: their rows are skipped
// (forward adds nothing, backward drops the row); callers validate positions on the host.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/step_control.h"

namespace ndt::cuda {

// ---- embedding (vocab-parallel ready) ----
template <typename E>
void embedding_forward(E* out, const int32_t* ids, const E* table, int64_t T, int64_t V, int64_t C,
                       int64_t vocab_start, cudaStream_t stream = 0);
// dtable(V, C) += scatter of dout rows; deterministic (stable sort of ids, then per-id row sums in token
// order).
template <typename E>
void embedding_backward(float* dtable, const E* dout, const int32_t* ids, int64_t T, int64_t V, int64_t C,
                        int64_t vocab_start, cudaStream_t stream = 0);
// out(T, C) += pos_table(P, C)[pos[t]]
template <typename E>
void add_position_embedding_forward(E* out, const int32_t* pos, const E* pos_table, int64_t T, int64_t P,
                                    int64_t C, cudaStream_t stream = 0);
template <typename E>
void add_position_embedding_backward(float* dpos_table, const E* dout, const int32_t* pos, int64_t T,
                                     int64_t P, int64_t C, cudaStream_t stream = 0);

// ---- linear through cuBLASLt (implemented in cublaslt.cpp) ----
// out(T, OC) = inp(T, IC) @ weight(OC, IC)^T + bias(OC); bias (may be null) fused as an epilogue.
// fp32: exact fp32 math (no TF32). bf16: bf16 inputs, fp32 accumulation, bf16 output. accumulate: out is
// added to the product (beta = 1) before the one rounding to E. residual (T, OC; not out): out = residual +
// the product + bias, likewise rounded once (the residual read in the matmul's epilogue).
template <typename E>
void linear_forward(E* out, const E* inp, const E* weight, const E* bias, int64_t T, int64_t IC, int64_t OC,
                    cudaStream_t stream = 0, bool accumulate = false, const E* residual = nullptr);
// dinp(T, IC) += dout @ weight (beta = 1, in E; accumulate_dinp = false: dinp = ..., beta = 0, dinp is not
// read, so it may be uninitialized); dweight(OC, IC) += dout^T @ inp (E inputs, fp32 C/D);
// dbias(OC) += column sums of dout (deterministic kernel).
template <typename E>
void linear_backward(E* dinp, float* dweight, float* dbias, const E* dout, const E* inp, const E* weight,
                     int64_t T, int64_t IC, int64_t OC, cudaStream_t stream = 0, bool accumulate_dinp = true);
// dbias(OC) += sum over rows of dout(T, OC) (the linear dbias, exported for fused/sharded callers).
template <typename E>
void bias_backward(float* dbias, const E* dout, int64_t T, int64_t OC, cudaStream_t stream = 0);
// GPT-2 MLP fusions (bf16 only): the GELU runs in the matmul's epilogue (cublaslt.h gemm_gelu). Each
// returns false, doing nothing, where the fusion does not apply (OC resp. IC not a multiple of 8, pointers
// not 16-byte aligned, no cuBLASLt algorithm); the caller then runs linear_* and gelu_* unfused.
// pre(T, OC) = inp(T, IC) @ weight(OC, IC)^T + bias(OC) (bias may be null), act(T, OC) = gelu(pre).
bool linear_gelu_forward(__nv_bfloat16* act, __nv_bfloat16* pre, const __nv_bfloat16* inp,
                         const __nv_bfloat16* weight, const __nv_bfloat16* bias, int64_t T, int64_t IC,
                         int64_t OC, cudaStream_t stream = 0);
// dpre(T, IC) = gelu'(pre(T, IC)) * (dout(T, OC) @ weight(OC, IC)), overwritten (not read): the input
// gradient of linear_backward with gelu_backward, without the (T, IC) gradient between them.
bool linear_dgelu_backward(__nv_bfloat16* dpre, const __nv_bfloat16* dout, const __nv_bfloat16* weight,
                           const __nv_bfloat16* pre, int64_t T, int64_t IC, int64_t OC,
                           cudaStream_t stream = 0);

// ---- norms over the last dim (one warp per row); mean/rstd (may be null in forward) saved per row ----
template <typename E>
void layernorm_forward(E* out, float* mean, float* rstd, const E* inp, const E* weight, const E* bias,
                       int64_t T, int64_t C, float eps, cudaStream_t stream = 0);
// Norm backward: dinp += input gradient; with dres set, dinp = dres + input gradient instead (dinp not read:
// the residual branch's gradient without a copy). dweight/dbias += their column sums. With dsum set, dsum +=
// the column sums of dinp as written (the bias gradient of the layer whose output dinp is the gradient of),
// in the same pass where the fused kernel runs.
template <typename E>
void layernorm_backward(E* dinp, float* dweight, float* dbias, const E* dout, const E* inp, const E* weight,
                        const float* mean, const float* rstd, int64_t T, int64_t C, cudaStream_t stream = 0,
                        const E* dres = nullptr, float* dsum = nullptr);
template <typename E>
void rmsnorm_forward(E* out, float* rstd, const E* inp, const E* weight, int64_t T, int64_t C, float eps,
                     cudaStream_t stream = 0);
// The residual add before a norm in one kernel: h = a + (b + rbias) (residual_forward's arithmetic; rbias
// may be null, else one row), out = norm(h); equal bit for bit to residual_forward then the norm.
template <typename E>
void add_layernorm_forward(E* h, E* out, float* mean, float* rstd, const E* a, const E* b, const E* rbias,
                           const E* weight, const E* bias, int64_t T, int64_t C, float eps,
                           cudaStream_t stream);
template <typename E>
void add_rmsnorm_forward(E* h, E* out, float* rstd, const E* a, const E* b, const E* rbias, const E* weight,
                         int64_t T, int64_t C, float eps, cudaStream_t stream);
template <typename E>
void rmsnorm_backward(E* dinp, float* dweight, const E* dout, const E* inp, const E* weight,
                      const float* rstd, int64_t T, int64_t C, cudaStream_t stream = 0,
                      const E* dres = nullptr, float* dsum = nullptr);

// ---- rotary embedding on (T, H, D), rotate_half layout; angles in double as on CPU. inp == out ok ----
template <typename E>
void rope_forward(E* out, const E* inp, const int32_t* pos, int64_t T, int64_t H, int64_t D, float theta,
                  cudaStream_t stream = 0);
// The fused q/k/v projection (T, (H + 2 KV) * D), rows [q | k | v], split into q (T, H, D) and k (T, KV, D),
// both rotated as by rope_forward, and v (T, KV, D) copied. With kv_rows (T), token t's k and v go to row
// kv_rows[t] of k and v (a KV cache) instead of row t.
template <typename E>
void qkv_split_rope(E* q, E* k, E* v, const E* qkv, const int32_t* pos, int64_t T, int64_t H, int64_t KV,
                    int64_t D, float theta, cudaStream_t stream = 0, const int32_t* kv_rows = nullptr);
// The backward of qkv_split_rope: dqkv (T, (H + 2 KV) * D) = rows [dq rotated back | dk rotated back | dv],
// each rotation exactly rope_backward's (overwritten, not accumulated).
template <typename E>
void qkv_merge_rope_backward(E* dqkv, const E* dq, const E* dk, const E* dv, const int32_t* pos, int64_t T,
                             int64_t H, int64_t KV, int64_t D, float theta, cudaStream_t stream = 0);
// dinp += inverse rotation of dout (dinp == dout is NOT allowed: it accumulates).
template <typename E>
void rope_backward(E* dinp, const E* dout, const int32_t* pos, int64_t T, int64_t H, int64_t D, float theta,
                   cudaStream_t stream = 0);

// ---- activations (elementwise over N) ----
template <typename E>
void gelu_forward(E* out, const E* inp, int64_t N, cudaStream_t stream = 0);
// Backward ops add into their outputs; accumulate = false overwrites them instead (they are not read).
template <typename E>
void gelu_backward(E* dinp, const E* dout, const E* inp, int64_t N, cudaStream_t stream = 0,
                   bool accumulate = true);
template <typename E>
void swiglu_forward(E* out, const E* gate, const E* up, int64_t N, cudaStream_t stream = 0);
// The same from the fused gate/up projection h13 (T, 2F), rows [gate | up]: out (T, F).
template <typename E>
void swiglu_forward_fused(E* out, const E* h13, int64_t T, int64_t F, cudaStream_t stream = 0);
template <typename E>
void swiglu_backward(E* dgate, E* dup, const E* dout, const E* gate, const E* up, int64_t N,
                     cudaStream_t stream = 0, bool accumulate = true);
// out = a + (b + bias[i % C]) (residual stream; out may alias a or b; bias optional, C elements).
template <typename E>
void residual_forward(E* out, const E* a, const E* b, int64_t N, cudaStream_t stream = 0,
                      const E* bias = nullptr, int64_t C = 1);

// ---- softmax cross-entropy in vocab-parallel pieces (logits E, everything per-row float) ----
template <typename E>
void xent_rowmax(float* rowmax, const E* logits, int64_t T, int64_t V, cudaStream_t stream = 0);
template <typename E>
void xent_sumexp(float* sumexp, const E* logits, const float* rowmax, int64_t T, int64_t V,
                 cudaStream_t stream = 0);
// Fused single pass (online max + rescaled sum): equals xent_rowmax then xent_sumexp. Under TP, after
// an all-reduce(max) of rowmax into global_max, call xent_rebase_sumexp before the all-reduce(sum).
template <typename E>
void xent_rowmax_sumexp(float* rowmax, float* sumexp, const E* logits, int64_t T, int64_t V,
                        cudaStream_t stream = 0);
// sumexp[t] *= exp(local_max[t] - global_max[t]) (0 when the local shard is empty: local_max = -inf).
void xent_rebase_sumexp(float* sumexp, const float* local_max, const float* global_max, int64_t T,
                        cudaStream_t stream = 0);
template <typename E>
void xent_target_logit(float* target_logit, const E* logits, const int32_t* targets, int64_t T, int64_t V,
                       int64_t vocab_start, cudaStream_t stream = 0);
void xent_logprob(float* logprob, const float* target_logit, const float* rowmax, const float* sumexp,
                  int64_t T, cudaStream_t stream = 0);
// dlogits[t][j] += dloss[t] * (softmax[t][j] - [j == target]); rows with dloss[t] == 0 are skipped.
template <typename E>
void xent_backward(E* dlogits, const E* logits, const float* rowmax, const float* sumexp,
                   const int32_t* targets, const float* dloss, int64_t T, int64_t V, int64_t vocab_start,
                   cudaStream_t stream = 0);
// Memory-saving variant: OVERWRITES logits with dlogits = dloss * (softmax - onehot) (rows with
// dloss[t] == 0 become 0). Not accumulating: use it when the logits buffer is dead after backward.
template <typename E>
void xent_backward_inplace(E* logits, const float* rowmax, const float* sumexp, const int32_t* targets,
                           const float* dloss, int64_t T, int64_t V, int64_t vocab_start,
                           cudaStream_t stream = 0);
// The whole vocabulary on this rank (no TP shards): logprob[t] = log softmax(logits[t])[targets[t]] and the
// logits OVERWRITTEN with dloss * (softmax - onehot), in one kernel. The same values as
// xent_rowmax_sumexp, xent_target_logit, xent_logprob, then xent_backward_inplace (targets in [0, V)).
template <typename E>
void xent_loss_backward_inplace(E* logits, float* logprob, const int32_t* targets, const float* dloss,
                                int64_t T, int64_t V, cudaStream_t stream = 0);
// One-rank convenience: losses[t] = -log softmax(logits[t])[targets[t]], 0 where mask[t] == 0 (mask may
// be null). Synchronizes `stream`; returns the sum of the losses.
template <typename E>
double cross_entropy_forward(float* losses, const E* logits, const int32_t* targets, const float* mask,
                             int64_t T, int64_t V, cudaStream_t stream = 0);

// ---- optimizer helpers (fp32 master weights and state) ----
// AdamW, PyTorch semantics, step counts from 1, one launch over a flat range of n elements. The effective
// gradient is grad * grad_scale (fuses clipping). When param_bf16 is non-null, it receives the updated
// parameters rounded to bf16 in the same pass (the compute copy).
void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, float lr, float beta1,
                  float beta2, float eps, float weight_decay, int64_t step,
                  __nv_bfloat16* param_bf16 = nullptr, float grad_scale = 1.0f, cudaStream_t stream = 0);
// One range of adamw_update_runs: its own pointers (a parameter run, its gradient and state), n elements,
// weight decay on or off. chunk0: the index of its first chunk of kAdamwChunk elements (filled by
// adamw_plan_runs).
struct AdamwRun {
  float* param;
  const float* grad;
  float* m;
  float* v;
  __nv_bfloat16* param_bf16;
  int64_t n;
  int64_t chunk0;
  int32_t decay;
  int32_t vec;  // every pointer 16-byte aligned: packs of 4
};
constexpr int64_t kAdamwChunk = 1 << 14;
// Fills chunk0 and vec of each run; returns the total number of chunks (the launch's blocks).
int64_t adamw_plan_runs(AdamwRun* runs, int nruns);
// adamw_update over every run in ONE launch (an optimizer step over many parameters without a launch
// each, the same arithmetic per element): runs_dev holds the planned runs in device memory. With a
// `control` (device memory, filled by decide_step), the step size, bias correction and clip factor come
// from it instead of step and grad_scale, and the launch changes nothing where it says skip.
void adamw_update_runs(const AdamwRun* runs_dev, int nruns, int64_t chunks, float lr, float beta1,
                       float beta2, float eps, float weight_decay, int64_t step, float grad_scale,
                       cudaStream_t stream = 0, const StepControl* control = nullptr);
// core/step_control.h's decide_step in a one-thread kernel: control and record in device memory,
// d.bias_corrections too.
void decide_step(StepControl* control, const StepDecision& d, StepRecord* record, cudaStream_t stream = 0);
// *result (device double) = (accumulate ? *result : 0) + sum of x^2; deterministic (fixed blocks).
void sum_squares_device(double* result, const float* x, int64_t n, bool accumulate = false,
                        cudaStream_t stream = 0);
// *dst += *src, one device double each (a sum the host would otherwise read back to add).
void add_f64(double* dst, const double* src, cudaStream_t stream = 0);
// Host convenience (as cpu::sum_squares): synchronizes `stream`.
double sum_squares(const float* x, int64_t n, cudaStream_t stream = 0);
template <typename E>
void scale_inplace(E* x, float s, int64_t n, cudaStream_t stream = 0);
// y += x
template <typename E>
void add_inplace(E* y, const E* x, int64_t n, cudaStream_t stream = 0);

// Log-sum-exp merge of a partial attention result (o, l) into (out, lse) (contract: cpu::attention_merge).
template <typename E>
void attention_merge(E* out, float* lse, const E* o, const float* l, int64_t rows, int64_t D,
                     cudaStream_t stream = 0);

// ---- casts (round to nearest even) ----
void cast(__nv_bfloat16* out, const float* in, int64_t n, cudaStream_t stream = 0);
void cast(float* out, const __nv_bfloat16* in, int64_t n, cudaStream_t stream = 0);

// ---- MoE row movement (contracts: ops.h moe_*; one block per output row, fixed order, no atomics) ----
template <typename E>
void moe_permute(E* out, const E* x, const int32_t* src, const float* scale, int64_t R, int64_t C,
                 cudaStream_t stream = 0);
template <typename E>
void moe_unpermute(E* out, const E* y, const int32_t* pos, const float* gates, int64_t N, int64_t k,
                   int64_t C, bool accumulate, cudaStream_t stream = 0);
template <typename E>
void moe_gate_grad(float* dgates, const E* dout, const E* y, const int32_t* pos, int64_t N, int64_t k,
                   int64_t C, cudaStream_t stream = 0);

// ---- row scatter (cuda_rows.cu): dst[rows[i]] = src[i] for i < n, rows of C elements; rows distinct ----
// ops::decode_advance on the device (one thread per sequence; a row past pos_k's end is skipped, the
// host twin's check).
void decode_advance(int32_t* tokens, int32_t* positions, const int32_t* sampled, int32_t* rows,
                    int32_t* pos_q, int32_t* pos_k, int64_t n, int64_t rows_k, cudaStream_t stream = 0);
template <typename E>
void scatter_rows(E* dst, const int32_t* rows, const E* src, int64_t n, int64_t C, cudaStream_t stream = 0);
// dst(T, wa + wb + wc) = [a(T, wa) | b(T, wb) | c(T, wc)] row by row.
template <typename E>
void concat_cols3(E* dst, const E* a, int64_t wa, const E* b, int64_t wb, const E* c, int64_t wc, int64_t T,
                  cudaStream_t stream = 0);

// ---- token sampling (twin of generate/sampler.cpp choose_token; cuda_sample.cu) ----
// Row r of logits (n, V): token[r] and logprob[r] (log p under the temperature-1 softmax of the row) from
// the uniform u[r] (device doubles). temperature 0: argmax; top_k 0: all; top_k/top_p sort each row on the
// device (temporary memory from the stream-ordered allocator). Asynchronous on `stream`.
template <typename E>
void sample_tokens(int32_t* token, float* logprob, const E* logits, int64_t n, int64_t V, double temperature,
                   int64_t top_k, double top_p, const double* u, cudaStream_t stream = 0);

}  // namespace ndt::cuda
