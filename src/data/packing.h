#pragma once
// Sequence packing (THD layout): samples laid end to end in one token stream with cu_seqlens, and the
// policy that groups a step's samples into microbatches under a token budget (docs/data.md).
#include <cstdint>
#include <vector>

#include "data/dataset.h"

namespace ndt {

// Padding rules of a packed microbatch.
struct PackLayout {
  int64_t seq_multiple = 1;  // every sequence padded to a multiple of this (2·cp under context parallelism)
  int64_t stream_multiple = 1;  // total tokens padded to a multiple of this by a trailing pad-only
                                // sequence (cp·tp·2 with sequence parallelism; a multiple of seq_multiple)
  int64_t max_len = -1;         // samples cut to max_len + 1 tokens (max_len inputs); -1 = no cut
};

// The padding rules a layout needs: 2·cp per sequence; the stream also a multiple of tp·2·cp under
// sequence parallelism (every CP rank then holds a token count divisible by tp).
PackLayout pack_layout(int64_t cp, int64_t tp, bool sequence_parallel, int64_t max_len = -1);

// Inputs (tokens) a sample occupies once packed: min(len - 1, max_len) rounded up to seq_multiple.
int64_t packed_length(const Sample& s, const PackLayout& layout);

// Lays samples end to end as one THD microbatch: a sample of n tokens gives n-1 inputs and targets with
// its own loss mask and positions 0.., padded with pad_id (mask 0) to the layout's multiples. Padding
// never bears loss and never counts in num_loss_tokens; attention never crosses a sequence boundary.
Microbatch pack_samples(const std::vector<Sample>& samples, int32_t pad_id, const PackLayout& layout = {});

// The packing policy. Given each sample's packed length, returns microbatches as lists of sample
// indices (ascending), ordered by their first index. The count m is the smallest multiple of
// `count_multiple` (the pipeline schedule's need, e.g. p for interleaved) such that assigning samples
// longest first, each to the currently lightest microbatch (LPT), keeps every microbatch within
// `budget` tokens; ties go to the lower index, so the result is a pure function of the lengths.
// LPT also balances the token counts, which is what pipeline stages and DP ranks wait on.
// m is at least min_count (replicas that must run the same number of microbatches agree on it: expert
// parallelism exchanges tokens between DP ranks in every MoE layer).
// Errors (clear message) when a sample alone exceeds the budget or no m <= samples works.
std::vector<std::vector<int64_t>> pack_into_microbatches(const std::vector<int64_t>& lengths, int64_t budget,
                                                         int64_t count_multiple = 1, int64_t min_count = 1);

}  // namespace ndt
