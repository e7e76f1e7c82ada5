// ndtrain plan: which parallel layouts of a config divide correctly on N GPUs, their predicted per-rank
// memory and a step-time estimate (src/plan, docs/planner.md). Runs on one process; nothing is allocated.
#include <cstdio>
#include <string>
#include <vector>

#include "apps/commands.h"
#include "apps/setup.h"
#include "plan/plan.h"
#include "plan/report.h"

namespace ndt::app {

Runner add_plan(CLI::App& app) {
  auto* cmd = app.add_subcommand("plan",
                                 "List the parallel layouts of a config on N GPUs with predicted memory "
                                 "and step time (docs/planner.md)");
  struct Opts {
    std::string config;
    std::vector<std::string> sets;
    plan::PlanOptions plan{.gpus = 0};
    bool json = false, as_configured = false;
    int top = 0;
  };
  auto o = std::make_shared<Opts>();
  cmd->add_option("config,-c,--config", o->config, "YAML config file (see configs/)")->required();
  cmd->add_option("--gpus", o->plan.gpus, "Number of GPUs (ranks); with --as-configured, default tp*cp*dp*pp")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--gpu-mem-gib", o->plan.gpu_mem_gib, "Memory of one GPU in GiB")->capture_default_str();
  cmd->add_option("--set", o->sets, "Override config keys (as for train)");
  cmd->add_flag("--json", o->json, "Machine-readable output: every layout, per-rank predictions");
  cmd->add_flag("--as-configured", o->as_configured,
                "Predict only the layout the config and --set describe (parallel.*, train.recompute)");
  cmd->add_option("--top", o->top, "Show only the N fastest layouts that fit (0 = all)")
      ->capture_default_str();
  plan::Hardware& hw = o->plan.hw;
  cmd->add_option("--tflops", hw.tflops, "Peak dense bf16 TFLOP/s of one GPU")->capture_default_str();
  cmd->add_option("--mfu", hw.mfu, "Fraction of the peak the compute reaches")->capture_default_str();
  cmd->add_option("--nvlink-gbps", hw.nvlink_gbps, "GB/s per direction per GPU inside a node")
      ->capture_default_str();
  cmd->add_option("--ib-gbps", hw.ib_gbps, "GB/s per direction per GPU between nodes")->capture_default_str();
  cmd->add_option("--gpus-per-node", hw.gpus_per_node, "GPUs per node")->capture_default_str();
  cmd->add_option("--hbm-gbps", hw.hbm_gbps, "GPU memory bandwidth in GB/s (optimizer update)")
      ->capture_default_str();
  cmd->add_option("--latency-us", hw.latency_us, "Fixed cost of one collective or transfer")
      ->capture_default_str();
  return [o](Communicator& world) {
    std::vector<std::string> sets = o->sets;
#ifndef NDT_HAVE_CUDA
    // A build without the CUDA backend plans GPU runs all the same (the predictions assume cuda), but its
    // config validation would refuse train.device=cuda.
    sets.push_back("train.device=cpu");
#endif
    auto cfg = load_config(o->config, sets);
    agree_or_throw(cfg.status(), world);
    const ParallelConfig& p = cfg.value().parallel;
    if (o->plan.gpus == 0) {
      if (!o->as_configured) throw AgreedError("ndtrain plan: --gpus N is required (or --as-configured)");
      o->plan.gpus = static_cast<int>(p.tp * p.cp * p.dp * p.pp);
    }
    if (world.rank() != 0) return 0;  // one process answers; the plan needs no ranks
    const plan::PlanResult r = plan::plan(cfg.value(), o->plan, o->as_configured);
    const std::string text = o->json ? plan::to_json(r, o->plan, cfg.value()).dump(2) + "\n"
                                     : plan::format_report(r, o->plan, cfg.value(), o->top);
    std::fputs(text.c_str(), stdout);
    return 0;
  };
}

}  // namespace ndt::app
