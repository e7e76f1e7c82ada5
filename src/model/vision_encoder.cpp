#include "model/vision_encoder.h"

#include <vector>

#include "ops/ops.h"

namespace ndt {

Tensor patchify(const Tensor& images, int64_t P) {
  NDT_CHECK(images.dim() == 4 && images.dtype() == DType::F32 && images.device() == Device::CPU,
            "images must be host f32 (B, channels, H, W), got {} {} on {}", dtype_name(images.dtype()),
            shape_str(images.shape()), device_name(images.device()));
  const int64_t B = images.size(0), ch = images.size(1), S = images.size(2);
  NDT_CHECK(images.size(3) == S && S % P == 0, "images must be square with a side divisible by {}, got {}", P,
            shape_str(images.shape()));
  const int64_t G = S / P, N = G * G, K = ch * P * P;
  Tensor out = Tensor::empty({B * N, K});
  const float* src = images.f32();
  float* dst = out.f32();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t gy = 0; gy < G; ++gy)
      for (int64_t gx = 0; gx < G; ++gx) {
        float* row = dst + (b * N + gy * G + gx) * K;
        for (int64_t c = 0; c < ch; ++c)
          for (int64_t py = 0; py < P; ++py) {
            const float* line = src + ((b * ch + c) * S + gy * P + py) * S + gx * P;
            for (int64_t px = 0; px < P; ++px) row[(c * P + py) * P + px] = line[px];
          }
      }
  return out;
}

VisionEncoder::VisionEncoder(const EncoderConfig& cfg, int64_t llm_d_model, double norm_eps, double init_std,
                             TpHooks* tp, ParamStore& store)
    : cfg_(cfg),
      llm_c_(llm_d_model),
      eps_(static_cast<float>(norm_eps)),
      tp_(tp ? tp : &default_tp_),
      ps_(&store) {
  NDT_CHECK(cfg_.style == "gpt2" || cfg_.style == "llama", "encoder style must be gpt2 or llama, got {}",
            cfg_.style);
  NDT_CHECK(cfg_.image_size > 0 && cfg_.patch_size > 0 && cfg_.image_size % cfg_.patch_size == 0,
            "encoder image_size {} must be a positive multiple of patch_size {}", cfg_.image_size,
            cfg_.patch_size);
  NDT_CHECK(cfg_.channels > 0 && cfg_.n_heads > 0 && cfg_.d_model % cfg_.n_heads == 0 && llm_c_ > 0,
            "encoder: channels {}, d_model {} (divisible by n_heads {}), LLM d_model {} must be positive",
            cfg_.channels, cfg_.d_model, cfg_.n_heads, llm_c_);
  // Sequence parallelism would shard the tokens between the replicated pieces (patch embedding, final
  // norm) and need their gradients reduced; the encoder is small enough not to want it.
  NDT_CHECK(!tp_->sequence_parallel(), "the vision encoder does not support sequence parallelism");
  const int64_t tps = tp_->size(), r = tp_->rank();
  const int64_t C = cfg_.d_model, N = cfg_.patches(), K = cfg_.patch_dim();
  const int64_t Hp = cfg_.projector_hidden > 0 ? cfg_.projector_hidden : llm_c_;
  NDT_CHECK(Hp % tps == 0, "tp={} must divide the projector width {}", tps, Hp);
  hidden_local_ = Hp / tps;
  const float std = static_cast<float>(init_std);

  // Pixels enter through a K-wide linear map: at the transformer's std (0.02) an image's signal would sit
  // below the position table's and the LLM learns to ignore it; 1/sqrt(K) (a conv's default fan-in scale)
  // gives unit-variance patch features.
  store.add("encoder.patch_embed.weight", {C, K}, InitKind::Normal, 1.0f / std::sqrt(static_cast<float>(K)),
            true);
  store.add("encoder.patch_embed.bias", {C}, InitKind::Zeros, 0, false);
  store.add("encoder.positions.weight", {N, C}, InitKind::Normal, std, true);

  // The body is the LLM's own block code, headless, under the encoder's names and without a causal mask.
  ModelConfig m;
  m.style = cfg_.style;
  m.vocab_size = tps;  // never used without embedding and head; must only divide over TP
  m.d_model = C;
  m.n_layers = cfg_.n_layers;
  m.n_heads = cfg_.n_heads;
  m.n_kv_heads = 0;
  m.d_ff = cfg_.d_ff;
  m.max_seq_len = N;
  m.norm_eps = norm_eps;
  m.init_std = init_std;
  m.param_prefix = "encoder.";
  m.causal = false;
  body_ = std::make_unique<Transformer>(m, StageSpec{0, cfg_.n_layers, false, false}, tp, &store);

  store.add("encoder.final_norm.weight", {C}, InitKind::Ones, 0, false);
  if (gpt2()) store.add("encoder.final_norm.bias", {C}, InitKind::Zeros, 0, false);
  // fc1 column-parallel (output features split), fc2 row-parallel (input features split).
  store.add("projector.fc1.weight", {Hp, C}, InitKind::Normal, std, true, 0, tps, r);
  store.add("projector.fc1.bias", {Hp}, InitKind::Zeros, 0, false, 0, tps, r);
  store.add("projector.fc2.weight", {llm_c_, Hp}, InitKind::Normal, std, true, 1, tps, r);
  store.add("projector.fc2.bias", {llm_c_}, InitKind::Zeros, 0, false);
}

