#include "apps/commands.h"
#include "apps/setup.h"
#include "parallel/layout.h"
#include "train/trainer.h"

namespace ndt::app {

Runner add_train(CLI::App& app) {
  auto* cmd = app.add_subcommand("train", "Train a model from a YAML config");
  auto config = std::make_shared<std::string>();
  auto sets = std::make_shared<std::vector<std::string>>();
  cmd->add_option("-c,--config", *config, "YAML config file (see configs/)")->required();
  cmd->add_option("--set", *sets, "Override config keys: --set train.steps=100 model.n_layers=4");
  auto trace = std::make_shared<std::string>();
  cmd->add_option("--trace", *trace,
                  "Write a Chrome trace (JSON) of steps 1-3: forward/backward/send/recv per rank");
  return [config, sets, trace](Communicator& world) {
    RunSetup s = load_run(world, *config, *sets);
    auto layout = Layout::create(s.cfg, world);
    agree_or_throw(layout.status(), world);
    Trainer trainer(s.cfg, layout.value()->comms(), *s.tok, *s.train, s.val.get());
    if (!trace->empty()) trainer.set_trace(*trace);
    trainer.run();
    return 0;
  };
}

}  // namespace ndt::app
