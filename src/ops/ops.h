#pragma once
// Tensor-level ops: check shapes/dtypes, then dispatch on the tensor's device to the CPU reference
// kernels (ops/cpu_ops.h) or, in a CUDA build, to their GPU twins (cuda/cuda_ops.h, cuda/flash_attention.h)
// on the compute stream of cuda/runtime.h. Callers (model, trainer) only use this header, so adding a
// backend changes no caller. Backward ops ACCUMULATE into gradients (+=), as in cpu_ops.h; those with an
// `accumulate` flag overwrite their activation gradient when it is false (a fresh, uninitialized buffer: on
// the GPU this saves zeroing it and reading it back).
//
// Dtypes: on the CPU everything is f32. On CUDA, activations, their gradients and the weights passed in
// (a Param's compute_value()) share one activation dtype, f32 or bf16; parameter GRADIENTS and per-row
// statistics (norm mean/rstd, attention lse, softmax rowmax/sumexp, logprob, dloss) are always f32.
// Integer/metadata inputs (ids, targets, positions, cu_seqlens, loss mask) may stay on the host when the
// compute runs on the device: they are uploaded (asynchronously, stream-ordered) by the op.
#include <cstdint>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace ndt::ops {

// out(T, C) = table rows of ids (zero rows for ids outside [vocab_start, vocab_start + V)).
void embedding_forward(Tensor& out, const Tensor& ids, const Tensor& table, int64_t vocab_start);
void embedding_backward(Tensor& dtable, const Tensor& dout, const Tensor& ids, int64_t vocab_start);
void add_position_embedding_forward(Tensor& x, const Tensor& pos, const Tensor& table);
void add_position_embedding_backward(Tensor& dtable, const Tensor& dx, const Tensor& pos);

// out(T, OC) = inp(T, IC) @ weight(OC, IC)^T (+ bias(OC) when defined); accumulate: out += that (on the
// GPU in the matmul's fp32 accumulator, rounded once: a residual add without its own pass).
void linear_forward(Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor* bias,
                    bool accumulate = false);
// residual + (inp @ weight^T + bias) as a new tensor (like residual): add(residual, linear(inp, weight),
// bias). On the GPU the matmul reads the residual in its epilogue and rounds the sum once (no add pass, no
// rounding of the product alone); on the CPU it is those two ops, bit for bit.
Tensor linear_residual_forward(const Tensor& inp, const Tensor& weight, const Tensor* bias,
                               const Tensor& residual);
// dinp (+)= dout @ weight; dweight += dout^T @ inp (skipped when dweight is undefined: the input gradient
// alone, e.g. per row block); dbias += column sums of dout.
void linear_backward(Tensor* dinp, Tensor& dweight, Tensor* dbias, const Tensor& dout, const Tensor& inp,
                     const Tensor& weight, bool accumulate_dinp = true);

void layernorm_forward(Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& inp, const Tensor& weight,
                       const Tensor& bias, float eps);
// dinp += input gradient, or with dres: dinp = *dres + input gradient (dinp a fresh buffer, not read). With
// dinp_colsum (F32, one per column): += the column sums of dinp as written, i.e. bias_backward(*dinp_colsum,
// dinp) after the op, in the same pass on the GPU (the bias gradient of the layer that produced the input).
void layernorm_backward(Tensor& dinp, Tensor& dweight, Tensor& dbias, const Tensor& dout, const Tensor& inp,
                        const Tensor& weight, const Tensor& mean, const Tensor& rstd,
                        const Tensor* dres = nullptr, Tensor* dinp_colsum = nullptr);
void rmsnorm_forward(Tensor& out, Tensor& rstd, const Tensor& inp, const Tensor& weight, float eps);
// The residual add before a norm: h = add(a, b, rbias) (a new tensor like a), then the norm of h into out.
// One kernel on the GPU, equal bit for bit to the two ops.
void add_layernorm_forward(Tensor& h, Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& a,
                           const Tensor& b, const Tensor* rbias, const Tensor& weight, const Tensor& bias,
                           float eps);
