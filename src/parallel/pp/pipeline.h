#pragma once
// Pipeline engine: the model chunks this rank holds (virtual stage s = chunk * p + rank of L/(p*v)
// layers each) and an executor that runs a schedule's actions (pp/schedule.h) over the pipeline
// communicator. With p = 1 the schedule is plain gradient accumulation, so every layout uses this path.
//
// Microbatch metadata (token counts, cu_seqlens, positions) is never sent: every rank builds the same
// microbatches from the same global sample indices, so each stage and TP rank knows every shape, and
// the only P2P traffic is activations (tag 1) and gradients (tag 2), in schedule order.
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "dist/communicator.h"
#include "model/transformer.h"
#include "parallel/cp/cp_attention.h"
#include "parallel/pp/schedule.h"
#include "train/config.h"
#include "train/token_loss.h"

namespace ndt {
namespace cuda {
class IntervalClock;
}  // namespace cuda

// First layer of each of the p*v stages plus the end (size p*v + 1), from parallel.stage_layers or an
// even split. Error names the key when the list does not fit the model.
Result<std::vector<int64_t>> stage_boundaries(const ParallelConfig& par, int64_t n_layers);

class PipelineEngine {
 public:
  // Collective over pp (builds the tied-embedding group). tp and cp may be null (one rank). With
  // cp > 1 every method takes FULL microbatches (each sequence a multiple of 2·cp long) and runs this CP
  // rank's shard of them (parallel/cp/cp_shard.h).
  PipelineEngine(const Config& cfg, Communicator& pp, TpHooks* tp, Communicator* cp = nullptr,
                 EpHooks* ep = nullptr);

  ParamStore& params() { return store_; }
  Transformer& chunk(int c) { return *chunks_.at(static_cast<size_t>(c)); }
  int num_chunks() const { return static_cast<int>(chunks_.size()); }
  // Called during train() with [begin, end) of the flat gradient buffer as soon as a layer's gradients are
  // final (after its last microbatch's backward), so DP reduction can start while backward continues; the
  // head's parameters (output matrix, final norm) once their last microbatch's head backward is done, before
  // the layers' backward. reduced = true: the range needs no reduction (the gathered untied table below).
  void set_grads_ready_hook(std::function<void(int64_t, int64_t, bool reduced)> hook) {
    grads_ready_ = std::move(hook);
  }
  // The token-embedding table's gradient of every microbatch through `hook` (not owned; null = local), a hook
  // that adds the rows of the whole group the grads-ready hook reduces over (parallel/dp/
  // gathered_embedding_grad.h); its finish() runs after the embedding chunk's last backward. A tied table's
  // range (the head's part) is reported for reduction after the last head backward, before the last gather;
  // an untied table's is reported as reduced. Needs the grads-ready hook set first, gradients zero when
  // train() starts (the trainer zeroes them every step), and no table tied across pipeline stages (its two
  // copies are summed after the DP reduction).
  void set_embedding_grad_hook(EmbeddingGradHook* hook);
  // Multimodal: the embedding stage's external input rows (not owned; null = none).
  void set_embed_hooks(EmbedHooks* h) {
    for (auto& c : chunks_) c->set_embed_hooks(c->stage().has_embedding ? h : nullptr);
  }
  void set_recompute(bool on) {
    for (auto& c : chunks_) c->set_recompute(on);
  }

  // Forward and backward of all microbatches by the schedule; gradients accumulate into params().
  // Returns this rank's part of the loss sum that token_loss gave (last stage only; 0 elsewhere); the
  // cross-entropy part is summed where the model runs, without waiting for it: take_loss() reads it.
  // Appends per-action timings to `trace` when given (start relative to `t0_us`).
  // token_loss (optional) replaces the cross-entropy: it seeds each microbatch's backward and gives the
  // loss contribution (train/token_loss.h); loss_scale is then unused.
  double train(const std::vector<Microbatch>& mbs, float loss_scale,
               std::vector<pp::TraceEvent>* trace = nullptr, double t0_us = 0,
               TokenLoss* token_loss = nullptr);
  // After train(): this rank's cross-entropy loss sum of that step (0 on stages without the head, or with a
  // token_loss); waits for the device. Read late (after the gradient norm), it costs no extra wait. Read
  // once per train().
  double take_loss();
  // The same sum where it lies (an F64 scalar on the store's device; undefined before the first train()).
  const Tensor& loss_sum_tensor() const { return loss_acc_; }
  // After train(): sums the tied embedding's gradient between the first and last stage.
  void sync_tied_grads();

