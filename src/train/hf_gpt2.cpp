// Hugging Face GPT-2 (GPT2LMHeadModel) export and import for style gpt2 models (docs/checkpoints.md).
//
// GPT-2 stores its linear layers as Conv1D, weight (in, out): ours (out, in) transposed. The attention's
// c_attn fuses q, k and v along the output: c_attn.weight = [wq; wk; wv]^T, c_attn.bias = [bq; bk; bv].
// We keep no key bias: q . (k_j + b_k) = q . k_j + q . b_k adds the same constant to all of a query's
// scores, which softmax ignores, so dropping a pretrained b_k on import changes no output (tested), and
// export writes zeros there.
#include <fmt/format.h>

#include <filesystem>
#include <map>
#include <set>

#include "train/hf_common.h"

namespace fs = std::filesystem;

namespace ndt {
namespace {

Tensor transposed(const Tensor& t) {  // (R, C) -> (C, R), host f32
  const int64_t R = t.size(0), C = t.size(1);
  Tensor out = Tensor::empty({C, R});
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < C; ++j) out.f32()[j * R + i] = t.f32()[i * C + j];
  return out;
}

// The HF tensor names of one layer.
std::string hl(const std::string& prefix, int64_t l, const char* rest) {
  return fmt::format("{}h.{}.{}", prefix, l, rest);
}

}  // namespace

Status export_hf_gpt2(const std::string& out_dir, const ModelConfig& cfg,
                      const std::vector<std::pair<std::string, Tensor>>& full_params,
                      const HfExportOptions& opts) {
  if (cfg.moe.enabled()) return Status::error("export_hf: GPT-2 has no Mixture-of-Experts form (model.moe)");
  if (cfg.kv_heads() != cfg.n_heads)
    return Status::error(
        fmt::format("export_hf: GPT-2 has no grouped-query attention (model.n_kv_heads {} != n_heads {})",
                    cfg.kv_heads(), cfg.n_heads));
  if (cfg.head_dim() * cfg.n_heads != cfg.d_model)
    return Status::error(fmt::format(
        "export_hf: GPT-2's head width is n_embd / n_head (model.head_dim {} * n_heads {} != d_model {})",
        cfg.head_dim(), cfg.n_heads, cfg.d_model));
  std::map<std::string, const Tensor*> p;
  for (const auto& [name, t] : full_params) p[name] = &t;
  std::set<std::string> used;
  auto get = [&](const std::string& n) -> const Tensor& {
    auto it = p.find(n);
    if (it == p.end()) throw Error(fmt::format("export_hf: parameter {} is missing", n));
    used.insert(n);
    return *it->second;
  };
  const int64_t C = cfg.d_model;
  std::vector<std::pair<std::string, Tensor>> out;
  try {
    const std::string t = "transformer.";
    out.emplace_back(t + "wte.weight", get("embed.tokens.weight"));
    out.emplace_back(t + "wpe.weight", get("embed.positions.weight"));
    for (int64_t l = 0; l < cfg.n_layers; ++l) {
      const std::string o = fmt::format("layers.{}.", l);
      out.emplace_back(hl(t, l, "ln_1.weight"), get(o + "attn_norm.weight"));
      out.emplace_back(hl(t, l, "ln_1.bias"), get(o + "attn_norm.bias"));
      Tensor qkv = Tensor::empty({3 * C, C}), bias = Tensor::zeros({3 * C});
      qkv.view_at(0, {C, C}).copy_from(get(o + "attn.wq.weight"));
      qkv.view_at(C * C, {C, C}).copy_from(get(o + "attn.wk.weight"));
      qkv.view_at(2 * C * C, {C, C}).copy_from(get(o + "attn.wv.weight"));
      bias.view_at(0, {C}).copy_from(get(o + "attn.wq.bias"));
      bias.view_at(2 * C, {C}).copy_from(get(o + "attn.wv.bias"));  // key bias: zeros (see above)
      out.emplace_back(hl(t, l, "attn.c_attn.weight"), transposed(qkv));
      out.emplace_back(hl(t, l, "attn.c_attn.bias"), bias);
      out.emplace_back(hl(t, l, "attn.c_proj.weight"), transposed(get(o + "attn.wo.weight")));
      out.emplace_back(hl(t, l, "attn.c_proj.bias"), get(o + "attn.wo.bias"));
      out.emplace_back(hl(t, l, "ln_2.weight"), get(o + "mlp_norm.weight"));
      out.emplace_back(hl(t, l, "ln_2.bias"), get(o + "mlp_norm.bias"));
      out.emplace_back(hl(t, l, "mlp.c_fc.weight"), transposed(get(o + "mlp.fc.weight")));
      out.emplace_back(hl(t, l, "mlp.c_fc.bias"), get(o + "mlp.fc.bias"));
      out.emplace_back(hl(t, l, "mlp.c_proj.weight"), transposed(get(o + "mlp.proj.weight")));
      out.emplace_back(hl(t, l, "mlp.c_proj.bias"), get(o + "mlp.proj.bias"));
    }
    out.emplace_back(t + "ln_f.weight", get("final_norm.weight"));
    out.emplace_back(t + "ln_f.bias", get("final_norm.bias"));
    if (!cfg.tied()) out.emplace_back("lm_head.weight", get("lm_head.weight"));
  } catch (const Error& e) {
    return Status::error(e.what());
  }
  for (const auto& [name, t] : full_params)
    if (!used.count(name))
      return Status::error(fmt::format("export_hf: parameter {} has no Hugging Face GPT-2 counterpart{}",
                                       name, name == "lm_head.weight" ? " (the config says tied)" : ""));
  nlohmann::ordered_json c;
  c["architectures"] = {"GPT2LMHeadModel"};
  c["model_type"] = "gpt2";
  c["n_embd"] = C;
  c["n_layer"] = cfg.n_layers;
  c["n_head"] = cfg.n_heads;
  c["n_inner"] = cfg.ffn_dim();
  c["n_positions"] = cfg.max_seq_len;
  c["n_ctx"] = cfg.max_seq_len;
  c["vocab_size"] = cfg.vocab_size;
  c["layer_norm_epsilon"] = cfg.norm_eps;
  c["activation_function"] = "gelu_new";  // the tanh approximation, ours
  c["resid_pdrop"] = 0.0;
  c["embd_pdrop"] = 0.0;
  c["attn_pdrop"] = 0.0;
  c["scale_attn_weights"] = true;
  c["initializer_range"] = cfg.init_std;
  c["tie_word_embeddings"] = cfg.tied();
  return hf_detail::write_hf_dir(out_dir, c, std::move(out), opts);
}

