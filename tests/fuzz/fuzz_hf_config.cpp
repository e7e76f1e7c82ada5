// Fuzz target: Hugging Face import (train/hf_interop.h, hf_common.h). The input is a config.json, imported
// (import_hf) from three directories made at start-up that hold the weights of tiny Llama, GPT-2 and
// Mixtral models, so a config that matches one of them is imported to the end (shapes checked, tensors
// read). The same input is also the model.safetensors.index.json of a fourth directory holding a sharded
// Llama export (weight_map, shard file names).
// NDT_FUZZ_DUMP_SEED=DIR writes the four directories' valid config.json / index files to DIR.
#include <cstdlib>

#include "fuzz_common.h"
#include "model/transformer.h"
#include "train/hf_interop.h"

using namespace ndt;
namespace fs = std::filesystem;

namespace {

ModelConfig tiny(const std::string& style, int64_t experts) {
  ModelConfig m;
  m.style = style;
  m.vocab_size = 16;
  m.d_model = 8;
  m.n_layers = 1;
  m.n_heads = 2;
  m.n_kv_heads = style == "llama" ? 1 : 0;
  m.d_ff = 8;
  m.max_seq_len = 8;
  m.moe.num_experts = experts;
  m.moe.top_k = 1;
  m.moe.aux_loss_coef = 0.01;
  return m;
}

std::string export_dir(const std::string& name, const ModelConfig& cfg, int64_t shard_bytes) {
  Transformer model(cfg, StageSpec{}, nullptr);
  model.params().init(5);
  std::vector<std::pair<std::string, Tensor>> full;
  for (auto& p : model.params().all()) full.emplace_back(p->name, p->value.clone());
  const std::string dir = fuzz::path("hf/" + name);
  HfExportOptions opts;
  opts.shard_bytes = shard_bytes;
  Status st = export_hf(dir, cfg, full, opts);
  if (!st) fuzz::property_failed("setup", st.message());
  if (const char* out = std::getenv("NDT_FUZZ_DUMP_SEED")) {
    for (const char* f : {"config.json", "model.safetensors.index.json"})
      if (fs::exists(fs::path(dir) / f))
        fs::copy_file(fs::path(dir) / f, fs::path(out) / (name + "_" + f),
                      fs::copy_options::overwrite_existing);
  }
  return dir;
}

struct Dirs {
  std::vector<std::string> single;  // config.json fuzzed
  std::string sharded;              // index fuzzed
};

const Dirs& dirs() {
  static const Dirs d = [] {
    Dirs x;
    x.single.push_back(export_dir("llama", tiny("llama", 0), 0));
    x.single.push_back(export_dir("gpt2", tiny("gpt2", 0), 0));
    x.single.push_back(export_dir("mixtral", tiny("llama", 2), 0));
    x.sharded = export_dir("sharded", tiny("llama", 0), 600);
    return x;
  }();
  return d;
}

void import_guarded(const std::string& dir) {
  try {
    auto r = import_hf(dir);
    if (!r) return;
    for (const auto& [name, t] : r.value().second)
      if (!t.defined() || t.numel() < 1) fuzz::property_failed("import", "empty tensor " + name);
  } catch (const Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Dirs& d = dirs();
  const std::string_view text = fuzz::as_text(data, size);
  for (const std::string& dir : d.single) {
    fuzz::write_file(fs::path(dir).lexically_relative(fuzz::temp_dir()).string() + "/config.json", text);
    import_guarded(dir);
  }
  fuzz::write_file(
      fs::path(d.sharded).lexically_relative(fuzz::temp_dir()).string() + "/model.safetensors.index.json",
      text);
  import_guarded(d.sharded);
  return 0;
}