void add_rmsnorm_forward(Tensor& h, Tensor& out, Tensor& rstd, const Tensor& a, const Tensor& b,
                         const Tensor* rbias, const Tensor& weight, float eps);
void rmsnorm_backward(Tensor& dinp, Tensor& dweight, const Tensor& dout, const Tensor& inp,
                      const Tensor& weight, const Tensor& rstd, const Tensor* dres = nullptr,
                      Tensor* dinp_colsum = nullptr);

// x(T, H, D) rotated in place by positions pos(T).
void rope_forward(Tensor& x, const Tensor& pos, float theta);
void rope_backward(Tensor& dx, const Tensor& pos, float theta);
// A fused q/k/v projection qkv(T, (H + 2 KV) D), rows [q | k | v], split into q(T, H, D) and k(T, KV, D),
// rotated by positions pos(T), and v(T, KV, D) (decode steps: one matmul instead of three). With kv_rows
// (T, I32), k and v are a KV cache's (R, KV, D) and token t's rows are written at row kv_rows[t].
void qkv_split_rope(Tensor& q, Tensor& k, Tensor& v, const Tensor& qkv, const Tensor& pos, float theta,
                    const Tensor* kv_rows = nullptr);
// The inverse of the split without the rotation: qkv(T, (H + 2 KV) D) = [q | k | v] row by row (their
// gradients as one operand of the fused q/k/v matmul's backward).
void qkv_merge(Tensor& qkv, const Tensor& q, const Tensor& k, const Tensor& v);
// The backward of qkv_split_rope (without kv_rows): qkv_merge of dq and dk rotated back by positions pos(T)
// (rope_backward) and dv, in one pass on the GPU; dq, dk, dv are left as they are.
void qkv_merge_rope_backward(Tensor& dqkv, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                             const Tensor& pos, float theta);

// Whether cuDNN's fused attention takes q with these sequences: bf16 on a CUDA device with cuDNN's attention
// enabled, host cu_seqlens of equal-length segments covering every row. Returns the segment count and
// length, or {0, 0} (always on builds without CUDA).
std::pair<int64_t, int64_t> cudnn_equal_segments(const Tensor& q, const Tensor& cu_seqlens);

// q(T, H, D), k/v(T, KV, D), cu_seqlens(nseq + 1); out(T, H, D), lse(T, H). Backward adds into dq/dk/dv,
// or overwrites them with accumulate = false (which lets bf16 CUDA runs with equal-length segments and a
// host cu_seqlens use cuDNN's fused attention, cuda/cudnn_attention.h; the forward uses it likewise).
void attention_forward(Tensor& out, Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& cu_seqlens, float scale);
void attention_backward(Tensor& dq, Tensor& dk, Tensor& dv, const Tensor& dout, const Tensor& q,
                        const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& cu_seqlens, float scale, bool accumulate = true);
// The causal backward above (accumulate = false) into the fused q/k/v gradient dqkv(T, (H + 2 KV) D), rows
// [dq | dk | dv] (= attention_backward, then qkv_merge): on the GPU's cuDNN path written there directly.
void attention_backward_qkv(Tensor& dqkv, const Tensor& dout, const Tensor& q, const Tensor& k,
                            const Tensor& v, const Tensor& out, const Tensor& lse, const Tensor& cu_seqlens,
                            float scale);
// General form (context parallelism, contract in cpu_ops.h): queries q(Tq, H, D) against keys
// k/v(Tk, KV, D) of the same sequences, cu_q/cu_k (nseq + 1), visible iff pos_k <= pos_q.
void attention_forward(Tensor& out, Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& cu_q, const Tensor& cu_k, const Tensor& pos_q, const Tensor& pos_k,
                       float scale);
