// Hugging Face GPT-2 (GPT2LMHeadModel) interop, train/hf_gpt2.cpp: the exported directory has GPT-2's exact
// tensor names and Conv1D (in, out) shapes (read from the safetensors header by hand) and config keys; the
// round trip is bit-exact (tied and untied heads); a checkpoint in the original unprefixed naming, with the
// causal-mask buffers and a NONZERO key bias, imports to the same weights, and our forward's logits equal
// an independent double-precision GPT-2 forward that applies that key bias (max relative difference 1e-4):
// the key bias folds away exactly because softmax ignores a per-query constant.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "data/packing.h"
#include "model/transformer.h"
#include "temp_dir.h"
#include "tiny_model.h"
#include "train/hf_interop.h"
#include "train/safetensors.h"

namespace ndt {
namespace {

ModelConfig gpt2_config(int tied) {
  ModelConfig cfg = testing::tiny_model("gpt2");  // d 16, 2 layers, 4 heads, d_ff 24, vocab 32, 16 positions
  cfg.tie_embeddings = tied;
  cfg.norm_eps = 1e-5;
  return cfg;
}

std::vector<std::pair<std::string, Tensor>> random_params(const ModelConfig& cfg, uint32_t seed) {
  return testing::random_full_params(cfg, seed);
}

nlohmann::json header_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  std::string h(n, '\0');
  in.read(h.data(), static_cast<std::streamsize>(n));
  return nlohmann::json::parse(h);
}

std::map<std::string, std::vector<double>> read_all(const std::string& path) {
  auto f = open_safetensors(path).value();
  std::map<std::string, std::vector<double>> out;
  for (const auto& n : f.names()) {
    const Tensor t = f.read(n);
    out[n] = std::vector<double>(t.f32(), t.f32() + t.numel());
  }
  return out;
}

// Independent GPT-2 forward in double from HF tensors (prefix "" or "transformer."): logits (T, V).
std::vector<double> reference_logits(std::map<std::string, std::vector<double>>& W, const std::string& pre,
                                     const ModelConfig& cfg, const std::vector<int32_t>& ids) {
  const int64_t T = static_cast<int64_t>(ids.size()), C = cfg.d_model, H = cfg.n_heads, D = C / H,
                F = cfg.ffn_dim(), V = cfg.vocab_size;
  auto ln = [&](const std::vector<double>& x, const std::string& n) {
    std::vector<double> y(x.size());
    for (int64_t t = 0; t < T; ++t) {
      double m = 0, v = 0;
      for (int64_t c = 0; c < C; ++c) m += x[t * C + c] / C;
      for (int64_t c = 0; c < C; ++c) v += (x[t * C + c] - m) * (x[t * C + c] - m) / C;
      for (int64_t c = 0; c < C; ++c)
        y[t * C + c] =
            (x[t * C + c] - m) / std::sqrt(v + cfg.norm_eps) * W[n + ".weight"][c] + W[n + ".bias"][c];
    }
    return y;
  };
  auto conv1d = [&](const std::vector<double>& x, const std::string& n, int64_t in, int64_t outw) {
    std::vector<double> y(static_cast<size_t>(T * outw));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t o = 0; o < outw; ++o) {
        double s = W[n + ".bias"][o];
        for (int64_t i = 0; i < in; ++i) s += x[t * in + i] * W[n + ".weight"][i * outw + o];
        y[t * outw + o] = s;
      }
    return y;
  };
  std::vector<double> x(static_cast<size_t>(T * C));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < C; ++c)
      x[t * C + c] = W[pre + "wte.weight"][ids[t] * C + c] + W[pre + "wpe.weight"][t * C + c];
  for (int64_t l = 0; l < cfg.n_layers; ++l) {
    const std::string h = pre + "h." + std::to_string(l) + ".";
    const auto qkv = conv1d(ln(x, h + "ln_1"), h + "attn.c_attn", C, 3 * C);
    std::vector<double> att(static_cast<size_t>(T * C), 0.0);
    for (int64_t hd = 0; hd < H; ++hd)
      for (int64_t i = 0; i < T; ++i) {
        std::vector<double> s(static_cast<size_t>(i + 1));
        double mx = -1e300, z = 0;
        for (int64_t j = 0; j <= i; ++j) {
          double d = 0;
          for (int64_t e = 0; e < D; ++e) d += qkv[i * 3 * C + hd * D + e] * qkv[j * 3 * C + C + hd * D + e];
          s[j] = d / std::sqrt(static_cast<double>(D));
          mx = std::max(mx, s[j]);
        }
        for (auto& v : s) z += v = std::exp(v - mx);
        for (int64_t j = 0; j <= i; ++j)
          for (int64_t e = 0; e < D; ++e)
            att[i * C + hd * D + e] += s[j] / z * qkv[j * 3 * C + 2 * C + hd * D + e];
      }
    const auto o = conv1d(att, h + "attn.c_proj", C, C);
    for (size_t k = 0; k < x.size(); ++k) x[k] += o[k];
    auto f = conv1d(ln(x, h + "ln_2"), h + "mlp.c_fc", C, F);
    for (auto& v : f) v = 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)));
    const auto m = conv1d(f, h + "mlp.c_proj", F, C);
    for (size_t k = 0; k < x.size(); ++k) x[k] += m[k];
  }
  const auto xf = ln(x, pre + "ln_f");
  const auto& head = cfg.tied() ? W[pre + "wte.weight"] : W["lm_head.weight"];
  std::vector<double> logits(static_cast<size_t>(T * V));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t v = 0; v < V; ++v) {
      double s = 0;
      for (int64_t c = 0; c < C; ++c) s += xf[t * C + c] * head[v * C + c];
      logits[t * V + v] = s;
    }
  return logits;
}

