#include "ops/ops.h"

#include <algorithm>
#include <cstring>

#include "core/bf16.h"
#include "ops/cpu_ops.h"

#ifdef NDT_HAVE_CUDA
#include <cuda_bf16.h>

#include <type_traits>

#include "cuda/cuda_ops.h"
#include "cuda/cudnn_attention.h"
#include "cuda/flash_attention.h"
#include "cuda/runtime.h"
#include "cuda/train_kernels.h"
#endif

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
bool on_cuda(const Tensor& t) { return t.device() == Device::CUDA; }

#ifdef NDT_HAVE_CUDA
using bf16 = __nv_bfloat16;
template <typename E>
constexpr DType dtype_for() {
  return std::is_same_v<E, float> ? DType::F32 : DType::BF16;
}
// Device pointer of t as E (checks device and dtype).
template <typename E>
E* dp(Tensor& t, const char* what) {
  NDT_CHECK(t.device() == Device::CUDA && t.dtype() == dtype_for<E>(),
            "{}: expected a cuda {} tensor, got {} {}", what, dtype_name(dtype_for<E>()),
            device_name(t.device()), dtype_name(t.dtype()));
  return static_cast<E*>(t.data_ptr());
}
template <typename E>
const E* dp(const Tensor& t, const char* what) {
  return dp<E>(const_cast<Tensor&>(t), what);
}
template <typename E>
E* dp_opt(Tensor* t, const char* what) {
  return t ? dp<E>(*t, what) : nullptr;
}
template <typename E>
const E* dp_opt(const Tensor* t, const char* what) {
  return t ? dp<E>(*t, what) : nullptr;
}
// Metadata (i32 ids/positions/cu_seqlens, f32 masks) on the device: itself, or an upload kept in `keep`
// (freed stream-ordered after the launches that use it).
template <typename T>
const T* dev_meta(const Tensor& t, Tensor& keep) {
  if (t.device() == Device::CUDA) return t.data<T>();
  keep = t.to(Device::CUDA);
  return keep.data<T>();
}
template <typename E>
struct Tag {
  using type = E;
};
// Calls f(Tag<E>) with E the activation type of t (float or bf16).
template <typename F>
void by_dtype(const Tensor& t, F&& f) {
  if (t.dtype() == DType::F32)
    f(Tag<float>{});
  else if (t.dtype() == DType::BF16)
    f(Tag<bf16>{});
  else
    NDT_FAIL("cuda op on a {} tensor: activations must be f32 or bf16", dtype_name(t.dtype()));
}
cudaStream_t st() { return cuda::stream(); }
// On a CUDA tensor: run the body with E = its activation type, then return from the calling op.
#define NDT_ON_CUDA(t, ...)                    \
  if (on_cuda(t)) {                            \
    by_dtype((t), [&](auto tag_) {             \
      using E = typename decltype(tag_)::type; \
      __VA_ARGS__;                             \
    });                                        \
    return;                                    \
  }
#else
#define NDT_ON_CUDA(t, ...)
#endif

}  // namespace

void embedding_forward(Tensor& out, const Tensor& ids, const Tensor& table, int64_t vocab_start) {
  int64_t T = ids.numel(), V = table.size(0), C = table.size(1);
  require_shape(out, {T, C}, "embedding_forward out");
  NDT_ON_CUDA(table, Tensor k;
              cuda::embedding_forward<E>(dp<E>(out, "embedding out"), dev_meta<int32_t>(ids, k),
                                         dp<E>(table, "embedding table"), T, V, C, vocab_start, st()));
  require_cpu(table, "embedding_forward");
  cpu::embedding_forward(out.f32(), ids.i32(), table.f32(), T, V, C, vocab_start);
}

void embedding_backward(Tensor& dtable, const Tensor& dout, const Tensor& ids, int64_t vocab_start) {
  int64_t T = ids.numel(), V = dtable.size(0), C = dtable.size(1);
  require_shape(dout, {T, C}, "embedding_backward dout");
  NDT_ON_CUDA(dout, Tensor k;
              cuda::embedding_backward<E>(dp<float>(dtable, "dtable"), dp<E>(dout, "dout"),
                                          dev_meta<int32_t>(ids, k), T, V, C, vocab_start, st()));
  require_cpu(dtable, "embedding_backward");
  cpu::embedding_backward(dtable.f32(), dout.f32(), ids.i32(), T, V, C, vocab_start);
}

void add_position_embedding_forward(Tensor& x, const Tensor& pos, const Tensor& table) {
  int64_t T = pos.numel(), P = table.size(0), C = table.size(1);
  require_shape(x, {T, C}, "add_position_embedding x");
  NDT_ON_CUDA(x, Tensor k; cuda::add_position_embedding_forward<E>(dp<E>(x, "x"), dev_meta<int32_t>(pos, k),
                                                                   dp<E>(table, "pos table"), T, P, C, st()));
  require_cpu(x, "add_position_embedding_forward");
  cpu::add_position_embedding_forward(x.f32(), pos.i32(), table.f32(), T, P, C);
}

void add_position_embedding_backward(Tensor& dtable, const Tensor& dx, const Tensor& pos) {
  int64_t T = pos.numel(), P = dtable.size(0), C = dtable.size(1);
  NDT_ON_CUDA(dx, Tensor k;
              cuda::add_position_embedding_backward<E>(dp<float>(dtable, "dpos table"), dp<E>(dx, "dx"),
                                                       dev_meta<int32_t>(pos, k), T, P, C, st()));
  require_cpu(dx, "add_position_embedding_backward");
  cpu::add_position_embedding_backward(dtable.f32(), dx.f32(), pos.i32(), T, P, C);
}

void linear_forward(Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor* bias,
                    bool accumulate) {
  int64_t OC = weight.size(0), IC = weight.size(1), T = rows(inp);
  NDT_CHECK(inp.size(-1) == IC, "linear_forward: input has {} features, weight expects {}", inp.size(-1), IC);
  NDT_CHECK(out.numel() == T * OC, "linear_forward: out has {} elements, expected {}", out.numel(), T * OC);
  NDT_ON_CUDA(inp, cuda::linear_forward<E>(dp<E>(out, "linear out"), dp<E>(inp, "linear inp"),
                                           dp<E>(weight, "linear weight"), dp_opt<E>(bias, "linear bias"), T,
                                           IC, OC, st(), accumulate));
  require_cpu(inp, "linear_forward");
  if (!accumulate) {
    cpu::linear_forward(out.f32(), inp.f32(), weight.f32(), bias ? bias->f32() : nullptr, T, IC, OC);
    return;
  }
  Tensor prod = Tensor::empty(out.shape());
  cpu::linear_forward(prod.f32(), inp.f32(), weight.f32(), bias ? bias->f32() : nullptr, T, IC, OC);
  for (int64_t i = 0; i < out.numel(); ++i) out.f32()[i] += prod.f32()[i];
}

Tensor linear_residual_forward(const Tensor& inp, const Tensor& weight, const Tensor* bias,
                               const Tensor& residual) {
  const int64_t OC = weight.size(0), IC = weight.size(1), T = rows(inp);
  NDT_CHECK(inp.size(-1) == IC, "linear_residual_forward: input has {} features, weight expects {}",
            inp.size(-1), IC);
  NDT_CHECK(residual.numel() == T * OC, "linear_residual_forward: residual has {} elements, expected {}",
            residual.numel(), T * OC);
#ifdef NDT_HAVE_CUDA
  if (on_cuda(inp)) {
    Tensor out = Tensor::empty(residual.shape(), residual.dtype(), residual.device());
    by_dtype(inp, [&](auto tag_) {
      using E = typename decltype(tag_)::type;
      cuda::linear_forward<E>(dp<E>(out, "linear out"), dp<E>(inp, "linear inp"),
                              dp<E>(weight, "linear weight"), dp_opt<E>(bias, "linear bias"), T, IC, OC, st(),
                              /*accumulate=*/false, dp<E>(residual, "linear residual"));
    });
    return out;
  }
#endif
  Tensor prod = Tensor::empty(residual.shape());
  linear_forward(prod, inp, weight, nullptr);
  return add(residual, prod, bias);
}

