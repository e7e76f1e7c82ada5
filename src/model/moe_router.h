#pragma once
// The MoE router in fp32: scores, top-k selection, gate weights, optional capacity dropping, the
// permutation of slots by expert, and the exact backward from gate / balancing-probability / z-loss
// gradients to the router logits. The pointer functions are the host reference; the Tensor functions run
// where the logits live (cuda/moe_route.h on the GPU, the same arithmetic).
//
// For a token with router logits l (E):
//   softmax router:  p = softmax(l); experts = top-k of p; raw gate = p[e]
//   sigmoid router:  s = sigmoid(l) (in double); experts = top-k of s + bias (bias only selects); raw gate =
//   s[e] gates = raw / sum(raw over the k chosen) when renormalize, else raw
// Ties go to the smaller expert id. Balancing probabilities P (the load-balancing loss's P_e): p for
// softmax, s / sum_e s for sigmoid. z = logsumexp(l) (router z-loss).
#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace ndt {

struct RouterSpec {
  int64_t experts = 0, top_k = 1;
  bool sigmoid = false;
  bool renormalize = true;
  double capacity_factor = 0;  // > 0: each expert keeps at most ceil(cf * N * k / E) slots, in token order
};

struct Routing {
  int64_t rows = 0;             // N tokens
  std::vector<float> score;     // (N, E) p (softmax) or s (sigmoid)
  std::vector<int32_t> choice;  // (N * k) chosen expert of each slot, in selection order
  std::vector<float> gate;      // (N * k)
  std::vector<uint8_t> kept;    // (N * k) 0 where capacity dropped the slot
};

// logits (N, E); bias (E) or null (sigmoid selection bias).
Routing route(const float* logits, const float* bias, int64_t N, const RouterSpec& spec);

// route() per token, without capacity: score (N, E), choice / gate (N * k), lse (N) = logsumexp(l), pnorm (N)
// the balancing probabilities' normaliser (P = score / pnorm: 1 for softmax, sum of s for sigmoid).
void route_tokens(const float* logits, const float* bias, int64_t N, const RouterSpec& spec, float* score,
                  int32_t* choice, float* gate, float* lse, float* pnorm);

// Statistics of the real tokens (tok_seq[t] >= 0, the sequence of token t) of a routed microbatch of S
// sequences, stats (2 S E + 2): [count (S, E) of slots routed to each expert, dropped ones included |
// psum (S, E) sum of P[t, e] | real slots dropped | sum of lse^2]. Sums in double, stored as f32.
void seq_stats(float* stats, const int32_t* tok_seq, const int32_t* choice, const int32_t* slot_pos,
               const float* score, const float* pnorm, const float* lse, int64_t N, int64_t S, int64_t E,
               int64_t k);

// Slots an expert keeps among N tokens' N * k: ceil(capacity_factor * N * k / E); -1 (no limit) when the
// capacity factor is 0.
int64_t expert_capacity(const RouterSpec& spec, int64_t N);

// Slots sorted by (expert, token, slot), each expert keeping its first `cap` slots in that order (cap < 0:
// all): slot_pos (N * k) the row of each slot or -1, kept_gate (N * k) its gate or 0, row_token / row_gate
// (sum(counts) rows) the token and gate of each row, counts (E) the rows of each expert.
void expert_permutation(const int32_t* choice, const float* gate, int64_t N, int64_t k, int64_t E,
                        int64_t cap, int32_t* slot_pos, float* kept_gate, int32_t* row_token, float* row_gate,
                        int32_t* counts);

// A routed microbatch where its logits live; only `counts` is on the host (the all-to-all sizes).
struct RoutedTokens {
  Tensor score;                 // (N, E) f32
  Tensor choice;                // (N * k) i32
  Tensor gate;                  // (N * k) f32, before capacity dropping
  Tensor lse;                   // (N) f32 logsumexp of each token's logits
  Tensor pnorm;                 // (N) f32 (route_tokens)
  Tensor slot_pos, kept_gate;   // (N * k) i32 / f32 (expert_permutation)
  Tensor row_token, row_gate;   // (R) i32 / f32, R = sum(counts)
  std::vector<int64_t> counts;  // (E) host
};

// route_tokens + expert_permutation on logits' device. On the GPU the per-expert counts are copied back:
// the layer's one synchronization. bias (E) f32 on the same device, or null.
RoutedTokens route_tokens(const Tensor& logits, const Tensor* bias, const RouterSpec& spec);

// seq_stats where the routing lives, copied back to the host (a short second round trip on the GPU).
// tok_seq (N) i32 on the routing's device.
std::vector<float> seq_stats(const RoutedTokens& r, const Tensor& tok_seq, int64_t S, const RouterSpec& spec);

// The loss terms' gradients in compact form, per real token t of sequence s = tok_seq[t] >= 0:
//   balancing:  dP[t, e] = float(double(aux_w[s]) * aux_cnt[s * E + e])   (aux_w undefined: no term)
//   z-loss:     dz[t] = float(z_scale * lse[t])                            (z_scale 0: no term)
struct RouterLossGrad {
  Tensor tok_seq;         // (N) i32
  Tensor aux_w, aux_cnt;  // (S) f32, (S, E) f32
  double z_scale = 0;
};

// router_backward for a RoutedTokens: dlogits (N, E) f32 on logits' device from dgate (N * k) f32 there and
// the loss terms (null: none). No host round trip.
void router_backward(Tensor& dlogits, const RoutedTokens& r, const RouterSpec& spec, const Tensor& logits,
                     const Tensor& dgate, const RouterLossGrad* loss);

// Balancing probabilities P (N, E) from a routing (see above).
std::vector<float> balance_probs(const Routing& r, const RouterSpec& spec);

// dlogits (N, E) = d/dlogits of sum(dgate * gate) + sum(dP * P) + sum(dz * logsumexp(logits)).
// dgate (N * k) (dropped slots are ignored), dP (N, E) or null, dz (N) or null. Overwrites dlogits.
void router_backward(float* dlogits, const Routing& r, const RouterSpec& spec, const float* logits,
                     const float* dgate, const float* dP, const float* dz);

}  // namespace ndt