// The general form with one query row per segment (a decode step over a KV cache): q (nseq, H, D), query
// row s belongs to segment s (cu_q = 0, 1, ..., nseq). CPU: the general kernel; CUDA: a decode kernel that
// reads each cached K/V row once for all query heads of its group (flash kernel where it does not apply).
void attention_decode(Tensor& out, Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                      const Tensor& cu_k, const Tensor& pos_q, const Tensor& pos_k, float scale);
// After a decode step of n sequences (every tensor I32 on one device; n elements except pos_k), in place:
// tokens = sampled, positions += 1, rows += 1, pos_q += 1, then pos_k[rows[s]] = pos_q[s]. That is the
// next decode step's input and the KV cache metadata KvCache::begin would build for it, made where they
// live (on a GPU without the host, so the next step can be launched before this one's tokens come back).
void decode_advance(Tensor& tokens, Tensor& positions, const Tensor& sampled, Tensor& rows, Tensor& pos_q,
                    Tensor& pos_k);
void attention_backward(Tensor& dq, Tensor& dk, Tensor& dv, const Tensor& dout, const Tensor& q,
                        const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& cu_q, const Tensor& cu_k, const Tensor& pos_q, const Tensor& pos_k,
                        float scale);

// (out, lse) <- log-sum-exp merge with a partial result (o, l) over a disjoint key set (ring CP);
// out/o (T, H, D) in the activation dtype, lse/l (T, H) f32.
void attention_merge(Tensor& out, Tensor& lse, const Tensor& o, const Tensor& l);

// Row permutations (dim 0): gather_rows returns src[idx[i]] for each i; scatter_add_rows adds src[i]
// into dst[idx[i]].
Tensor gather_rows(const Tensor& src, const std::vector<int64_t>& idx);
// dst[rows[i]] = src[i] along dim 0 (rows: (n) i32, distinct, in range; host or on dst's device).
void scatter_rows(Tensor& dst, const Tensor& rows, const Tensor& src);
void scatter_add_rows(Tensor& dst, const Tensor& src, const std::vector<int64_t>& idx);

void gelu_forward(Tensor& out, const Tensor& inp);
void gelu_backward(Tensor& dinp, const Tensor& dout, const Tensor& inp, bool accumulate = true);
// GPT-2's MLP around its GELU, fused into the matmuls on CUDA bf16 (cuBLASLt epilogues); elsewhere, and
// where the fusion does not apply (see cuda::linear_gelu_forward), exactly the composite in the comments.
// pre(T, OC) = inp(T, IC) @ weight(OC, IC)^T (+ bias), act = gelu(pre)   [linear_forward; gelu_forward]
void linear_gelu_forward(Tensor& act, Tensor& pre, const Tensor& inp, const Tensor& weight,
                         const Tensor* bias);
// The backward of out = act @ weight^T with act = gelu(pre): dpre(T, IC) = gelu'(pre) * (dout(T, OC) @
// weight(OC, IC)), overwritten; dweight(OC, IC) += dout^T @ act (skipped when undefined); no bias gradient
// (bias_backward).
// [linear_backward(&d, dweight, nullptr, dout, act, weight, false); gelu_backward(dpre, d, pre, false)]
void linear_dgelu_backward(Tensor& dpre, Tensor& dweight, const Tensor& dout, const Tensor& act,
                           const Tensor& weight, const Tensor& pre);
void swiglu_forward(Tensor& out, const Tensor& gate, const Tensor& up);
// out(T, F) = silu(gate) * up from a fused projection h13(T, 2F), rows [gate | up].
void swiglu_forward_fused(Tensor& out, const Tensor& h13);
void swiglu_backward(Tensor& dgate, Tensor& dup, const Tensor& dout, const Tensor& gate, const Tensor& up,
                     bool accumulate = true);

// y += x (same numel).
void add_(Tensor& y, const Tensor& x);

}  // namespace ndt::ops

namespace ndt::ops {
// dbias(C) += column sums of dy(T, C).
void bias_backward(Tensor& dbias, const Tensor& dy);
// Copy of rows [first, first + count) of a (T, ...) tensor.
Tensor slice_rows(const Tensor& t, int64_t first, int64_t count);
}  // namespace ndt::ops

