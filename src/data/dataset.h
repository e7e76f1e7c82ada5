#pragma once
// Datasets hand out samples by global index; the order in which a run visits them is a pure function
// of (data seed, step, position in the global batch), never of the rank (DESIGN.md §1).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "data/tokenizer.h"

namespace ndt {

// One training example. loss_mask[i] = 1 when predicting tokens[i] from tokens[0..i) bears loss
// (so loss_mask[0] is always 0). Both vectors have the same length.
struct Sample {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> loss_mask;
  // Multimodal samples: the image, (channels, H, W) row-major f32; its placeholder tokens in `tokens`
  // take the encoder's projected patches (docs/multimodal.md). Empty for text-only samples.
  std::vector<float> image;
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  // Number of distinct samples; -1 for an unbounded generator (synthetic tasks).
  virtual int64_t size() const = 0;
  virtual Sample get(int64_t index) const = 0;
  // The same sample without its image (tokens and loss mask): what the language model's microbatches
  // need. Multimodal datasets skip rendering; others return get(). Pure, so safe from several threads.
  virtual Sample get_tokens(int64_t index) const { return get(index); }
};

// Samples of a synthetic task for evaluation: the prompt (fed to generation) and the expected answer.
struct EvalProblem {
  std::vector<int32_t> prompt;  // tokens up to and including the answer delimiter
  std::string answer;           // the exact text the model must generate (before EOS)
};

// A microbatch in THD layout: samples laid end to end, one sequence each. Inputs are tokens[0..n-1)
// of each sample and targets tokens[1..n); without packing every sample is padded to seq_len with
// pad tokens whose loss mask is 0 (padding at the end of a causal sequence changes nothing before it).
struct Microbatch {
  Tensor tokens;      // (T) i32 input ids
  Tensor targets;     // (T) i32 next-token targets (pad id where masked)
  Tensor loss_mask;   // (T) f32 1 = loss-bearing
  Tensor positions;   // (T) i32 position of each token inside its sequence
  Tensor cu_seqlens;  // (nseq + 1) i32
  int64_t nseq = 0;
  int64_t max_seqlen = 0;
  int64_t num_loss_tokens = 0;  // sum of loss_mask
  // Optional, one f32 element where the model runs: the loss gradient's scale, read on the device instead
  // of the engine's argument (a step replayed from a CUDA graph reads the value of its own step).
  Tensor loss_scale;
  // Per sequence, its real (non-padding) inputs: positions [0, seq_real[s]) of sequence s are sample
  // tokens, the rest padding (0 for a pad-only sequence). Layout-independent statistics (MoE load
  // balancing) count real tokens and sequences only, since padding depends on the layout.
  std::vector<int32_t> seq_real;
  // Per sequence, the index of its sample in the list the microbatch was built from (-1: a pad-only
  // sequence). Post-training losses find each row's per-sample side inputs through it; callers that
  // build from a slice of a larger list may rewrite them to global indices.
  std::vector<int64_t> sample_ids;
  int64_t num_real_tokens() const;
  int64_t num_real_seqs() const;
  int64_t num_tokens() const { return tokens.defined() ? tokens.numel() : 0; }
};

// Builds one microbatch from samples: each sample truncated to seq_len + 1 tokens, turned into
// (seq_len inputs, seq_len targets), padded with pad_id up to seq_len (not packed).
Microbatch make_microbatch(const std::vector<Sample>& samples, int64_t seq_len, int32_t pad_id);

// Index of the j-th sample of step `step` in a global batch of `global_batch`: for unbounded datasets
// step * global_batch + j; for finite ones an epoch-wise Philox-keyed permutation of [0, size).
// shuffle = false: (step * global_batch + j) mod dataset_size (file order).
int64_t sample_index(int64_t data_seed, int64_t step, int64_t j, int64_t global_batch, int64_t dataset_size,
                     bool shuffle = true);

}  // namespace ndt
