#pragma once
// A Mixture-of-Experts feed-forward block written for ONE device, with explicit forward and backward.
// Expert parallelism enters only through EpHooks (dispatch / combine of expert-grouped rows); the ranks
// that share one sequence's tokens (CP, and TP under sequence parallelism) through `seq_reduce`.
//
//   logits = x Wr^T (fp32; Wr (E, C) replicated)            router: model/moe_router.h
//   slots  = top-k experts per token, gates g               permute: rows sorted by (expert, token, slot)
//   y_t    = sum_j g_tj * Expert_{e_tj}(x_t)                 experts: SwiGLU (llama) or GELU + biases (gpt2)
//
// Losses added to the model's gradient (formulas in docs/architecture.md), both layout-independent:
//   aux (Switch/GShard form, per sequence s of T_s real tokens, mean over the S real sequences of the
//        global batch): alpha * E / S * sum_s sum_e f_se * P_se, f_se = count_se / (k T_s),
//        P_se = mean over the tokens of s of P_te (balancing probabilities);
//   z-loss: beta / R * sum over the R real tokens of the global batch of logsumexp(logits_t)^2.
// Padding tokens are routed and computed (their outputs reach no real token) but never counted.
//
// Parameters under `prefix` ("layers.3.mlp."): router.weight (E, C), router.expert_bias (E, sigmoid
// router; changed outside the gradient, see update_expert_bias), experts.{w1,w3,w2}.weight (E, F, C),
// (E, F, C), (E, C, F) for llama, experts.{fc,proj}.{weight,bias} for gpt2. Backward accumulates (+=) into
// Param::grad.
#include <functional>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "data/dataset.h"
#include "model/ep_hooks.h"
#include "model/moe_router.h"
#include "model/params.h"
#include "train/config.h"

namespace ndt {

// Set per optimizer step by whoever runs the step (the pipeline engine).
struct MoeStepContext {
  double seqs = 1;      // real sequences in the global batch (the aux loss is a mean over them)
  double tokens = 1;    // real tokens in the global batch (the z-loss is a mean over them)
  bool record = false;  // accumulate MoeStats: the step's training forwards (not recomputation, inference)
};

// One layer's statistics over the microbatches of a step, this rank's tokens only.
struct MoeStats {
  std::vector<double> load;  // (E) slots of real tokens routed to each expert
  double aux = 0, z = 0;     // this rank's share of the aux and z loss values (coefficients applied)
  double dropped = 0;        // slots dropped by the capacity factor
  void clear(int64_t E) {
    load.assign(static_cast<size_t>(E), 0.0);
    aux = z = dropped = 0;
  }
};

struct MoeActs {
  Tensor x;             // (N, C) block input (the MLP norm's output)
  Tensor xf;            // (N, C) f32 router input (x itself when x is f32)
  Tensor logits;        // (N, E) f32 router logits
  RoutedTokens routed;  // scores, choices, permutation (model/moe_router.h); counts on the host
  RouterLossGrad loss;  // the aux / z losses' gradient terms (tok_seq undefined: none)
  EpPlan plan;
  Tensor xe;           // (Re, C) rows of this rank's experts, grouped by local expert
  Tensor h1, h3, act;  // (Re, F) fc or gate; up (llama); activation
  Tensor yp;           // (R, C) expert outputs back on this rank, in permuted order
};

class MoeLayer {
 public:
  // Registers the router and this EP rank's E/ep experts in ps. ep may be null (one rank).
  MoeLayer(const ModelConfig& cfg, const std::string& prefix, ParamStore& ps, EpHooks* ep);
  void set_seq_reduce(std::function<void(float*, int64_t)> f) { seq_reduce_ = std::move(f); }
  void set_context(MoeStepContext* ctx) { ctx_ = ctx; }
  // x (N, C) holds rows [tok0, tok0 + N) of the microbatch mb (this CP rank's shard). Returns (N, C).
  // Collective over EP (and over the sequence group when the aux loss is on).
  Tensor forward(const Microbatch& mb, int64_t tok0, const Tensor& x, MoeActs& a);
  // dy (N, C) -> dx (N, C), a fresh tensor; accumulates parameter gradients. Collective over EP.
  Tensor backward(const Tensor& dy, MoeActs& a);
  MoeStats& stats() { return stats_; }
  // Aux-loss-free balancing (sigmoid router): bias_e += rate * sign(mean load - load_e), from the global
  // batch's load (the same on every rank). No-op for the softmax router.
  void update_expert_bias(const std::vector<double>& global_load);
  const RouterSpec& spec() const { return spec_; }

 private:
  // The local experts on their rows of a.xe: matmuls per expert, the activation over all rows at once.
  void experts_forward(MoeActs& a, Tensor& ye);
  void experts_backward(MoeActs& a, const Tensor& dye, Tensor& dxe);
  // Per-token aux / z gradients (and stats) from the routing of real tokens.
  void balance_terms(const Microbatch& mb, int64_t tok0, MoeActs& a);

  ModelConfig cfg_;
  RouterSpec spec_;
  EpHooks default_ep_;
  EpHooks* ep_;
  int64_t E_, El_, k_, F_, C_;
  Param* router_;
  Param* bias_ = nullptr;
  std::vector<Param*> w_;  // llama: w1, w3, w2; gpt2: fc, proj
  std::vector<Param*> b_;  // gpt2: fc bias, proj bias
  std::function<void(float*, int64_t)> seq_reduce_;
  MoeStepContext* ctx_ = nullptr;
  MoeStats stats_;
};

}  // namespace ndt
