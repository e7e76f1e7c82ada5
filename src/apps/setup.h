#pragma once
// What every command needs before work starts: the config, tokenizer and datasets. Loaded on every
// rank; failures are agreed over the world so that all ranks stop together with the same message.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "data/dataset.h"
#include "dist/communicator.h"
#include "dist/watchdog.h"
#include "train/config.h"

namespace ndt::app {

struct RunSetup {
  Config cfg;
  std::unique_ptr<Tokenizer> tok;
  std::unique_ptr<Dataset> train;
  std::unique_ptr<Dataset> val;  // may be null
};

// Config, tokenizer, datasets, layout validation. Throws ndt::Error (same message on every rank).
// OK when `dir` exists or can be created and a file can be written in it; else an error naming `key`.
Status check_writable_dir(const std::string& dir, const std::string& key);

RunSetup load_run(Communicator& world, const std::string& config_path,
                  const std::vector<std::string>& overrides);

// Full tensors of a safetensors file, or of <dir>/model.safetensors when `path` is a run directory
// (initial weights: --init, posttrain.init). Errors agreed over the world.
std::vector<std::pair<std::string, Tensor>> read_weights(const std::string& path, Communicator& world);

// Turn a local status into a world-agreed one and throw it when it is an error.
void agree_or_throw(const Status& local, Communicator& world);

// The collective watchdog of a run (train.collective_timeout_s; null when off, or for one CPU rank).
// Start it before the layout splits its groups off the world (they inherit it) and makes its NCCL
// communicators (they register with it). One GPU rank has it too: its GPU can hang.
std::unique_ptr<Watchdog> start_watchdog(const Config& cfg, Communicator& world);

}  // namespace ndt::app
