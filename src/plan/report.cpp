#include "plan/report.h"

#include <fmt/format.h>

#include <map>

namespace ndt::plan {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

double gib(int64_t bytes) { return static_cast<double>(bytes) / kGiB; }

std::string count(double n) {
  if (n >= 1e9) return fmt::format("{:.2f}B", n / 1e9);
  if (n >= 1e6) return fmt::format("{:.1f}M", n / 1e6);
  if (n >= 1e3) return fmt::format("{:.1f}k", n / 1e3);
  return fmt::format("{:.0f}", n);
}

const char* verdict_name(Verdict v) {
  switch (v) {
    case Verdict::Fits:
      return "fits";
    case Verdict::DoesNotFit:
      return "does_not_fit";
    case Verdict::Invalid:
      return "invalid";
  }
  return "";
}

}  // namespace

std::string format_report(const PlanResult& r, const PlanOptions& o, const Config& base, int top) {
  const ModelConfig& m = base.model;
  const Hardware& hw = o.hw;
  std::string out =
      fmt::format("ndtrain plan: {} on {} GPUs x {:.0f} GiB\n", base.source, o.gpus, o.gpu_mem_gib);
  out += fmt::format(
      "model: {} {}, {} parameters{}, {} layers, d_model {}, vocab {}; step: {} samples x {} tokens, "
      "micro_batch {}{}\n",
      m.style, m.moe.enabled() ? "MoE" : "dense", count(static_cast<double>(r.size.total)),
      m.moe.enabled() ? fmt::format(" ({} active)", count(static_cast<double>(r.size.active))) : "",
      m.n_layers, m.d_model, m.vocab_size, base.train.global_batch, base.data.seq_len, base.train.micro_batch,
      base.data.packing ? ", packed" : "");
  out += fmt::format(
      "assumed: {:.0f} TFLOP/s x MFU {:.2f} per GPU; NVLink {:.0f} GB/s, between nodes {:.0f} GB/s ({} GPUs "
      "per "
      "node); communication not overlapped\n",
      hw.tflops, hw.mfu, hw.nvlink_gbps, hw.ib_gbps, hw.gpus_per_node);
  for (const std::string& n : r.notes) out += "note: " + n + "\n";
  out +=
      "memory: peak = predicted peak_mem_gib_per_rank (allocated tensors, max over ranks); need = peak + "
      "pool slack + CUDA context, cuBLASLt and NCCL buffers\n";

  int fits = 0;
  for (const LayoutPlan& l : r.layouts) fits += l.verdict == Verdict::Fits;
  out += fmt::format("\nlayouts that fit ({}, fastest first):\n", fits);
  out +=
      fmt::format("  {:>3}  {:<30} {:<18} {:>4} {:>6}  {:>7} {:>6} {:>9} {:>6}  {:>12} {:>6}  {:>8} {:>8}\n",
                  "#", "layout", "flags", "m", "bubble", "weights", "optim", "act/mb", "in", "peak (rank)",
                  "need", "step s", "tok/s");
  int shown = 0;
  for (const LayoutPlan& l : r.layouts) {
    if (l.verdict != Verdict::Fits || (top > 0 && shown >= top)) continue;
    const StageMemory& s = l.stages[static_cast<size_t>(l.peak_pp_rank)];
    const PersistentBytes& p = s.persistent;
    out += fmt::format(
        "  {:>3}  {:<30} {:<18} {:>4} {:>6.3f}  {:>7.2f} {:>6.2f} {:>9.3f} {:>6}  {:>7.2f} ({:>2})  "
        "{:>6.2f}  {:>8.3f} {:>8}\n",
        ++shown, l.layout.degrees(), l.layout.flags(), l.microbatches.count, l.time.bubble,
        gib(p.weights + p.grads + p.compute), gib(p.optimizer), gib(s.act_per_microbatch), s.max_in_flight,
        l.peak_gib, l.peak_world_rank, l.need_gib, l.time.step_s, count(l.time.tokens_per_s));
  }
  if (fits > shown) out += fmt::format("  ... {} more (--top 0 shows all)\n", fits - shown);
  out +=
      "  (weights: fp32 values + fp32 grads + bf16 copy; optim: AdamW m, v (+ ZeRO-1 shards over MPI); "
      "act/mb: kept "
      "by\n"
      "   one microbatch's forward on the peak rank; in: microbatches in flight there; GiB; rank = world "
      "rank)\n";

  // Rejected: one line per layout and reason; flag variants with the same reason share a line.
  std::vector<std::pair<std::string, std::vector<std::string>>> rejected;
  std::map<std::string, size_t> index;
  for (const LayoutPlan& l : r.layouts) {
    if (l.verdict == Verdict::Fits) continue;
    const std::string what = l.verdict == Verdict::Invalid ? "does not divide: " : "does not fit: ";
    const std::string key = l.layout.degrees() + " | " + what + l.reason;
    if (auto it = index.find(key); it != index.end()) {
      rejected[it->second].second.push_back(l.layout.flags());
      continue;
    }
    index[key] = rejected.size();
    rejected.push_back({key, {l.layout.flags()}});
  }
  out += fmt::format("\nrejected ({} layouts){}\n", r.layouts.size() - static_cast<size_t>(fits),
                     rejected.empty() ? ": none" : ":");
  for (const auto& [key, flags] : rejected) {
    const size_t bar = key.find(" | ");
    std::string f;
    for (const std::string& x : flags) f += (f.empty() ? "" : ", ") + x;
    out += fmt::format("  {} [{}]: {}\n", key.substr(0, bar), f, key.substr(bar + 3));
  }
  return out;
}