Tensor VisionEncoder::forward(const Tensor& images, EncoderActs& acts) {
  NDT_CHECK(images.dim() == 4 && images.size(0) > 0 && images.size(1) == cfg_.channels &&
                images.size(2) == cfg_.image_size && images.size(3) == cfg_.image_size,
            "images must be (B, {}, {}, {}), got {}", cfg_.channels, cfg_.image_size, cfg_.image_size,
            shape_str(images.shape()));
  const int64_t B = images.size(0), N = patches(), T = B * N, C = cfg_.d_model;
  acts = EncoderActs();
  acts.B = B;

  // One sequence per image: attention stays inside an image; positions are the patch index (RoPE).
  Microbatch& mb = acts.mb;
  std::vector<int32_t> pos(static_cast<size_t>(T)), cu(static_cast<size_t>(B + 1));
  for (int64_t t = 0; t < T; ++t) pos[static_cast<size_t>(t)] = static_cast<int32_t>(t % N);
  for (int64_t b = 0; b <= B; ++b) cu[static_cast<size_t>(b)] = static_cast<int32_t>(b * N);
  mb.tokens = Tensor::zeros({T}, DType::I32);
  mb.positions = Tensor::from_vector(pos, {T});
  mb.cu_seqlens = Tensor::from_vector(cu, {B + 1});
  mb.nseq = B;
  mb.max_seqlen = N;
  mb.seq_real.assign(static_cast<size_t>(B), static_cast<int32_t>(N));
  for (int64_t b = 0; b < B; ++b) mb.sample_ids.push_back(b);

  // Patchify on the host (a pure reshuffle), then one upload in the compute dtype.
  const Tensor host = patchify(images, cfg_.patch_size).to(ps_->device());
  if (ps_->compute_dtype() == DType::F32) {
    acts.patches = host;
  } else {
    acts.patches = act(host.shape());
    ops::cast_into(acts.patches, host);
  }

  Tensor x = act({T, C});
  ops::linear_forward(x, acts.patches, p("encoder.patch_embed.weight").compute_value(),
                      &p("encoder.patch_embed.bias").compute_value());
  ops::add_position_embedding_forward(x, mb.positions, p("encoder.positions.weight").compute_value());
  acts.x_final = body_->forward(mb, x, acts.body);

  acts.fn = act({T, C});
  acts.fn_rstd = stat({T});
  if (gpt2()) {
    acts.fn_mean = stat({T});
    ops::layernorm_forward(acts.fn, acts.fn_mean, acts.fn_rstd, acts.x_final,
                           p("encoder.final_norm.weight").compute_value(),
                           p("encoder.final_norm.bias").compute_value(), eps_);
  } else {
    ops::rmsnorm_forward(acts.fn, acts.fn_rstd, acts.x_final, p("encoder.final_norm.weight").compute_value(),
                         eps_);
  }

  acts.p_in = tp_->enter_forward(acts.fn);
  acts.fc1 = act({T, hidden_local_});
  acts.act = act({T, hidden_local_});
  ops::linear_forward(acts.fc1, acts.p_in, p("projector.fc1.weight").compute_value(),
                      &p("projector.fc1.bias").compute_value());
  ops::gelu_forward(acts.act, acts.fc1);
  Tensor partial = act({T, llm_c_});
  ops::linear_forward(partial, acts.act, p("projector.fc2.weight").compute_value(), nullptr);
  Tensor y = tp_->exit_forward(partial);
  // The replicated bias joins after the reduction (else it would be counted tp times). ops has no plain
  // broadcast bias add, so it rides on the residual-add kernel with a zero residual.
  return ops::add(Tensor::zeros(y.shape(), y.dtype(), y.device()), y,
                  &p("projector.fc2.bias").compute_value());
}