namespace ndt::ops {
// ---- loss pieces: vocab-parallel softmax cross-entropy (the math is in cpu_ops.h) ----
// logits (T, V) in the activation dtype; rowmax, sumexp, target_logit, logprob, dloss (T) f32.
void xent_rowmax(Tensor& rowmax, const Tensor& logits);
void xent_sumexp(Tensor& sumexp, const Tensor& logits, const Tensor& rowmax);
// xent_rowmax then xent_sumexp (one pass over the logits on the device; one rank: nothing to reduce between).
void xent_rowmax_sumexp(Tensor& rowmax, Tensor& sumexp, const Tensor& logits);
void xent_target_logit(Tensor& target_logit, const Tensor& logits, const Tensor& targets,
                       int64_t vocab_start);
void xent_logprob(Tensor& logprob, const Tensor& target_logit, const Tensor& rowmax, const Tensor& sumexp);
// dlogits += dloss * (softmax - onehot(target)).
void xent_backward(Tensor& dlogits, const Tensor& logits, const Tensor& rowmax, const Tensor& sumexp,
                   const Tensor& targets, const Tensor& dloss, int64_t vocab_start);
// The same values written over the logits (when the logits die with the backward: saves a (T, V) buffer).
void xent_backward_inplace(Tensor& logits, const Tensor& rowmax, const Tensor& sumexp, const Tensor& targets,
                           const Tensor& dloss, int64_t vocab_start);
// One rank holding the whole vocabulary: logprob = log softmax(logits)[target] and the logits overwritten
// with their gradient, as xent_rowmax_sumexp, xent_target_logit, xent_logprob and xent_backward_inplace would
// (the same values); one kernel on the device. The loss taken in the backward of a training step.
void xent_loss_backward_inplace(Tensor& logits, Tensor& logprob, const Tensor& targets, const Tensor& dloss);
// -sum over rows with mask != 0 of logprob * mask, accumulated in double (waits for the device).
double masked_loss_sum(const Tensor& logprob, const Tensor& mask);
// acc (F64, one element, on logprob's device) += masked_loss_sum(logprob, mask), without waiting.
void masked_loss_sum_into(Tensor& acc, const Tensor& logprob, const Tensor& mask);
// dloss(T) = scale * mask (dloss on any device, mask f32).
void fill_dloss(Tensor& dloss, const Tensor& mask, float scale);
// The same with the scale a one-element f32 tensor on dloss's device, read when the op runs (a replayed
// CUDA graph reads the value of its step).
void fill_dloss(Tensor& dloss, const Tensor& mask, const Tensor& scale);

// ---- elementwise / conversion ----
// a + (b + bias) as a new tensor (like a); bias (optional) has the size of a row and is added to every row.
// One pass on the GPU: the residual add of a block output whose bias waits for the TP reduction.
Tensor add(const Tensor& a, const Tensor& b, const Tensor* bias = nullptr);
// dst = src converted between f32 and bf16 (round to nearest even), same numel and device.
void cast_into(Tensor& dst, const Tensor& src);
// A CPU f32 copy of t (t itself when it is one already): host-side reads of device results.
Tensor to_host_f32(const Tensor& t);
}  // namespace ndt::ops

namespace ndt::ops {
// ---- Mixture-of-Experts row movement (model/moe.h). Index/gate tensors may live on the host. ----
// out(R, C): out[i] = x[src[i]] * (scale ? scale[i] : 1); src (R) i32, scale (R) f32.
void moe_permute(Tensor& out, const Tensor& x, const Tensor& src, const Tensor* scale);
// out(N, C) = (out +) sum over j = 0..k-1 with pos[t*k + j] >= 0 of (gates ? gates[t*k + j] : 1) *
// y[pos[t*k + j]], added in slot order; pos (N*k) i32, gates (N*k) f32. accumulate = false overwrites out.
void moe_unpermute(Tensor& out, const Tensor& y, const Tensor& pos, const Tensor* gates, int64_t k,
                   bool accumulate);
// dgates(N*k) f32 = dot(dout[t], y[pos[t*k + j]]) (0 where pos < 0), on dout's device.
void moe_gate_grad(Tensor& dgates, const Tensor& dout, const Tensor& y, const Tensor& pos, int64_t k);
}  // namespace ndt::ops
