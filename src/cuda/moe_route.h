#pragma once
// The MoE router on the device: the twins of model/moe_router.h's host reference (route_tokens,
// expert_permutation, router_backward), so that routing needs no host round trip beyond the per-expert
// counts. All asynchronous on `stream`; doubles where the host reference uses them; no atomics.
#include <cuda_runtime.h>

#include <cstdint>

namespace ndt::cuda {

// One thread per token: score (N, E), choice / gate (N * k), lse (N), pnorm (N) from logits (N, E); bias (E)
// or null.
void moe_route(float* score, int32_t* choice, float* gate, float* lse, float* pnorm, const float* logits,
               const float* bias, int64_t N, int64_t E, int64_t k, bool sigmoid, bool renormalize,
               cudaStream_t stream);

// Statistics of real tokens (tok_seq >= 0) per (sequence, expert), stats (2 S E + 2) f32: slot counts (S, E),
// balancing-probability sums (S, E), dropped slots, sum of lse^2. One block per (s, e) and one for the rest.
void moe_seq_stats(float* stats, const int32_t* tok_seq, const int32_t* choice, const int32_t* slot_pos,
                   const float* score, const float* pnorm, const float* lse, int64_t N, int64_t S, int64_t E,
                   int64_t k, cudaStream_t stream);

// Slots sorted by (expert, token, slot), each expert keeping its first `cap` slots (cap < 0: all):
// slot_pos (N * k; -1 when dropped), kept_gate (N * k; 0 when dropped), row_token / row_gate (the first
// sum(counts) of N * k entries), counts (E) kept slots per expert. One block per expert.
void moe_permutation(int32_t* slot_pos, float* kept_gate, int32_t* row_token, float* row_gate,
                     int32_t* counts, const int32_t* choice, const float* gate, int64_t N, int64_t k,
                     int64_t E, int64_t cap, cudaStream_t stream);

// dlogits (N, E) from the gate gradients dgate (N * k; ignored where slot_pos < 0), the balancing loss
// dP[t, e] = float(double(aux_w[s]) * aux_cnt[s * E + e]) for s = tok_seq[t] >= 0 (aux_w null: no term) and
// the z-loss dz[t] = float(z_scale * lse[t]) for real tokens. score / choice / gate / lse / logits as
// moe_route left them.
void moe_router_backward(float* dlogits, const float* score, const int32_t* choice, const float* gate,
                         const int32_t* slot_pos, const float* logits, const float* lse, const float* dgate,
                         const int32_t* tok_seq, const float* aux_w, const float* aux_cnt, double z_scale,
                         int64_t N, int64_t E, int64_t k, bool sigmoid, bool renormalize,
                         cudaStream_t stream);

}  // namespace ndt::cuda