void linear_backward(Tensor* dinp, Tensor& dweight, Tensor* dbias, const Tensor& dout, const Tensor& inp,
                     const Tensor& weight, bool accumulate_dinp) {
  int64_t OC = weight.size(0), IC = weight.size(1), T = rows(inp);
  NDT_CHECK(dout.numel() == T * OC, "linear_backward: dout has {} elements, expected {}", dout.numel(),
            T * OC);
  Tensor* wgrad = dweight.defined() ? &dweight : nullptr;
  NDT_ON_CUDA(inp,
              cuda::linear_backward<E>(dp_opt<E>(dinp, "dinp"), dp_opt<float>(wgrad, "dweight"),
                                       dp_opt<float>(dbias, "dbias"), dp<E>(dout, "dout"), dp<E>(inp, "inp"),
                                       dp<E>(weight, "weight"), T, IC, OC, st(), accumulate_dinp));
  require_cpu(inp, "linear_backward");
  if (dinp && !accumulate_dinp) dinp->zero_();
  cpu::linear_backward(dinp ? dinp->f32() : nullptr, wgrad ? wgrad->f32() : nullptr,
                       dbias ? dbias->f32() : nullptr, dout.f32(), inp.f32(), weight.f32(), T, IC, OC);
}

void layernorm_forward(Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& inp, const Tensor& weight,
                       const Tensor& bias, float eps) {
  NDT_ON_CUDA(inp, cuda::layernorm_forward<E>(dp<E>(out, "ln out"), dp<float>(mean, "ln mean"),
                                              dp<float>(rstd, "ln rstd"), dp<E>(inp, "ln inp"),
                                              dp<E>(weight, "ln weight"), dp<E>(bias, "ln bias"), rows(inp),
                                              inp.size(-1), eps, st()));
  require_cpu(inp, "layernorm_forward");
  cpu::layernorm_forward(out.f32(), mean.f32(), rstd.f32(), inp.f32(), weight.f32(), bias.f32(), rows(inp),
                         inp.size(-1), eps);
}

namespace {
// The norm backwards' optional operands: the residual gradient like dinp, one column sum per column.
void check_norm_backward(const char* op, const Tensor& dinp, const Tensor* dres, const Tensor* dinp_colsum,
                         const Tensor& inp) {
  NDT_CHECK(!dres || dres->numel() == dinp.numel(), "{}: residual gradient {} vs {}", op,
            dres ? shape_str(dres->shape()) : "", shape_str(dinp.shape()));
  NDT_CHECK(!dinp_colsum || dinp_colsum->numel() == inp.size(-1), "{}: column sums of {} for rows of {}", op,
            dinp_colsum ? dinp_colsum->numel() : 0, inp.size(-1));
}
}  // namespace

void layernorm_backward(Tensor& dinp, Tensor& dweight, Tensor& dbias, const Tensor& dout, const Tensor& inp,
                        const Tensor& weight, const Tensor& mean, const Tensor& rstd, const Tensor* dres,
                        Tensor* dinp_colsum) {
  check_norm_backward("layernorm_backward", dinp, dres, dinp_colsum, inp);
  NDT_ON_CUDA(inp, cuda::layernorm_backward<E>(
                       dp<E>(dinp, "ln dinp"), dp<float>(dweight, "ln dweight"), dp<float>(dbias, "ln dbias"),
                       dp<E>(dout, "ln dout"), dp<E>(inp, "ln inp"), dp<E>(weight, "ln weight"),
                       dp<float>(mean, "ln mean"), dp<float>(rstd, "ln rstd"), rows(inp), inp.size(-1), st(),
                       dp_opt<E>(dres, "ln dres"), dp_opt<float>(dinp_colsum, "ln dinp colsum")));
  require_cpu(inp, "layernorm_backward");
  if (dres) dinp.copy_from(*dres);
  cpu::layernorm_backward(dinp.f32(), dweight.f32(), dbias.f32(), dout.f32(), inp.f32(), weight.f32(),
                          mean.f32(), rstd.f32(), rows(inp), inp.size(-1));
  if (dinp_colsum) bias_backward(*dinp_colsum, dinp);
}

void rmsnorm_forward(Tensor& out, Tensor& rstd, const Tensor& inp, const Tensor& weight, float eps) {
  NDT_ON_CUDA(
      inp, cuda::rmsnorm_forward<E>(dp<E>(out, "rms out"), dp<float>(rstd, "rms rstd"), dp<E>(inp, "rms inp"),
                                    dp<E>(weight, "rms weight"), rows(inp), inp.size(-1), eps, st()));
  require_cpu(inp, "rmsnorm_forward");
  cpu::rmsnorm_forward(out.f32(), rstd.f32(), inp.f32(), weight.f32(), rows(inp), inp.size(-1), eps);
}

namespace {
// add()'s checks, for the fused add + norm.
void check_residual(const Tensor& a, const Tensor& b, const Tensor* rbias) {
  NDT_CHECK(a.numel() == b.numel() && a.dim() >= 1, "add + norm: {} vs {}", shape_str(a.shape()),
            shape_str(b.shape()));
  NDT_CHECK(!rbias || rbias->numel() == a.size(-1), "add + norm: bias of {} elements for rows of {}",
            rbias ? rbias->numel() : 0, a.size(-1));
}
}  // namespace

void add_layernorm_forward(Tensor& h, Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& a,
                           const Tensor& b, const Tensor* rbias, const Tensor& weight, const Tensor& bias,
                           float eps) {
  check_residual(a, b, rbias);
#ifdef NDT_HAVE_CUDA
  if (on_cuda(a)) {
    h = Tensor::empty(a.shape(), a.dtype(), a.device());
    by_dtype(a, [&](auto tag_) {
      using E = typename decltype(tag_)::type;
      cuda::add_layernorm_forward<E>(
          dp<E>(h, "add+ln h"), dp<E>(out, "add+ln out"), dp<float>(mean, "ln mean"),
          dp<float>(rstd, "ln rstd"), dp<E>(a, "add a"), dp<E>(b, "add b"), dp_opt<E>(rbias, "add bias"),
          dp<E>(weight, "ln weight"), dp<E>(bias, "ln bias"), rows(a), a.size(-1), eps, st());
    });
    return;
  }
#endif
  h = add(a, b, rbias);
  layernorm_forward(out, mean, rstd, h, weight, bias, eps);
}

void add_rmsnorm_forward(Tensor& h, Tensor& out, Tensor& rstd, const Tensor& a, const Tensor& b,
                         const Tensor* rbias, const Tensor& weight, float eps) {
  check_residual(a, b, rbias);
#ifdef NDT_HAVE_CUDA
  if (on_cuda(a)) {
    h = Tensor::empty(a.shape(), a.dtype(), a.device());
    by_dtype(a, [&](auto tag_) {
      using E = typename decltype(tag_)::type;
      cuda::add_rmsnorm_forward<E>(dp<E>(h, "add+rms h"), dp<E>(out, "add+rms out"),
                                   dp<float>(rstd, "rms rstd"), dp<E>(a, "add a"), dp<E>(b, "add b"),
                                   dp_opt<E>(rbias, "add bias"), dp<E>(weight, "rms weight"), rows(a),
                                   a.size(-1), eps, st());
    });
    return;
  }
#endif
  h = add(a, b, rbias);
  rmsnorm_forward(out, rstd, h, weight, eps);
}

