#pragma once
// CPU reference kernels (fp32, OpenMP-threaded, sgemm through OpenBLAS). One function per op, forward
// and backward, on raw contiguous row-major buffers; the CUDA backend provides twins with the same
// signatures in namespace ndt::cuda.
//
// Letters: T tokens (all sequences of a microbatch laid end to end, THD layout), C channels,
// H query heads, KV key/value heads, D head dim, V vocab (the local shard under TP), OC/IC out/in features.
//
// Gradient convention: every backward ACCUMULATES (+=) into all of its d-outputs (input and parameter
// gradients alike); callers zero them when they need a fresh value. A null d-pointer means "not needed".
#include <cstdint>

namespace ndt::cpu {

// ---- embedding (vocab-parallel ready) ----
// out(T, C)[t] = table(V, C)[ids[t] - vocab_start] when vocab_start <= ids[t] < vocab_start + V, else 0.
void embedding_forward(float* out, const int32_t* ids, const float* table, int64_t T, int64_t V, int64_t C,
                       int64_t vocab_start);
void embedding_backward(float* dtable, const float* dout, const int32_t* ids, int64_t T, int64_t V, int64_t C,
                        int64_t vocab_start);
// Learned absolute positions: out(T, C) += pos_table(P, C)[pos[t]] (pos[t] < P is checked).
void add_position_embedding_forward(float* out, const int32_t* pos, const float* pos_table, int64_t T,
                                    int64_t P, int64_t C);
void add_position_embedding_backward(float* dpos_table, const float* dout, const int32_t* pos, int64_t T,
                                     int64_t P, int64_t C);

// ---- linear: out(T, OC) = inp(T, IC) @ weight(OC, IC)^T + bias(OC) (bias may be null) ----
void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t T,
                    int64_t IC, int64_t OC);
void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int64_t T, int64_t IC, int64_t OC);

// ---- norms over the last dim; mean/rstd saved per row (T) ----
void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int64_t T, int64_t C, float eps);
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int64_t T, int64_t C);
void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t T, int64_t C,
                     float eps);
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                      const float* rstd, int64_t T, int64_t C);

// ---- rotary embedding on (T, H, D), rotating pairs (i, i + D/2) (Llama/HF "rotate_half" layout) ----
// angle = pos[t] * theta^(-2i/D). inp == out is allowed.
void rope_forward(float* out, const float* inp, const int32_t* pos, int64_t T, int64_t H, int64_t D,
                  float theta);
void rope_backward(float* dinp, const float* dout, const int32_t* pos, int64_t T, int64_t H, int64_t D,
                   float theta);

// ---- causal self-attention on packed sequences (grouped-query) ----
// q(T, H, D), k/v(T, KV, D), H % KV == 0 (query head h uses kv head h / (H/KV)).
// cu_seqlens(nseq+1): sequence s is tokens [cu_seqlens[s], cu_seqlens[s+1]); attention never crosses
// a sequence boundary and is causal within a sequence. out(T, H, D); lse(T, H) = log-sum-exp of the
// scaled scores of each query row, saved for backward (which recomputes probabilities from it).
void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                       const int32_t* cu_seqlens, int64_t nseq, int64_t T, int64_t H, int64_t KV, int64_t D,
                       float scale);
void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                        const float* v, const float* out, const float* lse, const int32_t* cu_seqlens,
                        int64_t nseq, int64_t T, int64_t H, int64_t KV, int64_t D, float scale);

// General form, for context parallelism: queries and keys come from different row sets. Sequence s
// has query rows [cu_q[s], cu_q[s+1]) of q(Tq, H, D) and key rows [cu_k[s], cu_k[s+1]) of k/v(Tk, KV, D);
// query i may attend key j iff pos_k[j] <= pos_q[i] (global positions in the sequence). Rows with no
// allowed key get out 0 and lse -inf (so partial results merge by log-sum-exp); query rows past
// cu_q[nseq] get out 0 and lse 0. Backward recomputes P = exp(S - lse) from the lse and out it is given
// (for ring attention: the final merged ones) and accumulates (+=) into dq, dk, dv.
void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                       const int32_t* cu_q, const int32_t* cu_k, const int32_t* pos_q, const int32_t* pos_k,
                       int64_t nseq, int64_t Tq, int64_t Tk, int64_t H, int64_t KV, int64_t D, float scale);
