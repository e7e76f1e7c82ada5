#pragma once
// A decoder-only transformer (GPT-2 or Llama style) written for ONE device with explicit forward and
// backward passes and typed saved activations. Tensor parallelism enters only through TpHooks (local
// shapes: Hl = H/tp heads, KVl, Fl, Vl); pipeline parallelism through StageSpec (which layers, and
// whether this stage owns the embedding and/or the head). Backward accumulates into Param::grad.
//
// D is the head width (ModelConfig::head_dim()); the attention width H*D need not equal C (Qwen3).
// Data layout is THD: all sequences of a microbatch end to end, T tokens, with cu_seqlens.
// Under sequence parallelism the residual stream holds this rank's Tl = T/tp tokens; otherwise Tl = T.
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <vector>

#include "core/tensor.h"
#include "data/dataset.h"
#include "model/cp_hooks.h"
#include "model/embed_hooks.h"
#include "model/embedding_grad_hook.h"
#include "model/ep_hooks.h"
#include "model/kv_hooks.h"
#include "model/moe.h"
#include "model/params.h"
#include "model/tp_hooks.h"
#include "train/config.h"

namespace ndt {

struct StageSpec {
  int64_t first_layer = 0;
  int64_t last_layer = -1;  // exclusive; -1 = n_layers
  bool has_embedding = true;
  bool has_head = true;
};

struct LayerActs {
  Tensor x_in;                  // (Tl, C) layer input (residual stream)
  Tensor n1, n1_mean, n1_rstd;  // (Tl, C), (Tl), (Tl) attention norm
  Tensor a_in;                  // (T, C) attention input after `enter`
  Tensor q, k, v;               // (T, Hl, D), (T, KVl, D), (T, KVl, D), after RoPE
  // model.qk_norm (Qwen3): the projections before the per-head RMSNorm and its statistics.
  Tensor q_raw, k_raw;          // (T, Hl, D), (T, KVl, D)
  Tensor q_rstd, k_rstd;        // (T * Hl), (T * KVl)
  Tensor att, lse;              // (T, Hl, D), (T, Hl)
  Tensor h;                     // (Tl, C) after the attention residual
  Tensor n2, n2_mean, n2_rstd;  // MLP norm
  Tensor m_in;                  // (T, C)
  Tensor fc1, fc3;              // (T, Fl): gpt2 pre-GELU / llama gate; llama up
  Tensor act;                   // (T, Fl) activation output
  MoeActs moe;                  // MoE layers: the routed experts (fc1/fc3/act then hold the shared experts)
};

struct Activations {
  std::vector<LayerActs> layers;
  Tensor x_final;               // (Tl, C) input to the final norm
  Tensor fn, fn_mean, fn_rstd;  // final norm
  Tensor head_in;               // (T, C)
  Tensor logits;                // (T, Vl) this rank's vocab columns
  Tensor rowmax, sumexp;        // (T) reduced over TP
  Tensor logprob;               // (T) log p(target) per token (all TP ranks hold it)
  // Set before forward by a caller that runs backward next with the loss mask as its seed (training):
  // on one TP rank the forward then stops at the logits, and backward takes the loss and its gradient in
  // one kernel (logprob and loss_sum valid after backward). Forward clears it when it cannot (TP).
  bool loss_in_backward = false;
};

class Transformer {
 public:
  // tp may be null (one rank). Parameters are registered with TP shapes but not initialized: call
  // params().init(seed). `store`, when given, receives the parameters instead of an own store, so the
  // model chunks a pipeline rank holds can share one store (and one optimizer).
  // ep (may be null: one rank) holds this rank's share of the routed experts of MoE layers.
  Transformer(const ModelConfig& cfg, StageSpec stage, TpHooks* tp, ParamStore* store = nullptr,
              EpHooks* ep = nullptr);