void rmsnorm_backward(Tensor& dinp, Tensor& dweight, const Tensor& dout, const Tensor& inp,
                      const Tensor& weight, const Tensor& rstd, const Tensor* dres, Tensor* dinp_colsum) {
  check_norm_backward("rmsnorm_backward", dinp, dres, dinp_colsum, inp);
  NDT_ON_CUDA(inp, cuda::rmsnorm_backward<E>(dp<E>(dinp, "rms dinp"), dp<float>(dweight, "rms dweight"),
                                             dp<E>(dout, "rms dout"), dp<E>(inp, "rms inp"),
                                             dp<E>(weight, "rms weight"), dp<float>(rstd, "rms rstd"),
                                             rows(inp), inp.size(-1), st(), dp_opt<E>(dres, "rms dres"),
                                             dp_opt<float>(dinp_colsum, "rms dinp colsum")));
  require_cpu(inp, "rmsnorm_backward");
  if (dres) dinp.copy_from(*dres);
  cpu::rmsnorm_backward(dinp.f32(), dweight.f32(), dout.f32(), inp.f32(), weight.f32(), rstd.f32(), rows(inp),
                        inp.size(-1));
  if (dinp_colsum) bias_backward(*dinp_colsum, dinp);
}

void rope_forward(Tensor& x, const Tensor& pos, float theta) {
  NDT_ON_CUDA(x, Tensor k;
              cuda::rope_forward<E>(dp<E>(x, "rope x"), dp<E>(x, "rope x"), dev_meta<int32_t>(pos, k),
                                    x.size(0), x.size(1), x.size(2), theta, st()));
  require_cpu(x, "rope_forward");
  cpu::rope_forward(x.f32(), x.f32(), pos.i32(), x.size(0), x.size(1), x.size(2), theta);
}

void qkv_split_rope(Tensor& q, Tensor& k, Tensor& v, const Tensor& qkv, const Tensor& pos, float theta,
                    const Tensor* kv_rows) {
  const int64_t T = q.size(0), H = q.size(1), KV = k.size(1), D = q.size(2);
  require_shape(qkv, {T, (H + 2 * KV) * D}, "qkv_split_rope qkv");
  NDT_CHECK(kv_rows ? kv_rows->numel() == T && kv_rows->dtype() == DType::I32 && k.dim() == 3 &&
                          v.shape() == k.shape()
                    : k.size(0) == T && v.size(0) == T,
            "qkv_split_rope: k {} and v {} for {} tokens{}", shape_str(k.shape()), shape_str(v.shape()), T,
            kv_rows ? " stored by row" : "");
  NDT_ON_CUDA(qkv, Tensor pk; Tensor rk; cuda::qkv_split_rope<E>(
                  dp<E>(q, "q"), dp<E>(k, "k"), dp<E>(v, "v"), dp<E>(qkv, "qkv"), dev_meta<int32_t>(pos, pk),
                  T, H, KV, D, theta, st(), kv_rows ? dev_meta<int32_t>(*kv_rows, rk) : nullptr));
  require_cpu(qkv, "qkv_split_rope");
  if (kv_rows) {  // the host twin: split into fresh rows, then store them
    Tensor kt = Tensor::empty({T, KV, D}), vt = Tensor::empty({T, KV, D});
    qkv_split_rope(q, kt, vt, qkv, pos, theta);
    scatter_rows(k, *kv_rows, kt);
    scatter_rows(v, *kv_rows, vt);
    return;
  }
  const float* x = qkv.f32();
  const int64_t W = (H + 2 * KV) * D;
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(q.f32() + t * H * D, x + t * W, sizeof(float) * H * D);
    std::memcpy(k.f32() + t * KV * D, x + t * W + H * D, sizeof(float) * KV * D);
    std::memcpy(v.f32() + t * KV * D, x + t * W + (H + KV) * D, sizeof(float) * KV * D);
  }
  cpu::rope_forward(q.f32(), q.f32(), pos.i32(), T, H, D, theta);
  cpu::rope_forward(k.f32(), k.f32(), pos.i32(), T, KV, D, theta);
}

void qkv_merge(Tensor& qkv, const Tensor& q, const Tensor& k, const Tensor& v) {
  const int64_t T = q.size(0), wq = q.numel() / std::max<int64_t>(T, 1),
                wk = k.numel() / std::max<int64_t>(T, 1);
  NDT_CHECK(k.numel() == v.numel() && k.size(0) == T && v.size(0) == T, "qkv_merge: k {} and v {} for q {}",
            shape_str(k.shape()), shape_str(v.shape()), shape_str(q.shape()));
  require_shape(qkv, {T, wq + 2 * wk}, "qkv_merge qkv");
  NDT_ON_CUDA(qkv, cuda::concat_cols3<E>(dp<E>(qkv, "qkv"), dp<E>(q, "q"), wq, dp<E>(k, "k"), wk,
                                         dp<E>(v, "v"), wk, T, st()));
  require_cpu(qkv, "qkv_merge");
  float* x = qkv.f32();
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(x + t * (wq + 2 * wk), q.f32() + t * wq, sizeof(float) * wq);
    std::memcpy(x + t * (wq + 2 * wk) + wq, k.f32() + t * wk, sizeof(float) * wk);
    std::memcpy(x + t * (wq + 2 * wk) + wq + wk, v.f32() + t * wk, sizeof(float) * wk);
  }
}

void qkv_merge_rope_backward(Tensor& dqkv, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                             const Tensor& pos, float theta) {
  const int64_t T = dq.size(0), H = dq.size(1), KV = dk.size(1), D = dq.size(2);
  require_shape(dk, {T, KV, D}, "qkv_merge_rope_backward dk");
  require_shape(dv, {T, KV, D}, "qkv_merge_rope_backward dv");
  require_shape(dqkv, {T, (H + 2 * KV) * D}, "qkv_merge_rope_backward dqkv");
  NDT_ON_CUDA(dqkv, Tensor pk; cuda::qkv_merge_rope_backward<E>(
                  dp<E>(dqkv, "dqkv"), dp<E>(dq, "dq"), dp<E>(dk, "dk"), dp<E>(dv, "dv"),
                  dev_meta<int32_t>(pos, pk), T, H, KV, D, theta, st()));
  require_cpu(dqkv, "qkv_merge_rope_backward");
  Tensor rq = Tensor::zeros(dq.shape()), rk = Tensor::zeros(dk.shape());
  cpu::rope_backward(rq.f32(), dq.f32(), pos.i32(), T, H, D, theta);
  cpu::rope_backward(rk.f32(), dk.f32(), pos.i32(), T, KV, D, theta);
  qkv_merge(dqkv, rq, rk, dv);
}

void rope_backward(Tensor& dx, const Tensor& pos, float theta) {
  // Backward is the inverse rotation; it writes (not accumulates) when input and output alias, so
  // rotate a copy into a zeroed buffer and store it back.
  Tensor tmp = Tensor::zeros(dx.shape(), dx.dtype(), dx.device());
  NDT_ON_CUDA(dx, Tensor k;
              cuda::rope_backward<E>(dp<E>(tmp, "rope tmp"), dp<E>(dx, "rope dx"), dev_meta<int32_t>(pos, k),
                                     dx.size(0), dx.size(1), dx.size(2), theta, st());
              dx.copy_from(tmp));
  require_cpu(dx, "rope_backward");
  cpu::rope_backward(tmp.f32(), dx.f32(), pos.i32(), dx.size(0), dx.size(1), dx.size(2), theta);
  dx.copy_from(tmp);
}

