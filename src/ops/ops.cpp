#include "ops/ops.h"

#include <algorithm>
#include <cstring>

#include "ops/cpu_ops.h"

namespace ndt::ops {
namespace {

// Every op runs where its first tensor lives; mixing devices is a caller bug.
void require_cpu(const Tensor& t, const char* op) {
  NDT_CHECK(t.device() == Device::CPU, "{}: no CUDA kernel in this build (tensor on {})", op,
            device_name(t.device()));
}
void require_shape(const Tensor& t, const Shape& s, const char* what) {
  NDT_CHECK(t.shape() == s, "{}: expected shape {}, got {}", what, shape_str(s), shape_str(t.shape()));
}
int64_t rows(const Tensor& t) { return t.numel() / t.size(-1); }

}  // namespace

void embedding_forward(Tensor& out, const Tensor& ids, const Tensor& table, int64_t vocab_start) {
  require_cpu(table, "embedding_forward");
  int64_t T = ids.numel(), V = table.size(0), C = table.size(1);
  require_shape(out, {T, C}, "embedding_forward out");
  cpu::embedding_forward(out.f32(), ids.i32(), table.f32(), T, V, C, vocab_start);
}

void embedding_backward(Tensor& dtable, const Tensor& dout, const Tensor& ids, int64_t vocab_start) {
  require_cpu(dtable, "embedding_backward");
  int64_t T = ids.numel(), V = dtable.size(0), C = dtable.size(1);
  require_shape(dout, {T, C}, "embedding_backward dout");
  cpu::embedding_backward(dtable.f32(), dout.f32(), ids.i32(), T, V, C, vocab_start);
}

void add_position_embedding_forward(Tensor& x, const Tensor& pos, const Tensor& table) {
  require_cpu(x, "add_position_embedding_forward");
  int64_t T = pos.numel(), P = table.size(0), C = table.size(1);
  require_shape(x, {T, C}, "add_position_embedding x");
  cpu::add_position_embedding_forward(x.f32(), pos.i32(), table.f32(), T, P, C);
}

void add_position_embedding_backward(Tensor& dtable, const Tensor& dx, const Tensor& pos) {
  require_cpu(dx, "add_position_embedding_backward");
  int64_t T = pos.numel(), P = dtable.size(0), C = dtable.size(1);
  cpu::add_position_embedding_backward(dtable.f32(), dx.f32(), pos.i32(), T, P, C);
}

void linear_forward(Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor* bias) {
  require_cpu(inp, "linear_forward");
  int64_t OC = weight.size(0), IC = weight.size(1), T = rows(inp);
  NDT_CHECK(inp.size(-1) == IC, "linear_forward: input has {} features, weight expects {}", inp.size(-1), IC);
  NDT_CHECK(out.numel() == T * OC, "linear_forward: out has {} elements, expected {}", out.numel(), T * OC);
  cpu::linear_forward(out.f32(), inp.f32(), weight.f32(), bias ? bias->f32() : nullptr, T, IC, OC);
}

void linear_backward(Tensor* dinp, Tensor& dweight, Tensor* dbias, const Tensor& dout, const Tensor& inp,
                     const Tensor& weight) {
  require_cpu(inp, "linear_backward");
  int64_t OC = weight.size(0), IC = weight.size(1), T = rows(inp);
  NDT_CHECK(dout.numel() == T * OC, "linear_backward: dout has {} elements, expected {}", dout.numel(),
            T * OC);
  cpu::linear_backward(dinp ? dinp->f32() : nullptr, dweight.f32(), dbias ? dbias->f32() : nullptr,
                       dout.f32(), inp.f32(), weight.f32(), T, IC, OC);
}

void layernorm_forward(Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& inp, const Tensor& weight,
                       const Tensor& bias, float eps) {
  require_cpu(inp, "layernorm_forward");
  cpu::layernorm_forward(out.f32(), mean.f32(), rstd.f32(), inp.f32(), weight.f32(), bias.f32(), rows(inp),
                         inp.size(-1), eps);
}

void layernorm_backward(Tensor& dinp, Tensor& dweight, Tensor& dbias, const Tensor& dout, const Tensor& inp,
                        const Tensor& weight, const Tensor& mean, const Tensor& rstd) {
  require_cpu(inp, "layernorm_backward");
  cpu::layernorm_backward(dinp.f32(), dweight.f32(), dbias.f32(), dout.f32(), inp.f32(), weight.f32(),
                          mean.f32(), rstd.f32(), rows(inp), inp.size(-1));
}

void rmsnorm_forward(Tensor& out, Tensor& rstd, const Tensor& inp, const Tensor& weight, float eps) {
  require_cpu(inp, "rmsnorm_forward");
  cpu::rmsnorm_forward(out.f32(), rstd.f32(), inp.f32(), weight.f32(), rows(inp), inp.size(-1), eps);
}

void rmsnorm_backward(Tensor& dinp, Tensor& dweight, const Tensor& dout, const Tensor& inp,
                      const Tensor& weight, const Tensor& rstd) {
  require_cpu(inp, "rmsnorm_backward");
  cpu::rmsnorm_backward(dinp.f32(), dweight.f32(), dout.f32(), inp.f32(), weight.f32(), rstd.f32(), rows(inp),
                        inp.size(-1));
}

void rope_forward(Tensor& x, const Tensor& pos, float theta) {
  require_cpu(x, "rope_forward");
  cpu::rope_forward(x.f32(), x.f32(), pos.i32(), x.size(0), x.size(1), x.size(2), theta);
}

void rope_backward(Tensor& dx, const Tensor& pos, float theta) {
  require_cpu(dx, "rope_backward");
  // Backward is the inverse rotation; it writes (not accumulates) when input and output alias, so
  // rotate a copy into a zeroed buffer and store it back.
  Tensor tmp = Tensor::zeros(dx.shape());
  cpu::rope_backward(tmp.f32(), dx.f32(), pos.i32(), dx.size(0), dx.size(1), dx.size(2), theta);
  dx.copy_from(tmp);
}

void attention_forward(Tensor& out, Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& cu_seqlens, float scale) {
  require_cpu(q, "attention_forward");
  int64_t T = q.size(0), H = q.size(1), D = q.size(2), KV = k.size(1);
  NDT_CHECK(H % KV == 0, "attention: {} query heads not divisible by {} kv heads", H, KV);
  cpu::attention_forward(out.f32(), lse.f32(), q.f32(), k.f32(), v.f32(), cu_seqlens.i32(),
                         cu_seqlens.numel() - 1, T, H, KV, D, scale);
}

void attention_backward(Tensor& dq, Tensor& dk, Tensor& dv, const Tensor& dout, const Tensor& q,
                        const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& cu_seqlens, float scale) {
  require_cpu(q, "attention_backward");
  int64_t T = q.size(0), H = q.size(1), D = q.size(2), KV = k.size(1);
  cpu::attention_backward(dq.f32(), dk.f32(), dv.f32(), dout.f32(), q.f32(), k.f32(), v.f32(), out.f32(),
                          lse.f32(), cu_seqlens.i32(), cu_seqlens.numel() - 1, T, H, KV, D, scale);
}

void attention_forward(Tensor& out, Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& cu_q, const Tensor& cu_k, const Tensor& pos_q, const Tensor& pos_k,
                       float scale) {
  require_cpu(q, "attention_forward");
  NDT_CHECK(cu_q.numel() == cu_k.numel() && pos_q.numel() == q.size(0) && pos_k.numel() == k.size(0),
            "attention: query/key metadata do not match ({} / {} segments, {} / {} positions)", cu_q.numel(),
            cu_k.numel(), pos_q.numel(), pos_k.numel());
  cpu::attention_forward(out.f32(), lse.f32(), q.f32(), k.f32(), v.f32(), cu_q.i32(), cu_k.i32(), pos_q.i32(),
                         pos_k.i32(), cu_q.numel() - 1, q.size(0), k.size(0), q.size(1), k.size(1), q.size(2),
                         scale);
}

void attention_backward(Tensor& dq, Tensor& dk, Tensor& dv, const Tensor& dout, const Tensor& q,
                        const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse, const Tensor& cu_q,
                        const Tensor& cu_k, const Tensor& pos_q, const Tensor& pos_k, float scale) {
  require_cpu(q, "attention_backward");
  cpu::attention_backward(dq.f32(), dk.f32(), dv.f32(), dout.f32(), q.f32(), k.f32(), v.f32(), out.f32(),
                          lse.f32(), cu_q.i32(), cu_k.i32(), pos_q.i32(), pos_k.i32(), cu_q.numel() - 1,
                          q.size(0), k.size(0), q.size(1), k.size(1), q.size(2), scale);
}

Tensor gather_rows(const Tensor& src, const std::vector<int64_t>& idx) {
  require_cpu(src, "gather_rows");
  Shape shape = src.shape();
  const int64_t row = src.numel() / std::max<int64_t>(1, shape[0]), bytes = row * dtype_size(src.dtype());
  shape[0] = static_cast<int64_t>(idx.size());
  Tensor out = Tensor::empty(shape, src.dtype());
  const char* s = static_cast<const char*>(src.data_ptr());
  char* d = static_cast<char*>(out.data_ptr());
  for (size_t i = 0; i < idx.size(); ++i) {
    NDT_CHECK(idx[i] >= 0 && idx[i] < src.size(0), "gather_rows: index {} outside {} rows", idx[i], src.size(0));
    std::memcpy(d + static_cast<int64_t>(i) * bytes, s + idx[i] * bytes, static_cast<size_t>(bytes));
  }
  return out;
}

void scatter_add_rows(Tensor& dst, const Tensor& src, const std::vector<int64_t>& idx) {
  require_cpu(src, "scatter_add_rows");
  NDT_CHECK(src.dtype() == DType::F32 && dst.dtype() == DType::F32 && src.size(0) == static_cast<int64_t>(idx.size()),
            "scatter_add_rows: f32 tensors with one index per source row");
  const int64_t row = src.numel() / std::max<int64_t>(1, src.size(0));
  for (size_t i = 0; i < idx.size(); ++i) {
    NDT_CHECK(idx[i] >= 0 && idx[i] < dst.size(0), "scatter_add_rows: index {} outside {} rows", idx[i],
              dst.size(0));
    cpu::add_inplace(dst.f32() + idx[i] * row, src.f32() + static_cast<int64_t>(i) * row, row);
  }
}

void gelu_forward(Tensor& out, const Tensor& inp) {
  require_cpu(inp, "gelu_forward");
  cpu::gelu_forward(out.f32(), inp.f32(), inp.numel());
}

void gelu_backward(Tensor& dinp, const Tensor& dout, const Tensor& inp) {
  require_cpu(inp, "gelu_backward");
  cpu::gelu_backward(dinp.f32(), dout.f32(), inp.f32(), inp.numel());
}

void swiglu_forward(Tensor& out, const Tensor& gate, const Tensor& up) {
  require_cpu(gate, "swiglu_forward");
  cpu::swiglu_forward(out.f32(), gate.f32(), up.f32(), gate.numel());
}

void swiglu_backward(Tensor& dgate, Tensor& dup, const Tensor& dout, const Tensor& gate, const Tensor& up) {
  require_cpu(gate, "swiglu_backward");
  cpu::swiglu_backward(dgate.f32(), dup.f32(), dout.f32(), gate.f32(), up.f32(), gate.numel());
}

void add_(Tensor& y, const Tensor& x) {
  require_cpu(y, "add_");
  NDT_CHECK(y.numel() == x.numel(), "add_: {} vs {}", shape_str(y.shape()), shape_str(x.shape()));
  cpu::add_inplace(y.f32(), x.f32(), y.numel());
}

}  // namespace ndt::ops

namespace ndt::ops {

void add_bias(Tensor& x, const Tensor& bias) {
  require_cpu(x, "add_bias");
  const int64_t C = bias.numel(), T = x.numel() / C;
  float* px = x.f32();
  const float* pb = bias.f32();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < C; ++c) px[t * C + c] += pb[c];
}

void bias_backward(Tensor& dbias, const Tensor& dy) {
  require_cpu(dy, "bias_backward");
  const int64_t C = dbias.numel(), T = dy.numel() / C;
  float* pd = dbias.f32();
  const float* py = dy.f32();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < C; ++c) pd[c] += py[t * C + c];
}

Tensor slice_rows(const Tensor& t, int64_t first, int64_t count) {
  NDT_CHECK(first >= 0 && first + count <= t.size(0), "slice_rows [{}, {}) out of {}", first, first + count,
            t.size(0));
  Shape s = t.shape();
  s[0] = count;
  Tensor out = Tensor::empty(s, t.dtype(), t.device());
  const size_t row_bytes = t.nbytes() / static_cast<size_t>(t.size(0));
  std::memcpy(out.data_ptr(), static_cast<const uint8_t*>(t.data_ptr()) + first * row_bytes,
              count * row_bytes);
  return out;
}

}  // namespace ndt::ops