  // Inference through all stages (forward only, stage order, blocking chain). Results are returned on
  // every pipeline rank.
  double loss_sum(const Microbatch& mb);
  std::vector<int32_t> argmax(const Microbatch& mb, const std::vector<int64_t>& rows);
  // Per-token scores of a forward pass, for every row of the full microbatch, on every rank of the
  // pipeline and CP groups: logprob[t] = log p(targets[t]) and the k largest logits of row t (values
  // descending, ties to the smaller id), gathered over the vocabulary shards of TP.
  struct Scores {
    std::vector<float> logprob;     // (T)
    std::vector<float> topk_value;  // (T, k)
    std::vector<int32_t> topk_id;   // (T, k)
  };
  Scores scores(const Microbatch& mb, int64_t k);

  // MoE: the MoE layers of this rank's chunks (global layer index -> layer), and the step's loss
  // normalisers (real sequences and tokens of the global batch). Between begin_moe_step and
  // end_moe_step, training forwards count routing statistics (MoeLayer::stats, cleared by begin).
  std::vector<std::pair<int64_t, MoeLayer*>> moe_layers();
  void begin_moe_step(double seqs, double tokens);
  void end_moe_step() { moe_ctx_.record = false; }

  // Compute seconds of the last train() call and the seconds it spanned, for the measured bubble. On a
  // GPU with p > 1 both are GPU times from events (the host only enqueues work); otherwise compute is
  // host time and the span is 0 (the caller's wall time stands).
  double last_compute_seconds() const { return compute_s_; }
  double last_span_seconds() const { return span_s_; }
  double theoretical_bubble(int m) const;

 private:
  int stage_of(int chunk) const { return chunk * p_ + rank_; }
  bool is_last(int chunk) const { return stage_of(chunk) == p_ * v_ - 1; }
  int64_t local_tokens(const Microbatch& mb) const;
  // Collective over the pipeline group: opens the links to both ring neighbours at once (once).
  void connect_peers();
  // A (rows, d_model) buffer for stage activations, on the store's device in its compute dtype.
  Tensor act_buffer(int64_t rows) const;
  // [begin, end) of layer l's parameters in the flat buffers ({0, 0} when they are not contiguous).
  std::pair<int64_t, int64_t> layer_range(int64_t l);
  // Reports [begin, end) of the named parameters this rank holds to grads_ready_, adjacent ones merged.
  void report_ready(std::initializer_list<const char*> names, bool reduced);
  // This CP rank's shard of a full microbatch (the microbatch itself without CP).
  Microbatch shard(const Microbatch& full) const;
  // Runs the stages in order with blocking send/recv; returns the last chunk's activations on the
  // last stage's rank (others: empty).
  bool forward_only(const Microbatch& mb, Activations& last_acts, int* last_chunk);

  Config cfg_;
  Communicator& pp_;
  TpHooks* tp_;
  Communicator* cp_;
  std::unique_ptr<CpAttention> cp_attention_;
  int p_, v_, rank_;
  ParamStore store_;
  std::vector<std::unique_ptr<Transformer>> chunks_;
  std::unique_ptr<Communicator> tied_;
  std::function<void(int64_t, int64_t, bool)> grads_ready_;
  EmbeddingGradHook* embedding_grad_ = nullptr;
  std::map<int64_t, std::pair<int64_t, int64_t>>
      layer_ranges_;  // pp ranks 0 and p-1, when embeddings are tied and p > 1
  bool peers_connected_ = false;
  double compute_s_ = 0, span_s_ = 0;
  Tensor loss_acc_;  // F64 (1) where the model runs: train()'s cross-entropy sum, read by take_loss()
  std::shared_ptr<cuda::IntervalClock> gpu_clock_;  // GPU event timing (CUDA builds, p > 1)
  MoeStepContext moe_ctx_;
};

}  // namespace ndt