std::pair<int64_t, int64_t> cudnn_equal_segments(const Tensor& q, const Tensor& cu_seqlens) {
#ifdef NDT_HAVE_CUDA
  if (!on_cuda(q) || q.dtype() != DType::BF16 || cu_seqlens.device() != Device::CPU ||
      !cuda::cudnn_attention_enabled())
    return {0, 0};
  const int64_t nseq = cu_seqlens.numel() - 1;
  const int32_t* cu = cu_seqlens.i32();
  if (nseq <= 0 || cu[0] != 0 || cu[nseq] != q.size(0)) return {0, 0};
  const int64_t S = cu[1];
  for (int64_t s = 1; s <= nseq; ++s)
    if (cu[s] - cu[s - 1] != S) return {0, 0};
  return {nseq, S};
#else
  (void)q, (void)cu_seqlens;
  return {0, 0};
#endif
}

void attention_forward(Tensor& out, Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& cu_seqlens, float scale) {
  int64_t T = q.size(0), H = q.size(1), D = q.size(2), KV = k.size(1);
  NDT_CHECK(H % KV == 0, "attention: {} query heads not divisible by {} kv heads", H, KV);
#ifdef NDT_HAVE_CUDA
  if (auto [B, S] = cudnn_equal_segments(q, cu_seqlens); B > 0)
    if (cuda::cudnn_attention_forward(dp<bf16>(out, "att out"), dp<float>(lse, "att lse"), dp<bf16>(q, "q"),
                                      dp<bf16>(k, "k"), dp<bf16>(v, "v"), B, S, H, KV, D, scale, st()))
      return;
#endif
  NDT_ON_CUDA(q, Tensor kc; const int32_t* cu = dev_meta<int32_t>(cu_seqlens, kc);
              cuda::attention_forward<E>(dp<E>(out, "att out"), dp<float>(lse, "att lse"), dp<E>(q, "q"),
                                         dp<E>(k, "k"), dp<E>(v, "v"), cu, cu, nullptr, nullptr,
                                         cu_seqlens.numel() - 1, T, T, H, KV, D, scale, st()));
  require_cpu(q, "attention_forward");
  cpu::attention_forward(out.f32(), lse.f32(), q.f32(), k.f32(), v.f32(), cu_seqlens.i32(),
                         cu_seqlens.numel() - 1, T, H, KV, D, scale);
}

void attention_backward(Tensor& dq, Tensor& dk, Tensor& dv, const Tensor& dout, const Tensor& q,
                        const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& cu_seqlens, float scale, bool accumulate) {
  int64_t T = q.size(0), H = q.size(1), D = q.size(2), KV = k.size(1);
  if (!accumulate) {
#ifdef NDT_HAVE_CUDA
    if (auto [B, S] = cudnn_equal_segments(q, cu_seqlens); B > 0)
      if (cuda::cudnn_attention_backward(dp<bf16>(dq, "dq"), dp<bf16>(dk, "dk"), dp<bf16>(dv, "dv"),
                                         dp<bf16>(dout, "att dout"), dp<bf16>(q, "q"), dp<bf16>(k, "k"),
                                         dp<bf16>(v, "v"), dp<bf16>(out, "att out"),
                                         dp<float>(lse, "att lse"), B, S, H, KV, D, scale, st()))
        return;
#endif
    dq.zero_();
    dk.zero_();
    dv.zero_();
  }
  NDT_ON_CUDA(q, Tensor kc; const int32_t* cu = dev_meta<int32_t>(cu_seqlens, kc);
              cuda::attention_backward<E>(
                  dp<E>(dq, "dq"), dp<E>(dk, "dk"), dp<E>(dv, "dv"), dp<E>(dout, "att dout"), dp<E>(q, "q"),
                  dp<E>(k, "k"), dp<E>(v, "v"), dp<E>(out, "att out"), dp<float>(lse, "att lse"), cu, cu,
                  nullptr, nullptr, cu_seqlens.numel() - 1, T, T, H, KV, D, scale, st()));
  require_cpu(q, "attention_backward");
  cpu::attention_backward(dq.f32(), dk.f32(), dv.f32(), dout.f32(), q.f32(), k.f32(), v.f32(), out.f32(),
                          lse.f32(), cu_seqlens.i32(), cu_seqlens.numel() - 1, T, H, KV, D, scale);
}

void attention_backward_qkv(Tensor& dqkv, const Tensor& dout, const Tensor& q, const Tensor& k,
                            const Tensor& v, const Tensor& out, const Tensor& lse, const Tensor& cu_seqlens,
                            float scale) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KV = k.size(1), W = (H + 2 * KV) * D;
  require_shape(dqkv, {T, W}, "attention_backward_qkv dqkv");
#ifdef NDT_HAVE_CUDA
  if (auto [B, S] = cudnn_equal_segments(q, cu_seqlens); B > 0) {
    bf16* g = dp<bf16>(dqkv, "dqkv");
    if (cuda::cudnn_attention_backward(g, g + H * D, g + (H + KV) * D, dp<bf16>(dout, "att dout"),
                                       dp<bf16>(q, "q"), dp<bf16>(k, "k"), dp<bf16>(v, "v"),
                                       dp<bf16>(out, "att out"), dp<float>(lse, "att lse"), B, S, H, KV, D,
                                       scale, st(), W, W))
      return;
  }
#endif
  Tensor dq = Tensor::empty(q.shape(), q.dtype(), q.device()),
         dk = Tensor::empty(k.shape(), k.dtype(), k.device()),
         dv = Tensor::empty(v.shape(), v.dtype(), v.device());
  attention_backward(dq, dk, dv, dout, q, k, v, out, lse, cu_seqlens, scale, /*accumulate=*/false);
  qkv_merge(dqkv, dq, dk, dv);
}

void attention_forward(Tensor& out, Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& cu_q, const Tensor& cu_k, const Tensor& pos_q, const Tensor& pos_k,
                       float scale) {
  NDT_CHECK(cu_q.numel() == cu_k.numel() && pos_q.numel() == q.size(0) && pos_k.numel() == k.size(0),
            "attention: query/key metadata do not match ({} / {} segments, {} / {} positions)", cu_q.numel(),
            cu_k.numel(), pos_q.numel(), pos_k.numel());
  NDT_ON_CUDA(q, Tensor k1, k2, k3, k4; cuda::attention_forward<E>(
                  dp<E>(out, "att out"), dp<float>(lse, "att lse"), dp<E>(q, "q"), dp<E>(k, "k"),
                  dp<E>(v, "v"), dev_meta<int32_t>(cu_q, k1), dev_meta<int32_t>(cu_k, k2),
                  dev_meta<int32_t>(pos_q, k3), dev_meta<int32_t>(pos_k, k4), cu_q.numel() - 1, q.size(0),
                  k.size(0), q.size(1), k.size(1), q.size(2), scale, st()));
  require_cpu(q, "attention_forward");
  cpu::attention_forward(out.f32(), lse.f32(), q.f32(), k.f32(), v.f32(), cu_q.i32(), cu_k.i32(), pos_q.i32(),
                         pos_k.i32(), cu_q.numel() - 1, q.size(0), k.size(0), q.size(1), k.size(1), q.size(2),
                         scale);
}