TEST(HfGpt2, ExportHasGpt2NamesShapesAndConfig) {
  testing::TempDir tmp;
  const ModelConfig cfg = gpt2_config(0);
  const std::string out = (tmp.path() / "hf").string();
  ASSERT_TRUE(export_hf(out, cfg, random_params(cfg, 1)));
  std::ifstream cf(out + "/config.json");
  const nlohmann::json c = nlohmann::json::parse(cf);
  EXPECT_EQ(c["architectures"][0], "GPT2LMHeadModel");
  EXPECT_EQ(c["model_type"], "gpt2");
  EXPECT_EQ(c["n_embd"], 16);
  EXPECT_EQ(c["n_layer"], 2);
  EXPECT_EQ(c["n_head"], 4);
  EXPECT_EQ(c["n_inner"], 24);
  EXPECT_EQ(c["n_positions"], 16);
  EXPECT_EQ(c["vocab_size"], 32);
  EXPECT_EQ(c["activation_function"], "gelu_new");
  EXPECT_EQ(c["tie_word_embeddings"], false);
  const nlohmann::json h = header_of(out + "/model.safetensors");
  const std::map<std::string, std::vector<int64_t>> want = {{"transformer.wte.weight", {32, 16}},
                                                            {"transformer.wpe.weight", {16, 16}},
                                                            {"transformer.h.1.ln_1.weight", {16}},
                                                            {"transformer.h.1.attn.c_attn.weight", {16, 48}},
                                                            {"transformer.h.1.attn.c_attn.bias", {48}},
                                                            {"transformer.h.1.attn.c_proj.weight", {16, 16}},
                                                            {"transformer.h.0.mlp.c_fc.weight", {16, 24}},
                                                            {"transformer.h.0.mlp.c_proj.weight", {24, 16}},
                                                            {"transformer.ln_f.bias", {16}},
                                                            {"lm_head.weight", {32, 16}}};
  for (const auto& [name, shape] : want) {
    ASSERT_TRUE(h.contains(name)) << name;
    EXPECT_EQ(h[name]["shape"].get<std::vector<int64_t>>(), shape) << name;
    EXPECT_EQ(h[name]["dtype"], "F32") << name;
  }
  EXPECT_EQ(h.size(), 2u + 2 * 12 + 2 + 1 + 1);  // wte, wpe, 12 per layer, ln_f, head, __metadata__
}

TEST(HfGpt2, RoundTripIsBitExact) {
  for (int tied : {0, 1}) {
    testing::TempDir tmp;
    const ModelConfig cfg = gpt2_config(tied);
    auto params = random_params(cfg, 2 + tied);
    const std::string out = (tmp.path() / "hf").string();
    ASSERT_TRUE(export_hf(out, cfg, params));
    auto back = import_hf(out);
    ASSERT_TRUE(back) << back.status().message();
    const ModelConfig& got = back.value().first;
    EXPECT_EQ(got.style, "gpt2");
    EXPECT_EQ(got.tied(), tied == 1);
    EXPECT_EQ(got.d_ff, 24);
    ASSERT_EQ(back.value().second.size(), params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_EQ(back.value().second[i].first, params[i].first);
      const Tensor& a = params[i].second;
      const Tensor& b = back.value().second[i].second;
      ASSERT_EQ(a.numel(), b.numel());
      EXPECT_EQ(std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()), 0) << params[i].first;
    }
  }
}

