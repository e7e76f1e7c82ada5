// Hugging Face Qwen3 (Qwen3ForCausalLM) interop. The test writes a Qwen3 directory itself, the way
// transformers lays one out (config.json with Qwen3-0.6B's keys, tensors under their exact names and shapes:
// head_dim 6 with hidden 16 / 4 heads, so q_proj is (24, 16) and o_proj (16, 24); per-head q/k RMSNorm
// weights of size head_dim; no biases), tied and untied. It imports it, runs our forward and compares the
// logits with an independent double-precision Qwen3 forward computed from the files alone (plain loops:
// q/k norm over each head BEFORE rotate-half RoPE, GQA, SwiGLU); exports it back (the same tensors
// bit for bit), re-imports it (identical); and generates greedily from it with the KV-cache engine, which
// must give the full-forward argmax tokens. Refusals: sliding windows, attention_bias, MoE, qkv_bias, and
// GPT-2 with a head width other than n_embd / n_head.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "core/check.h"
#include "data/packing.h"
#include "dist/communicator.h"
#include "generate/generator.h"
#include "model/transformer.h"
#include "reference_math.h"
#include "temp_dir.h"
#include "tiny_model.h"
#include "train/evaluate.h"
#include "train/hf_interop.h"
#include "train/safetensors.h"