void attention_decode(Tensor& out, Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                      const Tensor& cu_k, const Tensor& pos_q, const Tensor& pos_k, float scale) {
  const int64_t nseq = q.size(0);
  NDT_CHECK(cu_k.numel() == nseq + 1 && pos_q.numel() == nseq && pos_k.numel() == k.size(0),
            "attention_decode: {} query rows with {} key segments, {} query and {} key positions", nseq,
            cu_k.numel() - 1, pos_q.numel(), pos_k.numel());
#ifdef NDT_HAVE_CUDA
  if (on_cuda(q)) {
    bool done = false;
    by_dtype(q, [&](auto tag_) {
      using E = typename decltype(tag_)::type;
      Tensor k1, k2, k3;
      done = cuda::attention_decode<E>(dp<E>(out, "att out"), dp<float>(lse, "att lse"), dp<E>(q, "q"),
                                       dp<E>(k, "k"), dp<E>(v, "v"), dev_meta<int32_t>(cu_k, k1),
                                       dev_meta<int32_t>(pos_q, k2), dev_meta<int32_t>(pos_k, k3), nseq,
                                       q.size(1), k.size(1), q.size(2), scale, st(), /*splits=*/0, k.size(0));
    });
    if (done) return;
  }
#endif
  std::vector<int32_t> iota(static_cast<size_t>(nseq + 1));
  for (int64_t s = 0; s <= nseq; ++s) iota[static_cast<size_t>(s)] = static_cast<int32_t>(s);
  attention_forward(out, lse, q, k, v, Tensor::from_vector(iota, {nseq + 1}), cu_k, pos_q, pos_k, scale);
}

void attention_backward(Tensor& dq, Tensor& dk, Tensor& dv, const Tensor& dout, const Tensor& q,
                        const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& cu_q, const Tensor& cu_k, const Tensor& pos_q, const Tensor& pos_k,
                        float scale) {
  NDT_ON_CUDA(q, Tensor k1, k2, k3, k4; cuda::attention_backward<E>(
                  dp<E>(dq, "dq"), dp<E>(dk, "dk"), dp<E>(dv, "dv"), dp<E>(dout, "att dout"), dp<E>(q, "q"),
                  dp<E>(k, "k"), dp<E>(v, "v"), dp<E>(out, "att out"), dp<float>(lse, "att lse"),
                  dev_meta<int32_t>(cu_q, k1), dev_meta<int32_t>(cu_k, k2), dev_meta<int32_t>(pos_q, k3),
                  dev_meta<int32_t>(pos_k, k4), cu_q.numel() - 1, q.size(0), k.size(0), q.size(1), k.size(1),
                  q.size(2), scale, st()));
  require_cpu(q, "attention_backward");
  cpu::attention_backward(dq.f32(), dk.f32(), dv.f32(), dout.f32(), q.f32(), k.f32(), v.f32(), out.f32(),
                          lse.f32(), cu_q.i32(), cu_k.i32(), pos_q.i32(), pos_k.i32(), cu_q.numel() - 1,
                          q.size(0), k.size(0), q.size(1), k.size(1), q.size(2), scale);
}

void decode_advance(Tensor& tokens, Tensor& positions, const Tensor& sampled, Tensor& rows, Tensor& pos_q,
                    Tensor& pos_k) {
  const int64_t n = tokens.numel();
  for (const Tensor* t :
       std::initializer_list<const Tensor*>{&tokens, &positions, &sampled, &rows, &pos_q, &pos_k})
    NDT_CHECK(t->dtype() == DType::I32 && t->device() == tokens.device() && (t == &pos_k || t->numel() == n),
              "decode_advance: {} sequences, got a {} {} tensor of {} elements", n, dtype_name(t->dtype()),
              device_name(t->device()), t->numel());
#ifdef NDT_HAVE_CUDA
  if (on_cuda(tokens)) {
    cuda::decode_advance(tokens.i32(), positions.i32(), sampled.i32(), rows.i32(), pos_q.i32(), pos_k.i32(),
                         n, pos_k.numel(), st());
    return;
  }
#endif
  for (int64_t s = 0; s < n; ++s) {
    tokens.i32()[s] = sampled.i32()[s];
    positions.i32()[s] += 1;
    const int32_t r = ++rows.i32()[s], p = ++pos_q.i32()[s];
    NDT_CHECK(r >= 0 && r < pos_k.numel(), "decode_advance: cache row {} outside {} rows", r, pos_k.numel());
    pos_k.i32()[r] = p;
  }
}

void scatter_rows(Tensor& dst, const Tensor& rows, const Tensor& src) {
  const int64_t n = rows.numel(), row = dst.numel() / std::max<int64_t>(1, dst.size(0));
  NDT_CHECK(src.dtype() == dst.dtype() && src.device() == dst.device() && src.size(0) == n &&
                src.numel() == n * row,
            "scatter_rows: {} rows of {} into {} {}", n, shape_str(src.shape()), shape_str(dst.shape()),
            dtype_name(dst.dtype()));
  NDT_ON_CUDA(dst, Tensor k; cuda::scatter_rows<E>(dp<E>(dst, "scatter_rows dst"), dev_meta<int32_t>(rows, k),
                                                   dp<E>(src, "scatter_rows src"), n, row, st()));
  const int32_t* r = rows.i32();
  const int64_t bytes = row * dtype_size(dst.dtype());
  for (int64_t i = 0; i < n; ++i) {
    NDT_CHECK(r[i] >= 0 && r[i] < dst.size(0), "scatter_rows: row {} outside {} rows", r[i], dst.size(0));
    std::memcpy(static_cast<char*>(dst.data_ptr()) + r[i] * bytes,
                static_cast<const char*>(src.data_ptr()) + i * bytes, static_cast<size_t>(bytes));
  }
}

Tensor gather_rows(const Tensor& src, const std::vector<int64_t>& idx) {
  Shape shape = src.shape();
  const int64_t row = src.numel() / std::max<int64_t>(1, shape[0]), bytes = row * dtype_size(src.dtype());
  shape[0] = static_cast<int64_t>(idx.size());
  Tensor out = Tensor::empty(shape, src.dtype(), src.device());
  for (size_t i = 0; i < idx.size(); ++i)
    NDT_CHECK(idx[i] >= 0 && idx[i] < src.size(0), "gather_rows: index {} outside {} rows", idx[i],
              src.size(0));
  if (on_cuda(src)) {
    // Row permutations here are runs of consecutive rows (CP chunks): one copy per run.
    for (size_t i = 0; i < idx.size();) {
      size_t j = i + 1;
      while (j < idx.size() && idx[j] == idx[j - 1] + 1) ++j;
      const int64_t n = static_cast<int64_t>(j - i);
      out.view_at(static_cast<int64_t>(i) * row, {n * row}).copy_from(src.view_at(idx[i] * row, {n * row}));
      i = j;
    }
    return out;
  }
  const char* s = static_cast<const char*>(src.data_ptr());
  char* d = static_cast<char*>(out.data_ptr());
  for (size_t i = 0; i < idx.size(); ++i)
    std::memcpy(d + static_cast<int64_t>(i) * bytes, s + idx[i] * bytes, static_cast<size_t>(bytes));
  return out;
}

void scatter_add_rows(Tensor& dst, const Tensor& src, const std::vector<int64_t>& idx) {
  NDT_CHECK(src.dtype() == dst.dtype() && src.size(0) == static_cast<int64_t>(idx.size()),
            "scatter_add_rows: same dtypes with one index per source row");
  const int64_t row = src.numel() / std::max<int64_t>(1, src.size(0));
  for (size_t i = 0; i < idx.size(); ++i)
    NDT_CHECK(idx[i] >= 0 && idx[i] < dst.size(0), "scatter_add_rows: index {} outside {} rows", idx[i],
              dst.size(0));
#ifdef NDT_HAVE_CUDA
  if (on_cuda(src)) {
    by_dtype(src, [&](auto tag_) {
      using E = typename decltype(tag_)::type;
      for (size_t i = 0; i < idx.size();) {  // runs of consecutive rows: one launch each
        size_t j = i + 1;
        while (j < idx.size() && idx[j] == idx[j - 1] + 1) ++j;
        cuda::add_inplace<E>(dp<E>(dst, "scatter dst") + idx[i] * row,
                             dp<E>(src, "scatter src") + static_cast<int64_t>(i) * row,
                             static_cast<int64_t>(j - i) * row, st());
        i = j;
      }
    });
    return;
  }
#endif
  require_cpu(src, "scatter_add_rows");
  NDT_CHECK(src.dtype() == DType::F32, "scatter_add_rows: f32 tensors on the CPU");
  for (size_t i = 0; i < idx.size(); ++i)
    cpu::add_inplace(dst.f32() + idx[i] * row, src.f32() + static_cast<int64_t>(i) * row, row);
}

