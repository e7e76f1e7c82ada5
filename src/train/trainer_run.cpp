// Trainer::run: the loop with its progress line, metrics, evaluation and final outputs.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "parallel/tp/gather_params.h"
#include "train/metrics.h"
#include "train/safetensors.h"
#include "train/trainer.h"

#ifdef NDT_HAVE_CUDA
#include "cuda/runtime.h"
#endif

namespace ndt {
namespace {

void print_eval(const EvalStats& ev, int64_t step) {
  std::string line = fmt::format("eval  step {:>5}", step);
  if (ev.exact_match >= 0)
    line += fmt::format(" | exact match {:.1f}% of {} held-out problems", 100 * ev.exact_match, ev.problems);
  if (ev.val_loss >= 0) line += fmt::format(" | val loss {:.4f}", ev.val_loss);
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

}  // namespace

namespace {

// Every pipeline stage broadcasts its tensors (names and shapes over the host, values as `dev` tensors:
// the device buffers go over NCCL on GPUs) in stage order; a name already taken (the tied embedding's
// copy on the last stage) is skipped. Collective over pp.
std::vector<std::pair<std::string, Tensor>> exchange_stages(
    Communicator& pp, const std::vector<std::pair<std::string, Tensor>>& mine, Device dev) {
  std::vector<std::pair<std::string, Tensor>> all;
  for (int q = 0; q < pp.size(); ++q) {
    const bool root = q == pp.rank();
    int64_t n = root ? static_cast<int64_t>(mine.size()) : 0;
    pp.broadcast(&n, 1, DType::I64, q);
    for (int64_t i = 0; i < n; ++i) {
      std::string name = root ? mine[static_cast<size_t>(i)].first : std::string();
      int64_t meta[2] = {static_cast<int64_t>(name.size()),
                         root ? mine[static_cast<size_t>(i)].second.dim() : 0};
      pp.broadcast(meta, 2, DType::I64, q);
      std::vector<int32_t> chars(name.begin(), name.end());  // (no byte dtype on the wire)
      chars.resize(static_cast<size_t>(meta[0]));
      pp.broadcast(chars.data(), meta[0], DType::I32, q);
      name.assign(chars.begin(), chars.end());
      Shape shape = root ? mine[static_cast<size_t>(i)].second.shape() : Shape(static_cast<size_t>(meta[1]));
      pp.broadcast(shape.data(), meta[1], DType::I64, q);
      Tensor t = root ? mine[static_cast<size_t>(i)].second : Tensor::empty(shape, DType::F32, dev);
      pp.broadcast(t.data_ptr(), t.numel(), DType::F32, q);
      if (std::none_of(all.begin(), all.end(), [&](const auto& e) { return e.first == name; }))
        all.emplace_back(std::move(name), std::move(t));
    }
  }
  return all;
}

}  // namespace

std::vector<std::pair<std::string, Tensor>> Trainer::full_weights() {
  std::vector<std::pair<std::string, Tensor>> full;
  engine_->params().with_host_values([&] { full = gather_full_params(engine_->params(), *c_.tp, c_.ep); },
                                     /*write_back=*/false);
  if (c_.pp->size() > 1) full = exchange_stages(*c_.pp, full, Device::CPU);
  // A second module is whole on every rank of every stage: added after the stages' exchange, not through it.
  if (companion_)
    for (auto& t : companion_->full_weights()) full.push_back(std::move(t));
  return full;
}

std::optional<std::vector<std::pair<std::string, Tensor>>> Trainer::full_weights_on_device() {
  if ((c_.tp && c_.tp->size() > 1) || (c_.ep && c_.ep->size() > 1) || companion_) return std::nullopt;
  ParamStore& store = engine_->params();
  store.settle_values();  // (the views below are read on the device stream)
  std::vector<std::pair<std::string, Tensor>> mine;
  for (const auto& p : store.all()) mine.emplace_back(p->name, p->value);  // whole tensors: store views
  if (c_.pp->size() == 1) return mine;
  return exchange_stages(*c_.pp, mine, store.device());
}

std::vector<std::pair<std::string, Tensor>> Trainer::full_grads() {
  auto out = gather_full_tensors(engine_->params(), opt_->gather_grads(), *c_.tp, c_.ep);
  if (companion_)
    for (auto& g : companion_->full_grads()) out.push_back(std::move(g));
  return out;
}

void Trainer::swap_weights(std::vector<Tensor>& other) {
  auto& ps = engine_->params().all();
  NDT_CHECK(other.empty() || other.size() == ps.size(), "weight snapshot has {} tensors, the model {}",
            other.size(), ps.size());
  const bool take = other.empty();  // first call: just take a copy
  engine_->params().with_host_values(
      [&] {
        if (take) {
          for (auto& p : ps) other.push_back(p->value.clone());
          return;
        }
        for (size_t i = 0; i < ps.size(); ++i) {
          Tensor mine = ps[i]->value.clone();
          ps[i]->value.copy_from(other[i]);
          other[i] = std::move(mine);
        }
      },
      /*write_back=*/!take);
}

void Trainer::report_pipeline(bool logger) {
  // Measured bubble: the share of step time a stage spends outside forward/backward, averaged over stages.
  double sums[2] = {compute_s_, step_s_};
  c_.pp->all_reduce(sums, 2, DType::F64, ReduceOp::Sum);
  if (logger && sums[1] > 0 && c_.pp->size() > 1)
    std::printf(
        "pipeline bubble: measured %.1f%%, theoretical %.1f%% (unit-cost model, forward = backward / 2)\n",
        100.0 * (1.0 - sums[0] / sums[1]), 100.0 * theory_bubble_);
  if (trace_path_.empty()) return;
  // Gather every rank's events to world rank 0 and write one Chrome trace.
  std::vector<pp::TraceEvent> all = trace_;
  Communicator& w = *c_.world;
  if (w.rank() > 0) {
    int64_t n = static_cast<int64_t>(trace_.size());
    w.send(&n, 1, DType::I64, 0, 8);
    for (auto& e : trace_) {
      double v[3] = {static_cast<double>(e.rank), e.start_us, e.dur_us};
      w.send(v, 3, DType::F64, 0, 8);
      w.send_string(e.name, 0, 8);
    }
    return;
  }
  for (int q = 1; q < w.size(); ++q) {
    int64_t n = 0;
    w.recv(&n, 1, DType::I64, q, 8);
    for (int64_t i = 0; i < n; ++i) {
      double v[3];
      w.recv(v, 3, DType::F64, q, 8);
      all.push_back({static_cast<int>(v[0]), w.recv_string(q, 8), v[1], v[2]});
    }
  }
  std::ofstream(trace_path_) << pp::chrome_trace_json(all);
  std::printf("wrote pipeline trace %s (%zu events; open in Perfetto or chrome://tracing)\n",
              trace_path_.c_str(), all.size());
}

void Trainer::run(std::function<void(const StepStats&)> on_step, std::function<void(int64_t)> before_step) {
  const bool logger = c_.world->rank() == 0;
  const TrainConfig& tc = cfg_.train;
  std::unique_ptr<MetricsWriter> metrics;
  const int64_t n_params = count_params();  // collective over pp
  if (logger) {
    std::filesystem::create_directories(tc.out_dir);
    std::ofstream(std::filesystem::path(tc.out_dir) / "config.yaml") << config_to_yaml(cfg_);
    if (start_step_ > 0) truncate_metrics_from(tc.out_dir, start_step_).throw_if_error();
    metrics = std::make_unique<MetricsWriter>(
        MetricsWriter::open(tc.out_dir, /*append=*/start_step_ > 0, tc.tensorboard).value());
    std::printf("ndtrain: %s model, %lld parameters, task %s, %d rank(s) [%s%s%s]\n",
                cfg_.model.style.c_str(), static_cast<long long>(n_params), cfg_.data.task.c_str(),
                c_.world->size(),
                fmt::format("tp={} cp={} ep={} dp={} pp={}", cfg_.parallel.tp, cfg_.parallel.cp,
                            cfg_.parallel.ep, cfg_.parallel.dp, cfg_.parallel.pp)
                    .c_str(),
                cfg_.parallel.sequence_parallel ? " sp" : "", cfg_.parallel.zero1 ? " zero1" : "");
    std::fflush(stdout);
  }
  std::vector<std::pair<int64_t, double>> train_curve, val_curve;
  std::vector<int64_t> load_steps, load_layers;
  std::vector<std::vector<std::vector<double>>> loads;  // [MoE layer][step][expert]
  auto log_eval = [&](int64_t step) {
    EvalStats ev = evaluate();
    if (!logger) return;
    print_eval(ev, step);
    nlohmann::json j = {{"type", "eval"}, {"step", step}};
    if (ev.exact_match >= 0) j["exact_match"] = ev.exact_match;
    if (ev.val_loss >= 0) {
      j["val_loss"] = ev.val_loss;
      val_curve.emplace_back(step, ev.val_loss);
    }
    metrics->write(j).throw_if_error();
  };

  const auto start = std::chrono::steady_clock::now();
  // The same moment on the wall clock: a step's Unix time ("time") lines it up with outside samples
  // (bench/gpu_bench.sh CLOCKS=1).
  const double start_unix =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  const double tokens_per_step = static_cast<double>(tc.global_batch * cfg_.data.seq_len);
  // Logs a complete step; `elapsed` is the run's wall time when it ended.
  auto log_step = [&](const StepStats& st, double elapsed) {
    if (on_step) on_step(st);
    if (!logger) return;
    train_curve.emplace_back(st.step, st.loss);
    nlohmann::json rec = {{"type", "train"},
                          {"step", st.step},
                          {"loss", st.loss},
                          {"lr", st.lr},
                          {"grad_norm", st.grad_norm},
                          {"loss_tokens", st.tokens},
                          {"step_seconds", st.seconds},
                          {"peak_mem_gib", st.peak_mem_gib},
                          {"elapsed_seconds", elapsed},
                          {"time", start_unix + elapsed},
                          {"skipped", st.skipped},
                          {"skipped_steps", st.skipped_steps}};
    if (!st.peak_mem_gib_per_rank.empty()) rec["peak_mem_gib_per_rank"] = st.peak_mem_gib_per_rank;
    if (st.moe.active) {
      rec["moe_aux_loss"] = st.moe.aux_loss;
      rec["moe_z_loss"] = st.moe.z_loss;
      rec["expert_load_max_over_mean"] = st.moe.load_ratio;
      rec["moe_dropped_fraction"] = st.moe.dropped;
      nlohmann::json per_layer;
      for (size_t i = 0; i < st.moe.layers.size(); ++i)
        per_layer[std::to_string(st.moe.layers[i])] = st.moe.load[i];
      rec["expert_load"] = per_layer;
      load_layers = st.moe.layers;
      load_steps.push_back(st.step);
      loads.resize(st.moe.load.size());
      for (size_t i = 0; i < st.moe.load.size(); ++i) loads[i].push_back(st.moe.load[i]);
    }
    metrics->write(rec).throw_if_error();
    if (st.step % tc.log_every == 0 || st.step == tc.steps - 1) {
      const double done = static_cast<double>(st.step + 1 - start_step_);
      const double tps = tokens_per_step * done / elapsed;
      const double eta = elapsed / done * static_cast<double>(tc.steps - st.step - 1);
      std::string mem = st.peak_mem_gib > 0 ? fmt::format(" | mem {:.2f} GiB", st.peak_mem_gib) : "";
      if (st.moe.active)
        mem += fmt::format(" | aux {:.4f} z {:.4f} | load max/mean {:.2f}", st.moe.aux_loss, st.moe.z_loss,
                           st.moe.load_ratio);
      std::printf(
          "step %5lld/%lld | loss %.4f | lr %.2e | grad norm %.3f | %s tok/s | step %.1f ms%s | elapsed %s "
          "| "
          "eta %s\n",
          static_cast<long long>(st.step), static_cast<long long>(tc.steps), st.loss, st.lr, st.grad_norm,
          format_count(tps).c_str(), st.seconds * 1e3, mem.c_str(), format_duration(elapsed).c_str(),
          format_duration(eta).c_str());
      std::fflush(stdout);
    }
  };
  // Waits for the steps in flight (train.host_sync = log) and logs every complete step; each one's end in
  // wall time counts back from now by the times of the steps after it.
  auto collect = [&] {
    const std::string error = collect_steps();
    const double now = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::vector<double> ends(ready_.size());
    double later = 0;
    for (size_t i = ready_.size(); i-- > 0;) {
      ends[i] = now - later;
      later += ready_[i].seconds;
    }
    for (size_t i = 0; i < ready_.size(); ++i) log_step(ready_[i], ends[i]);
    ready_.clear();
    if (!error.empty()) throw AgreedError(error);
  };
  int64_t step = start_step_;
  for (; step < tc.steps; ++step) {
#ifdef NDT_HAVE_CUDA
    if (cuda::profiling_enabled()) cuda::mark("other");
#endif
    if (before_step) before_step(step);
    launch_step(step);
    const bool checkpoint_due =
        tc.checkpoint_every > 0 && (step + 1) % tc.checkpoint_every == 0 && step + 1 < tc.steps;
    const bool eval_due = tc.eval_every > 0 && step > 0 && step % tc.eval_every == 0 && step != tc.steps - 1;
    const bool asked = std::find(wait_after_.begin(), wait_after_.end(), step) != wait_after_.end();
    if (pending_.empty() || step % tc.log_every == 0 || step == tc.steps - 1 || checkpoint_due || eval_due ||
        asked || deferred_->full())
      collect();
#ifdef NDT_HAVE_CUDA
    // NDT_CUDA_PROFILE=1: the GPU time between the phase marks of this step (cuda/runtime.h), rank 0.
    if (cuda::profiling_enabled()) {
      cuda::mark("end");
      const std::string phases = cuda::profile_report();
      if (logger) std::printf("gpu phases, step %lld: %s\n", static_cast<long long>(step), phases.c_str());
    }
#endif
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (checkpoint_due) save_checkpoint(step + 1);
    if (eval_due) log_eval(step);
    // The time limit is decided on rank 0 and broadcast, so every rank stops at the same step.
    int32_t stop = tc.max_seconds > 0 && elapsed > static_cast<double>(tc.max_seconds);
    c_.world->broadcast(&stop, 1, DType::I32, 0);
    if (stop) {
      if (logger)
        std::printf("stopping after %lld steps: train.max_seconds=%lld reached\n",
                    static_cast<long long>(step + 1), static_cast<long long>(tc.max_seconds));
      ++step;
      break;
    }
  }
  collect();  // (steps in flight when train.max_seconds stopped the run)
  // The final checkpoint must land: a failed one ends the run with an error (the previous one stays valid).
  if (tc.checkpoint_every > 0 && !save_checkpoint(step))
    throw AgreedError(fmt::format("the final checkpoint (step {}) could not be saved", step));
  log_eval(step);

  // Final weights (gathered over TP, EP and PP) and the loss curve; one writer.
  const std::vector<std::pair<std::string, Tensor>> full = full_weights();
  report_pipeline(logger);
  if (companion_ && logger) {  // against whole steps (reductions and optimizer included), step 0 left out
    double total = 0;
    int64_t timed = 0;
    for (const StepStats& h : history_)
      if (h.step > 0) total += h.seconds, ++timed;
    const std::string line = timed > 0 ? companion_->report(total / static_cast<double>(timed)) : "";
    if (!line.empty()) std::printf("%s\n", line.c_str());
  }
  if (logger) {
    const std::filesystem::path dir(tc.out_dir);
    save_safetensors((dir / "model.safetensors").string(), full,
                     {{"format", "ndtrain"}, {"style", cfg_.model.style}})
        .throw_if_error();
    write_loss_svg(train_curve, val_curve, (dir / "loss.svg").string(),
                   fmt::format("{} on {} ({} steps)", cfg_.model.style, cfg_.data.task, step))
        .throw_if_error();
    if (!load_layers.empty())
      write_expert_load_svg(
          load_steps, load_layers, loads, (dir / "expert_load.svg").string(),
          fmt::format("expert load, {} experts top-{}", cfg_.model.moe.num_experts, cfg_.model.moe.top_k))
          .throw_if_error();
    std::printf("wrote %s/{model.safetensors, metrics.jsonl, loss.svg, config.yaml%s}\n", tc.out_dir.c_str(),
                load_layers.empty() ? "" : ", expert_load.svg");
    std::fflush(stdout);
  }
}

int64_t Trainer::count_params() const {
  int64_t n = engine_->params().global_numel();  // this stage's; summed over the stages
  c_.pp->all_reduce(&n, 1, DType::I64, ReduceOp::Sum);
  return n + (companion_ ? companion_->count_params() : 0);
}

}  // namespace ndt
