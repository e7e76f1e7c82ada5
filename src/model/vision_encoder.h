#pragma once
// The image side of a LLaVA-style multimodal model, written for ONE device with explicit forward and
// backward: a ViT encoder (patchify, patch embedding, learned positions, a bidirectional transformer
// body, final norm) followed by a two-layer GELU projector into the language model's width.
//
// Contract:
// - Parameters live in the caller's ParamStore under stable global names `encoder.*` and `projector.*`
//   (DESIGN.md §1.3); the store's device and compute dtype decide where activations live (as in
//   Transformer). Images arrive as host f32; everything after patchify runs on the store's device.
// - backward ACCUMULATES (+=) into Param::grad; it consumes the EncoderActs of the matching forward.
// - Tensor parallelism only through TpHooks, without sequence parallelism: the body splits heads and
//   MLP width like the LLM; the projector is fc1 column-parallel, fc2 row-parallel (Megatron f before
//   fc1, g after fc2). Patch embedding, positions, norms and fc2's bias are replicated, and every TP
//   rank computes them on the full token set, so their gradients are identical on every rank (no
//   reduction needed). forward's output and backward's dout are replicated over the TP group.
//
// Token layout: image b's N = patches() tokens are rows [b*N, (b+1)*N) in row-major patch order
// (patch (gy, gx) of the G x G grid is row b*N + gy*G + gx). Within a patch the features are
// channel-major: feature c*P*P + py*P + px is pixel (c, gy*P + py, gx*P + px).
#include <cstdint>
#include <memory>
#include <string>

#include "core/tensor.h"
#include "data/dataset.h"
#include "model/params.h"
#include "model/tp_hooks.h"
#include "model/transformer.h"
#include "train/config.h"

namespace ndt {

// T = B * N tokens, C = encoder d_model, K = patch_dim, Hpl = projector hidden width on this TP rank,
// Cl = the LLM's d_model.
struct EncoderActs {
  int64_t B = 0;            // images in the batch
  Microbatch mb;            // body metadata: B sequences of N tokens (tokens unused, positions 0..N-1)
  Tensor patches;           // (T, K) patchified pixels, on the device, compute dtype
  Activations body;         // the transformer body's saved activations (its layers)
  Tensor x_final;           // (T, C) body output, input of the final norm
  Tensor fn;                // (T, C) final norm output
  Tensor fn_mean, fn_rstd;  // (T), (T) f32 (mean: gpt2 LayerNorm only)
  Tensor p_in;              // (T, C) projector input after TP `enter`
  Tensor fc1;               // (T, Hpl) pre-GELU
  Tensor act;               // (T, Hpl) GELU output
};

class VisionEncoder {
 public:
  // Registers encoder.* and projector.* parameters in `store` (TP shards per tp; tp may be null = 1 rank).
  // llm_d_model: the projector's output width. Parameters are not initialized (store.init(seed) does it).
  // `tp` and `store` are not owned and must outlive the encoder.
  VisionEncoder(const EncoderConfig& cfg, int64_t llm_d_model, double norm_eps, double init_std, TpHooks* tp,
                ParamStore& store);
  // images: host f32 (B, channels, H, W). Returns (B * patches, llm_d_model) on the store's device in its
  // compute dtype, image b's patches at rows [b*patches, (b+1)*patches) in row-major patch order;
  // replicated over the TP group.
  Tensor forward(const Tensor& images, EncoderActs& acts);
  // dout: gradient of forward's output, same shape/placement (replicated over TP). Accumulates (+=) into
  // Param::grad. Consumes acts.
  void backward(const Tensor& dout, EncoderActs& acts);
  int64_t patches() const { return cfg_.patches(); }
  const EncoderConfig& config() const { return cfg_; }

 private:
  Param& p(const std::string& name) { return ps_->get(name); }
  Tensor act(Shape s) const { return Tensor::empty(std::move(s), ps_->compute_dtype(), ps_->device()); }
  Tensor stat(Shape s) const { return Tensor::empty(std::move(s), DType::F32, ps_->device()); }
  bool gpt2() const { return cfg_.style == "gpt2"; }

  EncoderConfig cfg_;
  int64_t llm_c_, hidden_local_;
  float eps_;
  TpHooks default_tp_;
  TpHooks* tp_;
  ParamStore* ps_;
  std::unique_ptr<Transformer> body_;
};

// Host patchify: images (B, ch, S, S) f32 -> (B * G*G, ch*P*P) f32 in the layout stated above.
Tensor patchify(const Tensor& images, int64_t patch_size);

}  // namespace ndt
