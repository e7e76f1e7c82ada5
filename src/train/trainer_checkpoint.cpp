// Trainer checkpoints: every rank's slices plus optimizer state, loadable into any layout.
#include <filesystem>
#include <map>

#include "train/checkpoint.h"
#include "train/trainer.h"

namespace ndt {

void Trainer::save_checkpoint(int64_t steps_done) {
  Tensor full_m, full_v;
  opt_->gather_moments(full_m, full_v);
  CheckpointMeta meta;
  meta.step = steps_done;
  meta.optimizer_steps = opt_->steps_taken();
  meta.config_yaml = config_to_yaml(cfg_);
  meta.layout = fmt::format("tp={} cp={} ep={} dp={} pp={} virtual_stages={}{}", cfg_.parallel.tp,
                            cfg_.parallel.cp, cfg_.parallel.ep, cfg_.parallel.dp, cfg_.parallel.pp,
                            cfg_.parallel.virtual_stages, cfg_.parallel.zero1 ? " zero1" : "");
  const std::string dir = cfg_.train.checkpoint_dir.empty()
                              ? (std::filesystem::path(cfg_.train.out_dir) / "checkpoints").string()
                              : cfg_.train.checkpoint_dir;
  // DP x CP replicas hold identical slices: rank 0 of that group at each (tp, pp) coordinate writes them;
  // expert slices differ over EP: rank 0 of each expert-data-parallel group writes its experts.
  engine_->params().with_host_values(
      [&] {
        ndt::save_checkpoint(dir, engine_->params(), full_m, full_v, meta, c_.expert_dp->rank() == 0,
                             static_cast<int>(cfg_.train.keep_last), *c_.world, c_.grad->rank() == 0)
            .throw_if_error();
      },
      /*write_back=*/false);
  if (c_.world->rank() == 0) {
    std::printf("saved checkpoint at step %lld to %s\n", static_cast<long long>(steps_done), dir.c_str());
    std::fflush(stdout);
  }
}

void Trainer::resume(const std::string& dir) {
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
  if (Status all = agree(st, *c_.world); !all) throw AgreedError(all.message());
  opt_->scatter_moments(full_m, full_v);
  opt_->set_steps_taken(meta.optimizer_steps);
  start_step_ = meta.step;
  if (c_.world->rank() == 0) {
    std::printf("resumed from %s (step %lld, written by layout %s)\n", step_dir.value().c_str(),
                static_cast<long long>(meta.step), meta.layout.c_str());
    std::fflush(stdout);
  }
}

void Trainer::load_weights(const std::vector<std::pair<std::string, Tensor>>& full) {
  std::map<std::string, const Tensor*> by_name;
  for (const auto& [name, t] : full) by_name[name] = &t;
  ParamStore& ps = engine_->params();
  ps.with_host_values([&] { copy_global_slices(ps, by_name, "initial weights"); }, /*write_back=*/true);
}

}  // namespace ndt
