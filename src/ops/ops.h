#pragma once
// Tensor-level ops: check shapes/dtypes, then dispatch on the tensor's device to the CPU reference
// kernels (ops/cpu_ops.h) or, in a CUDA build, to their GPU twins. Callers (model, trainer) only use
// this header, so adding a backend changes no caller. Backward ops ACCUMULATE into gradients (+=),
// as in cpu_ops.h.
#include <cstdint>

#include <vector>

#include "core/tensor.h"

namespace ndt::ops {

// out(T, C) = table rows of ids (zero rows for ids outside [vocab_start, vocab_start + V)).
void embedding_forward(Tensor& out, const Tensor& ids, const Tensor& table, int64_t vocab_start);
void embedding_backward(Tensor& dtable, const Tensor& dout, const Tensor& ids, int64_t vocab_start);
void add_position_embedding_forward(Tensor& x, const Tensor& pos, const Tensor& table);
void add_position_embedding_backward(Tensor& dtable, const Tensor& dx, const Tensor& pos);

// out(T, OC) = inp(T, IC) @ weight(OC, IC)^T (+ bias(OC) when defined).
void linear_forward(Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor* bias);
void linear_backward(Tensor* dinp, Tensor& dweight, Tensor* dbias, const Tensor& dout, const Tensor& inp,
                     const Tensor& weight);

void layernorm_forward(Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& inp, const Tensor& weight,
                       const Tensor& bias, float eps);
void layernorm_backward(Tensor& dinp, Tensor& dweight, Tensor& dbias, const Tensor& dout, const Tensor& inp,
                        const Tensor& weight, const Tensor& mean, const Tensor& rstd);
void rmsnorm_forward(Tensor& out, Tensor& rstd, const Tensor& inp, const Tensor& weight, float eps);
void rmsnorm_backward(Tensor& dinp, Tensor& dweight, const Tensor& dout, const Tensor& inp,
                      const Tensor& weight, const Tensor& rstd);

// x(T, H, D) rotated in place by positions pos(T).
void rope_forward(Tensor& x, const Tensor& pos, float theta);
void rope_backward(Tensor& dx, const Tensor& pos, float theta);

// q(T, H, D), k/v(T, KV, D), cu_seqlens(nseq + 1); out(T, H, D), lse(T, H).
void attention_forward(Tensor& out, Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& cu_seqlens, float scale);
void attention_backward(Tensor& dq, Tensor& dk, Tensor& dv, const Tensor& dout, const Tensor& q,
                        const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& cu_seqlens, float scale);
// General form (context parallelism, contract in cpu_ops.h): queries q(Tq, H, D) against keys
// k/v(Tk, KV, D) of the same sequences, cu_q/cu_k (nseq + 1), visible iff pos_k <= pos_q.
void attention_forward(Tensor& out, Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& cu_q, const Tensor& cu_k, const Tensor& pos_q, const Tensor& pos_k,
                       float scale);
void attention_backward(Tensor& dq, Tensor& dk, Tensor& dv, const Tensor& dout, const Tensor& q,
                        const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse, const Tensor& cu_q,
                        const Tensor& cu_k, const Tensor& pos_q, const Tensor& pos_k, float scale);

// Row permutations (dim 0): gather_rows returns src[idx[i]] for each i; scatter_add_rows adds src[i]
// into dst[idx[i]].
Tensor gather_rows(const Tensor& src, const std::vector<int64_t>& idx);
void scatter_add_rows(Tensor& dst, const Tensor& src, const std::vector<int64_t>& idx);

void gelu_forward(Tensor& out, const Tensor& inp);
void gelu_backward(Tensor& dinp, const Tensor& dout, const Tensor& inp);
void swiglu_forward(Tensor& out, const Tensor& gate, const Tensor& up);
void swiglu_backward(Tensor& dgate, Tensor& dup, const Tensor& dout, const Tensor& gate, const Tensor& up);

// y += x (same numel).
void add_(Tensor& y, const Tensor& x);

}  // namespace ndt::ops

namespace ndt::ops {
// x(T, C) += bias(C) broadcast over rows; dbias(C) += column sums of dy(T, C).
void add_bias(Tensor& x, const Tensor& bias);
void bias_backward(Tensor& dbias, const Tensor& dy);
// Copy of rows [first, first + count) of a (T, ...) tensor.
Tensor slice_rows(const Tensor& t, int64_t first, int64_t count);
}  // namespace ndt::ops