TEST(HfGpt2, KeyBiasFoldsAwayAndLogitsMatchAnIndependentForward) {
  testing::TempDir tmp;
  const ModelConfig cfg = gpt2_config(1);
  auto params = random_params(cfg, 7);
  const std::string out = (tmp.path() / "hf").string(), old = (tmp.path() / "old").string();
  ASSERT_TRUE(export_hf(out, cfg, params));
  // The original OpenAI-converted layout: no "transformer." prefix, mask buffers, and a key bias.
  auto file = open_safetensors(out + "/model.safetensors").value();
  std::vector<std::pair<std::string, Tensor>> tensors;
  std::mt19937 rng(3);
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (const auto& n : file.names()) {
    Tensor t = file.read(n);
    if (n.find("c_attn.bias") != std::string::npos)
      for (int64_t i = cfg.d_model; i < 2 * cfg.d_model; ++i) t.f32()[i] = d(rng);  // the key third
    tensors.emplace_back(n.rfind("transformer.", 0) == 0 ? n.substr(12) : n, t);
  }
  for (int l = 0; l < cfg.n_layers; ++l)
    tensors.emplace_back("h." + std::to_string(l) + ".attn.bias", Tensor::zeros({1, 1, 16, 16}));
  std::filesystem::create_directories(old);
  std::filesystem::copy_file(out + "/config.json", old + "/config.json");
  ASSERT_TRUE(save_safetensors(old + "/model.safetensors", tensors, {{"format", "pt"}}));
  auto imported = import_hf(old);
  ASSERT_TRUE(imported) << imported.status().message();
  for (size_t i = 0; i < params.size(); ++i)
    EXPECT_EQ(std::memcmp(params[i].second.data_ptr(), imported.value().second[i].second.data_ptr(),
                          params[i].second.nbytes()),
              0)
        << params[i].first;

  Transformer m(cfg, StageSpec{}, nullptr);
  for (const auto& [name, t] : imported.value().second) m.params().get(name).value.copy_from(t);
  Sample s;
  for (int i = 0; i < 13; ++i) {
    s.tokens.push_back(static_cast<int32_t>(rng() % 32));
    s.loss_mask.push_back(i > 0);
  }
  const std::vector<int32_t> ids(s.tokens.begin(), s.tokens.end() - 1);
  const Microbatch mb = pack_samples({s}, 0);
  Activations acts;
  m.forward(mb, Tensor(), acts);
  const std::vector<float> ours = acts.logits.to_vector<float>();
  auto W = read_all(old + "/model.safetensors");
  const std::vector<double> ref = reference_logits(W, "", cfg, ids);
  ASSERT_EQ(ours.size(), ref.size());
  double worst = 0, scale = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    worst = std::max(worst, std::abs(ours[i] - ref[i]));
    scale = std::max(scale, std::abs(ref[i]));
  }
  EXPECT_LT(worst / scale, 1e-4) << "max |ours - reference| " << worst << " of max |logit| " << scale;
}

TEST(HfGpt2, RefusesWhatItCannotRead) {
  testing::TempDir tmp;
  const ModelConfig cfg = gpt2_config(1);
  const std::string out = (tmp.path() / "hf").string();
  ASSERT_TRUE(export_hf(out, cfg, random_params(cfg, 4)));
  std::ifstream cf(out + "/config.json");
  nlohmann::json c = nlohmann::json::parse(cf);
  c["activation_function"] = "gelu";
  std::ofstream(out + "/config.json") << c.dump();
  auto r = import_hf(out);
  ASSERT_FALSE(r);
  EXPECT_NE(r.status().message().find("activation_function"), std::string::npos) << r.status().message();
  c["activation_function"] = "gelu_new";
  c["n_embd"] = 20;  // shapes no longer match
  std::ofstream(out + "/config.json") << c.dump();
  r = import_hf(out);
  ASSERT_FALSE(r);
  EXPECT_NE(r.status().message().find("shape"), std::string::npos) << r.status().message();
}

}  // namespace
}  // namespace ndt
