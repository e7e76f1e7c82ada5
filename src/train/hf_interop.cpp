#include "train/hf_interop.h"

#include <fmt/format.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "train/safetensors.h"

namespace fs = std::filesystem;

namespace ndt {
namespace {

struct Expected {
  std::string ours, hf;
  Shape shape;
};

// Every parameter of a full llama model, in our registration order.
std::vector<Expected> expected_params(const ModelConfig& cfg) {
  const int64_t C = cfg.d_model, D = cfg.head_dim(), H = cfg.n_heads, KV = cfg.kv_heads(), F = cfg.ffn_dim(),
                V = cfg.vocab_size;
  std::vector<Expected> out;
  out.push_back({"embed.tokens.weight", "model.embed_tokens.weight", {V, C}});
  for (int64_t l = 0; l < cfg.n_layers; ++l) {
    const std::string o = fmt::format("layers.{}.", l), h = fmt::format("model.layers.{}.", l);
    out.push_back({o + "attn_norm.weight", h + "input_layernorm.weight", {C}});
    out.push_back({o + "attn.wq.weight", h + "self_attn.q_proj.weight", {H * D, C}});
    out.push_back({o + "attn.wk.weight", h + "self_attn.k_proj.weight", {KV * D, C}});
    out.push_back({o + "attn.wv.weight", h + "self_attn.v_proj.weight", {KV * D, C}});
    out.push_back({o + "attn.wo.weight", h + "self_attn.o_proj.weight", {C, H * D}});
    out.push_back({o + "mlp_norm.weight", h + "post_attention_layernorm.weight", {C}});
    out.push_back({o + "mlp.w1.weight", h + "mlp.gate_proj.weight", {F, C}});
    out.push_back({o + "mlp.w3.weight", h + "mlp.up_proj.weight", {F, C}});
    out.push_back({o + "mlp.w2.weight", h + "mlp.down_proj.weight", {C, F}});
  }
  out.push_back({"final_norm.weight", "model.norm.weight", {C}});
  if (!cfg.tied()) out.push_back({"lm_head.weight", "lm_head.weight", {V, C}});
  return out;
}

const std::map<std::string, std::string>& layer_map() {
  static const std::map<std::string, std::string> m = {
      {"attn_norm.weight", "input_layernorm.weight"}, {"attn.wq.weight", "self_attn.q_proj.weight"},
      {"attn.wk.weight", "self_attn.k_proj.weight"},  {"attn.wv.weight", "self_attn.v_proj.weight"},
      {"attn.wo.weight", "self_attn.o_proj.weight"},  {"mlp_norm.weight", "post_attention_layernorm.weight"},
      {"mlp.w1.weight", "mlp.gate_proj.weight"},      {"mlp.w3.weight", "mlp.up_proj.weight"},
      {"mlp.w2.weight", "mlp.down_proj.weight"}};
  return m;
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
                 const std::vector<std::pair<std::string, Tensor>>& full_params) {
  if (cfg.style != "llama")
    return Status::error(fmt::format(
        "export_hf: only style llama models can be exported to Hugging Face format (this model is style {})",
        cfg.style));
  if (cfg.n_heads <= 0 || cfg.d_model % cfg.n_heads != 0)
    return Status::error(
        fmt::format("export_hf: d_model {} is not a multiple of n_heads {}", cfg.d_model, cfg.n_heads));
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
    out.emplace_back(e.hf, t);
    given.erase(it);
  }
  if (!given.empty())
    return Status::error(
        fmt::format("export_hf: parameter {} has no Hugging Face Llama counterpart{}", given.begin()->first,
                    given.begin()->first == "lm_head.weight" ? " (the config says tied)" : ""));
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) return Status::error(fmt::format("export_hf: cannot create '{}': {}", out_dir, ec.message()));
  nlohmann::ordered_json c;
  c["architectures"] = {"LlamaForCausalLM"};
  c["model_type"] = "llama";
  c["hidden_size"] = cfg.d_model;
  c["intermediate_size"] = cfg.ffn_dim();
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
  c["attention_bias"] = false;
  c["mlp_bias"] = false;
  c["initializer_range"] = cfg.init_std;
  c["tie_word_embeddings"] = cfg.tied();
  c["torch_dtype"] = "float32";
  const std::string cpath = (fs::path(out_dir) / "config.json").string();
  {
    std::ofstream f(cpath + ".tmp", std::ios::trunc);
    f << c.dump(2) << "\n";
    f.flush();
    if (!f) return Status::error(fmt::format("export_hf: cannot write '{}'", cpath));
  }
  fs::rename(cpath + ".tmp", cpath, ec);
  if (ec) return Status::error(fmt::format("export_hf: cannot write '{}': {}", cpath, ec.message()));
  // transformers requires metadata format=pt to load safetensors weights.
  return save_safetensors((fs::path(out_dir) / "model.safetensors").string(), out, {{"format", "pt"}});
}

