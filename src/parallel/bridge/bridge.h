#pragma once
// The bridge between a multimodal model's encoder layout and its LLM layout (docs/multimodal.md).
//
// Both layouts cover every rank of the world (colocated). Sample j of a global batch of B samples is
// encoded by the encoder DP rank j / (B / enc_dp) (all enc_tp ranks of that DP rank hold the same,
// replicated output) and consumed by the LLM DP rank j / (B / llm_dp) (every tp/cp/pp rank of that
// replica needs it). enc_dp == llm_dp with matching coordinates: every rank keeps its rows (no
// communication); enc_dp > llm_dp (fan-in): an LLM rank gathers enc_dp / llm_dp encoder shards;
// enc_dp < llm_dp (fan-out): an LLM rank takes its slice of one encoder shard.
//
// Routing is a pure function of the two layouts, the same on every rank, for ANY axis order: for each
// (destination rank, sample) it names one source rank, itself when it holds the sample, else a fixed
// replica (spread over the replicas by destination rank). The exchange is one all-to-all over the world
// in which each rank sends only what its peers need.
//
// Backward is the exact adjoint. The LLM's gradient of an injected row is a partial sum over the ranks
// of its replica that hold pieces of the sequence: CP ranks hold different chunks, only the first
// pipeline stage has a gradient at all (zeros elsewhere), and under sequence parallelism each TP rank
// holds its own rows (without SP the TP ranks hold identical, complete gradients and are NOT summed).
// The gradient is therefore first summed over that group (the "intra-CP sum"), after which every rank of
// the replica holds the complete gradient, then routed back to every encoder rank of the sample (the
// encoder's TP ranks all need it, its output being replicated).
#include <cstdint>
#include <utility>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "dist/communicator.h"

namespace ndt {

// Per world rank, its coordinates in the two layouts.
struct BridgeMap {
  int64_t batch = 0;  // samples in the batch being moved (the global batch, or a padded eval set)
  int64_t enc_dp = 1, enc_tp = 1, llm_dp = 1;
  std::vector<int64_t> enc_dp_of, enc_tp_of, llm_dp_of;  // indexed by world rank
  int world() const { return static_cast<int>(enc_dp_of.size()); }
  // Samples [first, first + count) of rank r's encoder shard / LLM shard.
  std::pair<int64_t, int64_t> enc_block(int r) const;
  std::pair<int64_t, int64_t> llm_block(int r) const;
  // Divisibility and coverage (every encoder (dp, tp) and LLM dp coordinate present), with messages.
  Status validate() const;
};

// For one rank and one direction: per peer (world rank), the samples it sends there / receives from there
// (ascending global indices).
struct BridgeRoute {
  std::vector<std::vector<int64_t>> send, recv;
};

// Forward: encoder shards -> LLM shards. Backward: LLM shards (complete after the intra-replica sum) ->
// encoder shards.
BridgeRoute route_forward(const BridgeMap& m, int rank);
BridgeRoute route_backward(const BridgeMap& m, int rank);
// Whether no rank sends anything to another rank in that direction (then no collective is needed).
bool route_is_local(const BridgeMap& m, bool forward);

class Bridge {
 public:
  // world: the communicator the map's ranks index; replica: the ranks of one LLM replica whose gradients
  // of a row are partial sums (cp x pp, and tp under sequence parallelism), null = none. Not owned.
  Bridge(BridgeMap map, Communicator& world, Communicator* replica);
  const BridgeMap& map() const { return map_; }
  // enc (Be * rows, C): this rank's encoder shard, `rows` rows per sample -> (Bl * rows, C), this rank's
  // LLM shard. Same device and dtype; collective over the world unless the forward route is local.
  Tensor forward(const Tensor& enc, int64_t rows) const;
  // dllm (Bl * rows, C): this rank's partial gradient of its LLM shard (summed over `replica` in place)
  // -> (Be * rows, C), the complete gradient of this rank's encoder shard.
  Tensor backward(Tensor& dllm, int64_t rows) const;
  // The same without the replica sum (tests show that dropping it breaks parity).
  Tensor backward_unreduced(const Tensor& dllm, int64_t rows) const;

 private:
  Tensor exchange(const BridgeRoute& r, const Tensor& src, int64_t src_first, int64_t dst_first,
                  int64_t dst_count, int64_t rows, bool local) const;
  BridgeMap map_;
  Communicator& world_;
  Communicator* replica_;
  BridgeRoute fwd_, bwd_;
  bool fwd_local_, bwd_local_;
};

}  // namespace ndt
