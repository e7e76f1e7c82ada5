// ndtrain verify: run the single-process reference and a parallel layout on the same config and seed,
// and compare per-step loss and gradient norm and the final (gathered) weights.
#include <algorithm>
#include <cmath>

#include "apps/commands.h"
#include "apps/setup.h"
#include "parallel/layout.h"
#include "parallel/tp/gather_params.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

namespace ndt::app {
namespace {

double rel(double a, double ref) { return std::abs(a - ref) / std::max(std::abs(ref), 1e-12); }

// ||a - b||_inf / ||b||_inf over one tensor.
double weight_rel_diff(const Tensor& a, const Tensor& b) {
  double dmax = 0, bmax = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    dmax = std::max(dmax, static_cast<double>(std::abs(a.f32()[i] - b.f32()[i])));
    bmax = std::max(bmax, static_cast<double>(std::abs(b.f32()[i])));
  }
  return dmax / std::max(bmax, 1e-12);
}

}  // namespace

Runner add_verify(CLI::App& app) {
  auto* cmd = app.add_subcommand("verify", "Check a parallel layout against the single-process run");
  struct Opts {
    std::string config;
    std::vector<std::string> sets;
    int64_t steps = 5;
    double tol_loss = 1e-5, tol_weights = 1e-4;
    std::string resume;
  };
  auto o = std::make_shared<Opts>();
  cmd->add_option("-c,--config", o->config, "YAML config file")->required();
  cmd->add_option("--set", o->sets,
                  "Config overrides, including the layout: --set parallel.tp=2 parallel.dp=2");
  cmd->add_option("--steps", o->steps, "Optimizer steps to compare")->check(CLI::Range(1, 1000));
  cmd->add_option("--tol-loss", o->tol_loss, "Max relative difference of loss and grad norm per step");
  cmd->add_option("--tol-weights", o->tol_weights, "Max ||w - w_ref||_inf / ||w_ref||_inf per tensor");
  cmd->add_option("--resume", o->resume,
                  "Start the layout from this checkpoint (step k, any layout) and compare its steps k.. with "
                  "one straight single-process run from step 0");
  return [o](Communicator& world) {
    RunSetup s = load_run(world, o->config, o->sets);
    int64_t first = 0;  // the step the compared layout starts at
    if (!o->resume.empty()) {
      auto dir = resolve_checkpoint(o->resume);
      auto meta = dir ? read_checkpoint_meta(dir.value()) : Result<CheckpointMeta>(dir.status());
      agree_or_throw(meta.status(), world);
      first = meta.value().step;
    }
    s.cfg.train.steps = first + o->steps;
    auto layout = Layout::create(s.cfg, world);
    agree_or_throw(layout.status(), world);

    // The reference runs on every rank (no communication, identical everywhere): one process, same
    // config, seed, global batch and microbatch size.
    Config ref_cfg = s.cfg;
    ref_cfg.parallel = ParallelConfig{};
    Trainer ref(ref_cfg, RunComms{}, *s.tok, *s.train, nullptr);
    Trainer par(s.cfg, layout.value()->comms(), *s.tok, *s.train, nullptr);
    if (!o->resume.empty()) par.resume(o->resume);
    for (int64_t i = 0; i < first + o->steps; ++i) {
      ref.train_step(i);
      if (i >= first) par.train_step(i);
    }
    RunComms pc = layout.value()->comms();
    auto par_w = gather_full_params(par.params(), *pc.tp);

    bool ok = true;
    const bool logger = world.rank() == 0;
    if (logger) {
      std::printf("verify: %s against the single-process run, %lld steps%s\n",
                  layout.value()->grid().describe().c_str(), static_cast<long long>(o->steps),
                  o->resume.empty()
                      ? ""
                      : (", resumed at step " + std::to_string(first) + " from " + o->resume).c_str());
      std::printf("%5s %14s %14s %10s %12s %12s %10s\n", "step", "loss(ref)", "loss", "rel", "gnorm(ref)",
                  "gnorm", "rel");
    }
    for (int64_t i = 0; i < o->steps; ++i) {
      const StepStats &a = ref.history()[static_cast<size_t>(first + i)],
                      &b = par.history()[static_cast<size_t>(i)];
      const double rl = rel(b.loss, a.loss), rg = rel(b.grad_norm, a.grad_norm);
      ok = ok && rl <= o->tol_loss && rg <= o->tol_loss && a.tokens == b.tokens;
      if (logger)
        std::printf("%5lld %14.8f %14.8f %10.2e %12.6f %12.6f %10.2e%s\n", static_cast<long long>(first + i),
                    a.loss, b.loss, rl, a.grad_norm, b.grad_norm, rg,
                    (rl <= o->tol_loss && rg <= o->tol_loss) ? "" : "  <-- FAIL");
    }
    double worst = 0;
    std::string worst_name;
    int64_t covered = 0;  // parameters checked here, each counted once over pipeline stages
    for (const auto& [name, w] : par_w) {
      covered += par.params().get(name).count_in_norm;
      const Param* rp = ref.params().find(name);
      NDT_CHECK(rp != nullptr && rp->value.numel() == w.numel(),
                "layout has parameter {} that the reference lacks", name);
      const double d = weight_rel_diff(w, rp->value);
      if (d >= worst) {
        worst = d;
        worst_name = name;
      }
    }
    pc.pp->all_reduce(&covered, 1, DType::I64, ReduceOp::Sum);
    const double local_worst = worst;
    world.all_reduce(&worst, 1, DType::F64, ReduceOp::Max);
    ok = ok && covered == static_cast<int64_t>(ref.params().all().size()) && worst <= o->tol_weights;
    if (logger) {
      const std::string where = local_worst == worst ? " (" + worst_name + ")" : "";
      std::printf(
          "weights after %lld steps, %lld tensors: max ||w - w_ref||_inf / ||w_ref||_inf = %.2e%s, "
          "tolerance %.1e\n",
          static_cast<long long>(o->steps), static_cast<long long>(covered), worst, where.c_str(),
          o->tol_weights);
    }
    // Every rank checked its own copy; the layout passes only if all of them did.
    int32_t all_ok = ok;
    world.all_reduce(&all_ok, 1, DType::I32, ReduceOp::Min);
    if (logger) std::printf("verify: %s\n", all_ok ? "PASS" : "FAIL");
    std::fflush(stdout);
    return all_ok ? 0 : 1;
  };
}

}  // namespace ndt::app
