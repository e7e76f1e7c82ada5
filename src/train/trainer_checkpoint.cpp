// Trainer checkpoints: every rank's slices plus optimizer state, loadable into any layout.
#include <algorithm>
#include <filesystem>
#include <map>

#include "train/checkpoint.h"
#include "train/trainer.h"

namespace ndt {

namespace {
std::string checkpoint_root(const TrainConfig& tc) {
  return tc.checkpoint_dir.empty() ? (std::filesystem::path(tc.out_dir) / "checkpoints").string()
                                   : tc.checkpoint_dir;
}
// A second module's checkpoints (the multimodal encoder) live beside the LLM's step directories.
std::string companion_root(const std::string& root) {
  return (std::filesystem::path(root) / "encoder").string();
}
}  // namespace

bool Trainer::save_checkpoint(int64_t steps_done) {
  Tensor full_m, full_v;
  opt_->gather_moments(full_m, full_v);
  CheckpointMeta meta;
  meta.step = steps_done;
  meta.optimizer_steps = opt_->steps_taken();
  meta.config_yaml = config_to_yaml(cfg_);
  meta.layout = fmt::format("tp={} cp={} ep={} dp={} pp={} virtual_stages={}{}", cfg_.parallel.tp,
                            cfg_.parallel.cp, cfg_.parallel.ep, cfg_.parallel.dp, cfg_.parallel.pp,
                            cfg_.parallel.virtual_stages, cfg_.parallel.zero1 ? " zero1" : "");
  const std::string dir = checkpoint_root(cfg_.train);
  // A second module first: the LLM's step directory appearing is what commits the checkpoint.
  if (companion_) companion_->save_checkpoint(companion_root(dir), steps_done);
  // DP x CP replicas hold identical slices: rank 0 of that group at each (tp, pp) coordinate writes them;
  // expert slices differ over EP: rank 0 of each expert-data-parallel group writes its experts.
  CheckpointFault fault = CheckpointFault::None;
  if (auto f = checkpoint_fault(faults_, steps_done, c_.world->rank()))
    fault = *f == Fault::Kind::CkptWriteError ? CheckpointFault::WriteError : CheckpointFault::ShortWrite;
  Status st;
  engine_->params().with_host_values(
      [&] {
        st = ndt::save_checkpoint(dir, engine_->params(), full_m, full_v, meta, c_.expert_dp->rank() == 0,
                                  static_cast<int>(cfg_.train.keep_last), *c_.world, c_.grad->rank() == 0,
                                  fault);
      },
      /*write_back=*/false);
  // A failed save (a full disk, say) costs this checkpoint only: every rank got the same status, the staging
  // directory is gone, the previous checkpoint stays the newest valid one and training state is in memory.
  if (!st) {
    if (c_.world->rank() == 0) {
      std::printf(
          "checkpoint at step %lld FAILED (training goes on; the previous checkpoint stays valid): %s\n",
          static_cast<long long>(steps_done), st.message().c_str());
      std::fflush(stdout);
    }
    return false;
  }
  if (c_.world->rank() == 0) {
    std::printf("saved checkpoint at step %lld to %s\n", static_cast<long long>(steps_done), dir.c_str());
    std::fflush(stdout);
  }
  return true;
}

void Trainer::resume(const std::string& dir) {
  if (dir != "auto") {
    Status st = try_resume(dir);
    if (!st) throw AgreedError(st.message());
    return;
  }
  // auto: the newest step directory of the run's checkpoint root that loads on every rank; incomplete or
  // corrupt ones (a save that was killed, a truncated shard) are skipped with a line saying why.
  const std::string root = checkpoint_root(cfg_.train);
  std::vector<std::string> steps;
  std::error_code ec;
  if (std::filesystem::is_directory(root, ec))
    for (const auto& e : std::filesystem::directory_iterator(root, ec))
      if (e.is_directory() && e.path().filename().string().rfind("step-", 0) == 0)
        steps.push_back(e.path().string());
  std::sort(steps.rbegin(), steps.rend());  // step-%08d: newest first
  const bool logger = c_.world->rank() == 0;
  for (const std::string& d : steps) {
    Status st = try_resume(d);
    if (st) return;
    if (logger) std::printf("resume auto: skipping %s: %s\n", d.c_str(), st.message().c_str());
  }
  if (logger) {
    std::printf("resume auto: no valid checkpoint in %s: starting from step 0\n", root.c_str());
    std::fflush(stdout);
  }
  start_step_ = 0;
  engine_->params().with_host_values([&] { engine_->params().init(static_cast<uint64_t>(cfg_.train.seed)); },
                                     /*write_back=*/true);
  const int64_t n = engine_->params().flat_values().numel();
  opt_->scatter_moments(Tensor::zeros({n}), Tensor::zeros({n}));
  opt_->set_steps_taken(0);
}

Status Trainer::try_resume(const std::string& dir) {
  auto step_dir = resolve_checkpoint(dir);
  Status st = step_dir.status();
  CheckpointMeta meta;
  if (st) {
    auto m = read_checkpoint_meta(step_dir.value());
    st = m.status();
    if (st) meta = m.value();
  }
  const int64_t n = engine_->params().flat_values().numel();
  Tensor full_m = Tensor::zeros({n}), full_v = Tensor::zeros({n});
  engine_->params().with_host_values(
      [&] {
        if (st) st = load_checkpoint(step_dir.value(), engine_->params(), &full_m, &full_v);
      },
      /*write_back=*/true);
  // Every rank must agree before training continues (a missing shard on one rank stops all).
  if (Status all = agree(st, *c_.world); !all) return all;
  if (companion_) {
    const std::string root = std::filesystem::path(step_dir.value()).parent_path().string();
    if (Status all = agree(companion_->load_checkpoint(companion_root(root), meta.step), *c_.world); !all)
      return all;
  }
  opt_->scatter_moments(full_m, full_v);
  opt_->set_steps_taken(meta.optimizer_steps);
  start_step_ = meta.step;
  if (c_.world->rank() == 0) {
    std::printf("resumed from %s (step %lld, written by layout %s)\n", step_dir.value().c_str(),
                static_cast<long long>(meta.step), meta.layout.c_str());
    std::fflush(stdout);
  }
  return Status::ok();
}

void Trainer::load_weights(const std::vector<std::pair<std::string, Tensor>>& full) {
  std::map<std::string, const Tensor*> by_name;
  for (const auto& [name, t] : full) by_name[name] = &t;
  ParamStore& ps = engine_->params();
  ps.with_host_values([&] { copy_global_slices(ps, by_name, "initial weights"); }, /*write_back=*/true);
  if (companion_) companion_->load_weights(full);
}

}  // namespace ndt
