// ndtrain generate: greedy completion of prompts with the weights a training run saved.
#include <cstdio>
#include <filesystem>

#include "apps/commands.h"
#include "data/tokenizer.h"
#include "model/transformer.h"
#include "train/config.h"
#include "train/evaluate.h"
#include "train/safetensors.h"

namespace ndt::app {

Runner add_generate(CLI::App& app) {
  auto* cmd = app.add_subcommand("generate", "Complete prompts with a trained model (greedy)");
  struct Opts {
    std::string run_dir;
    std::vector<std::string> prompts;
    int64_t max_new_tokens = 32;
  };
  auto o = std::make_shared<Opts>();
  cmd->add_option("--run", o->run_dir, "Directory of a training run (config.yaml + model.safetensors)")
      ->required();
  cmd->add_option("-p,--prompt", o->prompts, "Prompt text (repeatable)")->required();
  cmd->add_option("-n,--max-new-tokens", o->max_new_tokens, "Tokens to generate at most")
      ->check(CLI::Range(1, 4096));
  return [o](Communicator& world) {
    NDT_CHECK(world.size() == 1, "generate runs in one process (got {} ranks)", world.size());
    const std::filesystem::path dir(o->run_dir);
    Config cfg = load_config((dir / "config.yaml").string(), {}).value();
    auto tok = make_tokenizer(cfg.data.tokenizer).value();
    Transformer model(cfg.model, StageSpec{}, nullptr);
    auto file = open_safetensors((dir / "model.safetensors").string()).value();
    for (auto& p : model.params().all()) {
      Tensor t = file.read(p->name);
      if (t.shape() != p->value.shape())
        NDT_FAIL("{}: tensor {} has shape {}, the config's model expects {}",
                 (dir / "model.safetensors").string(), p->name, shape_str(t.shape()),
                 shape_str(p->value.shape()));
      p->value.copy_from(t);
    }
    std::vector<std::vector<int32_t>> prompts;
    for (const auto& text : o->prompts) {
      std::vector<int32_t> ids{tok->bos_id()};
      auto body = tok->encode(text);
      ids.insert(ids.end(), body.begin(), body.end());
      prompts.push_back(ids);
    }
    auto out = greedy_generate(argmax_fn(model), prompts, o->max_new_tokens, tok->eos_id(), tok->pad_id());
    for (size_t i = 0; i < out.size(); ++i)
      std::printf("%s%s\n", o->prompts[i].c_str(), tok->decode(out[i]).c_str());
    return 0;
  };
}

}  // namespace ndt::app