void VisionEncoder::backward(const Tensor& dout, EncoderActs& acts) {
  const int64_t T = acts.B * patches(), C = cfg_.d_model;
  NDT_CHECK(acts.fc1.defined(), "VisionEncoder::backward without a forward (or its activations consumed)");
  NDT_CHECK(dout.dim() == 2 && dout.size(0) == T && dout.size(1) == llm_c_ &&
                dout.device() == ps_->device() && dout.dtype() == ps_->compute_dtype(),
            "dout must be ({}, {}) {} on {}, got {} {} on {}", T, llm_c_, dtype_name(ps_->compute_dtype()),
            device_name(ps_->device()), shape_str(dout.shape()), dtype_name(dout.dtype()),
            device_name(dout.device()));

  // Projector: out = exit(gelu(enter(fn) @ W1^T + b1) @ W2^T) + b2.
  ops::bias_backward(p("projector.fc2.bias").grad, dout);
  Tensor dm = tp_->exit_backward(dout);
  Tensor dact = act({T, hidden_local_});
  Param& w2 = p("projector.fc2.weight");
  ops::linear_backward(&dact, w2.grad, nullptr, dm, acts.act, w2.compute_value(), /*accumulate_dinp=*/false);
  Tensor dfc1 = act({T, hidden_local_});
  ops::gelu_backward(dfc1, dact, acts.fc1, /*accumulate=*/false);
  Param& w1 = p("projector.fc1.weight");
  Tensor dp_in = act({T, C});
  ops::linear_backward(&dp_in, w1.grad, &p("projector.fc1.bias").grad, dfc1, acts.p_in, w1.compute_value(),
                       /*accumulate_dinp=*/false);
  Tensor dfn = tp_->enter_backward(dp_in);  // sums the column shards' contributions

  Tensor dx = Tensor::zeros({T, C}, ps_->compute_dtype(), ps_->device());  // norm backward adds into it
  Param& nw = p("encoder.final_norm.weight");
  if (gpt2())
    ops::layernorm_backward(dx, nw.grad, p("encoder.final_norm.bias").grad, dfn, acts.x_final,
                            nw.compute_value(), acts.fn_mean, acts.fn_rstd);
  else
    ops::rmsnorm_backward(dx, nw.grad, dfn, acts.x_final, nw.compute_value(), acts.fn_rstd);

  Tensor dx0 = body_->backward(acts.mb, dx, 0.0f, acts.body);
  ops::add_position_embedding_backward(p("encoder.positions.weight").grad, dx0, acts.mb.positions);
  Param& pe = p("encoder.patch_embed.weight");
  ops::linear_backward(nullptr, pe.grad, &p("encoder.patch_embed.bias").grad, dx0, acts.patches,
                       pe.compute_value());
  acts = EncoderActs();
}

}  // namespace ndt
