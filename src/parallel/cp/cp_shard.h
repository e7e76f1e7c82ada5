#pragma once
// Load-balanced context-parallel split of a microbatch: every sequence (each packed sequence
// separately) has a length that is a multiple of 2·cp and is cut into 2·cp equal chunks; CP rank r holds
// chunks r and 2·cp−1−r, so every rank gets the same share of causal-attention work.
#include <cstdint>
#include <vector>

#include "data/dataset.h"

namespace ndt {

// Rank r's microbatch: its rows of tokens/targets/loss mask, GLOBAL positions (index in the full
// sequence), cu_seqlens over its rows (each sequence now 2 chunks long), max_seqlen of the full
// sequences, and its own loss-token count. Checks the 2·cp divisibility with a clear message.
Microbatch cp_shard(const Microbatch& full, int64_t cp, int64_t r);

// For each row of cp_shard(full, cp, r), its row in `full` (to put per-token results back in order).
std::vector<int64_t> cp_rows(const Microbatch& full, int64_t cp, int64_t r);

// The same rows computed from the sharded microbatch alone (local cu_seqlens), for CP rank `owner`:
// the global position of each of the owner's rows. Every CP rank can compute it for every other.
std::vector<int32_t> cp_positions(const Tensor& local_cu_seqlens, int64_t cp, int64_t owner);

}  // namespace ndt