  ParamStore& params() { return *ps_; }
  // Context parallelism: attention goes through `cp` (not owned; null = local attention).
  void set_cp(CpHooks* cp) { cp_ = cp; }
  // Cached generation: attention goes through `kv` (not owned; null = none), which keeps the keys and
  // values of earlier tokens; the microbatch then holds only new tokens at absolute positions.
  void set_kv_cache(KvHooks* kv) { kv_ = kv; }
  // Multimodal: rows of the first stage's input come from `embeds` (not owned; null = none).
  void set_embed_hooks(EmbedHooks* embeds) { embeds_ = embeds; }
  // MoE: the step's normalisers and statistics switch (not owned; null = no aux/z gradient, no stats).
  void set_moe_context(MoeStepContext* ctx);
  // The MoE layers of this stage by global layer index.
  const std::map<int64_t, std::unique_ptr<MoeLayer>>& moe_layers() const { return moe_; }
  // Activation recomputation: forward keeps only each layer's input; backward reruns the layer's forward
  // before its backward (same values, so the same gradients) for less activation memory.
  void set_recompute(bool on) { recompute_ = on; }
  // Called by backward() with each layer index once that layer's backward has been enqueued (its
  // parameter gradients are then complete for this microbatch); null = none.
  void set_layer_done_hook(std::function<void(int64_t)> hook) { layer_done_ = std::move(hook); }
  // Called by backward() on the last stage once the head's and the final norm's backward are enqueued
  // (their gradients, and the tied embedding's head part, complete for this microbatch); null = none.
  void set_head_done_hook(std::function<void()> hook) { head_done_ = std::move(hook); }
  // The first stage's token-embedding table gradient goes through `hook` (not owned; null = this rank's
  // rows by ops::embedding_backward).
  void set_embedding_grad_hook(EmbeddingGradHook* hook) { embedding_grad_ = hook; }
  const ModelConfig& config() const { return cfg_; }
  const StageSpec& stage() const { return stage_; }
  int64_t local_vocab() const { return vocab_local_; }
  int64_t vocab_start() const { return vocab_start_; }

  // Runs this stage. x_in (Tl, C) is the previous stage's output (ignored on the first stage).
  // Returns the stage output (Tl, C); on the last stage also fills acts.logprob from mb.targets.
  Tensor forward(const Microbatch& mb, const Tensor& x_in, Activations& acts);
  // Sum over loss-bearing tokens of -log p(target) (last stage, after forward). Double accumulation.
  double loss_sum(const Microbatch& mb, const Activations& acts) const;
  // acc (F64, one element, on the model's device) += loss_sum(mb, acts), without waiting for the device.
  void add_loss_sum(Tensor& acc, const Microbatch& mb, const Activations& acts) const;
  // Backward of this stage. On the last stage the loss gradient is seeded as loss_scale for every
  // loss-bearing token (loss_scale = 1 / tokens in the global batch) and dy is ignored; otherwise dy
  // (Tl, C) is the gradient of the stage output. Returns the gradient of x_in (first stage: undefined).
  // Consumes acts (layer activations are freed as it goes; the logits buffer becomes their gradient).
  //
  // Device and precision come from the parameter store (ParamStore::to_device): activations are
  // allocated there in its compute dtype, statistics (norm rstd, lse, softmax pieces, logprob) in f32;
  // microbatch tensors stay on the host (the ops upload what they need).
  // dloss (last stage, optional): a host f32 (T) tensor of per-row seeds dL/d(-log p(target)) from a
  // token loss (train/token_loss.h), used instead of loss_scale * loss_mask.
  Tensor backward(const Microbatch& mb, const Tensor& dy, float loss_scale, Activations& acts,
                  const Tensor* dloss = nullptr);
  // Greedy next token at the given token rows (global vocabulary ids, ties to the smallest id),
  // from acts.logits of the last forward (last stage).
  std::vector<int32_t> argmax_rows(const Activations& acts, const std::vector<int64_t>& rows) const;
  // The k largest logits of every row of the last forward (last stage), values descending with ties to
  // the smaller global id: values/ids (T, k). Collective over TP (shards' candidates are merged).
  void topk_rows(const Activations& acts, int64_t k, std::vector<float>& values,
                 std::vector<int32_t>& ids) const;

