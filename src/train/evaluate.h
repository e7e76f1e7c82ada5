#pragma once
// Evaluation: greedy generation with exact-match scoring, and validation loss.
// Both are collective over the TP group (vocab-parallel argmax/softmax) and split problems over DP.
#include <functional>
#include <string>
#include <vector>

#include "data/dataset.h"
#include "data/packing.h"
#include "dist/communicator.h"
#include "model/transformer.h"

namespace ndt {

// How evaluation runs the model: greedy next tokens at given rows, and the loss sum of a microbatch.
// Collective over the model's TP (and PP) groups; argmax_fn/loss_fn adapt a single Transformer.
using ArgmaxFn = std::function<std::vector<int32_t>(const Microbatch&, const std::vector<int64_t>&)>;
using LossFn = std::function<double(const Microbatch&)>;
ArgmaxFn argmax_fn(Transformer& model);
LossFn loss_fn(Transformer& model);

// Greedy completion of each prompt until EOS or max_new_tokens; returns the generated ids (no EOS).
// Recomputes the full forward each token (prompts here are short; a KV cache comes with RL work).
std::vector<std::vector<int32_t>> greedy_generate(const ArgmaxFn& model,
                                                  const std::vector<std::vector<int32_t>>& prompts,
                                                  int64_t max_new_tokens, int32_t eos_id, int32_t pad_id,
                                                  const PackLayout& layout = {}, Communicator* lockstep = nullptr);

// Fraction of problems whose greedy completion decodes exactly to the answer. Problems are split over
// dp (contiguous blocks); the count is summed over dp.
//
// lockstep (here and in validation_loss, score_samples): every DP rank runs the same number of model
// calls (padding with calls on a pad-only microbatch, and agreeing when generation stops), because the
// model's calls are collective across DP replicas (expert parallelism).
double exact_match(const ArgmaxFn& model, const Tokenizer& tok, const std::vector<EvalProblem>& problems,
                   int64_t max_new_tokens, Communicator& dp, const PackLayout& layout = {},
                   bool lockstep = false);

// Mean token loss over samples [0, n) of a dataset (split over dp, summed exactly).
double validation_loss(const LossFn& model, const Dataset& data, int64_t n, int64_t seq_len, int32_t pad_id,
                       int64_t batch, Communicator& dp, const PackLayout& layout = {}, bool lockstep = false);

// The number of calls every rank makes when mine are needed here: the maximum over dp under lockstep.
int64_t lockstep_count(int64_t mine, Communicator& dp, bool lockstep);

}  // namespace ndt
