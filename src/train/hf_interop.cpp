#include "train/hf_interop.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "train/hf_common.h"
#include "train/safetensors.h"

namespace fs = std::filesystem;

namespace ndt {
using hf_detail::HfWeights;
using hf_detail::read_as_f32;
namespace {

// One of our tensors and its Hugging Face counterpart(s). hf.size() == 1: the same tensor under another
// name. hf.size() > 1 (Mixtral experts): ours is stacked along dim 0 and hf[e] is its slice e.
struct Expected {
  std::string ours;
  std::vector<std::string> hf;
  Shape shape;  // ours (full)
};

// Every parameter of a full llama model (dense or MoE: routed experts only), in our registration order
// (model/transformer.cpp, model/moe.cpp).
std::vector<Expected> expected_params(const ModelConfig& cfg) {
  const int64_t C = cfg.d_model, D = cfg.head_dim(), H = cfg.n_heads, KV = cfg.kv_heads(), F = cfg.ffn_dim(),
                V = cfg.vocab_size, E = cfg.moe.num_experts, Fe = cfg.expert_ffn_dim();
  std::vector<Expected> out;
  auto one = [&](std::string ours, std::string hf, Shape shape) {
    out.push_back({std::move(ours), {std::move(hf)}, std::move(shape)});
  };
  one("embed.tokens.weight", "model.embed_tokens.weight", {V, C});
  for (int64_t l = 0; l < cfg.n_layers; ++l) {
    const std::string o = fmt::format("layers.{}.", l), h = fmt::format("model.layers.{}.", l);
    one(o + "attn_norm.weight", h + "input_layernorm.weight", {C});
    // The model's order: the three weights, then the biases.
    one(o + "attn.wq.weight", h + "self_attn.q_proj.weight", {H * D, C});
    one(o + "attn.wk.weight", h + "self_attn.k_proj.weight", {KV * D, C});
    one(o + "attn.wv.weight", h + "self_attn.v_proj.weight", {KV * D, C});
    if (cfg.qkv_bias) {
      one(o + "attn.wq.bias", h + "self_attn.q_proj.bias", {H * D});
      one(o + "attn.wk.bias", h + "self_attn.k_proj.bias", {KV * D});
      one(o + "attn.wv.bias", h + "self_attn.v_proj.bias", {KV * D});
    }
    one(o + "attn.wo.weight", h + "self_attn.o_proj.weight", {C, H * D});
    if (cfg.qk_norm) {  // Qwen3
      one(o + "attn.q_norm.weight", h + "self_attn.q_norm.weight", {D});
      one(o + "attn.k_norm.weight", h + "self_attn.k_norm.weight", {D});
    }
    one(o + "mlp_norm.weight", h + "post_attention_layernorm.weight", {C});
    if (!cfg.is_moe_layer(l)) {
      one(o + "mlp.w1.weight", h + "mlp.gate_proj.weight", {F, C});
      one(o + "mlp.w3.weight", h + "mlp.up_proj.weight", {F, C});
      one(o + "mlp.w2.weight", h + "mlp.down_proj.weight", {C, F});
      continue;
    }
    one(o + "mlp.router.weight", h + "block_sparse_moe.gate.weight", {E, C});
    auto stacked = [&](const char* w, Shape shape) {
      Expected e{fmt::format("{}mlp.experts.{}.weight", o, w), {}, std::move(shape)};
      for (int64_t x = 0; x < E; ++x)
        e.hf.push_back(fmt::format("{}block_sparse_moe.experts.{}.{}.weight", h, x, w));
      out.push_back(std::move(e));
    };
    stacked("w1", {E, Fe, C});
    stacked("w3", {E, Fe, C});
    stacked("w2", {E, C, Fe});
  }
  one("final_norm.weight", "model.norm.weight", {C});
  if (!cfg.tied()) one("lm_head.weight", "lm_head.weight", {V, C});
  return out;
}

// Shape of one slice along dim 0.
Shape slice_shape(const Shape& s) { return Shape(s.begin() + 1, s.end()); }

const std::map<std::string, std::string>& layer_map() {
  static const std::map<std::string, std::string> m = {
      {"attn_norm.weight", "input_layernorm.weight"},
      {"attn.wq.weight", "self_attn.q_proj.weight"},
      {"attn.wk.weight", "self_attn.k_proj.weight"},
      {"attn.wv.weight", "self_attn.v_proj.weight"},
      {"attn.wq.bias", "self_attn.q_proj.bias"},
      {"attn.wk.bias", "self_attn.k_proj.bias"},
      {"attn.wv.bias", "self_attn.v_proj.bias"},
      {"attn.wo.weight", "self_attn.o_proj.weight"},
      {"attn.q_norm.weight", "self_attn.q_norm.weight"},
      {"attn.k_norm.weight", "self_attn.k_norm.weight"},
      {"mlp_norm.weight", "post_attention_layernorm.weight"},
      {"mlp.w1.weight", "mlp.gate_proj.weight"},
      {"mlp.w3.weight", "mlp.up_proj.weight"},
      {"mlp.w2.weight", "mlp.down_proj.weight"},
      {"mlp.router.weight", "block_sparse_moe.gate.weight"},
      {"mlp.experts.w1.weight", "block_sparse_moe.experts.{e}.w1.weight"},
      {"mlp.experts.w3.weight", "block_sparse_moe.experts.{e}.w3.weight"},
      {"mlp.experts.w2.weight", "block_sparse_moe.experts.{e}.w2.weight"}};
  return m;
}

// Export restrictions of an MoE model: exactly what MixtralForCausalLM computes. "" when exportable.
std::string mixtral_export_problem(const ModelConfig& cfg) {
  const MoeConfig& m = cfg.moe;
  if (m.router != "softmax")
    return fmt::format("model.moe.router is '{}', Mixtral's router is softmax", m.router);
  if (!m.renormalize)
    return "model.moe.renormalize is false, Mixtral renormalizes the top-k gate weights (needs true)";
  if (m.shared_experts != 0)
    return fmt::format("model.moe.shared_experts is {}, Mixtral has no shared experts (needs 0)",
                       m.shared_experts);
  if (m.first_dense != 0)
    return fmt::format("model.moe.first_dense is {}, every Mixtral layer is MoE (needs 0)", m.first_dense);
  if (m.every != 1)
    return fmt::format("model.moe.every is {}, every Mixtral layer is MoE (needs 1)", m.every);
  if (m.capacity_factor != 0)
    return fmt::format("model.moe.capacity_factor is {}, Mixtral is dropless (needs 0)", m.capacity_factor);
  if (m.top_k < 1 || m.top_k > m.num_experts)
    return fmt::format("model.moe.top_k {} must be in [1, model.moe.num_experts = {}]", m.top_k,
                       m.num_experts);
  return "";
}

}  // namespace

std::string hf_name_for(const std::string& ours) {
  if (ours == "embed.tokens.weight") return "model.embed_tokens.weight";
  if (ours == "final_norm.weight") return "model.norm.weight";
  if (ours == "lm_head.weight") return "lm_head.weight";
  if (ours.rfind("layers.", 0) == 0) {
    size_t dot = ours.find('.', 7);
    if (dot == std::string::npos) return "";
    auto it = layer_map().find(ours.substr(dot + 1));
    if (it == layer_map().end()) return "";
    return "model." + ours.substr(0, dot + 1) + it->second;
  }
  return "";
}

Status export_hf(const std::string& out_dir, const ModelConfig& cfg,
                 const std::vector<std::pair<std::string, Tensor>>& full_params,
                 const HfExportOptions& opts) {
  if (cfg.is_gpt2()) return export_hf_gpt2(out_dir, cfg, full_params, opts);
  if (cfg.style != "llama")
    return Status::error(
        fmt::format("export_hf: style {} has no Hugging Face counterpart (llama and gpt2 do)", cfg.style));
  if (cfg.n_heads <= 0 || (cfg.head_dim_override == 0 && cfg.d_model % cfg.n_heads != 0))
    return Status::error(
        fmt::format("export_hf: d_model {} is not a multiple of n_heads {} (and no model.head_dim)",
                    cfg.d_model, cfg.n_heads));
  const bool moe = cfg.moe.enabled();
  if (moe) {
    const std::string problem = mixtral_export_problem(cfg);
    if (!problem.empty())
      return Status::error("export_hf: an MoE model exports as MixtralForCausalLM only: " + problem);
  }
  if (moe && cfg.qkv_bias)
    return Status::error(
        "export_hf: model.qkv_bias with model.moe has no Hugging Face counterpart here "
        "(Qwen2 is dense, Mixtral has no biases)");
  if (cfg.qk_norm && moe)
    return Status::error(
        "export_hf: model.qk_norm with model.moe has no Hugging Face counterpart here (Qwen3 is dense; "
        "Qwen3-MoE is not supported)");
  if (cfg.qk_norm && cfg.qkv_bias)
    return Status::error(
        "export_hf: model.qk_norm with model.qkv_bias has no Hugging Face counterpart (Qwen3's "
        "attention_bias "
        "also adds an o_proj bias, which we do not have)");
  const bool qwen2 = cfg.qkv_bias, qwen3 = cfg.qk_norm;
  const char* arch = moe ? "Mixtral" : qwen3 ? "Qwen3" : qwen2 ? "Qwen2" : "Llama";
  std::map<std::string, Tensor> given;
  for (const auto& [name, t] : full_params) {
    if (!given.emplace(name, t).second)
      return Status::error(fmt::format("export_hf: parameter {} given twice", name));
  }
  std::vector<std::pair<std::string, Tensor>> out;
  for (const Expected& e : expected_params(cfg)) {
    auto it = given.find(e.ours);
    if (it == given.end()) return Status::error(fmt::format("export_hf: parameter {} is missing", e.ours));
    const Tensor& t = it->second;
    if (!t.defined() || t.dtype() != DType::F32 || t.device() != Device::CPU)
      return Status::error(fmt::format("export_hf: parameter {} must be a defined F32 CPU tensor", e.ours));
    if (t.shape() != e.shape)
      return Status::error(fmt::format("export_hf: parameter {} has shape {}, the config implies {}", e.ours,
                                       shape_str(t.shape()), shape_str(e.shape)));
    if (e.hf.size() == 1) {
      out.emplace_back(e.hf[0], t);
    } else {
      // Stacked experts: one HF tensor per expert, views of our (E, ...) tensor (no copy).
      const Shape piece = slice_shape(e.shape);
      const int64_t n = shape_numel(piece);
      for (size_t x = 0; x < e.hf.size(); ++x)
        out.emplace_back(e.hf[x], t.view_at(static_cast<int64_t>(x) * n, piece));
    }
    given.erase(it);
  }
  if (!given.empty())
    return Status::error(
        fmt::format("export_hf: parameter {} has no Hugging Face {} counterpart{}", given.begin()->first,
                    arch, given.begin()->first == "lm_head.weight" ? " (the config says tied)" : ""));
  nlohmann::ordered_json c;
  c["architectures"] = {std::string(arch) + "ForCausalLM"};
  c["model_type"] = moe ? "mixtral" : qwen3 ? "qwen3" : qwen2 ? "qwen2" : "llama";
  c["hidden_size"] = cfg.d_model;
  // Mixtral: the width of one expert (there is no dense MLP).
  c["intermediate_size"] = moe ? cfg.expert_ffn_dim() : cfg.ffn_dim();
  c["num_hidden_layers"] = cfg.n_layers;
  c["num_attention_heads"] = cfg.n_heads;
  c["num_key_value_heads"] = cfg.kv_heads();
  c["head_dim"] = cfg.head_dim();
  c["vocab_size"] = cfg.vocab_size;
  c["max_position_embeddings"] = cfg.max_seq_len;
  c["rms_norm_eps"] = cfg.norm_eps;
  c["rope_theta"] = cfg.rope_theta;
  c["rope_scaling"] = nullptr;
  c["hidden_act"] = "silu";
  if (qwen2) {  // q/k/v biases are Qwen2's own, no key needed; full attention in every layer
    c["use_sliding_window"] = false;
  } else if (qwen3) {  // q/k norms are Qwen3's own; no biases (attention_bias would add q/k/v/o biases)
    c["attention_bias"] = false;
    c["use_sliding_window"] = false;
    c["sliding_window"] = nullptr;
  } else {
    c["attention_bias"] = false;
    c["mlp_bias"] = false;
  }
  c["initializer_range"] = cfg.init_std;
  c["tie_word_embeddings"] = cfg.tied();
  if (moe) {
    c["num_local_experts"] = cfg.moe.num_experts;
    c["num_experts_per_tok"] = cfg.moe.top_k;
    c["router_aux_loss_coef"] = cfg.moe.aux_loss_coef;
    c["output_router_logits"] = false;
    c["router_jitter_noise"] = 0.0;
    c["sliding_window"] = nullptr;
  }
  return hf_detail::write_hf_dir(out_dir, c, std::move(out), opts);
}

Result<std::pair<ModelConfig, std::vector<std::pair<std::string, Tensor>>>> import_hf(
    const std::string& dir) {
  const std::string cpath = (fs::path(dir) / "config.json").string();
  auto cj = hf_detail::read_config_json(dir);
  if (!cj) return cj.status();
  const nlohmann::json& c = cj.value();
  const bool gpt2_arch = c.contains("architectures") && c["architectures"].is_array() &&
                         std::find(c["architectures"].begin(), c["architectures"].end(), "GPT2LMHeadModel") !=
                             c["architectures"].end();
  if ((c.contains("model_type") && c["model_type"] == "gpt2") || (!c.contains("model_type") && gpt2_arch))
    return import_hf_gpt2(dir, c);
  ModelConfig cfg;
  cfg.style = "llama";
  bool mixtral = false, qwen2 = false, qwen3 = false;
  std::string key;
  try {
    // Sizes are integers in [1, max] (the bounds of the matching config keys, train/config.cpp): a float
    // or an absurd value is refused before it sizes anything.
    auto need_int = [&](const char* k, int64_t max) -> int64_t {
      key = k;
      if (!c.contains(k)) throw Error(fmt::format("import_hf: '{}': missing key \"{}\"", cpath, k));
      return hf_detail::json_size(c.at(k), cpath, k, max);
    };
    key = "model_type";
    if (c.contains("model_type")) {
      const std::string mt = c["model_type"].get<std::string>();
      if (mt != "llama" && mt != "mixtral" && mt != "qwen2" && mt != "qwen3")
        return Status::error(
            fmt::format("import_hf: '{}': model_type is \"{}\", only \"llama\", \"mixtral\", \"qwen2\", "
                        "\"qwen3\" and \"gpt2\" are supported",
                        cpath, mt));
      mixtral = mt == "mixtral";
      qwen2 = mt == "qwen2";
      qwen3 = mt == "qwen3";
    } else if (c.contains("architectures")) {
      key = "architectures";
      for (const auto& a : c["architectures"])
        if (a.get<std::string>() == "MixtralForCausalLM")
          mixtral = true;
        else if (a.get<std::string>() == "Qwen2ForCausalLM")
          qwen2 = true;
        else if (a.get<std::string>() == "Qwen3ForCausalLM")
          qwen3 = true;
    }
    cfg.d_model = need_int("hidden_size", 1 << 20);
    cfg.d_ff = need_int("intermediate_size", 1 << 22);
    cfg.n_layers = need_int("num_hidden_layers", 4096);
    cfg.n_heads = need_int("num_attention_heads", 4096);
    cfg.vocab_size = need_int("vocab_size", int64_t{1} << 31);
    cfg.n_kv_heads = c.contains("num_key_value_heads") && !c["num_key_value_heads"].is_null()
                         ? need_int("num_key_value_heads", 4096)
                         : cfg.n_heads;
    // Absent keys take the transformers config class's defaults (LlamaConfig / MixtralConfig / Qwen2Config /
    // Qwen3Config).
    cfg.max_seq_len = c.contains("max_position_embeddings") ? need_int("max_position_embeddings", 1 << 24)
                                                            : (mixtral          ? 4096 * 32
                                                               : qwen2 || qwen3 ? 32768
                                                                                : 2048);
    cfg.qkv_bias = qwen2;
    cfg.qk_norm = qwen3;
    key = "rms_norm_eps";
    cfg.norm_eps = c.value("rms_norm_eps", mixtral ? 1e-5 : 1e-6);
    key = "rope_theta";
    cfg.rope_theta = c.value("rope_theta", mixtral ? 1e6 : 10000.0);
    key = "tie_word_embeddings";
    cfg.tie_embeddings = c.value("tie_word_embeddings", false) ? 1 : 0;
    key = "initializer_range";
    cfg.init_std = c.value("initializer_range", 0.02);
    key = "hidden_act";
    if (c.contains("hidden_act") && c["hidden_act"].get<std::string>() != "silu")
      return Status::error(fmt::format("import_hf: '{}': hidden_act \"{}\" is not supported (only silu)",
                                       cpath, c["hidden_act"].get<std::string>()));
    key = "use_sliding_window";
    if ((qwen2 || qwen3) && c.value("use_sliding_window", false))
      return Status::error(fmt::format(
          "import_hf: '{}': \"use_sliding_window\": true is not supported: attention is full causal", cpath));
    key = "layer_types";
    if (c.contains("layer_types") && !c["layer_types"].is_null())
      for (const auto& t : c["layer_types"])
        if (t.get<std::string>() != "full_attention")
          return Status::error(fmt::format(
              "import_hf: '{}': layer_types \"{}\" is not supported: attention is full causal in every layer",
              cpath, t.get<std::string>()));
    for (const char* k : {"attention_bias", "mlp_bias"}) {
      key = k;
      if (!qwen2 && c.value(k, false))
        return Status::error(fmt::format("import_hf: '{}': \"{}\": true is not supported (no biases{})",
                                         cpath, k,
                                         qwen3 ? "; Qwen3's attention_bias also adds an o_proj bias" : ""));
    }
    key = "rope_scaling";
    if (c.contains("rope_scaling") && !c["rope_scaling"].is_null())
      return Status::error(fmt::format("import_hf: '{}': \"rope_scaling\" is not supported", cpath));
    // transformers >= 5 writes rope_parameters {rope_theta, rope_type} instead of a top-level rope_theta.
    key = "rope_parameters";
    if (c.contains("rope_parameters") && !c["rope_parameters"].is_null()) {
      const nlohmann::json& rp = c["rope_parameters"];
      const std::string type = rp.value("rope_type", std::string("default"));
      if (type != "default")
        return Status::error(fmt::format(
            "import_hf: '{}': \"rope_parameters\" with rope_type \"{}\" is not supported (only default)",
            cpath, type));
      if (rp.contains("rope_theta")) cfg.rope_theta = rp["rope_theta"].get<double>();
    }
    // The head width: config.json's head_dim where given (it may differ from hidden_size /
    // num_attention_heads: Qwen3-0.6B has 1024 / 16 with head_dim 128); absent, Qwen3Config's default 128,
    // the other families' hidden_size / num_attention_heads. Kept as model.head_dim only where it differs.
    key = "head_dim";
    int64_t head_dim = 0;
    if (c.contains("head_dim") && !c["head_dim"].is_null())
      head_dim = need_int("head_dim", 1 << 20);
    else if (qwen3)
      head_dim = 128;
    if ((head_dim == 0 && cfg.d_model % cfg.n_heads != 0) || cfg.n_heads % cfg.n_kv_heads != 0)
      return Status::error(
          fmt::format("import_hf: '{}': hidden_size {} / num_attention_heads {} / num_key_value_heads {} are "
                      "inconsistent",
                      cpath, cfg.d_model, cfg.n_heads, cfg.n_kv_heads));
    if (head_dim > 0 && !(cfg.d_model % cfg.n_heads == 0 && head_dim == cfg.d_model / cfg.n_heads))
      cfg.head_dim_override = head_dim;
    if (cfg.head_dim() % 2 != 0)
      return Status::error(fmt::format("import_hf: '{}': head_dim {} must be even (RoPE rotates pairs)",
                                       cpath, cfg.head_dim()));
    if (mixtral) {
      // Mixtral: every layer is MoE; softmax router over all experts, top-k, gates renormalized.
      MoeConfig& m = cfg.moe;
      m.num_experts = need_int("num_local_experts", 65536);
      m.top_k = need_int("num_experts_per_tok", 65536);
      m.d_ff_expert = cfg.d_ff;
      m.router = "softmax";
      m.renormalize = true;
      m.shared_experts = 0;
      m.first_dense = 0;
      m.every = 1;
      m.capacity_factor = 0;
      m.z_loss_coef = 0;
      key = "router_aux_loss_coef";
      m.aux_loss_coef = c.value("router_aux_loss_coef", 0.001);
      if (m.aux_loss_coef < 0)
        return Status::error(fmt::format("import_hf: '{}': \"router_aux_loss_coef\" must be >= 0, got {}",
                                         cpath, m.aux_loss_coef));
      if (m.top_k > m.num_experts)
        return Status::error(
            fmt::format("import_hf: '{}': num_experts_per_tok {} exceeds num_local_experts {}", cpath,
                        m.top_k, m.num_experts));
      key = "sliding_window";
      if (c.contains("sliding_window") && !c["sliding_window"].is_null() &&
          (!c["sliding_window"].is_number() || c["sliding_window"].get<double>() < cfg.max_seq_len))
        return Status::error(fmt::format(
            "import_hf: '{}': \"sliding_window\" {} (below max_position_embeddings {}) is not supported: "
            "attention is full causal",
            cpath, c["sliding_window"].dump(), cfg.max_seq_len));
    }
  } catch (const nlohmann::json::exception& e) {
    return Status::error(fmt::format("import_hf: '{}': bad value for \"{}\": {}", cpath, key, e.what()));
  } catch (const Error& e) {
    return Status::error(e.what());
  }

  auto f = HfWeights::open(dir);
  if (!f) return Status::error("import_hf: " + f.status().message());
  const HfWeights& file = f.value();
  const std::string mpath = file.describe();
  // The tensors config.json implies, counted before they are listed: a layer or expert count far beyond the
  // weights is refused here rather than listing ~n_layers * 3 * num_experts names (a smaller mismatch is
  // reported below with the first missing tensor).
  {
    const int64_t per_layer =
        7 + (cfg.qkv_bias ? 3 : 0) + (cfg.moe.enabled() ? 1 + 3 * cfg.moe.num_experts : 3);
    const int64_t implied = 2 + (cfg.tied() ? 0 : 1) + cfg.n_layers * per_layer;
    const auto held = static_cast<int64_t>(file.names().size());
    if (implied > held && implied > 65536)
      return Status::error(fmt::format("import_hf: '{}': config.json implies {} tensors, the weights hold {}",
                                       mpath, implied, held));
  }
  std::vector<std::pair<std::string, Tensor>> out;
  std::set<std::string> used;
  try {
    for (const Expected& e : expected_params(cfg)) {
      const Shape piece = e.hf.size() == 1 ? e.shape : slice_shape(e.shape);
      for (const std::string& hf : e.hf) {
        if (!file.contains(hf))
          return Status::error(
              fmt::format("import_hf: '{}': tensor {} (ours: {}) is missing", mpath, hf, e.ours));
        const Shape& got = file.info(hf).shape;
        if (got != piece)
          return Status::error(fmt::format("import_hf: '{}': tensor {} has shape {}, config.json implies {}",
                                           mpath, hf, shape_str(got), shape_str(piece)));
      }
      Tensor t = Tensor::empty(e.shape);
      const int64_t n = shape_numel(piece);
      for (size_t x = 0; x < e.hf.size(); ++x) {
        Tensor dst = e.hf.size() == 1 ? t : t.view_at(static_cast<int64_t>(x) * n, piece);
        read_as_f32(file, e.hf[x], dst);
        used.insert(e.hf[x]);
      }
      out.emplace_back(e.ours, std::move(t));
    }
  } catch (const Error& e) {
    return Status::error(fmt::format("import_hf: {}", e.what()));
  }
  for (const std::string& n : file.names()) {
    if (used.count(n)) continue;
    if (n.size() >= 19 && n.compare(n.size() - 19, 19, "rotary_emb.inv_freq") == 0)
      continue;                                         // buffer, not a weight
    if (n == "lm_head.weight" && cfg.tied()) continue;  // some tied exports still store the head
    return Status::error(
        fmt::format("import_hf: '{}': unexpected tensor {} (not part of a {} with this config)", mpath, n,
                    mixtral ? "Mixtral"
                    : qwen3 ? "Qwen3"
                    : qwen2 ? "Qwen2"
                            : "plain Llama"));
  }
  return std::make_pair(cfg, std::move(out));
}

}  // namespace ndt