namespace ndt {
namespace {

constexpr int64_t kHidden = 16, kHeads = 4, kKv = 2, kHeadDim = 6, kFfn = 24, kVocab = 32, kLayers = 2,
                  kPositions = 32;

// config.json as transformers 4.51 writes it for Qwen3-0.6B (with our tiny sizes).
nlohmann::json qwen3_config_json(bool tied) {
  return {{"architectures", {"Qwen3ForCausalLM"}},
          {"attention_bias", false},
          {"attention_dropout", 0.0},
          {"bos_token_id", 1},
          {"eos_token_id", 2},
          {"head_dim", kHeadDim},
          {"hidden_act", "silu"},
          {"hidden_size", kHidden},
          {"initializer_range", 0.02},
          {"intermediate_size", kFfn},
          {"max_position_embeddings", kPositions},
          {"max_window_layers", 28},
          {"model_type", "qwen3"},
          {"num_attention_heads", kHeads},
          {"num_hidden_layers", kLayers},
          {"num_key_value_heads", kKv},
          {"rms_norm_eps", 1e-6},
          {"rope_scaling", nullptr},
          {"rope_theta", 1000000},
          {"sliding_window", nullptr},
          {"tie_word_embeddings", tied},
          {"torch_dtype", "float32"},
          {"transformers_version", "4.51.0"},
          {"use_cache", true},
          {"use_sliding_window", false},
          {"vocab_size", kVocab}};
}

// The tensors of a Qwen3ForCausalLM state dict in module order, random: weights N(0, 0.3), norm weights
// 1 + N(0, 0.3) (so that a skipped q/k norm or a swapped q/k weight changes the result).
std::vector<std::pair<std::string, Tensor>> qwen3_tensors(bool tied, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 0.3f);
  std::vector<std::pair<std::string, Tensor>> out;
  auto add = [&](const std::string& name, Shape shape, float center = 0.0f) {
    Tensor t = Tensor::empty(shape);
    for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = center + d(rng);
    out.emplace_back(name, t);
  };
  const int64_t C = kHidden, D = kHeadDim;
  add("model.embed_tokens.weight", {kVocab, C});
  for (int64_t l = 0; l < kLayers; ++l) {
    const std::string h = "model.layers." + std::to_string(l) + ".";
    add(h + "self_attn.q_proj.weight", {kHeads * D, C});
    add(h + "self_attn.k_proj.weight", {kKv * D, C});
    add(h + "self_attn.v_proj.weight", {kKv * D, C});
    add(h + "self_attn.o_proj.weight", {C, kHeads * D});
    add(h + "self_attn.q_norm.weight", {D}, 1.0f);
    add(h + "self_attn.k_norm.weight", {D}, 1.0f);
    add(h + "mlp.gate_proj.weight", {kFfn, C});
    add(h + "mlp.up_proj.weight", {kFfn, C});
    add(h + "mlp.down_proj.weight", {C, kFfn});
    add(h + "input_layernorm.weight", {C}, 1.0f);
    add(h + "post_attention_layernorm.weight", {C}, 1.0f);
  }
  add("model.norm.weight", {C}, 1.0f);
  if (!tied) add("lm_head.weight", {kVocab, C});
  return out;
}

void write_qwen3_dir(const std::string& dir, const nlohmann::json& config,
                     const std::vector<std::pair<std::string, Tensor>>& tensors) {
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/config.json") << config.dump(2);
  ASSERT_TRUE(save_safetensors(dir + "/model.safetensors", tensors, {{"format", "pt"}}));
}

// Qwen3's forward from the directory alone, in double precision. skip_qk_norm: the same model without
// the q/k norms (to show they matter).
std::vector<double> reference_logits(const std::string& dir, const std::vector<int32_t>& ids,
                                     bool skip_qk_norm = false) {
  std::ifstream cf(dir + "/config.json");
  const nlohmann::json c = nlohmann::json::parse(cf);
  auto f = open_safetensors(dir + "/model.safetensors").value();
  std::map<std::string, std::vector<double>> W;
  for (const auto& n : f.names()) {
    const Tensor t = f.read(n);
    W[n] = std::vector<double>(t.f32(), t.f32() + t.numel());
  }
  const int64_t T = static_cast<int64_t>(ids.size()), C = c["hidden_size"], H = c["num_attention_heads"],
                KV = c["num_key_value_heads"], D = c["head_dim"], F = c["intermediate_size"],
                V = c["vocab_size"];
  const double eps = c["rms_norm_eps"], theta = c["rope_theta"];
  // RMSNorm over the last `width` values of each of the rows of x (rows * width), weight w (width).
  auto rms = [&](const std::vector<double>& x, int64_t width, const std::vector<double>& w) {
    std::vector<double> y(x.size());
    for (size_t r = 0; r < x.size() / static_cast<size_t>(width); ++r) {
      double ss = 0;
      for (int64_t i = 0; i < width; ++i) ss += x[r * width + i] * x[r * width + i];
      const double s = 1.0 / std::sqrt(ss / static_cast<double>(width) + eps);
      for (int64_t i = 0; i < width; ++i) y[r * width + i] = x[r * width + i] * s * w[i];
    }
    return y;
  };
  auto lin = [&](const std::vector<double>& x, const std::string& n, int64_t in, int64_t out) {
    const std::vector<double>& w = W.at(n);
    std::vector<double> y(static_cast<size_t>(T * out));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t o = 0; o < out; ++o) {
        double s = 0;
        for (int64_t i = 0; i < in; ++i) s += x[t * in + i] * w[o * in + i];
        y[t * out + o] = s;
      }
    return y;
  };
  auto rope = [&](std::vector<double>& x, int64_t heads) {  // rotate-half (HF's apply_rotary_pos_emb)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t i = 0; i < D / 2; ++i) {
          const double a = static_cast<double>(t) * std::pow(theta, -2.0 * static_cast<double>(i) / D);
          double& x1 = x[(t * heads + h) * D + i];
          double& x2 = x[(t * heads + h) * D + i + D / 2];
          const double r1 = x1 * std::cos(a) - x2 * std::sin(a), r2 = x2 * std::cos(a) + x1 * std::sin(a);
          x1 = r1;
          x2 = r2;
        }
  };
  std::vector<double> x(static_cast<size_t>(T * C));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < C; ++i) x[t * C + i] = W["model.embed_tokens.weight"][ids[t] * C + i];
  for (int64_t l = 0; l < c["num_hidden_layers"].get<int64_t>(); ++l) {
    const std::string h = "model.layers." + std::to_string(l) + ".";
    const auto n1 = rms(x, C, W[h + "input_layernorm.weight"]);
    auto q = lin(n1, h + "self_attn.q_proj.weight", C, H * D);
    auto k = lin(n1, h + "self_attn.k_proj.weight", C, KV * D);
    const auto v = lin(n1, h + "self_attn.v_proj.weight", C, KV * D);
    if (!skip_qk_norm) {  // (T, heads, D) viewed as rows of D: one norm per head, before RoPE
      q = rms(q, D, W[h + "self_attn.q_norm.weight"]);
      k = rms(k, D, W[h + "self_attn.k_norm.weight"]);
    }
    rope(q, H);
    rope(k, KV);
    const std::vector<double> att = testing::causal_gqa_attention(q, k, v, T, H, KV, D);
    const auto o = lin(att, h + "self_attn.o_proj.weight", H * D, C);
    for (size_t i = 0; i < x.size(); ++i) x[i] += o[i];
    const auto n2 = rms(x, C, W[h + "post_attention_layernorm.weight"]);
    const auto gate = lin(n2, h + "mlp.gate_proj.weight", C, F), up = lin(n2, h + "mlp.up_proj.weight", C, F);
    std::vector<double> a(gate.size());
    for (size_t i = 0; i < a.size(); ++i) a[i] = gate[i] / (1 + std::exp(-gate[i])) * up[i];
    const auto m = lin(a, h + "mlp.down_proj.weight", F, C);
    for (size_t i = 0; i < x.size(); ++i) x[i] += m[i];
  }
  const auto xf = rms(x, C, W["model.norm.weight"]);
  const auto& head =
      c["tie_word_embeddings"].get<bool>() ? W["model.embed_tokens.weight"] : W["lm_head.weight"];
  return testing::head_logits(xf, head, T, C, V);
}

