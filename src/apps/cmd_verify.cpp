// ndtrain verify: run the single-process reference and a parallel layout on the same config and seed,
// and compare per-step loss and gradient norm and the final (gathered) weights.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <map>

#include "apps/commands.h"
#include "apps/setup.h"
#include "mimo/mimo.h"
#include "parallel/layout.h"
#include "parallel/tp/gather_params.h"
#include "posttrain/grpo.h"
#include "posttrain/run.h"
#include "train/checkpoint.h"
#include "train/safetensors.h"
#include "train/trainer.h"

namespace ndt::app {
namespace {

double rel(double a, double ref) { return std::abs(a - ref) / std::max(std::abs(ref), 1e-12); }

// ||a - b||_2 / ||b||_2 (0 when both are zero).
double grad_rel_l2(const Tensor& a, const Tensor& b) {
  NDT_CHECK(a.numel() == b.numel(), "gradient sizes differ: {} vs {}", a.numel(), b.numel());
  double dd = 0, bb = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double d = static_cast<double>(a.f32()[i]) - b.f32()[i];
    dd += d * d;
    bb += static_cast<double>(b.f32()[i]) * b.f32()[i];
  }
  if (dd == 0) return 0;
  return std::sqrt(dd) / std::max(std::sqrt(bb), 1e-30);
}

// ||a - b||_inf / ||b||_inf over one tensor.
// ||a - b||_inf and ||b||_inf of one tensor.
std::pair<double, double> weight_diff(const Tensor& a, const Tensor& b) {
  double dmax = 0, bmax = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    dmax = std::max(dmax, std::abs(static_cast<double>(a.f32()[i]) - b.f32()[i]));
    bmax = std::max(bmax, static_cast<double>(std::abs(b.f32()[i])));
  }
  return {dmax, bmax};
}

}  // namespace

