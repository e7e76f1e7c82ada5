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

Runner add_convert(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "convert", "Convert weights between ndtrain runs and Hugging Face Llama / Mixtral directories");
  struct Opts {
    std::string to_hf, from_hf, run_dir;
  };
  auto o = std::make_shared<Opts>();
  cmd->add_option("--run", o->run_dir, "ndtrain run directory (config.yaml + model.safetensors)")->required();
  auto* to = cmd->add_option("--to-hf", o->to_hf, "Write a Hugging Face directory here from --run");
  auto* from = cmd->add_option("--from-hf", o->from_hf, "Read this Hugging Face directory into --run");
  to->excludes(from);
  return [o](Communicator& world) {
    NDT_CHECK(world.size() == 1, "convert runs in one process (got {} ranks)", world.size());
    const std::filesystem::path run(o->run_dir);
    if (!o->to_hf.empty()) {
      Config cfg = load_config((run / "config.yaml").string(), {}).value();
      auto file = open_safetensors((run / "model.safetensors").string()).value();
      std::vector<std::pair<std::string, Tensor>> params;
      for (const auto& name : file.names()) params.emplace_back(name, file.read(name));
      export_hf(o->to_hf, cfg.model, params).throw_if_error();
      std::printf("wrote Hugging Face model to %s (config.json, model.safetensors)\n", o->to_hf.c_str());
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