 private:
  Tensor layer_forward(int64_t l, const Microbatch& mb, const Tensor& x, LayerActs& a);
  Tensor layer_backward(int64_t l, const Microbatch& mb, const Tensor& dout, LayerActs& a);
  // The dense MLP (or an MoE layer's shared experts) under `prefix` with local width fl: the norm output
  // a.n2 -> the TP-reduced block output without its output bias; backward returns the norm-output grad.
  // residual (one TP rank): returns residual + that output + the down projection's bias, summed in the
  // down projection's matmul (in cached forwards without that bias, into *residual itself).
  Tensor mlp_forward(const std::string& prefix, int64_t fl, LayerActs& a, Tensor* residual = nullptr);
  // out_bias_done: the output bias's gradient was summed already (folded_mlp_bias).
  Tensor mlp_backward(const std::string& prefix, int64_t fl, const Tensor& dout, LayerActs& a,
                      bool out_bias_done = false);
  // Layer l's dense MLP output bias when its output gradient comes from a norm backward on this stage (the
  // next layer's attention norm, or the final norm): that norm's pass sums the bias gradient (one column-sum
  // pass fewer a layer on the GPU). Null otherwise (the gradient comes from another stage; an MoE layer).
  Param* folded_mlp_bias(int64_t l);
  void mlp_params(const std::string& prefix, int64_t width);
  // The q/k/v bias gradients from the fused [dq | dk | dv] when the biases are not back to back in the store.
  void qkv_bias_grads(const std::string& pre, const Tensor& dqkv);
  // model.qk_norm: RMSNorm over D of every head of raw (T, heads, D) with the weight prefix.weight (D),
  // shared by the heads; out fresh (T, heads, D), rstd (T * heads). Backward: dx (T, heads, D) fresh.
  void head_norm_forward(const std::string& prefix, const Tensor& raw, Tensor& out, Tensor& rstd);
  Tensor head_norm_backward(const std::string& prefix, const Tensor& dout, const Tensor& raw,
                            const Tensor& rstd);
  void norm_forward(const std::string& prefix, const Tensor& x, Tensor& out, Tensor& mean, Tensor& rstd);
  // h = a + (b + rbias) and out = norm(h): one kernel on the GPU.
  void add_norm_forward(const std::string& prefix, const Tensor& a, const Tensor& b, const Tensor* rbias,
                        Tensor& h, Tensor& out, Tensor& mean, Tensor& rstd);
  // dx += norm input gradient; with dres, dx = *dres + norm input gradient (dx fresh, not read). With
  // dx_bias, that bias's gradient += the column sums of dx (the layer below's output bias).
  void norm_backward(const std::string& prefix, Tensor& dx, const Tensor& dout, const Tensor& x,
                     const Tensor& mean, const Tensor& rstd, const Tensor* dres = nullptr,
                     Param* dx_bias = nullptr);
  Param& p(const std::string& name) { return ps_->get(name); }
  // Parameters `pre + names` stored back to back (registration order: wq, wk, wv; w1, w3) as one (rows, C)
  // matrix of the compute copy, for one matmul in place of several; undefined when they are not contiguous
  // (a bias in between) or the store is not flat.
  Tensor fused_weight(const std::string& pre, std::initializer_list<const char*> names);
  // The fp32 gradients of the same parameters (2-D weights or 1-D biases) as one view of the store's flat
  // gradients, when they lie back to back there; undefined otherwise.
  Tensor fused_grad(const std::string& pre, std::initializer_list<const char*> names);
  const Tensor* bias(const std::string& name);
  // Activation / statistics buffers on the store's device (activations in its compute dtype).
  Tensor act(Shape s) const { return Tensor::empty(std::move(s), ps_->compute_dtype(), ps_->device()); }
  Tensor act_zeros(Shape s) const { return Tensor::zeros(std::move(s), ps_->compute_dtype(), ps_->device()); }
  Tensor stat(Shape s) const { return Tensor::empty(std::move(s), DType::F32, ps_->device()); }
  std::string lp(int64_t l) const { return cfg_.param_prefix + "layers." + std::to_string(l) + "."; }
  // Bidirectional attention (model.causal false): every key of the sequence is visible, the general form
  // with all positions 0 (pos_k <= pos_q everywhere).
  Tensor zero_positions(int64_t T) const { return Tensor::zeros({T}, DType::I32); }

  ModelConfig cfg_;
  StageSpec stage_;
  TpHooks default_tp_;
  TpHooks* tp_;
  CpHooks* cp_ = nullptr;
  KvHooks* kv_ = nullptr;
  EmbedHooks* embeds_ = nullptr;
  bool recompute_ = false;
  std::function<void(int64_t)> layer_done_;
  std::function<void()> head_done_;
  EmbeddingGradHook* embedding_grad_ = nullptr;
  ParamStore own_params_;
  ParamStore* ps_;
  int64_t heads_local_, kv_local_, ffn_local_, vocab_local_, vocab_start_;
  int64_t shared_local_ = 0;  // MoE shared experts' hidden width on this TP rank
  std::map<int64_t, std::unique_ptr<MoeLayer>> moe_;
  MoeStepContext* moe_ctx_ = nullptr;
};

}  // namespace ndt
