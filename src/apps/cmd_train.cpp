#include <filesystem>

#include "apps/commands.h"
#include "apps/kernel_trace_window.h"
#include "apps/setup.h"
#include "dist/watchdog.h"
#include "mimo/mimo.h"
#include "parallel/layout.h"
#include "posttrain/run.h"
#include "train/hf_interop.h"
#include "train/safetensors.h"
#include "train/trainer.h"

namespace ndt::app {

Runner add_train(CLI::App& app) {
  auto* cmd = app.add_subcommand("train", "Train a model from a YAML config");
  auto config = std::make_shared<std::string>();
  auto sets = std::make_shared<std::vector<std::string>>();
  cmd->add_option("-c,--config", *config, "YAML config file (see configs/)")->required();
  cmd->add_option("--set", *sets, "Override config keys: --set train.steps=100 model.n_layers=4");
  auto trace = std::make_shared<std::string>();
  auto resume = std::make_shared<std::string>();
  auto init_hf = std::make_shared<std::string>();
  cmd->add_option("--init-hf", *init_hf,
                  "Fine-tune from a Hugging Face Llama or Mixtral directory (its config.json replaces the "
                  "model section)");
  auto init = std::make_shared<std::string>();
  cmd->add_option("--init", *init,
                  "Start from these weights: a model.safetensors of full tensors named as ndtrain names them "
                  "(written by a run, or by another framework for a like-for-like comparison)");
  cmd->add_option(
      "--resume", *resume,
      "Continue from a checkpoint directory (any layout can load it); auto: the newest valid one of "
      "this run, or step 0");
  cmd->add_option("--trace", *trace,
                  "Write a Chrome trace (JSON) of steps 1-3: forward/backward/send/recv per rank");
  auto kernel_trace = std::make_shared<std::string>();
  auto kernel_trace_steps = std::make_shared<std::string>("2:4");
  cmd->add_option(
      "--kernel-trace", *kernel_trace,
      "GPU runs: record every kernel of a few steps (CUPTI) into DIR/kernels.rank<r>.json (Chrome "
      "trace) and .txt (per-kernel table)");
  cmd->add_option("--kernel-trace-steps", *kernel_trace_steps,
                  "Steps the kernel trace covers, FIRST:LAST (0-based, inclusive)")
      ->capture_default_str();
  return [config, sets, trace, resume, init_hf, init_path = init, kernel_trace,
          kernel_trace_steps](Communicator& world) {
    RunSetup s = load_run(world, *config, *sets);
    // The output directory must take files before any work starts (rank 0 writes there); every rank
    // reports the same error rather than rank 0 alone failing at the first save.
    agree_or_throw(
        world.rank() == 0 ? check_writable_dir(s.cfg.train.out_dir, "train.out_dir") : Status::ok(), world);
    std::vector<std::pair<std::string, Tensor>> init;
    if (!init_hf->empty()) {
      auto imported = import_hf(*init_hf);
      agree_or_throw(imported.status(), world);
      s.cfg.model = imported.value().first;
      init = std::move(imported.value().second);
      agree_or_throw(validate_config(s.cfg), world);
      agree_or_throw(validate_layout(s.cfg, world.size()), world);
    }
    const std::unique_ptr<Watchdog> watchdog = start_watchdog(s.cfg, world);
    auto layout = Layout::create(s.cfg, world);
    agree_or_throw(layout.status(), world);
    Trainer trainer(s.cfg, layout.value()->comms(), *s.tok, *s.train, s.val.get());
    if (!init_path->empty()) {
      NDT_CHECK(init.empty(), "--init and --init-hf both name initial weights: give one");
      init = read_weights(*init_path, world);
    }
    if (!s.cfg.posttrain.init.empty()) {  // post-training starts from a run's weights (e.g. its SFT run)
      NDT_CHECK(init.empty(), "posttrain.init and --init/--init-hf both name initial weights: give one");
      init = read_weights(s.cfg.posttrain.init, world);
    }
    // A multimodal model's image encoder, on its own layout over the same ranks (docs/multimodal.md).
    const auto encoder = attach_encoder(trainer, world, layout.value().get(), *s.tok, *s.train);
    if (encoder && world.rank() == 0) std::printf("multimodal: %s\n", encoder->describe().c_str());
    if (!init.empty()) trainer.load_weights(init);
    if (s.cfg.posttrain.algo != "sft") {
      NDT_CHECK(!encoder, "post-training (posttrain.algo {}) does not take an image encoder yet",
                s.cfg.posttrain.algo);
      NDT_CHECK(resume->empty() && trace->empty() && kernel_trace->empty(),
                "--resume, --trace and --kernel-trace apply to posttrain.algo sft only");
      run_posttrain(trainer, *s.tok, world);
      return 0;
    }
    if (!trace->empty()) trainer.set_trace(*trace);
    if (!resume->empty()) trainer.resume(*resume);
    if (watchdog) watchdog->set_step(trainer.start_step());
    const auto ktrace =
        KernelTraceWindow::create(*kernel_trace, *kernel_trace_steps, s.cfg, world, trainer.start_step());
    if (ktrace) trainer.wait_after_steps(ktrace->edges());
    trainer.run(
        [&](const StepStats& st) {
          if (ktrace) ktrace->after_step(st.step);
        },
        [&](int64_t step) {
          if (watchdog) watchdog->set_step(step);
        });
    return 0;
  };
}

}  // namespace ndt::app
