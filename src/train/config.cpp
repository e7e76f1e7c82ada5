// Config parsing: YAML (+ presets) + `key=value` overrides -> typed, validated Config.
//
// Everything a key needs (type, range or allowed strings, where it lives in Config) is one row of
// kSchema below, so adding a key is adding one row (plus the field in config.h). The parser first
// flattens YAML mappings into dotted keys with their source location, then applies them in order
// (presets first, then the file, then overrides), so later sources win and every error can name the
// file and line the value came from.
#include "train/config.h"

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <set>
#include <sstream>
#include <variant>

#include "train/fault.h"

namespace ndt {

namespace fs = std::filesystem;

int64_t ModelConfig::ffn_dim() const {
  if (d_ff > 0) return d_ff;
  if (style == "gpt2") return 4 * d_model;
  // Llama rule: 2/3 of 4C (SwiGLU has three matrices instead of two, so this keeps the MLP's parameter
  // count close to a 4C GELU MLP), rounded UP to a multiple of 32 so matmul shapes stay friendly to
  // vector units / tensor cores and divide evenly over small TP degrees. (Meta rounds to 256; 32 wastes
  // less on the tiny models this engine tests with.) C=128 -> 352, C=768 -> 2048, C=2048 -> 5472.
  const int64_t raw = 8 * d_model / 3;
  return (raw + 31) / 32 * 32;
}

namespace {

// ---------------------------------------------------------------------------------------------------
// Schema
// ---------------------------------------------------------------------------------------------------

enum class Kind { Int, Float, String, Bool };

// Where a key's value lives: a pointer into a Config for one of the field types config.h uses.
using FieldRef = std::variant<int64_t*, int*, double*, std::string*, bool*>;

struct KeyDef {
  const char* name;  // dotted path
  Kind kind;
  double lo = -std::numeric_limits<double>::infinity();  // numeric range, inclusive
  double hi = std::numeric_limits<double>::infinity();
  std::vector<std::string> choices;  // strings: allowed values (empty = any)
  std::function<FieldRef(Config&)> field;
};

// Pointer-to-member pair -> accessor: member(&Config::model, &ModelConfig::d_model).
template <typename S, typename F>
std::function<FieldRef(Config&)> member(S Config::*section, F S::*f) {
  return [section, f](Config& c) -> FieldRef { return &(c.*section.*f); };
}

constexpr double kInf = std::numeric_limits<double>::infinity();

KeyDef int_key(const char* name, double lo, double hi, std::function<FieldRef(Config&)> f) {
  return KeyDef{name, Kind::Int, lo, hi, {}, std::move(f)};
}
KeyDef float_key(const char* name, double lo, double hi, std::function<FieldRef(Config&)> f) {
  return KeyDef{name, Kind::Float, lo, hi, {}, std::move(f)};
}
KeyDef str_key(const char* name, std::vector<std::string> choices, std::function<FieldRef(Config&)> f) {
  return KeyDef{name, Kind::String, -kInf, kInf, std::move(choices), std::move(f)};
}
KeyDef bool_key(const char* name, std::function<FieldRef(Config&)> f) {
  return KeyDef{name, Kind::Bool, -kInf, kInf, {}, std::move(f)};
}

// Order here is the order config_to_yaml writes keys in.
const std::vector<KeyDef>& schema() {
  using M = ModelConfig;
  using D = DataConfig;
  using T = TrainConfig;
  using P = ParallelConfig;
  auto m = [](auto M::*f) { return member(&Config::model, f); };
  auto d = [](auto D::*f) { return member(&Config::data, f); };
  auto t = [](auto T::*f) { return member(&Config::train, f); };
  auto p = [](auto P::*f) { return member(&Config::parallel, f); };
  auto r = [](auto PosttrainConfig::*f) { return member(&Config::posttrain, f); };
  using E = EncoderConfig;
  auto e = [](auto E::*f) { return member(&Config::encoder, f); };
  auto moe = [](auto MoeConfig::*f) -> std::function<FieldRef(Config&)> {
    return [f](Config& c) -> FieldRef { return &(c.model.moe.*f); };
  };
  static const std::vector<KeyDef> rows = {
      str_key("model.style", {"gpt2", "llama"}, m(&M::style)),
      int_key("model.vocab_size", 1, 1LL << 31, m(&M::vocab_size)),
      int_key("model.d_model", 1, 1 << 20, m(&M::d_model)),
      int_key("model.n_layers", 1, 4096, m(&M::n_layers)),
      int_key("model.n_heads", 1, 4096, m(&M::n_heads)),
      int_key("model.n_kv_heads", 0, 4096, m(&M::n_kv_heads)),
      int_key("model.head_dim", 0, 1 << 16, m(&M::head_dim_override)),
      int_key("model.d_ff", 0, 1 << 22, m(&M::d_ff)),
      int_key("model.max_seq_len", 1, 1 << 24, m(&M::max_seq_len)),
      float_key("model.rope_theta", 1, kInf, m(&M::rope_theta)),
      float_key("model.norm_eps", 0, 1, m(&M::norm_eps)),
      int_key("model.tie_embeddings", -1, 1, m(&M::tie_embeddings)),
      float_key("model.init_std", 0, 10, m(&M::init_std)),
      bool_key("model.qkv_bias", m(&M::qkv_bias)),
      bool_key("model.qk_norm", m(&M::qk_norm)),
      int_key("model.moe.num_experts", 0, 65536, moe(&MoeConfig::num_experts)),
      int_key("model.moe.top_k", 1, 65536, moe(&MoeConfig::top_k)),
      int_key("model.moe.d_ff_expert", 0, 1 << 22, moe(&MoeConfig::d_ff_expert)),
      int_key("model.moe.shared_experts", 0, 1024, moe(&MoeConfig::shared_experts)),
      int_key("model.moe.first_dense", 0, 4096, moe(&MoeConfig::first_dense)),
      int_key("model.moe.every", 1, 4096, moe(&MoeConfig::every)),
      str_key("model.moe.router", {"softmax", "sigmoid"}, moe(&MoeConfig::router)),
      bool_key("model.moe.renormalize", moe(&MoeConfig::renormalize)),
      float_key("model.moe.aux_loss_coef", 0, kInf, moe(&MoeConfig::aux_loss_coef)),
      float_key("model.moe.z_loss_coef", 0, kInf, moe(&MoeConfig::z_loss_coef)),
      float_key("model.moe.bias_update_rate", 0, kInf, moe(&MoeConfig::bias_update_rate)),
      float_key("model.moe.capacity_factor", 0, kInf, moe(&MoeConfig::capacity_factor)),

      str_key("data.task", {"addition", "sort", "lm", "shards", "sft", "image_caption"}, d(&D::task)),
      str_key("data.path", {}, d(&D::path)),
      str_key("data.val_path", {}, d(&D::val_path)),
      str_key("data.tokenizer", {}, d(&D::tokenizer)),
      int_key("data.seq_len", 1, 1 << 24, d(&D::seq_len)),
      int_key("data.addition_digits", 1, 18, d(&D::addition_digits)),  // operands must fit in int64
      float_key("data.addition_label_noise", 0, 1, d(&D::addition_label_noise)),
      int_key("data.seed", 0, kInf, d(&D::seed)),
      int_key("data.min_seq_len", 0, 1 << 24, d(&D::min_seq_len)),
      bool_key("data.packing", d(&D::packing)),
      bool_key("data.shuffle", d(&D::shuffle)),
      int_key("data.pack_tokens", 0, kInf, d(&D::pack_tokens)),
      str_key("data.chat_template", {"simple", "chatml", "llama3"}, d(&D::chat_template)),
      int_key("data.caption_digits", 1, 8, d(&D::caption_digits)),
      float_key("data.image_noise", 0, 10, d(&D::image_noise)),

      int_key("train.seed", 0, kInf, t(&T::seed)),
      int_key("train.steps", 0, kInf, t(&T::steps)),
      int_key("train.global_batch", 1, kInf, t(&T::global_batch)),
      int_key("train.micro_batch", 0, kInf, t(&T::micro_batch)),
      float_key("train.lr", 0, 10, t(&T::lr)),
      float_key("train.min_lr", 0, 10, t(&T::min_lr)),
      int_key("train.warmup_steps", 0, kInf, t(&T::warmup_steps)),
      float_key("train.beta1", 0, 1, t(&T::beta1)),
      float_key("train.beta2", 0, 1, t(&T::beta2)),
      float_key("train.adam_eps", 0, 1, t(&T::adam_eps)),
      float_key("train.weight_decay", 0, 10, t(&T::weight_decay)),
      float_key("train.grad_clip", 0, kInf, t(&T::grad_clip)),
      int_key("train.log_every", 1, kInf, t(&T::log_every)),
      int_key("train.eval_every", 0, kInf, t(&T::eval_every)),
      int_key("train.eval_samples", 0, kInf, t(&T::eval_samples)),
      str_key("train.out_dir", {}, t(&T::out_dir)),
      int_key("train.max_seconds", 0, kInf, t(&T::max_seconds)),
      int_key("train.checkpoint_every", 0, kInf, t(&T::checkpoint_every)),
      int_key("train.keep_last", 0, kInf, t(&T::keep_last)),
      str_key("train.checkpoint_dir", {}, t(&T::checkpoint_dir)),
      str_key("train.device", {"cpu", "cuda"}, t(&T::device)),
      str_key("train.device_comm", {"nccl", "mpi"}, t(&T::device_comm)),
      str_key("train.precision", {"auto", "fp32", "bf16"}, t(&T::precision)),
      str_key("train.attention", {"auto", "cudnn", "native"}, t(&T::attention)),
      bool_key("train.recompute", t(&T::recompute)),
      bool_key("train.cuda_graphs", t(&T::cuda_graphs)),
      bool_key("train.tensorboard", t(&T::tensorboard)),
      str_key("train.nonfinite", {"stop", "skip"}, t(&T::nonfinite)),
      str_key("train.host_sync", {"auto", "step", "log"}, t(&T::host_sync)),
      int_key("train.max_consecutive_skips", 1, kInf, t(&T::max_consecutive_skips)),
      float_key("train.collective_timeout_s", 0, kInf, t(&T::collective_timeout_s)),

      int_key("parallel.tp", 1, 4096, p(&P::tp)),
      int_key("parallel.cp", 1, 4096, p(&P::cp)),
      int_key("parallel.ep", 1, 4096, p(&P::ep)),
      int_key("parallel.dp", 1, 1 << 20, p(&P::dp)),
      int_key("parallel.pp", 1, 4096, p(&P::pp)),
      str_key("parallel.order", {}, p(&P::order)),  // permutation checked in validate_config
      bool_key("parallel.sequence_parallel", p(&P::sequence_parallel)),
      bool_key("parallel.tp_comm_overlap", p(&P::tp_comm_overlap)),
      bool_key("parallel.zero1", p(&P::zero1)),
      str_key("parallel.dp_embedding_grad", {"auto", "gather", "all_reduce"}, p(&P::dp_embedding_grad)),
      bool_key("parallel.dp_grad_window", p(&P::dp_grad_window)),
      str_key("parallel.dp_reduction", {"nccl", "copy_engine"}, p(&P::dp_reduction)),
      int_key("parallel.virtual_stages", 1, 1024, p(&P::virtual_stages)),
      str_key("parallel.schedule", {"1f1b", "interleaved", "gpipe"}, p(&P::schedule)),
      str_key("parallel.cp_attention", {"ring", "allgather"}, p(&P::cp_attention)),
      str_key("parallel.stage_layers", {}, p(&P::stage_layers)),  // checked against the layout

      str_key("posttrain.algo", {"sft", "dpo", "grpo"}, r(&PosttrainConfig::algo)),
      str_key("posttrain.task", {"addition", "sort", "jsonl"}, r(&PosttrainConfig::task)),
      str_key("posttrain.data_path", {}, r(&PosttrainConfig::data_path)),
      str_key("posttrain.reward", {"exact_match", "partial_match", "contains", "numeric"},
              r(&PosttrainConfig::reward)),
      str_key("posttrain.init", {}, r(&PosttrainConfig::init)),
      int_key("posttrain.eval_samples", 0, kInf, r(&PosttrainConfig::eval_samples)),
      int_key("posttrain.prompts_per_step", 1, kInf, r(&PosttrainConfig::prompts_per_step)),
      int_key("posttrain.samples_per_prompt", 1, kInf, r(&PosttrainConfig::samples_per_prompt)),
      int_key("posttrain.max_new_tokens", 1, 1 << 20, r(&PosttrainConfig::max_new_tokens)),
      float_key("posttrain.temperature", 0, 100, r(&PosttrainConfig::temperature)),
      float_key("posttrain.top_p", 0, 1, r(&PosttrainConfig::top_p)),
      int_key("posttrain.top_k", 0, 1LL << 31, r(&PosttrainConfig::top_k)),
      int_key("posttrain.gen_tp", 1, 4096, r(&PosttrainConfig::gen_tp)),
      str_key("posttrain.baseline", {"mean", "loo"}, r(&PosttrainConfig::baseline)),
      bool_key("posttrain.std_normalize", r(&PosttrainConfig::std_normalize)),
      float_key("posttrain.adv_eps", 0, 1, r(&PosttrainConfig::adv_eps)),
      float_key("posttrain.clip_low", 0, 1, r(&PosttrainConfig::clip_low)),
      float_key("posttrain.clip_high", 0, kInf, r(&PosttrainConfig::clip_high)),
      float_key("posttrain.kl_coef", 0, kInf, r(&PosttrainConfig::kl_coef)),
      str_key("posttrain.loss_agg", {"token", "sequence"}, r(&PosttrainConfig::loss_agg)),
      int_key("posttrain.epochs", 1, 1024, r(&PosttrainConfig::epochs)),
      bool_key("posttrain.dynamic_sampling", r(&PosttrainConfig::dynamic_sampling)),
      float_key("posttrain.tis_cap", 0, kInf, r(&PosttrainConfig::tis_cap)),
      float_key("posttrain.dpo_beta", 0, kInf, r(&PosttrainConfig::dpo_beta)),
      str_key("posttrain.dpo_logprob", {"sum", "mean"}, r(&PosttrainConfig::dpo_logprob)),
      float_key("posttrain.dpo_sft_coef", 0, kInf, r(&PosttrainConfig::dpo_sft_coef)),
      int_key("posttrain.pairs_per_step", 1, kInf, r(&PosttrainConfig::pairs_per_step)),

      int_key("encoder.image_size", 0, 1 << 16, e(&E::image_size)),
      int_key("encoder.patch_size", 1, 1 << 16, e(&E::patch_size)),
      int_key("encoder.channels", 1, 64, e(&E::channels)),
      str_key("encoder.style", {"gpt2", "llama"}, e(&E::style)),
      int_key("encoder.d_model", 1, 1 << 20, e(&E::d_model)),
      int_key("encoder.n_layers", 1, 4096, e(&E::n_layers)),
      int_key("encoder.n_heads", 1, 4096, e(&E::n_heads)),
      int_key("encoder.d_ff", 0, 1 << 22, e(&E::d_ff)),
      int_key("encoder.projector_hidden", 0, 1 << 22, e(&E::projector_hidden)),
      int_key("encoder.image_token", -1, 1LL << 31, e(&E::image_token)),
      int_key("encoder.parallel.tp", 1, 4096, e(&E::tp)),
      int_key("encoder.parallel.dp", 0, 1 << 20, e(&E::dp)),
      int_key("encoder.parallel.cp", 1, 4096, e(&E::cp)),
      int_key("encoder.parallel.pp", 1, 4096, e(&E::pp)),

      str_key("debug.fault", {}, member(&Config::debug, &DebugConfig::fault)),  // parsed in validate_config
  };
  return rows;
}

const KeyDef* find_key(const std::string& name) {
  for (const auto& k : schema())
    if (name == k.name) return &k;
  return nullptr;
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string unknown_key_message(const std::string& key, const std::string& where) {
  std::string msg = fmt::format("unknown config key '{}' in {}", key, where);
  const KeyDef* best = nullptr;
  size_t best_d = 3;
  for (const auto& k : schema()) {
    size_t dist = edit_distance(key, k.name);
    if (dist < best_d) best_d = dist, best = &k;
  }
  // Also catch a right leaf under the wrong section (`train.seq_len` -> `data.seq_len`).
  if (!best) {
    const std::string leaf = key.substr(key.rfind('.') + 1);
    for (const auto& k : schema()) {
      std::string kn = k.name;
      if (kn.substr(kn.rfind('.') + 1) == leaf) {
        best = &k;
        break;
      }
    }
  }
  if (best) msg += fmt::format(" (did you mean '{}'?)", best->name);
  return msg;
}

// ---------------------------------------------------------------------------------------------------
// Flattening YAML into (dotted key, scalar text, location) entries
// ---------------------------------------------------------------------------------------------------

struct Entry {
  std::string key;
  std::string value;  // scalar text as YAML wrote it (quotes removed)
  bool is_null = false;
  std::string where;  // "file:line" or "override 'a=b'"
};

std::string where_of(const std::string& source, const YAML::Node& n) {
  const YAML::Mark m = n.Mark();
  if (m.is_null()) return source;
  return fmt::format("{}:{}", source, m.line + 1);
}

// YAML aliases share nodes, so a small file can describe a mapping with exponentially many paths (a "billion
// laughs" document); flattening stops after this many nodes, far beyond any real config.
constexpr int64_t kMaxConfigNodes = 100000;

Status flatten(const YAML::Node& node, const std::string& prefix, const std::string& source,
               std::vector<Entry>& out, int64_t& budget) {
  for (const auto& kv : node) {  // (not it->first: yaml-cpp's iterator proxy trips -Wdangling-pointer)
    if (--budget < 0)
      return Status::error(
          fmt::format("config {} has more than {} keys (nested aliases?)", source, kMaxConfigNodes));
    if (!kv.first.IsScalar())
      return Status::error(fmt::format("config keys must be plain names ({})", where_of(source, kv.first)));
    const std::string key = prefix.empty() ? kv.first.Scalar() : prefix + "." + kv.first.Scalar();
    const YAML::Node& v = kv.second;
    if (v.IsMap()) {
      // A mapping under a leaf key is a type error, under an unknown name it is an unknown key.
      if (find_key(key))
        return Status::error(fmt::format("config key '{}' expects a single value, got a mapping ({})", key,
                                         where_of(source, v)));
      Status st = flatten(v, key, source, out, budget);
      if (!st) return st;
    } else if (v.IsSequence()) {
      if (!find_key(key)) return Status::error(unknown_key_message(key, where_of(source, kv.first)));
      return Status::error(
          fmt::format("config key '{}' expects a single value, got a list ({})", key, where_of(source, v)));
    } else {
      out.push_back(Entry{key, v.IsNull() ? "" : v.Scalar(), v.IsNull(), where_of(source, kv.first)});
    }
  }
  return Status::ok();
}

// ---------------------------------------------------------------------------------------------------
// Scalar conversion
// ---------------------------------------------------------------------------------------------------

std::string lower(std::string s) {
  for (auto& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return s;
}

std::optional<double> parse_double(const std::string& s) {
  if (s.empty()) return std::nullopt;
  const std::string l = lower(s);
  if (l == ".inf" || l == "+.inf" || l == "-.inf" || l == ".nan") return std::nullopt;  // never meaningful
  char* end = nullptr;
  errno = 0;
  double v = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size() || errno == ERANGE || !std::isfinite(v)) return std::nullopt;
  return v;
}

std::optional<int64_t> parse_int(const std::string& s) {
  int64_t v = 0;
  const char* b = s.data();
  const char* e = s.data() + s.size();
  if (b != e && *b == '+') ++b;
  auto [ptr, ec] = std::from_chars(b, e, v);
  if (ec == std::errc() && ptr == e && b != e) return v;
  // Accept integral floats like `1e6` (handy for steps / token counts).
  if (auto d = parse_double(s); d && std::floor(*d) == *d && std::fabs(*d) < 9.0e15)
    return static_cast<int64_t>(*d);
  return std::nullopt;
}

std::optional<bool> parse_bool(const std::string& s) {
  const std::string l = lower(s);
  if (l == "true" || l == "yes" || l == "on" || l == "1") return true;
  if (l == "false" || l == "no" || l == "off" || l == "0") return false;
  return std::nullopt;
}

std::string fmt_num(double v) {
  if (std::floor(v) == v && std::fabs(v) < 1e15) return fmt::format("{}", static_cast<int64_t>(v));
  return fmt::format("{}", v);
}

Status range_check(const KeyDef& k, double v, const std::string& text, const std::string& where) {
  if (v < k.lo)
    return Status::error(
        fmt::format("config key '{}' must be >= {}, got {} ({})", k.name, fmt_num(k.lo), text, where));
  if (v > k.hi)
    return Status::error(
        fmt::format("config key '{}' must be <= {}, got {} ({})", k.name, fmt_num(k.hi), text, where));
  return Status::ok();
}

Status apply_entry(Config& c, const Entry& e) {
  const KeyDef* k = find_key(e.key);
  if (!k) return Status::error(unknown_key_message(e.key, e.where));
  FieldRef ref = k->field(c);
  auto type_error = [&](const char* what) {
    return Status::error(
        fmt::format("config key '{}' expects {}, got '{}' ({})", e.key, what, e.value, e.where));
  };
  switch (k->kind) {
    case Kind::Int: {
      std::optional<int64_t> v = parse_int(e.value);
      // tie_embeddings is an int (-1 = style default) but reads naturally as a bool too.
      if (!v && k->lo >= -1 && k->hi <= 1)
        if (auto b = parse_bool(e.value)) v = *b ? 1 : 0;
      if (e.is_null || !v) return type_error("an integer");
      Status st = range_check(*k, static_cast<double>(*v), e.value, e.where);
      if (!st) return st;
      if (auto* p = std::get_if<int64_t*>(&ref))
        **p = *v;
      else
        *std::get<int*>(ref) = static_cast<int>(*v);
      return Status::ok();
    }
    case Kind::Float: {
      std::optional<double> v = parse_double(e.value);
      if (e.is_null || !v) return type_error("a number");
      Status st = range_check(*k, *v, e.value, e.where);
      if (!st) return st;
      *std::get<double*>(ref) = *v;
      return Status::ok();
    }
    case Kind::Bool: {
      std::optional<bool> v = parse_bool(e.value);
      if (e.is_null || !v) return type_error("true or false");
      *std::get<bool*>(ref) = *v;
      return Status::ok();
    }
    case Kind::String: {
      if (!k->choices.empty() &&
          std::find(k->choices.begin(), k->choices.end(), e.value) == k->choices.end()) {
        std::string all;
        for (const auto& ch : k->choices) all += (all.empty() ? "" : ", ") + ch;
        return Status::error(
            fmt::format("config key '{}' must be one of {}, got '{}' ({})", e.key, all, e.value, e.where));
      }
      *std::get<std::string*>(ref) = e.value;
      return Status::ok();
    }
  }
  return Status::ok();
}

// ---------------------------------------------------------------------------------------------------
// Files and presets
// ---------------------------------------------------------------------------------------------------

// configs/ directories to search for `preset: NAME`, after the including file's own directory.
std::vector<fs::path> preset_dirs() {
  std::vector<fs::path> dirs;
#ifdef NDT_SOURCE_DIR
  dirs.push_back(fs::path(NDT_SOURCE_DIR) / "configs");
#else
  // The library is built without NDT_SOURCE_DIR; this file's absolute path locates the repo instead
  // (src/train/config.cpp -> repo root). Only a fallback: a relocated binary still has ./configs.
  fs::path self(__FILE__);
  if (self.is_absolute()) dirs.push_back(self.parent_path().parent_path().parent_path() / "configs");
#endif
  dirs.push_back(fs::path("configs"));
  return dirs;
}

Result<fs::path> resolve_preset(const std::string& name, const fs::path& including_dir,
                                const std::string& where) {
  std::vector<fs::path> candidates;
  const bool is_path =
      name.find('/') != std::string::npos || name.ends_with(".yaml") || name.ends_with(".yml");
  if (is_path) {
    fs::path p(name);
    candidates.push_back(p.is_absolute() ? p : including_dir / p);
  } else {
    candidates.push_back(including_dir / (name + ".yaml"));
    for (const auto& d : preset_dirs()) candidates.push_back(d / (name + ".yaml"));
  }
  std::string tried;
  for (const auto& c : candidates) {
    std::error_code ec;
    if (fs::is_regular_file(c, ec)) return c;
    tried += (tried.empty() ? "" : ", ") + c.string();
  }
  return Status::error(fmt::format("preset '{}' ({}) not found; looked in {}", name, where, tried));
}

Result<YAML::Node> parse_yaml(const std::string& text, const std::string& source) {
  try {
    return YAML::Load(text);
  } catch (const YAML::Exception& ex) {
    // ex.mark is 0-based; ex.msg is the message without yaml-cpp's own "yaml-cpp: error at" prefix.
    if (!ex.mark.is_null())
      return Status::error(fmt::format("YAML syntax error in {} at line {}, column {}: {}", source,
                                       ex.mark.line + 1, ex.mark.column + 1, ex.msg));
    return Status::error(fmt::format("YAML syntax error in {}: {}", source, ex.msg));
  }
}

// Collects the entries of one YAML document (with its preset chain first). `stack` holds the files being
// loaded, for cycle detection.
Status collect(const std::string& text, const std::string& source, const fs::path& dir,
               std::vector<fs::path>& stack, std::vector<Entry>& out) {
  auto node = parse_yaml(text, source);
  if (!node) return node.status();
  const YAML::Node& root = node.value();
  if (root.IsNull()) return Status::ok();  // empty file: all defaults
  if (!root.IsMap())
    return Status::error(fmt::format("config {} must be a mapping of keys to values", source));

  // The preset is applied first wherever `preset:` is written, so the file's own keys always win.
  if (const YAML::Node pn = root["preset"]) {
    if (!pn.IsScalar())
      return Status::error(
          fmt::format("config key 'preset' expects a preset name ({})", where_of(source, pn)));
    const std::string where = where_of(source, pn);
    auto path = resolve_preset(pn.Scalar(), dir, where);
    if (!path) return path.status();
    std::error_code ec;
    fs::path canon = fs::weakly_canonical(path.value(), ec);
    if (ec) canon = path.value();
    if (std::find(stack.begin(), stack.end(), canon) != stack.end()) {
      std::string chain;
      for (const auto& s : stack) chain += s.string() + " -> ";
      return Status::error(fmt::format("preset cycle ({}): {}{}", where, chain, canon.string()));
    }
    std::ifstream in(path.value(), std::ios::binary);
    if (!in)
      return Status::error(fmt::format("cannot read preset file '{}' ({})", path.value().string(), where));
    std::stringstream ss;
    ss << in.rdbuf();
    stack.push_back(canon);
    Status st = collect(ss.str(), path.value().string(), path.value().parent_path(), stack, out);
    stack.pop_back();
    if (!st) return st;
  }
  std::vector<Entry> own;
  int64_t budget = kMaxConfigNodes;
  Status st = flatten(root, "", source, own, budget);
  if (!st) return st;
  std::erase_if(own, [](const Entry& e) { return e.key == "preset"; });
  out.insert(out.end(), own.begin(), own.end());
  return Status::ok();
}

Result<Entry> parse_override(const std::string& ov) {
  const auto eq = ov.find('=');
  if (eq == std::string::npos)
    return Status::error(fmt::format("override '{}' must look like key=value (e.g. train.lr=3e-4)", ov));
  auto trim = [](std::string s) {
    const auto b = s.find_first_not_of(" \t");
    const auto e = s.find_last_not_of(" \t");
    return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
  };
  Entry e;
  e.key = trim(ov.substr(0, eq));
  e.where = fmt::format("override '{}'", ov);
  const std::string raw = trim(ov.substr(eq + 1));
  if (e.key.empty()) return Status::error(fmt::format("override '{}' has an empty key", ov));
  // String keys take the text literally unless it is quoted (paths may contain ': ' or ' #'); other
  // keys read it as a YAML scalar, as in a file.
  const KeyDef* k = find_key(e.key);
  if (k && k->kind == Kind::String && (raw.empty() || (raw[0] != '"' && raw[0] != '\''))) {
    e.value = raw;
    return e;
  }
  try {
    YAML::Node n = YAML::Load(raw);
    if (n.IsMap() || n.IsSequence())
      return Status::error(
          fmt::format("config key '{}' expects a single value, got '{}' ({})", e.key, raw, e.where));
    e.is_null = n.IsNull() && raw.empty();
    e.value = n.IsNull() ? raw : n.Scalar();
  } catch (const YAML::Exception&) {
    e.value = raw;  // not valid YAML: take the text literally, the type check will judge it
  }
  return e;
}

Result<Config> build(const std::string& text, const std::string& source, const fs::path& dir,
                     std::vector<fs::path> stack, const std::vector<std::string>& overrides) {
  std::vector<Entry> entries;
  Status st = collect(text, source, dir, stack, entries);
  if (!st) return st;
  for (const auto& ov : overrides) {
    auto e = parse_override(ov);
    if (!e) return e.status();
    entries.push_back(std::move(e).value());
  }
  Config c;
  c.source = source;
  for (const auto& e : entries) {
    st = apply_entry(c, e);
    if (!st) return st;
  }
  st = validate_config(c);
  if (!st) return Status::error(st.message() + fmt::format(" ({})", source));
  return c;
}

template <typename... A>
Status errf(fmt::format_string<A...> f, A&&... args) {
  return Status::error(fmt::format(f, std::forward<A>(args)...));
}

std::string quote(const std::string& s) {
  // JSON-style double quoting is valid YAML and survives any characters.
  std::string out = "\"";
  for (char ch : s) {
    switch (ch) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        if (static_cast<unsigned char>(ch) < 0x20)
          out += fmt::format("\\x{:02x}", static_cast<unsigned>(static_cast<unsigned char>(ch)));
        else
          out += ch;
    }
  }
  return out + "\"";
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// Public API
// ---------------------------------------------------------------------------------------------------

Result<Config> load_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) return Status::error(fmt::format("config file '{}' not found", path));
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::error(fmt::format("cannot read config file '{}'", path));
  std::stringstream ss;
  ss << in.rdbuf();
  fs::path canon = fs::weakly_canonical(path, ec);
  if (ec) canon = path;
  return build(ss.str(), path, fs::path(path).parent_path(), {canon}, overrides);
}

Result<Config> parse_config_string(const std::string& yaml_text, const std::vector<std::string>& overrides,
                                   const std::string& source_name) {
  return build(yaml_text, source_name, fs::current_path(), {}, overrides);
}

// The multimodal pieces: the encoder's own shape and layout, and how it meets the LLM's.
static Status validate_encoder(const Config& c) {
  const EncoderConfig& e = c.encoder;
  const ParallelConfig& p = c.parallel;
  if (c.data.task == "image_caption" && !e.enabled())
    return errf("data.task image_caption needs an image encoder: set encoder.image_size (e.g. 16)");
  if (!e.enabled()) return Status::ok();
  if (e.cp != 1 || e.pp != 1)
    return errf(
        "encoder.parallel.cp = {} and encoder.parallel.pp = {}: the encoder runs without context or pipeline "
        "parallelism (both must be 1); give it tensor and data parallelism (encoder.parallel.tp, .dp)",
        e.cp, e.pp);
  if (e.image_size % e.patch_size != 0)
    return errf("encoder.image_size ({}) must be divisible by encoder.patch_size ({})", e.image_size,
                e.patch_size);
  if (e.d_model % e.n_heads != 0)
    return errf("encoder.d_model ({}) must be divisible by encoder.n_heads ({})", e.d_model, e.n_heads);
  if (e.style == "llama" && (e.d_model / e.n_heads) % 2 != 0)
    return errf("encoder.d_model / encoder.n_heads = {} must be even for encoder.style llama (RoPE)",
                e.d_model / e.n_heads);
  if (e.n_heads % e.tp != 0)
    return errf("encoder.parallel.tp ({}) must divide encoder.n_heads ({})", e.tp, e.n_heads);
  const int64_t world = p.tp * p.cp * p.dp * p.pp;
  if (world % e.tp != 0)
    return errf("encoder.parallel.tp ({}) must divide the world of {} rank(s) (parallel tp*cp*dp*pp)", e.tp,
                world);
  const int64_t edp = e.dp > 0 ? e.dp : world / e.tp;
  if (e.tp * edp != world)
    return errf(
        "encoder layout tp={} dp={} covers {} rank(s) but the LLM layout tp={} cp={} dp={} pp={} covers {}: "
        "both modules run on all ranks (colocated)",
        e.tp, edp, e.tp * edp, p.tp, p.cp, p.dp, p.pp, world);
  if (edp % p.dp != 0 && p.dp % edp != 0)
    return errf(
        "encoder.parallel.dp ({}) and parallel.dp ({}) must divide one another (the bridge gathers encoder "
        "shards into an LLM batch or slices one)",
        edp, p.dp);
  if (c.train.global_batch % edp != 0)
    return errf("train.global_batch ({}) must be divisible by encoder.parallel.dp ({})", c.train.global_batch,
                edp);
  if (c.train.device == "cuda" && e.d_model / e.n_heads != 64 && e.d_model / e.n_heads != 128)
    return errf(
        "train.device cuda needs an encoder head dim of 64 or 128, got encoder.d_model / n_heads = {}",
        e.d_model / e.n_heads);
  // image_caption samples: BOS, the placeholders, '=', the caption's digits and EOS (inputs: all but EOS).
  if (c.data.task == "image_caption" && e.patches() + c.data.caption_digits + 2 > c.data.seq_len)
    return errf(
        "captions longer than the context: BOS, an image's {} placeholder tokens ((encoder.image_size / "
        "encoder.patch_size)^2), '=' and {} caption digits need data.seq_len >= {}, got {}",
        e.patches(), c.data.caption_digits, e.patches() + c.data.caption_digits + 2, c.data.seq_len);
  return Status::ok();
}

Status validate_config(const Config& c) {
  const ModelConfig& m = c.model;
  const DataConfig& d = c.data;
  const TrainConfig& t = c.train;
  const ParallelConfig& p = c.parallel;

  // Single-key checks repeated here because a Config can also be built in code, not only parsed.
  if (m.style != "gpt2" && m.style != "llama")
    return errf("model.style must be gpt2 or llama, got '{}'", m.style);
  if (m.vocab_size < 1) return errf("model.vocab_size must be >= 1, got {}", m.vocab_size);
  if (m.d_model < 1 || m.n_layers < 1 || m.n_heads < 1)
    return errf("model.d_model, model.n_layers and model.n_heads must be >= 1, got {}, {}, {}", m.d_model,
                m.n_layers, m.n_heads);
  if (m.n_kv_heads < 0) return errf("model.n_kv_heads must be >= 0, got {}", m.n_kv_heads);
  if (m.d_ff < 0) return errf("model.d_ff must be >= 0, got {}", m.d_ff);
  if (m.tie_embeddings < -1 || m.tie_embeddings > 1)
    return errf("model.tie_embeddings must be -1, 0 or 1, got {}", m.tie_embeddings);

  if (m.head_dim_override < 0) return errf("model.head_dim must be >= 0, got {}", m.head_dim_override);
  // An explicit head width decouples the attention width H*D from d_model; without one D = C / H.
  if (m.head_dim_override == 0 && m.d_model % m.n_heads != 0)
    return errf("model.d_model ({}) must be divisible by model.n_heads ({}) (or set model.head_dim)",
                m.d_model, m.n_heads);
  if (m.n_heads % m.kv_heads() != 0)
    return errf("model.n_heads ({}) must be divisible by model.n_kv_heads ({})", m.n_heads, m.kv_heads());
  if (m.style == "gpt2" && m.n_kv_heads != 0 && m.n_kv_heads != m.n_heads)
    return errf("model.n_kv_heads ({}) must be 0 or model.n_heads ({}) for style gpt2 (no GQA)", m.n_kv_heads,
                m.n_heads);
  if (m.style == "gpt2" && m.qkv_bias)
    return errf("model.qkv_bias is for style llama (style gpt2 has its own q and v biases)");
  if (m.style == "gpt2" && m.qk_norm)
    return errf("model.qk_norm is for style llama (Qwen3's q/k RMSNorm; style gpt2 uses LayerNorm)");
  if (m.style == "llama" && m.head_dim() % 2 != 0)
    return errf("the head dim {} ({}) must be even for style llama (RoPE rotates pairs)", m.head_dim(),
                m.head_dim_override > 0 ? "model.head_dim" : "model.d_model / model.n_heads");
  if (d.seq_len > m.max_seq_len)
    return errf("data.seq_len ({}) must be <= model.max_seq_len ({})", d.seq_len, m.max_seq_len);
  if (const MoeConfig& e = m.moe; e.enabled()) {
    if (e.top_k > e.num_experts)
      return errf("model.moe.top_k ({}) must be <= model.moe.num_experts ({})", e.top_k, e.num_experts);
    if (e.router != "softmax" && e.router != "sigmoid")
      return errf("model.moe.router must be softmax or sigmoid, got '{}'", e.router);
    if (e.every < 1) return errf("model.moe.every must be >= 1, got {}", e.every);
    if (e.first_dense >= m.n_layers)
      return errf("model.moe.first_dense ({}) leaves no MoE layer in model.n_layers = {}", e.first_dense,
                  m.n_layers);
    if (e.num_experts % p.ep != 0)
      return errf("model.moe.num_experts ({}) must be divisible by parallel.ep ({})", e.num_experts, p.ep);
  } else if (p.ep > 1) {
    return errf("parallel.ep = {} needs a Mixture-of-Experts model (set model.moe.num_experts)", p.ep);
  }
  if (p.ep > 1 && (p.dp * p.cp) % p.ep != 0)
    return errf(
        "parallel.ep ({}) must divide parallel.dp * parallel.cp = {} * {} = {} (experts are sharded over the "
        "data x context parallel ranks)",
        p.ep, p.dp, p.cp, p.dp * p.cp);

  if (d.task != "addition" && d.task != "sort" && d.task != "lm" && d.task != "shards" && d.task != "sft" &&
      d.task != "image_caption")
    return errf("data.task must be one of addition, sort, lm, shards, sft, image_caption, got '{}'", d.task);
  if (Status st = validate_encoder(c); !st) return st;
  if ((d.task == "shards" || d.task == "sft") && d.path.empty())
    return errf("data.path is required for data.task {}", d.task);
  if (d.min_seq_len > d.seq_len)
    return errf("data.min_seq_len ({}) must be <= data.seq_len ({})", d.min_seq_len, d.seq_len);
  if (d.min_seq_len > 0 && d.task != "lm")
    return errf("data.min_seq_len applies to data.task lm only, got task '{}'", d.task);
  if (d.pack_tokens > 0 && !d.packing)
    return errf("data.pack_tokens ({}) is set but data.packing is false", d.pack_tokens);
  if (d.pack_tokens > 0 && d.pack_tokens < d.seq_len)
    return errf(
        "data.pack_tokens ({}) must be >= data.seq_len ({}): the longest sample must fit a microbatch",
        d.pack_tokens, d.seq_len);
  if (d.tokenizer.empty())
    return errf("data.tokenizer must be 'byte' or a SentencePiece .model path, got ''");

  if (!(t.lr > 0)) return errf("train.lr must be > 0, got {}", t.lr);
  if (t.min_lr < 0 || t.min_lr > t.lr)
    return errf("train.min_lr ({}) must be in [0, train.lr = {}]", t.min_lr, t.lr);
  if (t.warmup_steps > t.steps)
    return errf("train.warmup_steps ({}) must be <= train.steps ({})", t.warmup_steps, t.steps);
  if (t.global_batch < 1) return errf("train.global_batch must be >= 1, got {}", t.global_batch);
  if (t.micro_batch < 0) return errf("train.micro_batch must be >= 0, got {}", t.micro_batch);
  if (t.device != "cpu" && t.device != "cuda")
    return errf("train.device must be cpu or cuda, got '{}'", t.device);
  if (t.precision != "auto" && t.precision != "fp32" && t.precision != "bf16")
    return errf("train.precision must be auto, fp32 or bf16, got '{}'", t.precision);
  if (t.device == "cpu" && t.precision == "bf16")
    return errf("train.precision bf16 needs train.device cuda (the CPU engine computes in fp32)");
  if (t.attention != "auto" && t.attention != "cudnn" && t.attention != "native")
    return errf("train.attention must be auto, cudnn or native, got '{}'", t.attention);
  if (t.device == "cpu" && t.attention == "cudnn")
    return errf("train.attention cudnn needs train.device cuda (cuDNN's attention is a GPU kernel)");
  if (t.device == "cuda" && m.head_dim() != 64 && m.head_dim() != 128) {
    if (m.head_dim_override > 0)
      return errf(
          "train.device cuda needs a head dim of 64 or 128 (the GPU attention kernels), got model.head_dim = "
          "{}",
          m.head_dim());
    return errf(
        "train.device cuda needs a head dim of 64 or 128 (the GPU attention kernels), got model.d_model / "
        "model.n_heads = {} / {} = {}",
        m.d_model, m.n_heads, m.head_dim());
  }
#ifndef NDT_HAVE_CUDA
  if (t.device == "cuda")
    return errf(
        "train.device is cuda but this ndtrain was built without the CUDA backend (no nvcc at build time)");
#endif

  for (auto [name, v] : {std::pair{"tp", p.tp},
                         {"cp", p.cp},
                         {"ep", p.ep},
                         {"dp", p.dp},
                         {"pp", p.pp},
                         {"virtual_stages", p.virtual_stages}})
    if (v < 1) return errf("parallel.{} must be >= 1, got {}", name, v);
  if (t.nonfinite != "stop" && t.nonfinite != "skip")
    return errf("train.nonfinite must be stop or skip, got '{}'", t.nonfinite);
  if (t.max_consecutive_skips < 1)
    return errf("train.max_consecutive_skips must be >= 1, got {}", t.max_consecutive_skips);
  {
    auto faults = parse_fault_spec(c.debug.fault);
    if (!faults) return errf("config key 'debug.fault': {}", faults.status().message());
    const int64_t world = p.tp * p.cp * p.dp * p.pp;
    for (const Fault& f : faults.value()) {
      if (f.rank >= world)
        return errf("config key 'debug.fault': rank {} is outside the {} rank(s) of tp * cp * dp * pp",
                    f.rank, world);
      if (f.kind == Fault::Kind::GpuHang && t.device != "cuda")
        return errf("config key 'debug.fault': gpu_hang needs train.device cuda");
    }
  }
  if (t.global_batch % p.dp != 0)
    return errf("train.global_batch ({}) must be divisible by parallel.dp ({})", t.global_batch, p.dp);
  // (Checked first so that dp * micro_batch below cannot overflow.)
  if (t.micro_batch > t.global_batch / p.dp)
    return errf("train.micro_batch ({}) must be <= train.global_batch / parallel.dp ({} / {} = {})",
                t.micro_batch, t.global_batch, p.dp, t.global_batch / p.dp);
  if (t.micro_batch > 0 && t.global_batch % (p.dp * t.micro_batch) != 0)
    return errf("train.global_batch ({}) must be divisible by parallel.dp * train.micro_batch ({} * {} = {})",
                t.global_batch, p.dp, t.micro_batch, p.dp * t.micro_batch);
  if (p.schedule != "1f1b" && p.schedule != "interleaved" && p.schedule != "gpipe")
    return errf("parallel.schedule must be one of 1f1b, interleaved, gpipe, got '{}'", p.schedule);
  // Virtual stages only mean something to the interleaved schedule; silently ignoring them would hide
  // a config mistake.
  if (p.virtual_stages > 1 && p.schedule != "interleaved")
    return errf("parallel.virtual_stages ({}) > 1 requires parallel.schedule interleaved, got '{}'",
                p.virtual_stages, p.schedule);

  {
    std::vector<std::string> axes;
    std::stringstream ss(p.order);
    for (std::string a; std::getline(ss, a, '-');) axes.push_back(a);
    std::vector<std::string> sorted = axes;
    std::sort(sorted.begin(), sorted.end());
    const std::vector<std::string> want = {"cp", "dp", "ep", "pp", "tp"};
    if (sorted != want)
      return errf("parallel.order must be a '-'-separated permutation of tp, cp, ep, dp, pp, got '{}'",
                  p.order);
  }
  return Status::ok();
}

std::string config_to_yaml(const Config& c) {
  Config copy = c;  // the schema hands out mutable refs; read through a copy
  std::string out =
      fmt::format("# effective config (source: {})\n", c.source.empty() ? "<defaults>" : c.source);
  std::string section, subsection;
  for (const auto& k : schema()) {
    const std::string name = k.name;
    const auto dot = name.find('.'), last = name.rfind('.');
    const std::string sec = name.substr(0, dot), leaf = name.substr(last + 1);
    // A key two levels down (model.moe.top_k) is written under a nested mapping.
    const std::string sub = last > dot ? name.substr(dot + 1, last - dot - 1) : "";
    if (sec != section) {
      out += sec + ":\n";
      section = sec;
      subsection.clear();
    }
    if (sub != subsection) {
      if (!sub.empty()) out += "  " + sub + ":\n";
      subsection = sub;
    }
    const std::string indent = sub.empty() ? "  " : "    ";
    std::string value;
    FieldRef ref = k.field(copy);
    std::visit(
        [&](auto* p) {
          using V = std::remove_pointer_t<decltype(p)>;
          if constexpr (std::is_same_v<V, std::string>)
            value = quote(*p);
          else if constexpr (std::is_same_v<V, bool>)
            value = *p ? "true" : "false";
          else if constexpr (std::is_same_v<V, double>) {
            value = fmt::format("{}", *p);  // shortest representation that round-trips
            // "1e-05" -> "1.0e-05": YAML 1.1 readers (PyYAML) need a '.' to see a float.
            const auto e = value.find('e');
            if (e != std::string::npos && value.find('.') == std::string::npos)
              value = value.substr(0, e) + ".0" + value.substr(e);
          } else
            value = fmt::format("{}", *p);
        },
        ref);
    std::string note;
    if (name == "model.n_kv_heads" && c.model.n_kv_heads == 0)
      note = fmt::format("  # = {}", c.model.kv_heads());
    if (name == "model.head_dim" && c.model.head_dim_override == 0 && c.model.n_heads > 0)
      note = fmt::format("  # = {}", c.model.head_dim());
    if (name == "model.d_ff" && c.model.d_ff == 0) note = fmt::format("  # = {}", c.model.ffn_dim());
    if (name == "model.moe.d_ff_expert" && c.model.moe.enabled() && c.model.moe.d_ff_expert == 0)
      note = fmt::format("  # = {}", c.model.expert_ffn_dim());
    if (name == "model.tie_embeddings" && c.model.tie_embeddings < 0)
      note = fmt::format("  # = {}", c.model.tied() ? "tied" : "untied");
    if (name == "train.micro_batch" && c.train.micro_batch == 0 && c.parallel.dp > 0)
      note = fmt::format("  # = {}", c.train.global_batch / c.parallel.dp);
    out += fmt::format("{}{}: {}{}\n", indent, leaf, value, note);
  }
  return out;
}

}  // namespace ndt