double max_abs_diff(const std::vector<float>& a, const std::vector<double>& b) {
  double worst = 0;
  for (size_t i = 0; i < b.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
  return worst;
}

double max_abs(const std::vector<double>& b) {
  double m = 0;
  for (double v : b) m = std::max(m, std::abs(v));
  return m;
}

void load(Transformer& m, const std::vector<std::pair<std::string, Tensor>>& params) {
  ASSERT_EQ(params.size(), m.params().all().size());
  for (const auto& [name, t] : params) m.params().get(name).value.copy_from(t);
}

void import_matches_reference_and_round_trips(bool tied) {
  testing::TempDir tmp;
  const std::string dir = (tmp.path() / "qwen3").string();
  const auto hf = qwen3_tensors(tied, tied ? 5 : 6);
  write_qwen3_dir(dir, qwen3_config_json(tied), hf);

  auto imported = import_hf(dir);
  ASSERT_TRUE(imported) << imported.status().message();
  const ModelConfig& cfg = imported.value().first;
  EXPECT_EQ(cfg.style, "llama");
  EXPECT_TRUE(cfg.qk_norm);
  EXPECT_FALSE(cfg.qkv_bias);
  EXPECT_EQ(cfg.head_dim(), kHeadDim);
  EXPECT_EQ(cfg.head_dim_override, kHeadDim);
  EXPECT_EQ(cfg.d_model, kHidden);
  EXPECT_EQ(cfg.kv_heads(), kKv);
  EXPECT_EQ(cfg.tied(), tied);
  EXPECT_EQ(cfg.norm_eps, 1e-6);
  EXPECT_EQ(cfg.rope_theta, 1e6);
  EXPECT_EQ(cfg.max_seq_len, kPositions);
  const auto& params = imported.value().second;
  {
    const auto by_name = [&](const std::string& n) -> const Tensor& {
      for (const auto& [name, t] : params)
        if (name == n) return t;
      throw Error("missing " + n);
    };
    EXPECT_EQ(by_name("layers.1.attn.wq.weight").shape(), (Shape{kHeads * kHeadDim, kHidden}));
    EXPECT_EQ(by_name("layers.1.attn.wo.weight").shape(), (Shape{kHidden, kHeads * kHeadDim}));
    EXPECT_EQ(by_name("layers.0.attn.k_norm.weight").shape(), (Shape{kHeadDim}));
  }

  // Our forward against the independent reference.
  Transformer m(cfg, StageSpec{}, nullptr);
  load(m, params);
  std::mt19937 rng(tied ? 2 : 3);
  Sample s;
  for (int i = 0; i < 14; ++i) {
    s.tokens.push_back(static_cast<int32_t>(rng() % kVocab));
    s.loss_mask.push_back(i > 0);
  }
  const std::vector<int32_t> ids(s.tokens.begin(), s.tokens.end() - 1);
  Activations acts;
  m.forward(pack_samples({s}, 0), Tensor(), acts);
  const std::vector<float> ours = acts.logits.to_vector<float>();
  const auto ref = reference_logits(dir, ids);
  ASSERT_EQ(ours.size(), ref.size());
  const double diff = max_abs_diff(ours, ref);
  std::printf("Qwen3 %s: logits max |ours - reference| = %.3g (max |logit| %.3g)\n", tied ? "tied" : "untied",
              diff, max_abs(ref));
  EXPECT_LT(diff, 1e-4 * max_abs(ref));
  // The q/k norms are not a no-op: the reference without them moves far more than that.
  EXPECT_GT(max_abs_diff(ours, reference_logits(dir, ids, /*skip_qk_norm=*/true)), 1e-2 * max_abs(ref));

  // Export: config keys, and the tensors of the original directory bit for bit under the same names.
  const std::string out = (tmp.path() / "exported").string();
  ASSERT_TRUE(export_hf(out, cfg, params));
  std::ifstream cf(out + "/config.json");
  const nlohmann::json c = nlohmann::json::parse(cf);
  EXPECT_EQ(c["architectures"][0], "Qwen3ForCausalLM");
  EXPECT_EQ(c["model_type"], "qwen3");
  EXPECT_EQ(c["head_dim"], kHeadDim);
  EXPECT_EQ(c["attention_bias"], false);
  EXPECT_EQ(c["use_sliding_window"], false);
  EXPECT_EQ(c["tie_word_embeddings"], tied);
  EXPECT_EQ(c["num_key_value_heads"], kKv);
  EXPECT_EQ(c["rms_norm_eps"], 1e-6);
  EXPECT_EQ(c["rope_theta"], 1e6);
  auto file = open_safetensors(out + "/model.safetensors").value();
  EXPECT_EQ(file.names().size(), hf.size());
  for (const auto& [name, t] : hf) {
    ASSERT_TRUE(file.contains(name)) << name;
    const Tensor back = file.read(name);
    ASSERT_EQ(back.shape(), t.shape()) << name;
    EXPECT_EQ(std::memcmp(back.data_ptr(), t.data_ptr(), t.nbytes()), 0) << name;
  }
  // Import again: the same config and tensors.
  auto again = import_hf(out);
  ASSERT_TRUE(again) << again.status().message();
  EXPECT_EQ(again.value().first.head_dim_override, kHeadDim);
  EXPECT_TRUE(again.value().first.qk_norm);
  EXPECT_EQ(again.value().first.tied(), tied);
  ASSERT_EQ(again.value().second.size(), params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(again.value().second[i].first, params[i].first);
    EXPECT_EQ(std::memcmp(again.value().second[i].second.data_ptr(), params[i].second.data_ptr(),
                          params[i].second.nbytes()),
              0)
        << params[i].first;
  }

  // Generation (KV cache, head_dim != C/H) from the imported weights: greedy tokens equal the argmax of
  // the full forward recomputed for every new token.
  Config gc;
  gc.model = cfg;
  auto self = make_self_communicator();
  Generator gen(gc, *self, GenLayout{1});
  gen.load_full(params);
  const std::vector<std::vector<int32_t>> prompts = {{3, 7, 1}, {5}, {9, 2, 30, 4, 11, 6}};
  const int64_t max_new = 8;
  const auto want = greedy_generate(argmax_fn(m), prompts, max_new, /*eos=*/-1, /*pad=*/0);
  std::vector<GenRequest> reqs;
  for (size_t i = 0; i < prompts.size(); ++i) reqs.push_back({prompts[i], i, 0});
  SamplingParams sp;
  sp.temperature = 0;
  sp.max_new_tokens = max_new;
  const auto got = gen.generate(reqs, sp, 0);
  ASSERT_EQ(got.size(), prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(got[i].tokens, want[i]) << "prompt " << i;
    EXPECT_EQ(static_cast<int64_t>(got[i].tokens.size()), max_new);
  }
}

TEST(HfQwen3, UntiedImportMatchesAnIndependentForwardRoundTripsAndGenerates) {
  import_matches_reference_and_round_trips(/*tied=*/false);
}

TEST(HfQwen3, TiedImportMatchesAnIndependentForwardRoundTripsAndGenerates) {
  import_matches_reference_and_round_trips(/*tied=*/true);
}

// Without a head_dim key, Qwen3Config's default (128) applies, not hidden_size / num_attention_heads.
TEST(HfQwen3, AbsentHeadDimIsQwen3ConfigsDefault) {
  testing::TempDir tmp;
  const std::string dir = (tmp.path() / "qwen3").string();
  nlohmann::json c = qwen3_config_json(false);
  c.erase("head_dim");
  write_qwen3_dir(dir, c, qwen3_tensors(false, 1));
  auto r = import_hf(dir);
  ASSERT_FALSE(r);
  EXPECT_NE(r.status().message().find("config.json implies (512, 16)"), std::string::npos)
      << r.status().message();
}

TEST(HfQwen3, RefusesWhatItCannotRepresent) {
  testing::TempDir tmp;
  const auto tensors = qwen3_tensors(false, 4);
  auto refused = [&](const std::string& key, const nlohmann::json& value) {
    const std::string dir = (tmp.path() / key).string();
    nlohmann::json c = qwen3_config_json(false);
    c[key] = value;
    write_qwen3_dir(dir, c, tensors);
    auto r = import_hf(dir);
    ASSERT_FALSE(r) << key;
    EXPECT_NE(r.status().message().find(key), std::string::npos) << r.status().message();
  };
  refused("use_sliding_window", true);
  refused("attention_bias", true);
  refused("layer_types", {"full_attention", "sliding_attention"});

  ModelConfig cfg = testing::tiny_model("llama");
  cfg.qk_norm = true;
  cfg.head_dim_override = kHeadDim;
  cfg.qkv_bias = true;
  Status st = export_hf((tmp.path() / "bias").string(), cfg, testing::random_full_params(cfg, 2));
  ASSERT_FALSE(st);
  EXPECT_NE(st.message().find("qkv_bias"), std::string::npos) << st.message();
  cfg.qkv_bias = false;
  cfg.moe.num_experts = 4;
  st = export_hf((tmp.path() / "moe").string(), cfg, testing::random_full_params(cfg, 3));
  ASSERT_FALSE(st);
  EXPECT_NE(st.message().find("model.qk_norm with model.moe"), std::string::npos) << st.message();
  // GPT-2's head width is n_embd / n_head.
  ModelConfig g = testing::tiny_model("gpt2");
  g.head_dim_override = kHeadDim;
  st = export_hf((tmp.path() / "gpt2").string(), g, testing::random_full_params(g, 4));
  ASSERT_FALSE(st);
  EXPECT_NE(st.message().find("model.head_dim"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace ndt