void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                        const float* v, const float* out, const float* lse, const int32_t* cu_q,
                        const int32_t* cu_k, const int32_t* pos_q, const int32_t* pos_k, int64_t nseq,
                        int64_t Tq, int64_t Tk, int64_t H, int64_t KV, int64_t D, float scale);
// (out, lse) <- log-sum-exp merge of (out, lse) and a partial result (o, l) of the same queries over a
// disjoint key set; `rows` lse entries,
// each for D consecutive out elements (one head of one token). A side with lse -inf saw no key and
// contributes nothing.
void attention_merge(float* out, float* lse, const float* o, const float* l, int64_t rows, int64_t D);

// ---- activations (elementwise over N) ----
// GELU, tanh approximation (GPT-2).
void gelu_forward(float* out, const float* inp, int64_t N);
void gelu_backward(float* dinp, const float* dout, const float* inp, int64_t N);
// SwiGLU: out = silu(gate) * up.
void swiglu_forward(float* out, const float* gate, const float* up, int64_t N);
void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate, const float* up,
                     int64_t N);

// ---- softmax cross-entropy, in vocab-parallel pieces ----
// logits(T, V) hold vocab columns [vocab_start, vocab_start + V) of the full vocabulary. Under TP the
// caller reduces rowmax (max), sumexp (sum) and target logit (sum) over the TP group between steps;
// with one rank the three steps compose into the plain loss.
void xent_rowmax(float* rowmax, const float* logits, int64_t T, int64_t V);
void xent_sumexp(float* sumexp, const float* logits, const float* rowmax, int64_t T, int64_t V);
// target_logit[t] = logits[t][targets[t] - vocab_start] if in this shard, else 0.
void xent_target_logit(float* target_logit, const float* logits, const int32_t* targets, int64_t T, int64_t V,
                       int64_t vocab_start);
// logprob[t] = target_logit[t] - rowmax[t] - log(sumexp[t]); loss is -logprob.
void xent_logprob(float* logprob, const float* target_logit, const float* rowmax, const float* sumexp,
                  int64_t T);
// dlogits[t][j] += dloss[t] * (softmax[t][j] - [j == target[t]]); dloss[t] = 0 skips the row
// (ignore mask and loss scaling are folded into dloss by the caller).
void xent_backward(float* dlogits, const float* logits, const float* rowmax, const float* sumexp,
                   const int32_t* targets, const float* dloss, int64_t T, int64_t V, int64_t vocab_start);
// Convenience for one rank: per-token losses[t] = -log softmax(logits[t])[targets[t]]; rows with
// mask[t] == 0 get loss 0 (mask may be null). Returns the sum of the losses (double accumulation).
double cross_entropy_forward(float* losses, const float* logits, const int32_t* targets, const float* mask,
                             int64_t T, int64_t V);

// ---- optimizer helpers ----
// AdamW (decoupled weight decay, PyTorch semantics), step counts from 1.
void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, float lr, float beta1,
                  float beta2, float eps, float weight_decay, int64_t step);
// Sum of squares in double (for the global gradient norm).
double sum_squares(const float* x, int64_t n);
void scale_inplace(float* x, float s, int64_t n);
// y += x
void add_inplace(float* y, const float* x, int64_t n);

// MoE row movement (contracts in ops.h).
void moe_permute(float* out, const float* x, const int32_t* src, const float* scale, int64_t R, int64_t C);
void moe_unpermute(float* out, const float* y, const int32_t* pos, const float* gates, int64_t N, int64_t k,
                   int64_t C, bool accumulate);
void moe_gate_grad(float* dgates, const float* dout, const float* y, const int32_t* pos, int64_t N, int64_t k,
                   int64_t C);

}  // namespace ndt::cpu
