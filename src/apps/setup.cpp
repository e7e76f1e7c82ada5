#include "apps/setup.h"

#include <filesystem>
#include <fstream>

#include "data/make_dataset.h"
#include "parallel/layout.h"
#include "train/safetensors.h"

namespace ndt::app {

void agree_or_throw(const Status& local, Communicator& world) {
  Status st = agree(local, world);
  if (!st) throw AgreedError(st.message());
}

std::unique_ptr<Watchdog> start_watchdog(const Config& cfg, Communicator& world) {
  if ((world.size() == 1 && cfg.train.device != "cuda") || cfg.train.collective_timeout_s <= 0)
    return nullptr;
  auto w = std::make_unique<Watchdog>(cfg.train.collective_timeout_s, world.rank(), world.size());
  world.set_watchdog(w.get());
  return w;
}

Status check_writable_dir(const std::string& dir, const std::string& key) {
  namespace fs = std::filesystem;
  const fs::path d(dir.empty() ? "." : dir);
  std::error_code ec;
  fs::create_directories(d, ec);
  if (ec) return Status::error(fmt::format("{} '{}' cannot be created: {}", key, dir, ec.message()));
  const fs::path probe = d / ".ndtrain_write_probe";
  {
    std::ofstream f(probe, std::ios::trunc);
    f << "probe\n";
    f.flush();
    if (!f) return Status::error(fmt::format("{} '{}' is not writable", key, dir));
  }
  fs::remove(probe, ec);
  return Status::ok();
}

RunSetup load_run(Communicator& world, const std::string& config_path,
                  const std::vector<std::string>& overrides) {
  RunSetup s;
  auto cfg = load_config(config_path, overrides);
  agree_or_throw(cfg.status(), world);
  s.cfg = std::move(cfg).value();
  agree_or_throw(validate_layout(s.cfg, world.size()), world);

  auto tok = make_tokenizer(s.cfg.data.tokenizer);
  agree_or_throw(tok.status(), world);
  s.tok = std::move(tok).value();
  if (s.tok->vocab_size() > s.cfg.model.vocab_size) {
    agree_or_throw(
        Status::error(fmt::format("tokenizer '{}' has {} tokens but model.vocab_size is {}",
                                  s.cfg.data.tokenizer, s.tok->vocab_size(), s.cfg.model.vocab_size)),
        world);
  }
  auto train = make_dataset(s.cfg.data, *s.tok, false, s.cfg.encoder);
  agree_or_throw(train.status(), world);
  s.train = std::move(train).value();
  const std::string& task = s.cfg.data.task;
  const bool synthetic = task == "addition" || task == "sort" || task == "lm" || task == "image_caption";
  if (synthetic || !s.cfg.data.val_path.empty()) {
    auto val = make_dataset(s.cfg.data, *s.tok, true, s.cfg.encoder);
    agree_or_throw(val.status(), world);
    s.val = std::move(val).value();
  }
  return s;
}

std::vector<std::pair<std::string, Tensor>> read_weights(const std::string& path, Communicator& world) {
  std::filesystem::path p(path);
  if (std::filesystem::is_directory(p)) p /= "model.safetensors";
  auto file = open_safetensors(p.string());
  agree_or_throw(file.status(), world);
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& name : file.value().names()) out.emplace_back(name, file.value().read(name));
  return out;
}

}  // namespace ndt::app