Result<std::pair<ModelConfig, std::vector<std::pair<std::string, Tensor>>>> import_hf_gpt2(
    const std::string& dir, const nlohmann::json& c) {
  const std::string cpath = (fs::path(dir) / "config.json").string();
  ModelConfig cfg;
  cfg.style = "gpt2";
  std::string key;
  try {
    // Integers in [1, max] (the bounds of the matching config keys, train/config.cpp).
    auto need_int = [&](const char* k, int64_t max) -> int64_t {
      key = k;
      if (!c.contains(k)) throw Error(fmt::format("import_hf: '{}': missing key \"{}\"", cpath, k));
      return hf_detail::json_size(c.at(k), cpath, k, max);
    };
    cfg.d_model = need_int("n_embd", 1 << 20);
    cfg.n_layers = need_int("n_layer", 4096);
    cfg.n_heads = need_int("n_head", 4096);
    cfg.vocab_size = need_int("vocab_size", int64_t{1} << 31);
    cfg.max_seq_len = need_int("n_positions", 1 << 24);
    cfg.n_kv_heads = 0;
    key = "n_inner";
    cfg.d_ff =
        c.contains("n_inner") && !c["n_inner"].is_null() ? need_int("n_inner", 1 << 22) : 4 * cfg.d_model;
    key = "layer_norm_epsilon";
    cfg.norm_eps = c.value("layer_norm_epsilon", 1e-5);
    key = "initializer_range";
    cfg.init_std = c.value("initializer_range", 0.02);
    key = "tie_word_embeddings";
    cfg.tie_embeddings = c.value("tie_word_embeddings", true) ? 1 : 0;
    key = "activation_function";
    const std::string act = c.value("activation_function", std::string("gelu_new"));
    if (act != "gelu_new" && act != "gelu_pytorch_tanh")
      return Status::error(fmt::format(
          "import_hf: '{}': activation_function \"{}\" is not supported (only the tanh GELU: gelu_new)",
          cpath, act));
    for (const char* k : {"scale_attn_by_inverse_layer_idx"}) {
      key = k;
      if (c.value(k, false))
        return Status::error(fmt::format("import_hf: '{}': \"{}\": true is not supported", cpath, k));
    }
    key = "scale_attn_weights";
    if (!c.value("scale_attn_weights", true))
      return Status::error(
          fmt::format("import_hf: '{}': \"scale_attn_weights\": false is not supported (scores are scaled by "
                      "1/sqrt(head_dim))",
                      cpath));
    if (cfg.d_model % cfg.n_heads != 0)
      return Status::error(fmt::format("import_hf: '{}': n_embd {} is not a multiple of n_head {}", cpath,
                                       cfg.d_model, cfg.n_heads));
  } catch (const nlohmann::json::exception& e) {
    return Status::error(fmt::format("import_hf: '{}': bad value for \"{}\": {}", cpath, key, e.what()));
  } catch (const Error& e) {
    return Status::error(e.what());
  }

  auto f = hf_detail::HfWeights::open(dir);
  if (!f) return Status::error("import_hf: " + f.status().message());
  const hf_detail::HfWeights& w = f.value();
  // transformers' own saves prefix "transformer."; the original OpenAI-converted files do not.
  const std::string t = w.contains("transformer.wte.weight") ? "transformer." : "";
  const int64_t C = cfg.d_model, F = cfg.d_ff;
  std::set<std::string> used;
  std::vector<std::pair<std::string, Tensor>> out;
  auto read = [&](const std::string& hf, Shape shape) {
    if (!w.contains(hf)) throw Error(fmt::format("'{}': tensor {} is missing", w.describe(), hf));
    if (w.info(hf).shape != shape)
      throw Error(fmt::format("'{}': tensor {} has shape {}, config.json implies {}", w.describe(), hf,
                              shape_str(w.info(hf).shape), shape_str(shape)));
    Tensor x = Tensor::empty(shape);
    hf_detail::read_as_f32(w, hf, x);
    used.insert(hf);
    return x;
  };
  try {
    out.emplace_back("embed.tokens.weight", read(t + "wte.weight", {cfg.vocab_size, C}));
    out.emplace_back("embed.positions.weight", read(t + "wpe.weight", {cfg.max_seq_len, C}));
    for (int64_t l = 0; l < cfg.n_layers; ++l) {
      const std::string o = fmt::format("layers.{}.", l);
      out.emplace_back(o + "attn_norm.weight", read(hl(t, l, "ln_1.weight"), {C}));
      out.emplace_back(o + "attn_norm.bias", read(hl(t, l, "ln_1.bias"), {C}));
      const Tensor qkv = transposed(read(hl(t, l, "attn.c_attn.weight"), {C, 3 * C}));  // (3C, C)
      const Tensor b = read(hl(t, l, "attn.c_attn.bias"), {3 * C});
      // The model's order: the three weights, then the biases (key bias dropped).
      out.emplace_back(o + "attn.wq.weight", qkv.view_at(0, {C, C}).clone());
      out.emplace_back(o + "attn.wk.weight", qkv.view_at(C * C, {C, C}).clone());
      out.emplace_back(o + "attn.wv.weight", qkv.view_at(2 * C * C, {C, C}).clone());
      out.emplace_back(o + "attn.wq.bias", b.view_at(0, {C}).clone());
      out.emplace_back(o + "attn.wv.bias", b.view_at(2 * C, {C}).clone());
      out.emplace_back(o + "attn.wo.weight", transposed(read(hl(t, l, "attn.c_proj.weight"), {C, C})));
      out.emplace_back(o + "attn.wo.bias", read(hl(t, l, "attn.c_proj.bias"), {C}));
      out.emplace_back(o + "mlp_norm.weight", read(hl(t, l, "ln_2.weight"), {C}));
      out.emplace_back(o + "mlp_norm.bias", read(hl(t, l, "ln_2.bias"), {C}));
      out.emplace_back(o + "mlp.fc.weight", transposed(read(hl(t, l, "mlp.c_fc.weight"), {C, F})));
      out.emplace_back(o + "mlp.fc.bias", read(hl(t, l, "mlp.c_fc.bias"), {F}));
      out.emplace_back(o + "mlp.proj.weight", transposed(read(hl(t, l, "mlp.c_proj.weight"), {F, C})));
      out.emplace_back(o + "mlp.proj.bias", read(hl(t, l, "mlp.c_proj.bias"), {C}));
    }
    out.emplace_back("final_norm.weight", read(t + "ln_f.weight", {C}));
    out.emplace_back("final_norm.bias", read(t + "ln_f.bias", {C}));
    if (!cfg.tied()) out.emplace_back("lm_head.weight", read("lm_head.weight", {cfg.vocab_size, C}));
  } catch (const Error& e) {
    return Status::error(fmt::format("import_hf: {}", e.what()));
  }
  for (const std::string& n : w.names()) {
    if (used.count(n)) continue;
    // Causal-mask buffers of older checkpoints, and a stored copy of a tied head.
    const auto ends = [&](const std::string& s) {
      return n.size() >= s.size() && n.compare(n.size() - s.size(), s.size(), s) == 0;
    };
    if (ends(".attn.bias") || ends(".attn.masked_bias") || (n == "lm_head.weight" && cfg.tied())) continue;
    return Status::error(fmt::format(
        "import_hf: '{}': unexpected tensor {} (not part of a GPT-2 with this config)", w.describe(), n));
  }
  return std::make_pair(cfg, std::move(out));
}

}  // namespace ndt
