// ndtrain convert: export a run's weights to a Hugging Face Llama or Mixtral (MoE) directory (config.json +
// model.safetensors), or import one into an ndtrain run directory (config.yaml + model.safetensors).
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "apps/commands.h"
#include "train/config.h"
#include "train/hf_interop.h"
#include "train/safetensors.h"

namespace ndt::app {

namespace {
// "5GB", "500MB", "64KB" (powers of 1000, as transformers' max_shard_size) or plain bytes.
int64_t parse_size(const std::string& text) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    NDT_FAIL("--max-shard-size '{}': expected a number with an optional KB/MB/GB suffix", text);
  }
  const std::string unit = text.substr(used);
  const double mul = unit.empty() || unit == "B" ? 1
                     : unit == "KB"              ? 1e3
                     : unit == "MB"              ? 1e6
                     : unit == "GB"              ? 1e9
                                                 : -1;
  NDT_CHECK(mul > 0 && v > 0,
            "--max-shard-size '{}': expected a positive number with an optional KB/MB/GB suffix", text);
  return static_cast<int64_t>(v * mul);
}
}  // namespace

Runner add_convert(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "convert", "Convert weights between ndtrain runs and Hugging Face Llama / Mixtral directories");
  struct Opts {
    std::string to_hf, from_hf, run_dir, max_shard_size;
    bool bf16 = false;
  };
  auto o = std::make_shared<Opts>();
  cmd->add_option("--run", o->run_dir, "ndtrain run directory (config.yaml + model.safetensors)")->required();
  auto* to = cmd->add_option("--to-hf", o->to_hf, "Write a Hugging Face directory here from --run");
  auto* from = cmd->add_option("--from-hf", o->from_hf, "Read this Hugging Face directory into --run");
  to->excludes(from);
  cmd->add_option("--max-shard-size", o->max_shard_size,
                  "With --to-hf: split the weights into shards of at most this size (e.g. 5GB, 500MB, bytes) "
                  "with model.safetensors.index.json")
      ->needs(to);
  cmd->add_flag("--bf16", o->bf16, "With --to-hf: store the weights in bfloat16 (round to nearest even)")
      ->needs(to);
  return [o](Communicator& world) {
    NDT_CHECK(world.size() == 1, "convert runs in one process (got {} ranks)", world.size());
    const std::filesystem::path run(o->run_dir);
    if (!o->to_hf.empty()) {
      Config cfg = load_config((run / "config.yaml").string(), {}).value();
      auto file = open_safetensors((run / "model.safetensors").string()).value();
      std::vector<std::pair<std::string, Tensor>> params;
      for (const auto& name : file.names()) params.emplace_back(name, file.read(name));
      HfExportOptions opts;
      opts.bf16 = o->bf16;
      if (!o->max_shard_size.empty()) opts.shard_bytes = parse_size(o->max_shard_size);
      export_hf(o->to_hf, cfg.model, params, opts).throw_if_error();
      std::printf("wrote Hugging Face model to %s (config.json, %s)\n", o->to_hf.c_str(),
                  std::filesystem::exists(std::filesystem::path(o->to_hf) / "model.safetensors.index.json")
                      ? "model.safetensors.index.json and its shards"
                      : "model.safetensors");
      return 0;
    }
    NDT_CHECK(!o->from_hf.empty(), "convert needs --to-hf or --from-hf");
    auto imported = import_hf(o->from_hf).value();
    Config cfg;
    cfg.model = imported.first;
    // The data section is ours to choose: keep samples within the imported context, and use the HF
    // directory's SentencePiece model when it ships one.
    cfg.data.seq_len = std::min(cfg.data.seq_len, cfg.model.max_seq_len);
    if (std::filesystem::exists(std::filesystem::path(o->from_hf) / "tokenizer.model"))
      cfg.data.tokenizer = (std::filesystem::path(o->from_hf) / "tokenizer.model").string();
    std::filesystem::create_directories(run);
    save_safetensors((run / "model.safetensors").string(), imported.second, {{"format", "ndtrain"}})
        .throw_if_error();
    std::ofstream(run / "config.yaml") << config_to_yaml(cfg);
    std::printf("imported %s into %s (%zu tensors)\n", o->from_hf.c_str(), o->run_dir.c_str(),
                imported.second.size());
    return 0;
  };
}

}  // namespace ndt::app
