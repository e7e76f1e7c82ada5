#include "plan/cost.h"

#include <algorithm>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "parallel/pp/pipeline.h"
#include "parallel/pp/schedule.h"
#include "plan/act_mirror.h"
#include "plan/memory.h"

namespace ndt::plan {

ModelSize model_size(const ModelConfig& m) {
  const ParamCounts all = chunk_params(m, 1, 1, 0, m.n_layers, true, true);
  ModelSize s;
  s.total = all.dense + all.expert;
  s.active = all.dense;
  if (m.moe.enabled()) s.active += all.expert / m.moe.num_experts * m.moe.top_k;
  return s;
}

namespace {

constexpr int64_t kBucketBytes = int64_t{16} << 20;  // the plain-DP all-reduce bucket (train/optimizer.cpp)
constexpr double kAdamBytesPerParam = 30;  // read w, g, m, v and write w, m, v (fp32) + the bf16 copy

// Where each axis's neighbours sit among the world ranks (the grid's order, innermost first).
struct Placement {
  std::map<std::string, int64_t> stride, size;
  // World ranks one group over `axes` spans, assuming it starts on a node boundary.
  int64_t span(const std::vector<std::string>& axes) const {
    int64_t s = 1;
    for (const auto& a : axes) s += stride.at(a) * (size.at(a) - 1);
    return s;
  }
};

Placement placement(const ParallelConfig& p) {
  Placement pl;
  pl.size = {{"tp", p.tp}, {"cp", p.cp}, {"ep", 1}, {"dp", p.dp}, {"pp", p.pp}};
  int64_t s = 1;
  std::stringstream ss(p.order);
  for (std::string a; std::getline(ss, a, '-');) {
    pl.stride[a] = s;
    s *= pl.size.at(a);
  }
  return pl;
}

// Ring collectives over n ranks at bandwidth bw (bytes/s): all-reduce moves 2(n-1)/n of the buffer,
// all-gather / reduce-scatter (n-1)/n of the full buffer, all-to-all (n-1)/n of the local rows.
struct Comm {
  double lat;
  double all_reduce(double bytes, int64_t n, double bw) const {
    return n > 1 ? 2.0 * static_cast<double>(n - 1) / static_cast<double>(n) * bytes / bw + lat : 0;
  }
  double gather(double full_bytes, int64_t n, double bw) const {  // all-gather or reduce-scatter
    return n > 1 ? static_cast<double>(n - 1) / static_cast<double>(n) * full_bytes / bw + lat : 0;
  }
  double p2p(double bytes, double bw) const { return bytes / bw + lat; }
};

}  // namespace

StepTime step_time(const Config& cfg, const Hardware& hw) {
  const ModelConfig& m = cfg.model;
  const ParallelConfig& p = cfg.parallel;
  const MicrobatchShape mb = microbatch_shape(cfg);
  const ActDims d = act_dims(cfg, mb.tokens);
  const Placement pl = placement(p);
  const Comm cm{hw.latency_us * 1e-6};
  const double nv = hw.nvlink_gbps * 1e9, ib = hw.ib_gbps * 1e9;
  auto bw = [&](int64_t span) { return span <= hw.gpus_per_node ? nv : ib; };
  const double bw_tp = bw(pl.span({"tp"})), bw_cp = bw(pl.span({"cp"})), bw_pp = bw(pl.span({"pp"})),
               bw_grad = bw(pl.span({"dp", "cp"}));
  // EP groups are blocks of ep consecutive ranks of the DP x CP group, CP innermost.
  const int64_t ep_span = p.ep <= p.cp ? pl.stride.at("cp") * (p.ep - 1) + 1
                                       : pl.span({"cp"}) + pl.stride.at("dp") * (p.ep / p.cp - 1);
  const double bw_ep = bw(ep_span);
  const double flops_per_s = hw.tflops * 1e12 * hw.mfu;
  const int64_t mm = m.is_gpt2() ? 2 : 3;  // matmuls per MLP
  const double T = static_cast<double>(d.T), Tl = static_cast<double>(d.Tl);
  const double C = static_cast<double>(d.C), b = static_cast<double>(d.b);
  const double B = T * C * b, Bkv = T * static_cast<double>(d.KVl * d.D) * b;
  const bool tp = p.tp > 1, recompute = cfg.train.recompute;

  StepTime st;
  const std::vector<int64_t> bounds = stage_boundaries(p, m.n_layers).value();
  const int64_t S = p.pp * p.virtual_stages;
  double worst = -1;
  for (int64_t r = 0; r < p.pp; ++r) {
    double fwd = 0, head = 0, tp_s = 0, cp_s = 0, ep_s = 0, pp_s = 0;  // per microbatch
    for (int64_t c = 0; c < p.virtual_stages; ++c) {
      const int64_t s = c * p.pp + r;
      for (int64_t l = bounds[static_cast<size_t>(s)]; l < bounds[static_cast<size_t>(s) + 1]; ++l) {
        const bool moe = m.is_moe_layer(l), has_mlp = !moe || d.Fs > 0;
        const int64_t attn_mm = m.d_model * m.head_dim() * (2 * m.n_heads + 2 * m.kv_heads()) / p.tp;
        fwd += 2 * T * static_cast<double>(attn_mm);
        fwd += 2 * T * static_cast<double>(d.Hl * d.D * cfg.data.seq_len);  // causal QK^T and PV
        if (!moe) fwd += 2 * T * static_cast<double>(mm * d.C * d.Fl);
        if (moe) {
          fwd += 2 * Tl * static_cast<double>(d.E * d.C);         // router
          fwd += 2 * static_cast<double>(d.R * mm * d.C * d.Fe);  // routed rows
          fwd += 2 * T * static_cast<double>(mm * d.C * d.Fs);    // shared experts
        }
        const double passes = recompute ? 2 : 1;  // forward collectives run again under recomputation
        if (tp) {
          // Blocks: attention, and the MLP unless the MoE block is routed only (no TP collective).
          const int64_t blocks = has_mlp ? 2 : 1;
          // Per block and pass: all-reduce (exit forward, enter backward), or under SP all-gather +
          // reduce-scatter each way.
          const double one = d.sp ? 2 * cm.gather(B, p.tp, bw_tp) : cm.all_reduce(B, p.tp, bw_tp);
          tp_s += static_cast<double>(blocks) * (passes + 1) * one;
        }
        if (p.cp > 1) {
          if (d.ring) {
            const double f = static_cast<double>(p.cp - 1) * cm.p2p(2 * Bkv, bw_cp);
            cp_s +=
                passes * f + static_cast<double>(p.cp - 1) * cm.p2p(4 * Bkv, bw_cp) + cm.p2p(2 * Bkv, bw_cp);
          } else {
            const double ag = cm.gather(static_cast<double>(p.cp) * Bkv, p.cp, bw_cp);
            cp_s += passes * 2 * ag + 4 * ag;
          }
        }
        if (moe && p.ep > 1) {
          const double a2a = cm.gather(static_cast<double>(d.R) * C * b, p.ep, bw_ep);
          ep_s += (2 * passes + 2) * a2a;
        }
      }
      if (s == S - 1) head = 2 * T * C * static_cast<double>(d.Vl);
      if (tp && s == 0) tp_s += d.sp ? 2 * cm.gather(B, p.tp, bw_tp) : cm.all_reduce(B, p.tp, bw_tp);
      if (tp && s == S - 1)
        tp_s += (d.sp ? 2 * cm.gather(B, p.tp, bw_tp) : cm.all_reduce(B, p.tp, bw_tp)) +
                3 * cm.all_reduce(T * 4, p.tp, bw_tp);   // the vocab-parallel softmax's row reductions
      if (s > 0) pp_s += cm.p2p(Tl * C * b, bw_pp);      // input gradient back
      if (s < S - 1) pp_s += cm.p2p(Tl * C * b, bw_pp);  // activations forward
    }
    const double flops = 3 * (fwd + head) + (recompute ? fwd : 0);
    const double per_mb = flops / flops_per_s + tp_s + cp_s + ep_s + pp_s;
    if (per_mb > worst) {
      worst = per_mb;
      const double n = static_cast<double>(mb.count);
      st.critical_pp_rank = r;
      st.compute_s = n * flops / flops_per_s;
      st.tp_s = n * tp_s;
      st.cp_s = n * cp_s;
      st.ep_s = n * ep_s;
      st.pp_s = n * pp_s;
    }
    // Gradient reduction and the update of this rank's parameters, after the pipeline.
    const FlatSizes f = flat_sizes(cfg, rank_params(cfg, r));
    const int64_t g = p.dp * p.cp, edp = g / p.ep;
    double dp_s = 0;
    for (auto [len, n] : {std::pair{f.dense_len, g}, {f.expert_len, edp}}) {
      const double bytes = 4.0 * static_cast<double>(len);
      if (n <= 1 || len == 0) continue;
      if (p.zero1)
        dp_s += 2 * cm.gather(bytes, n, bw_grad);
      else
        dp_s +=
            cm.all_reduce(bytes, n, bw_grad) +
            cm.lat * static_cast<double>((static_cast<int64_t>(bytes) + kBucketBytes - 1) / kBucketBytes - 1);
    }
    if (m.tied() && p.pp > 1 && (r == 0 || r == p.pp - 1))
      dp_s += cm.all_reduce(4.0 * static_cast<double>(d.Vl * d.C), 2, bw(pl.span({"pp"})));
    st.dp_s = std::max(st.dp_s, dp_s);
    st.optimizer_s =
        std::max(st.optimizer_s, static_cast<double>(f.state) * kAdamBytesPerParam / (hw.hbm_gbps * 1e9));
  }
  const std::string kind = p.virtual_stages > 1 ? "interleaved" : (p.pp == 1 ? "1f1b" : p.schedule);
  st.bubble = pp::theoretical_bubble(kind, static_cast<int>(p.pp), static_cast<int>(p.virtual_stages),
                                     static_cast<int>(mb.count));
  const double pipelined = st.compute_s + st.tp_s + st.cp_s + st.ep_s + st.pp_s;
  st.step_s = pipelined / (1 - st.bubble) + st.dp_s + st.optimizer_s;
  const double tokens = static_cast<double>(cfg.train.global_batch * cfg.data.seq_len);
  const ModelSize ms = model_size(m);
  // Matmul parameters a token uses (the embedding lookup is none, the head is one when tied).
  const double embed = static_cast<double>(m.vocab_size * m.d_model) * (m.tied() ? 0 : 1) +
                       (m.is_gpt2() ? static_cast<double>(m.max_seq_len * m.d_model) : 0);
  const double attn = 6.0 * static_cast<double>(m.n_layers * m.n_heads * m.head_dim() * cfg.data.seq_len);
  st.model_flops = tokens * (6 * (static_cast<double>(ms.active) - embed) + attn);
  st.tokens_per_s = tokens / st.step_s;
  return st;
}

}  // namespace ndt::plan