void gelu_forward(Tensor& out, const Tensor& inp) {
  NDT_ON_CUDA(inp, cuda::gelu_forward<E>(dp<E>(out, "gelu out"), dp<E>(inp, "gelu inp"), inp.numel(), st()));
  require_cpu(inp, "gelu_forward");
  cpu::gelu_forward(out.f32(), inp.f32(), inp.numel());
}

void gelu_backward(Tensor& dinp, const Tensor& dout, const Tensor& inp, bool accumulate) {
  NDT_ON_CUDA(inp, cuda::gelu_backward<E>(dp<E>(dinp, "gelu dinp"), dp<E>(dout, "gelu dout"),
                                          dp<E>(inp, "gelu inp"), inp.numel(), st(), accumulate));
  require_cpu(inp, "gelu_backward");
  if (!accumulate) dinp.zero_();
  cpu::gelu_backward(dinp.f32(), dout.f32(), inp.f32(), inp.numel());
}

void linear_gelu_forward(Tensor& act, Tensor& pre, const Tensor& inp, const Tensor& weight,
                         const Tensor* bias) {
  const int64_t OC = weight.size(0), IC = weight.size(1), T = rows(inp);
  NDT_CHECK(inp.size(-1) == IC, "linear_gelu_forward: input has {} features, weight expects {}", inp.size(-1),
            IC);
  NDT_CHECK(act.numel() == T * OC && pre.numel() == T * OC,
            "linear_gelu_forward: act/pre have {}/{} elements, expected {}", act.numel(), pre.numel(),
            T * OC);
#ifdef NDT_HAVE_CUDA
  // bf16 only: fp32 keeps the exact-fp32 kernels (cuBLASLt's GELU is not our tanhf to the last bit).
  if (on_cuda(inp) && inp.dtype() == DType::BF16 &&
      cuda::linear_gelu_forward(dp<bf16>(act, "gelu act"), dp<bf16>(pre, "gelu pre"), dp<bf16>(inp, "fc inp"),
                                dp<bf16>(weight, "fc weight"), dp_opt<bf16>(bias, "fc bias"), T, IC, OC,
                                st()))
    return;
#endif
  linear_forward(pre, inp, weight, bias);
  gelu_forward(act, pre);
}

void linear_dgelu_backward(Tensor& dpre, Tensor& dweight, const Tensor& dout, const Tensor& act,
                           const Tensor& weight, const Tensor& pre) {
  const int64_t OC = weight.size(0), IC = weight.size(1), T = rows(act);
  NDT_CHECK(dout.numel() == T * OC, "linear_dgelu_backward: dout has {} elements, expected {}", dout.numel(),
            T * OC);
  NDT_CHECK(pre.numel() == T * IC && dpre.numel() == T * IC,
            "linear_dgelu_backward: pre/dpre have {}/{} elements, expected {}", pre.numel(), dpre.numel(),
            T * IC);
#ifdef NDT_HAVE_CUDA
  if (on_cuda(act) && act.dtype() == DType::BF16 &&
      cuda::linear_dgelu_backward(dp<bf16>(dpre, "dpre"), dp<bf16>(dout, "dout"), dp<bf16>(weight, "weight"),
                                  dp<bf16>(pre, "pre"), T, IC, OC, st())) {
    if (dweight.defined()) linear_backward(nullptr, dweight, nullptr, dout, act, weight);
    return;
  }
#endif
  Tensor dact = Tensor::empty(pre.shape(), pre.dtype(), pre.device());
  linear_backward(&dact, dweight, nullptr, dout, act, weight, /*accumulate_dinp=*/false);
  gelu_backward(dpre, dact, pre, /*accumulate=*/false);
}

void swiglu_forward(Tensor& out, const Tensor& gate, const Tensor& up) {
  NDT_ON_CUDA(gate, cuda::swiglu_forward<E>(dp<E>(out, "swiglu out"), dp<E>(gate, "gate"), dp<E>(up, "up"),
                                            gate.numel(), st()));
  require_cpu(gate, "swiglu_forward");
  cpu::swiglu_forward(out.f32(), gate.f32(), up.f32(), gate.numel());
}

void swiglu_forward_fused(Tensor& out, const Tensor& h13) {
  const int64_t T = out.size(0), F = out.size(1);
  require_shape(h13, {T, 2 * F}, "swiglu_forward_fused h13");
  NDT_ON_CUDA(h13, cuda::swiglu_forward_fused<E>(dp<E>(out, "swiglu out"), dp<E>(h13, "h13"), T, F, st()));
  require_cpu(h13, "swiglu_forward_fused");
  for (int64_t t = 0; t < T; ++t)
    cpu::swiglu_forward(out.f32() + t * F, h13.f32() + t * 2 * F, h13.f32() + t * 2 * F + F, F);
}

void swiglu_backward(Tensor& dgate, Tensor& dup, const Tensor& dout, const Tensor& gate, const Tensor& up,
                     bool accumulate) {
  NDT_ON_CUDA(gate,
              cuda::swiglu_backward<E>(dp<E>(dgate, "dgate"), dp<E>(dup, "dup"), dp<E>(dout, "swiglu dout"),
                                       dp<E>(gate, "gate"), dp<E>(up, "up"), gate.numel(), st(), accumulate));
  require_cpu(gate, "swiglu_backward");
  if (!accumulate) {
    if (dgate.defined()) dgate.zero_();
    if (dup.defined()) dup.zero_();
  }
  cpu::swiglu_backward(dgate.f32(), dup.f32(), dout.f32(), gate.f32(), up.f32(), gate.numel());
}

void attention_merge(Tensor& out, Tensor& lse, const Tensor& o, const Tensor& l) {
  NDT_CHECK(out.numel() == o.numel() && lse.numel() == l.numel() && lse.numel() > 0 &&
                out.numel() % lse.numel() == 0,
            "attention_merge: out {} / lse {} vs partial {} / {}", shape_str(out.shape()),
            shape_str(lse.shape()), shape_str(o.shape()), shape_str(l.shape()));
  const int64_t rows = lse.numel(), D = out.numel() / rows;
  NDT_ON_CUDA(out, cuda::attention_merge<E>(dp<E>(out, "merge out"), dp<float>(lse, "merge lse"),
                                            dp<E>(o, "merge o"), dp<float>(l, "merge l"), rows, D, st()));
  require_cpu(out, "attention_merge");
  cpu::attention_merge(out.f32(), lse.f32(), o.f32(), l.f32(), rows, D);
}

void add_(Tensor& y, const Tensor& x) {
  NDT_CHECK(y.numel() == x.numel(), "add_: {} vs {}", shape_str(y.shape()), shape_str(x.shape()));
  NDT_ON_CUDA(y, cuda::add_inplace<E>(dp<E>(y, "add_ y"), dp<E>(x, "add_ x"), y.numel(), st()));
  require_cpu(y, "add_");
  cpu::add_inplace(y.f32(), x.f32(), y.numel());
}

}  // namespace ndt::ops

