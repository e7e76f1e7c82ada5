#include "plan/plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <sstream>

#include "parallel/layout.h"

namespace ndt::plan {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> out;
  for (int64_t d = 1; d <= n; ++d)
    if (n % d == 0) out.push_back(d);
  return out;
}

// World rank -> pipeline rank under the grid's order (innermost first; ep is not a grid axis).
int64_t pp_rank_of(const ParallelConfig& p, int64_t world_rank) {
  const std::vector<std::pair<std::string, int64_t>> sizes = {
      {"tp", p.tp}, {"cp", p.cp}, {"ep", 1}, {"dp", p.dp}, {"pp", p.pp}};
  int64_t stride = 1;
  std::stringstream ss(p.order);
  for (std::string a; std::getline(ss, a, '-');) {
    const int64_t n =
        std::find_if(sizes.begin(), sizes.end(), [&](const auto& s) { return s.first == a; })->second;
    if (a == "pp") return world_rank / stride % n;
    stride *= n;
  }
  return 0;
}

// Process groups that move device data over NCCL with more than one rank (each holds NCCL buffers).
int64_t nccl_groups(const ParallelConfig& p) {
  const int64_t g = p.dp * p.cp, edp = g / p.ep;
  int64_t n = 0;
  for (int64_t s : {g, p.tp, p.pp, p.cp, p.ep}) n += s > 1;
  return n + (p.ep > 1 && edp > 1);
}

}  // namespace

std::string Layout::degrees() const {
  return fmt::format("tp={} cp={} dp={} pp={} ep={} v={}", tp, cp, dp, pp, ep, v);
}

std::string Layout::flags() const {
  std::string f;
  for (auto [on, name] : {std::pair{sp, "sp"}, {zero1, "zero1"}, {recompute, "recompute"}})
    if (on) f += (f.empty() ? "" : " ") + std::string(name);
  return f.empty() ? "-" : f;
}

std::vector<std::string> Layout::overrides() const {
  auto b = [](bool x) { return x ? "true" : "false"; };
  return {fmt::format("parallel.tp={}", tp),
          fmt::format("parallel.cp={}", cp),
          fmt::format("parallel.dp={}", dp),
          fmt::format("parallel.pp={}", pp),
          fmt::format("parallel.ep={}", ep),
          fmt::format("parallel.virtual_stages={}", v),
          fmt::format("parallel.schedule={}", schedule),
          fmt::format("parallel.sequence_parallel={}", b(sp)),
          fmt::format("parallel.zero1={}", b(zero1)),
          fmt::format("train.recompute={}", b(recompute))};
}

Layout layout_of(const Config& cfg) {
  const ParallelConfig& p = cfg.parallel;
  Layout l;
  l.tp = p.tp;
  l.cp = p.cp;
  l.dp = p.dp;
  l.pp = p.pp;
  l.ep = p.ep;
  l.v = p.virtual_stages;
  l.schedule = p.schedule;
  l.sp = p.sequence_parallel;
  l.zero1 = p.zero1;
  l.recompute = cfg.train.recompute;
  return l;
}

Config with_layout(const Config& base, const Layout& l) {
  Config c = base;
  ParallelConfig& p = c.parallel;
  p.tp = l.tp;
  p.cp = l.cp;
  p.dp = l.dp;
  p.pp = l.pp;
  p.ep = l.ep;
  p.virtual_stages = l.v;
  p.schedule = l.schedule;
  p.sequence_parallel = l.sp;
  p.zero1 = l.zero1;
  c.train.recompute = l.recompute;
  return c;
}

std::vector<Layout> candidate_layouts(const Config& base, int gpus) {
  const ModelConfig& m = base.model;
  const ParallelConfig& bp = base.parallel;
  // With v = 1 the config's own schedule (1f1b or gpipe) is kept; interleaving is the v > 1 rows.
  const std::string flat_schedule = bp.schedule == "interleaved" ? "1f1b" : bp.schedule;
  std::vector<Layout> out;
  for (int64_t tp : divisors(gpus))
    for (int64_t cp : divisors(gpus / tp))
      for (int64_t pp : divisors(gpus / (tp * cp))) {
        const int64_t dp = gpus / (tp * cp * pp);
        std::vector<int64_t> eps = {1};
        if (m.moe.enabled()) eps = divisors(dp * cp);
        std::vector<int64_t> vs = {1};
        if (!bp.stage_layers.empty()) {
          vs = {bp.virtual_stages};  // an explicit split fixes pp * v; other pp are refused by the trainer
        } else if (pp > 1) {
          for (int64_t v = 2; pp * v <= m.n_layers; ++v)
            if (m.n_layers % (pp * v) == 0) vs.push_back(v);
        }
        for (int64_t ep : eps)
          for (int64_t v : vs)
            for (bool sp : tp > 1 ? std::vector<bool>{false, true} : std::vector<bool>{false})
              for (bool zero1 : dp* cp > 1 ? std::vector<bool>{false, true} : std::vector<bool>{false})
                for (bool recompute : {false, true}) {
                  Layout l;
                  l.tp = tp;
                  l.cp = cp;
                  l.dp = dp;
                  l.pp = pp;
                  l.ep = ep;
                  l.v = v;
                  l.schedule = v > 1 ? "interleaved" : flat_schedule;
                  l.sp = sp;
                  l.zero1 = zero1;
                  l.recompute = recompute;
                  out.push_back(l);
                }
      }
  return out;
}