nlohmann::json to_json(const PlanResult& r, const PlanOptions& o, const Config& base) {
  using nlohmann::json;
  json j;
  j["config"] = base.source;
  j["gpus"] = o.gpus;
  j["gpu_mem_gib"] = o.gpu_mem_gib;
  j["assumptions"] = {{"tflops", o.hw.tflops},
                      {"mfu", o.hw.mfu},
                      {"nvlink_gbps", o.hw.nvlink_gbps},
                      {"ib_gbps", o.hw.ib_gbps},
                      {"gpus_per_node", o.hw.gpus_per_node},
                      {"hbm_gbps", o.hw.hbm_gbps},
                      {"latency_us", o.hw.latency_us},
                      {"cuda_context_gib", kCudaContextGiB},
                      {"cublas_workspace_gib", kCublasWorkspaceGiB},
                      {"nccl_gib_per_group", kNcclGiBPerGroup},
                      {"pool_slack", kPoolSlack}};
  j["parameters"] = {{"total", r.size.total}, {"active", r.size.active}};
  j["notes"] = r.notes;
  j["layouts"] = json::array();
  for (const LayoutPlan& l : r.layouts) {
    json e = {{"tp", l.layout.tp},
              {"cp", l.layout.cp},
              {"dp", l.layout.dp},
              {"pp", l.layout.pp},
              {"ep", l.layout.ep},
              {"virtual_stages", l.layout.v},
              {"schedule", l.layout.schedule},
              {"sequence_parallel", l.layout.sp},
              {"zero1", l.layout.zero1},
              {"recompute", l.layout.recompute},
              {"overrides", l.layout.overrides()},
              {"status", verdict_name(l.verdict)}};
    if (!l.reason.empty()) e["reason"] = l.reason;
    if (l.verdict != Verdict::Invalid) {
      e["microbatches"] = l.microbatches.count;
      e["tokens_per_microbatch_per_cp_rank"] = l.microbatches.tokens;
      e["peak_gib"] = l.peak_gib;
      e["peak_world_rank"] = l.peak_world_rank;
      e["peak_pp_rank"] = l.peak_pp_rank;
      e["need_gib"] = l.need_gib;
      e["peak_mem_gib_per_rank"] = l.rank_peak_gib;
      json stages = json::array();
      for (const StageMemory& s : l.stages)
        stages.push_back({{"pp_rank", s.pp_rank},
                          {"params_dense", s.params.dense},
                          {"params_expert", s.params.expert},
                          {"flat_elements", s.flat.total()},
                          {"optimizer_state_elements", s.flat.state},
                          {"weights_gib", gib(s.persistent.weights)},
                          {"grads_gib", gib(s.persistent.grads)},
                          {"compute_copy_gib", gib(s.persistent.compute)},
                          {"optimizer_gib", gib(s.persistent.optimizer)},
                          {"activations_per_microbatch_gib", gib(s.act_per_microbatch)},
                          {"max_in_flight", s.max_in_flight},
                          {"activation_peak_gib", gib(s.activation_peak)},
                          {"peak_gib", gib(s.peak)},
                          {"peak_at", s.peak_at}});
      e["stages"] = stages;
      const StepTime& t = l.time;
      e["time"] = {{"step_s", t.step_s},
                   {"bubble", t.bubble},
                   {"compute_s", t.compute_s},
                   {"tp_s", t.tp_s},
                   {"cp_s", t.cp_s},
                   {"ep_s", t.ep_s},
                   {"pp_s", t.pp_s},
                   {"dp_s", t.dp_s},
                   {"optimizer_s", t.optimizer_s},
                   {"critical_pp_rank", t.critical_pp_rank},
                   {"model_flops", t.model_flops},
                   {"tokens_per_s", t.tokens_per_s}};
    }
    j["layouts"].push_back(e);
  }
  return j;
}

}  // namespace ndt::plan