namespace ndt::ops {

void bias_backward(Tensor& dbias, const Tensor& dy) {
  const int64_t C = dbias.numel(), T = dy.numel() / C;
  NDT_ON_CUDA(dy, cuda::bias_backward<E>(dp<float>(dbias, "dbias"), dp<E>(dy, "dy"), T, C, st()));
  require_cpu(dy, "bias_backward");
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
  const int64_t row = t.numel() / std::max<int64_t>(1, t.size(0));
  Tensor out = Tensor::empty(s, t.dtype(), t.device());
  out.copy_from(t.view_at(first * row, s));
  return out;
}

// ---- loss pieces ----

void xent_rowmax(Tensor& rowmax, const Tensor& logits) {
  NDT_ON_CUDA(logits, cuda::xent_rowmax<E>(dp<float>(rowmax, "rowmax"), dp<E>(logits, "logits"),
                                           logits.size(0), logits.size(1), st()));
  require_cpu(logits, "xent_rowmax");
  cpu::xent_rowmax(rowmax.f32(), logits.f32(), logits.size(0), logits.size(1));
}

void xent_sumexp(Tensor& sumexp, const Tensor& logits, const Tensor& rowmax) {
  NDT_ON_CUDA(logits,
              cuda::xent_sumexp<E>(dp<float>(sumexp, "sumexp"), dp<E>(logits, "logits"),
                                   dp<float>(rowmax, "rowmax"), logits.size(0), logits.size(1), st()));
  require_cpu(logits, "xent_sumexp");
  cpu::xent_sumexp(sumexp.f32(), logits.f32(), rowmax.f32(), logits.size(0), logits.size(1));
}

void xent_rowmax_sumexp(Tensor& rowmax, Tensor& sumexp, const Tensor& logits) {
  NDT_ON_CUDA(logits,
              cuda::xent_rowmax_sumexp<E>(dp<float>(rowmax, "rowmax"), dp<float>(sumexp, "sumexp"),
                                          dp<E>(logits, "logits"), logits.size(0), logits.size(1), st()));
  xent_rowmax(rowmax, logits);
  xent_sumexp(sumexp, logits, rowmax);
}

void xent_target_logit(Tensor& target_logit, const Tensor& logits, const Tensor& targets,
                       int64_t vocab_start) {
  NDT_ON_CUDA(logits, Tensor k; cuda::xent_target_logit<E>(
                  dp<float>(target_logit, "target_logit"), dp<E>(logits, "logits"),
                  dev_meta<int32_t>(targets, k), logits.size(0), logits.size(1), vocab_start, st()));
  require_cpu(logits, "xent_target_logit");
  cpu::xent_target_logit(target_logit.f32(), logits.f32(), targets.i32(), logits.size(0), logits.size(1),
                         vocab_start);
}

void xent_logprob(Tensor& logprob, const Tensor& target_logit, const Tensor& rowmax, const Tensor& sumexp) {
#ifdef NDT_HAVE_CUDA
  if (on_cuda(logprob)) {
    cuda::xent_logprob(dp<float>(logprob, "logprob"), dp<float>(target_logit, "target_logit"),
                       dp<float>(rowmax, "rowmax"), dp<float>(sumexp, "sumexp"), logprob.numel(), st());
    return;
  }
#endif
  require_cpu(logprob, "xent_logprob");
  cpu::xent_logprob(logprob.f32(), target_logit.f32(), rowmax.f32(), sumexp.f32(), logprob.numel());
}

void xent_backward(Tensor& dlogits, const Tensor& logits, const Tensor& rowmax, const Tensor& sumexp,
                   const Tensor& targets, const Tensor& dloss, int64_t vocab_start) {
  NDT_ON_CUDA(logits, Tensor k1, k2; cuda::xent_backward<E>(
                  dp<E>(dlogits, "dlogits"), dp<E>(logits, "logits"), dp<float>(rowmax, "rowmax"),
                  dp<float>(sumexp, "sumexp"), dev_meta<int32_t>(targets, k1), dev_meta<float>(dloss, k2),
                  logits.size(0), logits.size(1), vocab_start, st()));
  require_cpu(logits, "xent_backward");
  cpu::xent_backward(dlogits.f32(), logits.f32(), rowmax.f32(), sumexp.f32(), targets.i32(), dloss.f32(),
                     logits.size(0), logits.size(1), vocab_start);
}

void xent_backward_inplace(Tensor& logits, const Tensor& rowmax, const Tensor& sumexp, const Tensor& targets,
                           const Tensor& dloss, int64_t vocab_start) {
  NDT_ON_CUDA(logits, Tensor k1, k2; cuda::xent_backward_inplace<E>(
                  dp<E>(logits, "logits"), dp<float>(rowmax, "rowmax"), dp<float>(sumexp, "sumexp"),
                  dev_meta<int32_t>(targets, k1), dev_meta<float>(dloss, k2), logits.size(0), logits.size(1),
                  vocab_start, st()));
  // CPU: the accumulating kernel into zeros, copied over (0 + x == x: the same values).
  Tensor d = Tensor::zeros(logits.shape());
  xent_backward(d, logits, rowmax, sumexp, targets, dloss, vocab_start);
  logits.copy_from(d);
}

void xent_loss_backward_inplace(Tensor& logits, Tensor& logprob, const Tensor& targets, const Tensor& dloss) {
  NDT_ON_CUDA(logits, Tensor k1, k2; cuda::xent_loss_backward_inplace<E>(
                  dp<E>(logits, "logits"), dp<float>(logprob, "logprob"), dev_meta<int32_t>(targets, k1),
                  dev_meta<float>(dloss, k2), logits.size(0), logits.size(1), st()));
  const int64_t T = logits.size(0);
  Tensor rowmax = Tensor::empty({T}), sumexp = Tensor::empty({T}), target_logit = Tensor::empty({T});
  xent_rowmax_sumexp(rowmax, sumexp, logits);
  xent_target_logit(target_logit, logits, targets, 0);
  xent_logprob(logprob, target_logit, rowmax, sumexp);
  xent_backward_inplace(logits, rowmax, sumexp, targets, dloss, 0);
}

double masked_loss_sum(const Tensor& logprob, const Tensor& mask) {
  Tensor acc = Tensor::zeros({1}, DType::F64, logprob.device());
  masked_loss_sum_into(acc, logprob, mask);
  return acc.to_vector<double>()[0];
}

void masked_loss_sum_into(Tensor& acc, const Tensor& logprob, const Tensor& mask) {
  NDT_CHECK(acc.dtype() == DType::F64 && acc.numel() == 1 && acc.device() == logprob.device(),
            "masked_loss_sum_into: the accumulator must be one F64 on the logprobs' device");
#ifdef NDT_HAVE_CUDA
  if (on_cuda(logprob)) {
    Tensor k;
    cuda::masked_loss_sum(acc.data<double>(), dp<float>(logprob, "logprob"), dev_meta<float>(mask, k),
                          logprob.numel(), st());
    return;
  }
#endif
  const float* lp = logprob.f32();
  const float* m = mask.f32();
  double s = 0;
  for (int64_t t = 0; t < logprob.numel(); ++t)
    if (m[t] != 0.0f) s -= static_cast<double>(lp[t]) * m[t];
  acc.data<double>()[0] += s;
}

void fill_dloss(Tensor& dloss, const Tensor& mask, float scale) {
  NDT_CHECK(dloss.numel() == mask.numel(), "fill_dloss: {} vs {} rows", dloss.numel(), mask.numel());
#ifdef NDT_HAVE_CUDA
  if (on_cuda(dloss)) {
    Tensor k;
    cuda::scale_mask(dp<float>(dloss, "dloss"), dev_meta<float>(mask, k), scale, dloss.numel(), st());
    return;
  }
#endif
  float* d = dloss.f32();
  const float* m = mask.f32();
  for (int64_t t = 0; t < dloss.numel(); ++t) d[t] = scale * m[t];
}

void fill_dloss(Tensor& dloss, const Tensor& mask, const Tensor& scale) {
  NDT_CHECK(scale.numel() == 1 && scale.dtype() == DType::F32 && scale.device() == dloss.device(),
            "fill_dloss: the scale must be one f32 element on the loss gradient's device");
#ifdef NDT_HAVE_CUDA
  if (on_cuda(dloss)) {
    NDT_CHECK(dloss.numel() == mask.numel(), "fill_dloss: {} vs {} rows", dloss.numel(), mask.numel());
    Tensor k;
    cuda::scale_mask_at(dp<float>(dloss, "dloss"), dev_meta<float>(mask, k), scale.f32(), dloss.numel(),
                        st());
    return;
  }
#endif
  fill_dloss(dloss, mask, scale.f32()[0]);
}

Tensor add(const Tensor& a, const Tensor& b, const Tensor* bias) {
  NDT_CHECK(a.numel() == b.numel(), "add: {} vs {}", shape_str(a.shape()), shape_str(b.shape()));
  const int64_t C = bias ? bias->numel() : 1;
  NDT_CHECK(C > 0 && a.numel() % C == 0, "add: bias of {} elements does not divide {}", C,
            shape_str(a.shape()));
#ifdef NDT_HAVE_CUDA
  if (on_cuda(a)) {
    Tensor out = Tensor::empty(a.shape(), a.dtype(), a.device());
    by_dtype(a, [&](auto tag_) {
      using E = typename decltype(tag_)::type;
      cuda::residual_forward<E>(dp<E>(out, "add out"), dp<E>(a, "add a"), dp<E>(b, "add b"), a.numel(), st(),
                                bias ? dp<E>(*bias, "add bias") : nullptr, C);
    });
    return out;
  }
#endif
  Tensor out = a.clone();
  if (!bias) {
    add_(out, b);
    return out;
  }
  require_cpu(a, "add");
  float* po = out.f32();
  const float *pb = b.f32(), *pbias = bias->f32();
  const int64_t T = a.numel() / C;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < C; ++c) po[t * C + c] += pb[t * C + c] + pbias[c];
  return out;
}