LayoutPlan plan_layout(const Config& base, const Layout& l, const PlanOptions& o) {
  LayoutPlan r;
  r.layout = l;
  const Config cfg = with_layout(base, l);
  // The trainer's checks, in its order: the config (load_config) and then the layout (Layout::create).
  // load_config names the file after a config error; validate_layout's messages name the layout.
  Status st = validate_config(cfg);
  if (!st) st = Status::error(fmt::format("{} ({})", st.message(), cfg.source));
  if (st) st = validate_layout(cfg, o.gpus);
  if (!st) {
    r.verdict = Verdict::Invalid;
    r.reason = st.message();
    return r;
  }
  r.microbatches = microbatch_shape(cfg);
  for (int64_t s = 0; s < l.pp; ++s) r.stages.push_back(stage_memory(cfg, s));
  const auto worst =
      std::max_element(r.stages.begin(), r.stages.end(),
                       [](const StageMemory& a, const StageMemory& b) { return a.peak < b.peak; });
  r.peak_pp_rank = worst->pp_rank;
  r.peak_gib = static_cast<double>(worst->peak) / kGiB;
  for (int64_t w = 0; w < o.gpus; ++w) {
    const int64_t s = pp_rank_of(cfg.parallel, w);
    r.rank_peak_gib.push_back(static_cast<double>(r.stages[static_cast<size_t>(s)].peak) / kGiB);
  }
  r.peak_world_rank =
      std::find(r.rank_peak_gib.begin(), r.rank_peak_gib.end(), r.peak_gib) - r.rank_peak_gib.begin();
  r.need_gib = r.peak_gib * (1 + kPoolSlack) + kCudaContextGiB + kCublasWorkspaceGiB +
               kNcclGiBPerGroup * static_cast<double>(nccl_groups(cfg.parallel));
  r.time = step_time(cfg, o.hw);
  if (r.need_gib > o.gpu_mem_gib) {
    r.verdict = Verdict::DoesNotFit;
    r.reason = fmt::format(
        "predicted {:.2f} GiB > {:.2f} GiB of GPU memory (peak allocated {:.2f} GiB on world rank {} = pp "
        "rank {}, "
        "at {}; plus pool slack and {:.2f} GiB outside the pool)",
        r.need_gib, o.gpu_mem_gib, r.peak_gib, r.peak_world_rank, r.peak_pp_rank, worst->peak_at,
        r.need_gib - r.peak_gib * (1 + kPoolSlack));
  } else {
    r.verdict = Verdict::Fits;
  }
  return r;
}

PlanResult plan(const Config& base, const PlanOptions& o, bool as_configured) {
  PlanResult res;
  res.size = model_size(base.model);
  const ModelConfig& m = base.model;
  if (base.train.device != "cuda")
    res.notes.push_back("predictions are for train.device=cuda (bf16 unless train.precision=fp32)");
  if (m.head_dim() != 64 && m.head_dim() != 128)
    res.notes.push_back(
        fmt::format("the head dim is {}: train.device=cuda accepts 64 or 128 only, so the GPU run would "
                    "refuse this model",
                    m.head_dim()));
  if (base.data.packing)
    res.notes.push_back(
        "packed microbatches are assumed full (full-length samples filling the token budget)");
  if (m.moe.enabled())
    res.notes.push_back(
        "MoE: routing assumed perfectly balanced (every expert gets N*k/E rows per microbatch)");
  if (base.encoder.enabled())
    res.notes.push_back(
        "the image encoder (encoder.*) is not modelled: its weights and activations come on top");
  if (base.posttrain.algo != "sft")
    res.notes.push_back(fmt::format(
        "posttrain.algo {}: only the training step is modelled (no generation engine, KV cache or reference "
        "weights)",
        base.posttrain.algo));
  const std::vector<Layout> layouts =
      as_configured ? std::vector<Layout>{layout_of(base)} : candidate_layouts(base, o.gpus);
  for (const Layout& l : layouts) res.layouts.push_back(plan_layout(base, l, o));
  std::stable_sort(res.layouts.begin(), res.layouts.end(), [](const LayoutPlan& a, const LayoutPlan& b) {
    if (a.verdict != b.verdict) return a.verdict < b.verdict;
    if (a.verdict == Verdict::Fits) {
      if (a.time.step_s != b.time.step_s) return a.time.step_s < b.time.step_s;
      return a.peak_gib < b.peak_gib;
    }
    if (a.verdict == Verdict::DoesNotFit) return a.need_gib < b.need_gib;
    return false;
  });
  return res;
}

}  // namespace ndt::plan