Runner add_verify(CLI::App& app) {
  auto* cmd = app.add_subcommand("verify", "Check a parallel layout against the single-process run");
  struct Opts {
    std::string config;
    std::vector<std::string> sets;
    int64_t steps = 5;
    double tol_loss = 1e-5, tol_weights = 1e-4, tol_grads = 1e-4;
    std::string resume;
    bool reference_unpacked = false;
    double tol_logprob = 1e-4;
    int64_t tol_topk_ids = 0;
    double tol_gen_kl = 1e-6;
  };
  auto o = std::make_shared<Opts>();
  cmd->add_option("-c,--config", o->config, "YAML config file")->required();
  cmd->add_option("--set", o->sets,
                  "Config overrides, including the layout: --set parallel.tp=2 parallel.dp=2");
  cmd->add_option("--steps", o->steps, "Optimizer steps to compare")->check(CLI::Range(1, 1000));
  cmd->add_option("--tol-loss", o->tol_loss, "Max relative difference of loss and grad norm per step");
  cmd->add_option(
      "--tol-weights", o->tol_weights,
      "Max ||w - w_ref||_inf / ||w_ref||_inf per tensor (see docs/parallelism.md for Adam's slack)");
  cmd->add_option("--tol-grads", o->tol_grads,
                  "Max ||g - g_ref||_2 / ||g_ref||_2 per tensor of the reduced gradients, at every step");
  cmd->add_option("--resume", o->resume,
                  "Start the layout from this checkpoint (step k, any layout) and compare its steps k.. with "
                  "one straight single-process run from step 0");
  cmd->add_option("--tol-logprob", o->tol_logprob,
                  "Max absolute difference of per-token logprobs and top-k logits after the compared steps");
  cmd->add_option(
         "--tol-topk-ids", o->tol_topk_ids,
         "Top-k ids that may differ from the reference beyond its near-ties (bf16 runs: logits rounded "
         "to 8 mantissa bits reorder close candidates)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--tol-gen-kl", o->tol_gen_kl,
                  "Post-training: max gen_kl_error of the layout per step (generator vs training policy)");
  cmd->add_flag(
      "--reference-unpacked", o->reference_unpacked,
      "Run the reference without packing (each sample padded to seq_len); default: the same packing, "
      "with the layout's microbatch grouping");
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
    const std::unique_ptr<Watchdog> watchdog = start_watchdog(s.cfg, world);  // a hung row names its call
    auto layout = Layout::create(s.cfg, world);
    agree_or_throw(layout.status(), world);

    // The reference runs on every rank (no communication, identical everywhere): one process, same
    // config, seed, global batch and microbatch size.
    Config ref_cfg = s.cfg;
    ref_cfg.parallel = ParallelConfig{};
    ref_cfg.posttrain.gen_tp = 1;  // the reference generates in one process too
    if (o->reference_unpacked) {   // packed layout vs the same samples padded, one per row
      ref_cfg.data.packing = false;
      ref_cfg.data.pack_tokens = 0;
    }
    ref_cfg.encoder.tp = 1;  // a multimodal model's encoder in one process too
    ref_cfg.encoder.dp = 0;
    Trainer ref(ref_cfg, RunComms{}, *s.tok, *s.train, nullptr);
    Trainer par(s.cfg, layout.value()->comms(), *s.tok, *s.train, nullptr);
    std::unique_ptr<Communicator> self = make_self_communicator();
    const auto ref_enc = attach_encoder(ref, *self, nullptr, *s.tok, *s.train);
    const auto par_enc = attach_encoder(par, world, layout.value().get(), *s.tok, *s.train);
    if (const char* f = std::getenv("NDT_MIMO_TEST_FAULT"); par_enc && f) par_enc->set_test_fault(f);
    // Same microbatches as the layout (interleaved pipelines pack into a multiple of pp microbatches), so
    // that only the parallel reductions differ.
    ref.set_pack_count_multiple(par.pack_count_multiple());
    if (!o->resume.empty()) par.resume(o->resume);
    if (!s.cfg.posttrain.init.empty()) {  // both start from the same weights (e.g. an SFT run's)
      const auto init = read_weights(s.cfg.posttrain.init, world);
      ref.load_weights(init);
      par.load_weights(init);
    }
    // Post-training: DPO/GRPO steps (rollouts from each run's own generator: the reference generates in
    // one process, the layout under its generation layout), compared like training steps plus the reward
    // and the generator/trainer agreement.
    const bool posttrain = s.cfg.posttrain.algo != "sft";
    NDT_CHECK(!posttrain || o->resume.empty(), "verify --resume compares training runs only");
    std::unique_ptr<PosttrainSession> ref_pt, par_pt;
    if (posttrain) {
      ref_pt = std::make_unique<PosttrainSession>(ref, *s.tok, *self);
      par_pt = std::make_unique<PosttrainSession>(par, *s.tok, world);
    }
    // Gradients at every optimizer step, after the reductions and before clipping: the reference's are kept
    // until the layout's same step compares against them (per tensor relative L2; this rank's tensors).
    std::deque<std::map<std::string, Tensor>> ref_grads;
    std::vector<std::pair<double, std::string>>
        grad_worst;  // per compared step: max over this rank's tensors
    ref.set_grads_hook([&](int64_t step) {
      if (step < first) return;
      std::map<std::string, Tensor> g;
      for (auto& [name, t] : ref.full_grads()) g[name] = std::move(t);
      ref_grads.push_back(std::move(g));
    });
    par.set_grads_hook([&](int64_t) {
      const auto mine = par.full_grads();  // collective: every rank, before any early return
      NDT_CHECK(!ref_grads.empty(), "the layout took an optimizer step the reference did not");
      std::pair<double, std::string> worst{0.0, ""};
      for (const auto& [name, g] : mine) {
        const auto it = ref_grads.front().find(name);
        NDT_CHECK(it != ref_grads.front().end(), "layout has gradient {} that the reference lacks", name);
        const double d = grad_rel_l2(g, it->second);
        if (d >= worst.first) worst = {d, name};
      }
      ref_grads.pop_front();
      grad_worst.push_back(worst);
    });
    std::vector<std::pair<nlohmann::ordered_json, nlohmann::ordered_json>> pt_metrics;
    for (int64_t i = 0; i < first + o->steps; ++i) {
      if (posttrain) {
        const PosttrainStep a = ref_pt->step(i), b = par_pt->step(i);
        pt_metrics.emplace_back(a.metrics, b.metrics);
        continue;
      }
      ref.train_step(i);
      if (i >= first) par.train_step(i);
    }
    RunComms pc = layout.value()->comms();
    std::vector<std::pair<std::string, Tensor>> par_w;  // host copies (the runs may live on GPUs)
    par.params().with_host_values([&] { par_w = gather_full_params(par.params(), *pc.tp, pc.ep); },
                                  /*write_back=*/false);
    // The encoder's tensors: on every rank of every pipeline stage, so counted apart from the LLM's.
    std::vector<std::pair<std::string, Tensor>> enc_w;
    if (par_enc) enc_w = par_enc->full_weights();

    bool ok = true;
    const bool logger = world.rank() == 0;
    if (logger) {
      std::printf("verify: %s against the single-process run, %lld steps%s\n",
                  (layout.value()->describe() + (par_enc ? "; " + par_enc->describe() : "")).c_str(),
                  static_cast<long long>(o->steps),
                  o->resume.empty()
                      ? ""
                      : (", resumed at step " + std::to_string(first) + " from " + o->resume).c_str());
      std::printf("%5s %14s %14s %10s %12s %12s %10s\n", "step", "loss(ref)", "loss", "rel", "gnorm(ref)",
                  "gnorm", "rel");
    }
    NDT_CHECK(ref.history().size() == par.history().size() + static_cast<size_t>(first),
              "the layout took {} optimizer steps, the reference {}", par.history().size(),
              ref.history().size() - static_cast<size_t>(first));
    for (int64_t i = 0; i < static_cast<int64_t>(par.history().size()); ++i) {
      const StepStats &a = ref.history()[static_cast<size_t>(first + i)],
                      &b = par.history()[static_cast<size_t>(i)];
      // Post-training losses are sums of signed terms (advantages and DPO margins average out), so their
      // value can sit orders of magnitude below the per-token scale (|A| ~ 1): compared relative to
      // max(|loss_ref|, 1) there; grad norms stay relative.
      const double rl =
          posttrain ? std::abs(b.loss - a.loss) / std::max(std::abs(a.loss), 1.0) : rel(b.loss, a.loss);
      const double rg = rel(b.grad_norm, a.grad_norm);
      ok = ok && rl <= o->tol_loss && rg <= o->tol_loss && a.tokens == b.tokens;
      if (logger)
        std::printf("%5lld %14.8f %14.8f %10.2e %12.6f %12.6f %10.2e%s\n", static_cast<long long>(first + i),
                    a.loss, b.loss, rl, a.grad_norm, b.grad_norm, rg,
                    (rl <= o->tol_loss && rg <= o->tol_loss) ? "" : "  <-- FAIL");
    }
    // Gradients: the worst tensor of each optimizer step over all ranks.
    bool grads_ok = true;
    for (size_t i = 0; i < grad_worst.size(); ++i) {
      const double mine = grad_worst[i].first;
      double d = mine;
      world.all_reduce(&d, 1, DType::F64, ReduceOp::Max);
      grads_ok = grads_ok && d <= o->tol_grads;
      // The lowest rank holding the worst tensor sends its name to rank 0, which prints.
      int32_t owner = mine == d ? world.rank() : world.size();
      world.all_reduce(&owner, 1, DType::I32, ReduceOp::Min);
      std::string name = grad_worst[i].second;
      if (owner != 0 && world.rank() == owner) world.send_string(name, 0);
      if (owner != 0 && logger) name = world.recv_string(owner) + ", rank " + std::to_string(owner);
      if (logger)
        std::printf("grads step %zu: max ||g - g_ref|| / ||g_ref|| = %.2e (%s)%s\n", i, d, name.c_str(),
                    d <= o->tol_grads ? "" : "  <-- FAIL");
    }
    ok = ok && grads_ok && !grad_worst.empty();
    if (posttrain) {
      // Rollout rewards equal (same samples) and the generator agreeing with the trainer as in one process.
      // (DPO: the margin, not the accuracy: at step 0 policy = reference, z = 0 and the sign of z is noise.)
      const char* keys[] = {"reward_mean", "gen_kl_error", "reward_margin"};
      for (size_t i = 0; i < pt_metrics.size(); ++i) {
        const auto& [a, b] = pt_metrics[i];
        std::string line = fmt::format("{:5} ", i);
        for (const char* k : keys) {
          if (!a.contains(k)) continue;
          const double va = a[k].get<double>(), vb = b.value(k, -1.0);
          // gen_kl_error: the CPU's generator and trainer do the same arithmetic (<= 1e-6, issue 14).
          const bool good = std::string(k) == "gen_kl_error"
                                ? vb <= o->tol_gen_kl
                                : std::abs(va - vb) <= o->tol_loss * std::max(1.0, std::abs(va));
          ok = ok && good;
          line += fmt::format(" {} {:.6g} (ref {:.6g}){}", k, vb, va, good ? "" : " <-- FAIL");
        }
        if (logger) std::printf("%s\n", line.c_str());
      }
    }
    double worst = 0, max_abs = 0;
    std::string worst_name;
    int64_t covered = 0;        // parameters checked here, each counted once over pipeline stages
    double counts[2] = {0, 0};  // elements beyond --tol-weights, elements compared (this rank)
    auto compare = [&](const std::vector<std::pair<std::string, Tensor>>& ws, ParamStore& ref_store) {
      for (const auto& [name, w] : ws) {
        const Param* rp = ref_store.find(name);
        NDT_CHECK(rp != nullptr && rp->value.numel() == w.numel(),
                  "layout has parameter {} that the reference lacks", name);
        const auto [dmax, wmax] = weight_diff(w, rp->value);
        const double d = dmax / std::max(wmax, 1e-12);
        max_abs = std::max(max_abs, dmax);
        if (d > o->tol_weights)  // elements beyond the tolerance (none when the tensor's worst is within)
          for (int64_t i = 0; i < w.numel(); ++i)
            counts[0] += std::abs(static_cast<double>(w.f32()[i]) - rp->value.f32()[i]) >
                         o->tol_weights * std::max(wmax, 1e-12);
        counts[1] += static_cast<double>(w.numel());
        if (d >= worst) {
          worst = d;
          worst_name = name;
        }
      }
    };
    ref.params().with_host_values(
        [&] {
          for (const auto& [name, w] : par_w) covered += par.params().get(name).count_in_norm;
          compare(par_w, ref.params());
        },
        /*write_back=*/false);
    pc.pp->all_reduce(&covered, 1, DType::I64, ReduceOp::Sum);
    int64_t expected = static_cast<int64_t>(ref.params().all().size());
    if (par_enc) {  // the encoder's tensors are on every rank of every stage
      ref_enc->params().with_host_values([&] { compare(enc_w, ref_enc->params()); }, /*write_back=*/false);
      covered += static_cast<int64_t>(enc_w.size());
      expected += static_cast<int64_t>(ref_enc->params().all().size());
    }
    const double local_worst = worst;
    world.all_reduce(&worst, 1, DType::F64, ReduceOp::Max);
    world.all_reduce(&max_abs, 1, DType::F64, ReduceOp::Max);
    world.all_reduce(counts, 2, DType::F64, ReduceOp::Sum);
    // Adam divides each gradient by sqrt(v) + eps: an element whose gradient sits near eps turns fp32
    // reduction-order noise into an update of up to ~lr, so a correct layout can differ there by up to
    // 2 * B * sum(lr) over the steps (B = max(1, (1 - beta1) / sqrt(1 - beta2)) bounds |m_hat /
    // sqrt(v_hat)|). Such elements are rare; an optimizer bug (a wrong ZeRO shard, a missing update) moves
    // many. So beyond the strict tolerance the weights still pass when every step's gradients agreed, at most
    // 0.1% of the elements are beyond it, and none beyond Adam's bound.
    const TrainConfig& tc = s.cfg.train;
    // (lr is at most train.lr at every optimizer step the layout took)
    const double lr_sum = tc.lr * static_cast<double>(grad_worst.size());
    const double adam_bound = 2.0 * std::max(1.0, (1.0 - tc.beta1) / std::sqrt(1.0 - tc.beta2)) * lr_sum;
    const double frac = counts[1] > 0 ? counts[0] / counts[1] : 0.0;
    const bool strict = worst <= o->tol_weights;
    const bool adam_ok = grads_ok && frac <= 1e-3 && max_abs <= adam_bound;
    ok = ok && covered == expected && (strict || adam_ok);
    if (logger) {
      const std::string where = local_worst == worst ? " (" + worst_name + ")" : "";
      std::printf(
          "weights after %lld steps, %lld tensors: max ||w - w_ref||_inf / ||w_ref||_inf = %.2e%s, "
          "tolerance %.1e\n",
          static_cast<long long>(o->steps), static_cast<long long>(covered), worst, where.c_str(),
          o->tol_weights);
      if (!strict)
        std::printf(
            "  %.0f of %.0f elements (%.5f%%) beyond it, max |w - w_ref| = %.2e, Adam's bound 2 B sum(lr) = "
            "%.2e: "
            "%s\n",
            counts[0], counts[1], 100.0 * frac, max_abs, adam_bound,
            adam_ok ? "Adam's eps amplification of reduction-order noise (gradients agreed): accepted"
                    : "FAIL");
    }
    // Per-token logprobs and top-k logits of the first global batch, in sample order, after training.
    {
      std::vector<Sample> samples;
      for (int64_t j = 0; j < s.cfg.train.global_batch; ++j)
        samples.push_back(s.train->get(sample_index(s.cfg.data.seed, 0, j, s.cfg.train.global_batch,
                                                    s.train->size(), s.cfg.data.shuffle)));
      constexpr int64_t kTop = 4;
      const auto a = ref.score(samples, kTop), b = par.score(samples, kTop);
      double lp_diff = 0, top_diff = 0;
      int64_t id_mismatch = 0;
      for (size_t i = 0; i < a.size(); ++i) {
        for (size_t t = 0; t < a[i].logprob.size(); ++t)
          lp_diff = std::max(lp_diff, static_cast<double>(std::abs(a[i].logprob[t] - b[i].logprob[t])));
        for (size_t j = 0; j < a[i].topk_value.size(); ++j) {
          top_diff =
              std::max(top_diff, static_cast<double>(std::abs(a[i].topk_value[j] - b[i].topk_value[j])));
          // An id may differ only where the reference has a near-tie with its neighbour.
          const bool tie =
              (j % kTop > 0 && a[i].topk_value[j - 1] - a[i].topk_value[j] < o->tol_logprob) ||
              (j % kTop + 1 < kTop && a[i].topk_value[j] - a[i].topk_value[j + 1] < o->tol_logprob);
          id_mismatch += a[i].topk_id[j] != b[i].topk_id[j] && !tie;
        }
      }
      const bool lp_ok =
          lp_diff <= o->tol_logprob && top_diff <= o->tol_logprob && id_mismatch <= o->tol_topk_ids;
      ok = ok && lp_ok;
      if (logger)
        std::printf(
            "scores of %zu samples: max |logprob - ref| = %.2e, max |top-%lld logit - ref| = %.2e, "
            "%lld top-k ids differ (at most %lld), tolerance %.1e%s\n",
            samples.size(), lp_diff, static_cast<long long>(kTop), top_diff,
            static_cast<long long>(id_mismatch), static_cast<long long>(o->tol_topk_ids), o->tol_logprob,
            lp_ok ? "" : "  <-- FAIL");
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
