#pragma once
// Per-token log-probabilities and top-k logits of a batch of samples under any layout, returned in the
// original sample order on every rank (what RL losses, reference-model KL and distillation need).
#include <cstdint>
#include <vector>

#include "data/packing.h"
#include "dist/communicator.h"
#include "parallel/pp/pipeline.h"

namespace ndt {

struct SampleScores {
  std::vector<float> logprob;     // (n - 1): log p(tokens[t + 1] | tokens[0..t]) for a sample of n tokens
  std::vector<float> topk_value;  // (n - 1, k): the k largest logits predicting token t + 1, descending
  std::vector<int32_t> topk_id;   // (n - 1, k): their token ids (ties to the smaller id)
};

// Samples are split over `dp` in contiguous blocks, packed `batch` at a time (padding per `layout`),
// scored through the engine (collective over its PP, TP and CP groups) and gathered over dp. Samples
// longer than layout.max_len + 1 tokens are scored on their first max_len + 1 tokens.
std::vector<SampleScores> score_samples(PipelineEngine& engine, const std::vector<Sample>& samples, int64_t k,
                                        const PackLayout& layout, int32_t pad_id, Communicator& dp,
                                        int64_t batch, bool lockstep = false);

}  // namespace ndt
