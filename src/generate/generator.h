#pragma once
// The generation engine: batched autoregressive decoding with a KV cache, colocated with training in
// the same processes but under its own layout (generation TP over gen_tp consecutive world ranks,
// world / gen_tp data-parallel replicas; no PP, CP or EP). Weights arrive by refit (load_full) from any
// training layout, cast to the generation precision.
//
// Randomness is counter-based: the uniform that samples generated token i of a request is a pure
// function of (seed, step, prompt_key, sample_key, i), so every layout draws the same rollouts.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "dist/communicator.h"
#include "model/params.h"
#include "train/config.h"

namespace ndt {

struct SamplingParams {
  double temperature = 1.0;  // 0 = greedy (argmax, ties to the smaller id)
  int64_t top_k = 0;         // 0 = whole vocabulary
  double top_p = 1.0;        // nucleus: smallest set of most likely tokens with mass >= top_p
  int64_t max_new_tokens = 32;
  std::vector<int32_t> stop_ids;  // generation of a request ends after emitting one of these
  uint64_t seed = 0;
};

struct GenRequest {
  std::vector<int32_t> prompt;
  uint64_t prompt_key = 0;  // global prompt index (RNG key)
  uint64_t sample_key = 0;  // sample index within the prompt's group (RNG key)
};

struct GenOutput {
  std::vector<int32_t> tokens;  // generated ids, the stop token included when one ended the request
  // log p(token) of each generated token under the generator's model at temperature 1 (the raw policy
  // distribution, not the temperature/top-k/top-p-modified sampling distribution).
  std::vector<float> logprobs;
  bool stopped = false;  // ended by a stop token (false: max_new_tokens or the context limit)
};

struct GenLayout {
  int64_t tp = 1;  // generation TP degree (divides the world size)
};

class Generator {
 public:
  // Collective over `world`. cfg.model is the model; cfg.train.device/precision choose where and in which
  // precision the generation weights live. Errors (clear message) when gen_tp does not divide the world
  // or the model's heads/vocabulary.
  Generator(const Config& cfg, Communicator& world, GenLayout layout);
  ~Generator();

  // Refit: full (global) tensors by parameter name, the same on every rank; each rank keeps its TP
  // slice of every parameter, cast to the generation precision. Collective-free.
  void load_full(const std::vector<std::pair<std::string, Tensor>>& full);

  // Refit straight from a training store on this rank (device to device on a GPU, then the cast), when it
  // holds, on the generator's device, every parameter whole (a DP/CP-only training layout, ZeRO-1
  // included: this rank takes its gen_tp block of each) or the very TP shard this rank generates with
  // (training tp = gen_tp over the same ranks, no PP/EP). Collective over the world (every rank takes the
  // same path); returns false, copying nothing, when that does not hold on some rank: use
  // load_full(full_weights) then.
  bool refit_from(ParamStore& train);
  // Refit from full (global) tensors already on the generator's device (Trainer::full_weights_on_device):
  // each rank takes its gen_tp block of each on the device. Collective like refit_from; false, copying
  // nothing, when a tensor is missing or on another device on some rank.
  bool refit_from_full(const std::vector<std::pair<std::string, Tensor>>& full);

  // Generates every request (the same list on every rank); replicas split the list into contiguous
  // blocks; the outputs of all requests are returned on every rank, in request order. Collective over
  // `world`. Prompts longer than model.max_seq_len - 1 are an error naming the request.
  std::vector<GenOutput> generate(const std::vector<GenRequest>& reqs, const SamplingParams& sampling,
                                  int64_t step);

  const GenLayout& layout() const { return layout_; }

 private:
  struct Impl;
  struct RefitSource {  // a training tensor: the values this rank holds and which slice of the global
    const Tensor* value = nullptr;
    Shape global_shape;
    int shard_dim = -1;
    int64_t shard_offset = 0;
  };
  bool refit_copy(const std::function<RefitSource(const std::string&)>& find, bool same_device);
  std::unique_ptr<Impl> impl_;
  GenLayout layout_;
};

}  // namespace ndt
