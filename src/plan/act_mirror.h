#pragma once
// The device allocations of one microbatch through one pipeline chunk, forward then backward, replayed
// in the order the engine makes them (model/transformer.cpp, model/moe.cpp, parallel/tp, parallel/cp,
// parallel/ep, ops/ops.cpp and the CUDA ops' scratch): what the forward keeps for the backward (the
// per-microbatch activations), and the transient peaks of both passes. Shapes assume every microbatch
// holds its full token budget and, for MoE, perfectly balanced routing (docs/planner.md).
#include <cstdint>
#include <string>

#include "train/config.h"

namespace ndt::plan {

// Sizes of one microbatch's tensors on one rank (bytes per element in b).
struct ActDims {
  int64_t T = 0;   // attention rows: tokens of the microbatch on this CP rank
  int64_t Tl = 0;  // residual-stream rows: T / tp under sequence parallelism, else T
  int64_t C = 0, D = 0, Hl = 0, KVl = 0, Fl = 0, Vl = 0;  // local heads, KV heads, MLP width, vocab
  int64_t Fs = 0;                                         // MoE shared experts' local width
  int64_t Fe = 0, E = 0, El = 0, k = 0;                   // MoE: expert width, experts, local experts, top-k
  int64_t R = 0;   // MoE: routed rows kept on this rank (N * k, fewer under a capacity factor)
  int64_t Re = 0;  // MoE: rows this rank's experts receive (R under balanced routing)
  bool moe_aux = false, moe_z = false;  // MoE: the step's loss terms (training forwards only)
  int64_t seqs = 1;                     // MoE: sequences per microbatch (the aux loss's count table)
  int64_t cp = 1, ep = 1, b = 2;        // b: bytes of an activation element (bf16 2, fp32 4)
  bool gpt2 = false, qk_norm = false, sp = false, ring = true, moe = false;
  int64_t granule = 256;  // allocation rounding (Tensor::empty on CUDA); 1 counts exact tensor bytes
  // Training on one TP rank: the loss is taken in the backward (Activations::loss_in_backward), so the
  // forward keeps no softmax statistics.
  bool loss_in_backward = false;
};
// cfg holds the layout; T = tokens of one microbatch on one CP rank.
ActDims act_dims(const Config& cfg, int64_t T);

struct ChunkSpec {
  int64_t first_layer = 0, last_layer = 0;
  bool has_embedding = false, has_head = false;
};

struct ChunkProfile {
  int64_t input = 0;     // the received stage input (0 on the first stage)
  int64_t dy = 0;        // the received gradient of the stage output (0 on the last stage)
  int64_t dx_out = 0;    // the gradient of the stage input, kept until it is sent (0 on the first stage)
  int64_t retained = 0;  // live bytes the forward adds and keeps until the backward (output included)
  int64_t fwd_peak = 0;  // peak above the live bytes at the forward's start
  int64_t bwd_peak = 0;  // peak above the live bytes at the backward's start (dy received)
  // Live-byte change over the backward and the engine's cleanup after it: -(retained + input + dy) + dx_out.
  int64_t bwd_delta = 0;
  std::string fwd_peak_at, bwd_peak_at;
};

// One chunk's forward and backward for one microbatch; cfg holds the layout (recompute included).
ChunkProfile chunk_profile(const Config& cfg, const ActDims& d, const ChunkSpec& chunk);

}  // namespace ndt::plan
