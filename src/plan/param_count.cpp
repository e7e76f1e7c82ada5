#include "plan/param_count.h"

#include "parallel/pp/pipeline.h"

namespace ndt::plan {

ParamCounts chunk_params(const ModelConfig& m, int64_t tp, int64_t ep, int64_t first_layer,
                         int64_t last_layer, bool has_embedding, bool has_head) {
  const int64_t C = m.d_model, D = m.head_dim(), H = m.n_heads, KV = m.kv_heads(), F = m.ffn_dim(),
                V = m.vocab_size;
  const bool gpt2 = m.is_gpt2();
  ParamCounts n;
  const int64_t norm = gpt2 ? 2 * C : C;  // weight (+ bias)
  // Column-parallel: (out/tp, C) weight and, where the style has one, an (out/tp) bias.
  auto col = [&](int64_t out, bool bias) { return out / tp * C + (bias ? out / tp : 0); };
  auto mlp = [&](int64_t width) {
    if (gpt2) return col(width, true) + C * (width / tp) + C;  // fc (+ bias), proj (+ replicated bias)
    return 2 * col(width, false) + C * (width / tp);           // w1, w3, w2
  };
  if (has_embedding || (has_head && m.tied())) n.dense += V / tp * C;
  if (has_embedding && gpt2) n.dense += m.max_seq_len * C;
  for (int64_t l = first_layer; l < last_layer; ++l) {
    n.dense += 2 * norm;
    n.dense += col(H * D, gpt2 || m.qkv_bias);     // wq
    n.dense += col(KV * D, !gpt2 && m.qkv_bias);   // wk (GPT-2 has no key bias)
    n.dense += col(KV * D, gpt2 || m.qkv_bias);    // wv
    n.dense += C * (H * D / tp) + (gpt2 ? C : 0);  // wo (+ replicated bias)
    if (!gpt2 && m.qk_norm) n.dense += 2 * D;      // q_norm, k_norm (replicated)
    if (!m.is_moe_layer(l)) {
      n.dense += mlp(F);
      continue;
    }
    const MoeConfig& e = m.moe;
    const int64_t Fe = m.expert_ffn_dim(), El = e.num_experts / ep;
    n.dense += e.num_experts * C + (e.router == "sigmoid" ? e.num_experts : 0);  // router (+ expert bias)
    n.expert += gpt2 ? El * (2 * Fe * C + Fe + C) : El * 3 * Fe * C;
    if (e.shared_experts > 0) n.dense += mlp(e.shared_experts * Fe);
  }
  if (has_head) n.dense += norm + (m.tied() ? 0 : V / tp * C);
  return n;
}

ParamCounts rank_params(const Config& cfg, int64_t pp_rank) {
  const ParallelConfig& p = cfg.parallel;
  const std::vector<int64_t> b = stage_boundaries(p, cfg.model.n_layers).value();
  const int64_t S = p.pp * p.virtual_stages;
  ParamCounts n;
  for (int64_t c = 0; c < p.virtual_stages; ++c) {
    const int64_t s = c * p.pp + pp_rank;
    const ParamCounts k = chunk_params(cfg.model, p.tp, p.ep, b[static_cast<size_t>(s)],
                                       b[static_cast<size_t>(s) + 1], s == 0, s == S - 1);
    n.dense += k.dense;
    n.expert += k.expert;
  }
  return n;
}

namespace {
int64_t round_up(int64_t n, int64_t a) { return (n + a - 1) / a * a; }
}  // namespace

FlatSizes flat_sizes(const Config& cfg, const ParamCounts& p) {
  const ParallelConfig& par = cfg.parallel;
  const int64_t g = par.dp * par.cp, edp = g / par.ep;  // gradient group, expert-data-parallel group
  FlatSizes f;
  f.dense_len = round_up(p.dense, g);
  f.expert_len = p.expert > 0 ? round_up(p.expert, edp) : 0;
  // Each region's moments cover the part this rank owns: 1/group of it under ZeRO-1 (train/optimizer.cpp).
  auto owned = [&](int64_t len, int64_t group, int64_t& shard) {
    if (len == 0) return int64_t{0};
    if (!par.zero1 || group == 1) return len;
    shard = len / group;
    return shard;
  };
  f.state = owned(f.dense_len, g, f.shard_dense) + owned(f.expert_len, edp, f.shard_expert);
  return f;
}

int64_t device_bytes(int64_t bytes) { return (std::max<int64_t>(bytes, 1) + 255) / 256 * 256; }

PersistentBytes persistent_bytes(const FlatSizes& f, bool bf16, bool zero1_buffers) {
  PersistentBytes b;
  const int64_t n = f.total();
  b.weights = device_bytes(4 * n);
  b.grads = device_bytes(4 * n);
  b.compute = bf16 ? device_bytes(2 * n) : 0;
  b.optimizer = 2 * device_bytes(4 * f.state);
  if (zero1_buffers)
    for (int64_t shard : {f.shard_dense, f.shard_expert})
      if (shard > 0) b.optimizer += device_bytes(4 * shard);
  return b;
}

}  // namespace ndt::plan