Result<std::pair<ModelConfig, std::vector<std::pair<std::string, Tensor>>>> import_hf(
    const std::string& dir) {
  const std::string cpath = (fs::path(dir) / "config.json").string();
  const std::string mpath = (fs::path(dir) / "model.safetensors").string();
  std::ifstream cf(cpath);
  if (!cf) return Status::error(fmt::format("import_hf: cannot open '{}'", cpath));
  std::stringstream ss;
  ss << cf.rdbuf();
  nlohmann::json c = nlohmann::json::parse(ss.str(), nullptr, false);
  if (c.is_discarded() || !c.is_object())
    return Status::error(fmt::format("import_hf: '{}': invalid JSON", cpath));
  ModelConfig cfg;
  cfg.style = "llama";
  std::string key;
  try {
    auto need_int = [&](const char* k) -> int64_t {
      key = k;
      if (!c.contains(k)) throw Error(fmt::format("import_hf: '{}': missing key \"{}\"", cpath, k));
      int64_t v = c.at(k).get<int64_t>();
      if (v <= 0) throw Error(fmt::format("import_hf: '{}': \"{}\" must be positive, got {}", cpath, k, v));
      return v;
    };
    key = "model_type";
    if (c.contains("model_type") && c["model_type"].get<std::string>() != "llama")
      return Status::error(fmt::format("import_hf: '{}': model_type is \"{}\", only \"llama\" is supported",
                                       cpath, c["model_type"].get<std::string>()));
    cfg.d_model = need_int("hidden_size");
    cfg.d_ff = need_int("intermediate_size");
    cfg.n_layers = need_int("num_hidden_layers");
    cfg.n_heads = need_int("num_attention_heads");
    cfg.vocab_size = need_int("vocab_size");
    cfg.n_kv_heads = c.contains("num_key_value_heads") && !c["num_key_value_heads"].is_null()
                         ? need_int("num_key_value_heads")
                         : cfg.n_heads;
    cfg.max_seq_len = c.contains("max_position_embeddings") ? need_int("max_position_embeddings") : 2048;
    key = "rms_norm_eps";
    cfg.norm_eps = c.value("rms_norm_eps", 1e-6);
    key = "rope_theta";
    cfg.rope_theta = c.value("rope_theta", 10000.0);
    key = "tie_word_embeddings";
    cfg.tie_embeddings = c.value("tie_word_embeddings", false) ? 1 : 0;
    key = "initializer_range";
    cfg.init_std = c.value("initializer_range", 0.02);
    key = "hidden_act";
    if (c.contains("hidden_act") && c["hidden_act"].get<std::string>() != "silu")
      return Status::error(fmt::format("import_hf: '{}': hidden_act \"{}\" is not supported (only silu)",
                                       cpath, c["hidden_act"].get<std::string>()));
    for (const char* k : {"attention_bias", "mlp_bias"}) {
      key = k;
      if (c.value(k, false))
        return Status::error(
            fmt::format("import_hf: '{}': \"{}\": true is not supported (no biases)", cpath, k));
    }
    key = "rope_scaling";
    if (c.contains("rope_scaling") && !c["rope_scaling"].is_null())
      return Status::error(fmt::format("import_hf: '{}': \"rope_scaling\" is not supported", cpath));
    if (cfg.d_model % cfg.n_heads != 0 || cfg.n_heads % cfg.n_kv_heads != 0)
      return Status::error(
          fmt::format("import_hf: '{}': hidden_size {} / num_attention_heads {} / num_key_value_heads {} are "
                      "inconsistent",
                      cpath, cfg.d_model, cfg.n_heads, cfg.n_kv_heads));
    key = "head_dim";
    if (c.contains("head_dim") && !c["head_dim"].is_null() && c["head_dim"].get<int64_t>() != cfg.head_dim())
      return Status::error(
          fmt::format("import_hf: '{}': head_dim {} differs from hidden_size / num_attention_heads = {}",
                      cpath, c["head_dim"].get<int64_t>(), cfg.head_dim()));
  } catch (const nlohmann::json::exception& e) {
    return Status::error(fmt::format("import_hf: '{}': bad value for \"{}\": {}", cpath, key, e.what()));
  } catch (const Error& e) {
    return Status::error(e.what());
  }

  if (!fs::exists(mpath)) {
    if (fs::exists((fs::path(dir) / "model.safetensors.index.json")))
      return Status::error(
          fmt::format("import_hf: '{}' is missing; sharded Hugging Face checkpoints "
                      "(model.safetensors.index.json) are not supported",
                      mpath));
    return Status::error(fmt::format("import_hf: '{}' is missing", mpath));
  }
  auto f = open_safetensors(mpath);
  if (!f) return Status::error("import_hf: " + f.status().message());
  const SafetensorsFile& file = f.value();
  std::vector<std::pair<std::string, Tensor>> out;
  std::set<std::string> used;
  try {
    for (const Expected& e : expected_params(cfg)) {
      if (!file.contains(e.hf))
        return Status::error(
            fmt::format("import_hf: '{}': tensor {} (ours: {}) is missing", mpath, e.hf, e.ours));
      const SafetensorInfo& info = file.info(e.hf);
      if (info.shape != e.shape)
        return Status::error(fmt::format("import_hf: '{}': tensor {} has shape {}, config.json implies {}",
                                         mpath, e.hf, shape_str(info.shape), shape_str(e.shape)));
      Tensor t;
      if (info.dtype == DType::F32) {
        t = file.read(e.hf);
      } else if (info.dtype == DType::BF16) {
        Tensor raw = file.read(e.hf);
        t = Tensor::empty(e.shape);
        const uint16_t* src = raw.data<uint16_t>();
        float* dst = t.f32();
        for (int64_t i = 0; i < t.numel(); ++i) {
          uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
          std::memcpy(&dst[i], &bits, 4);
        }
      } else {
        return Status::error(
            fmt::format("import_hf: '{}': tensor {} has dtype {} (only F32 and BF16 are supported)", mpath,
                        e.hf, safetensors_dtype_name(info.dtype)));
      }
      used.insert(e.hf);
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
    return Status::error(fmt::format(
        "import_hf: '{}': unexpected tensor {} (not part of a plain Llama with this config)", mpath, n));
  }
  return std::make_pair(cfg, std::move(out));
}

}  // namespace ndt
