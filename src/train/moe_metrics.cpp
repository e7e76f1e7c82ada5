#include "train/moe_metrics.h"

#include <algorithm>

namespace ndt {

MoeStepReport finish_moe_step(const Config& cfg, const std::vector<std::pair<int64_t, MoeLayer*>>& layers,
                              Communicator& grad, Communicator& tp, Communicator& pp, bool update_bias) {
  MoeStepReport rep;
  rep.active = true;
  const int64_t E = cfg.model.moe.num_experts;
  for (int64_t l = 0; l < cfg.model.n_layers; ++l)
    if (cfg.model.is_moe_layer(l)) rep.layers.push_back(l);
  // One row per MoE layer of the model: E loads, aux, z, dropped. Each layer lives on one pipeline stage.
  const int64_t W = E + 3, n = static_cast<int64_t>(rep.layers.size());
  auto index_of = [&](int64_t l) {
    return static_cast<size_t>(std::find(rep.layers.begin(), rep.layers.end(), l) - rep.layers.begin());
  };
  std::vector<double> buf(static_cast<size_t>(n * W), 0.0);
  // Without sequence parallelism every TP rank routes the same tokens: count them once.
  const bool count_here = cfg.parallel.sequence_parallel || tp.rank() == 0;
  for (const auto& [l, m] : layers) {
    if (!count_here) break;
    const auto row = index_of(l) * W;
    const MoeStats& s = m->stats();
    for (int64_t e = 0; e < E; ++e) buf[row + static_cast<size_t>(e)] = s.load[static_cast<size_t>(e)];
    buf[row + static_cast<size_t>(E)] = s.aux;
    buf[row + static_cast<size_t>(E) + 1] = s.z;
    buf[row + static_cast<size_t>(E) + 2] = s.dropped;
  }
  const auto count = static_cast<int64_t>(buf.size());
  for (Communicator* c : {&grad, &tp, &pp})
    if (c->size() > 1) c->all_reduce(buf.data(), count, DType::F64, ReduceOp::Sum);
  double slots = 0, dropped = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double* row = buf.data() + i * W;
    rep.load.emplace_back(row, row + E);
    double sum = 0, mx = 0;
    for (int64_t e = 0; e < E; ++e) {
      sum += row[e];
      mx = std::max(mx, row[e]);
    }
    if (sum > 0) rep.load_ratio = std::max(rep.load_ratio, mx / (sum / static_cast<double>(E)));
    rep.aux_loss += row[E];
    rep.z_loss += row[E + 1];
    dropped += row[E + 2];
    slots += sum;
  }
  rep.dropped = slots > 0 ? dropped / slots : 0.0;
  for (const auto& [l, m] : layers) {
    if (!update_bias) break;
    const auto i = index_of(l);
    m->update_expert_bias(rep.load[i]);
  }
  return rep;
}

}  // namespace ndt
