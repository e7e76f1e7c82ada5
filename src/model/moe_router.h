#pragma once
// The MoE router on the host, in fp32: scores, top-k selection, gate weights, optional capacity dropping,
// and the exact backward from gate / balancing-probability / z-loss gradients to the router logits.
//
// For a token with router logits l (E):
//   softmax router:  p = softmax(l); experts = top-k of p; raw gate = p[e]
//   sigmoid router:  s = sigmoid(l); experts = top-k of s + bias (bias only selects); raw gate = s[e]
//   gates = raw / sum(raw over the k chosen) when renormalize, else raw
// Ties go to the smaller expert id. Balancing probabilities P (the load-balancing loss's P_e): p for
// softmax, s / sum_e s for sigmoid. z = logsumexp(l) (router z-loss).
#include <cstdint>
#include <vector>

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

// Balancing probabilities P (N, E) from a routing (see above).
std::vector<float> balance_probs(const Routing& r, const RouterSpec& spec);

// dlogits (N, E) = d/dlogits of sum(dgate * gate) + sum(dP * P) + sum(dz * logsumexp(logits)).
// dgate (N * k) (dropped slots are ignored), dP (N, E) or null, dz (N) or null. Overwrites dlogits.
void router_backward(float* dlogits, const Routing& r, const RouterSpec& spec, const float* logits,
                     const float* dgate, const float* dP, const float* dz);

}  // namespace ndt