void cast_into(Tensor& dst, const Tensor& src) {
  NDT_CHECK(dst.numel() == src.numel() && dst.device() == src.device(), "cast_into: {} {} into {} {}",
            shape_str(src.shape()), device_name(src.device()), shape_str(dst.shape()),
            device_name(dst.device()));
  if (dst.dtype() == src.dtype()) {
    dst.copy_from(src);
    return;
  }
  const bool to_bf16 = dst.dtype() == DType::BF16 && src.dtype() == DType::F32;
  NDT_CHECK(to_bf16 || (dst.dtype() == DType::F32 && src.dtype() == DType::BF16),
            "cast_into: {} to {} unsupported", dtype_name(src.dtype()), dtype_name(dst.dtype()));
#ifdef NDT_HAVE_CUDA
  if (on_cuda(dst)) {
    if (to_bf16)
      cuda::cast(static_cast<bf16*>(dst.data_ptr()), src.f32(), src.numel(), st());
    else
      cuda::cast(dst.f32(), static_cast<const bf16*>(src.data_ptr()), src.numel(), st());
    return;
  }
#endif
  const int64_t n = src.numel();
  if (to_bf16) {
    const float* s = src.f32();
    uint16_t* d = dst.data<uint16_t>();
    for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(s[i]);
  } else {
    const uint16_t* s = src.data<uint16_t>();
    float* d = dst.f32();
    for (int64_t i = 0; i < n; ++i) d[i] = bf16_to_f32(s[i]);
  }
}

Tensor to_host_f32(const Tensor& t) {
  if (t.device() == Device::CPU && t.dtype() == DType::F32) return t;
  Tensor f = t;
  if (t.dtype() != DType::F32) {
    f = Tensor::empty(t.shape(), DType::F32, t.device());
    cast_into(f, t);
  }
  return f.to(Device::CPU);
}

}  // namespace ndt::ops

namespace ndt::ops {

void moe_permute(Tensor& out, const Tensor& x, const Tensor& src, const Tensor* scale) {
  const int64_t R = src.numel(), C = x.size(-1);
  require_shape(out, {R, C}, "moe_permute out");
  NDT_CHECK(src.dtype() == DType::I32 && (!scale || scale->numel() == R),
            "moe_permute: src i32 (R), scale (R)");
#ifdef NDT_HAVE_CUDA
  if (on_cuda(x)) {
    if (R == 0) return;
    Tensor k1, k2;
    by_dtype(x, [&](auto tag_) {
      using E = typename decltype(tag_)::type;
      cuda::moe_permute<E>(dp<E>(out, "moe_permute out"), dp<E>(x, "moe_permute x"),
                           dev_meta<int32_t>(src, k1), scale ? dev_meta<float>(*scale, k2) : nullptr, R, C,
                           st());
    });
    return;
  }
#endif
  require_cpu(x, "moe_permute");
  cpu::moe_permute(out.f32(), x.f32(), src.i32(), scale ? scale->f32() : nullptr, R, C);
}

void moe_unpermute(Tensor& out, const Tensor& y, const Tensor& pos, const Tensor* gates, int64_t k,
                   bool accumulate) {
  const int64_t N = out.size(0), C = out.size(-1);
  NDT_CHECK(pos.numel() == N * k && pos.dtype() == DType::I32 && (!gates || gates->numel() == N * k),
            "moe_unpermute: pos i32 and gates of N*k = {} entries", N * k);
#ifdef NDT_HAVE_CUDA
  if (on_cuda(out)) {
    if (N == 0) return;
    Tensor k1, k2;
    by_dtype(out, [&](auto tag_) {
      using E = typename decltype(tag_)::type;
      cuda::moe_unpermute<E>(dp<E>(out, "moe_unpermute out"),
                             y.numel() ? dp<E>(y, "moe_unpermute y") : nullptr, dev_meta<int32_t>(pos, k1),
                             gates ? dev_meta<float>(*gates, k2) : nullptr, N, k, C, accumulate, st());
    });
    return;
  }
#endif
  require_cpu(out, "moe_unpermute");
  cpu::moe_unpermute(out.f32(), y.numel() ? y.f32() : nullptr, pos.i32(), gates ? gates->f32() : nullptr, N,
                     k, C, accumulate);
}

void moe_gate_grad(Tensor& dgates, const Tensor& dout, const Tensor& y, const Tensor& pos, int64_t k) {
  const int64_t N = dout.size(0), C = dout.size(-1);
  NDT_CHECK(dgates.numel() == N * k && dgates.dtype() == DType::F32 && pos.numel() == N * k,
            "moe_gate_grad: dgates f32 and pos of N*k = {} entries", N * k);
#ifdef NDT_HAVE_CUDA
  if (on_cuda(dout)) {
    if (N == 0) return;
    Tensor k1;
    by_dtype(dout, [&](auto tag_) {
      using E = typename decltype(tag_)::type;
      cuda::moe_gate_grad<E>(dp<float>(dgates, "moe_gate_grad dgates"), dp<E>(dout, "moe_gate_grad dout"),
                             y.numel() ? dp<E>(y, "moe_gate_grad y") : nullptr, dev_meta<int32_t>(pos, k1), N,
                             k, C, st());
    });
    return;
  }
#endif
  require_cpu(dout, "moe_gate_grad");
  cpu::moe_gate_grad(dgates.f32(), dout.f32(), y.numel() ? y.f32() : nullptr, pos.i32(), N, k, C);
}

}  // namespace ndt::ops
