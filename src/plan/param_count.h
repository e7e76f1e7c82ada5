#pragma once
// Per-rank parameter counts and the persistent device memory they imply (weights, gradients, the bf16
// compute copy, AdamW state with or without ZeRO-1), computed from the config alone: no tensor is
// allocated. The rules mirror what the engine registers and allocates (model/transformer.cpp,
// model/moe.cpp, model/params.cpp ParamStore::flatten, train/optimizer.cpp), and tests/test_plan.cpp checks
// them against a real ParamStore and Optimizer.
#include <cstdint>

#include "train/config.h"

namespace ndt::plan {

// Elements one rank registers: the dense region (everything but routed experts) and the expert region.
struct ParamCounts {
  int64_t dense = 0;
  int64_t expert = 0;
};

// The parameters a Transformer chunk of layers [first_layer, last_layer) registers on one TP / EP rank.
ParamCounts chunk_params(const ModelConfig& m, int64_t tp, int64_t ep, int64_t first_layer,
                         int64_t last_layer, bool has_embedding, bool has_head);

// All chunks of pipeline rank `pp_rank` (virtual stages s = c * pp + pp_rank), for the config's layout.
ParamCounts rank_params(const Config& cfg, int64_t pp_rank);

// The flat buffers and optimizer state of one rank, in elements.
struct FlatSizes {
  int64_t dense_len = 0;   // dense region padded to a multiple of dp * cp (ParamStore::flatten)
  int64_t expert_len = 0;  // expert region padded to a multiple of the expert-data-parallel size
  int64_t total() const { return dense_len + expert_len; }
  int64_t state = 0;         // AdamW moments per moment (m and v each): the owned part of each region
  int64_t shard_dense = 0;   // ZeRO-1: reduced-gradient shard of the dense region (0 without ZeRO-1)
  int64_t shard_expert = 0;  // ZeRO-1: the same for the expert region
};
FlatSizes flat_sizes(const Config& cfg, const ParamCounts& p);

// Device bytes of one allocation of `bytes`, as the engine requests it from the pool (Tensor::empty rounds
// CUDA allocations up to 256-byte granules, at least one).
int64_t device_bytes(int64_t bytes);

// Persistent device memory of one rank (train.device cuda), each term as allocated.
struct PersistentBytes {
  int64_t weights = 0;    // fp32 master values (one flat buffer)
  int64_t grads = 0;      // fp32 flat gradient buffer
  int64_t compute = 0;    // bf16 copy of the values the kernels read (0 in fp32)
  int64_t optimizer = 0;  // AdamW m and v (+ ZeRO-1 gradient shards)
  int64_t total() const { return weights + grads + compute + optimizer; }
};
// zero1_buffers: ZeRO-1 keeps a reduced-gradient shard per sharded region (the CPU engine, and GPUs with
// train.device_comm=mpi); GPUs over NCCL reduce into the flat gradients in place and keep none.
PersistentBytes persistent_bytes(const FlatSizes& f, bool bf16, bool zero1_buffers);

}  // namespace ndt::plan
