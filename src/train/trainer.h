#pragma once
// The training loop: global batch -> this DP rank's share -> microbatches with gradient accumulation;
// loss = sum of token losses / loss-bearing tokens of the WHOLE global batch, counted before the
// step (DESIGN.md §1.2); warmup + cosine LR; AdamW (optionally ZeRO-1); global-norm clipping.
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "data/dataset.h"
#include "data/packing.h"
#include "dist/communicator.h"
#include "model/transformer.h"
#include "parallel/dp/gathered_embedding_grad.h"
#include "parallel/pp/pipeline.h"
#include "train/companion.h"
#include "train/config.h"
#include "train/deferred_steps.h"
#include "train/fault.h"
#include "train/logprobs.h"
#include "train/moe_metrics.h"
#include "train/optimizer.h"
#include "train/step_graph.h"
#include "train/token_loss.h"

namespace ndt {

// The process groups a run uses (all may be one-rank communicators). Not owned.
struct RunComms {
  Communicator* world = nullptr;
  Communicator* dp = nullptr;    // data-parallel replicas: which samples a rank trains on
  Communicator* cp = nullptr;    // context-parallel group (each sequence split over it)
  Communicator* grad = nullptr;  // DP x CP: every rank holding the same parameters (gradient reduction,
                                 // ZeRO-1 shards, loss sums); null = dp
  Communicator* tp = nullptr;
  Communicator* pp = nullptr;   // pipeline stages (P2P, loss and grad-norm reductions)
  TpHooks* tp_hooks = nullptr;  // null: no tensor parallelism
  // Expert parallelism (folded onto DP x CP): the EP group, the expert-data-parallel group (ranks holding
  // the same experts: expert gradient reduction, expert ZeRO-1 shards), and the dispatch hooks.
  Communicator* ep = nullptr;
  Communicator* expert_dp = nullptr;  // null = grad
  EpHooks* ep_hooks = nullptr;        // null: every rank holds all experts
};

struct StepStats {
  int64_t step = 0;
  double loss = 0;       // mean over loss-bearing tokens of the global batch
  double grad_norm = 0;  // before clipping
  double lr = 0;
  int64_t tokens = 0;  // loss-bearing tokens in the global batch
  double seconds = 0;
  double peak_mem_gib = 0;  // train.device cuda: peak device memory of live tensors so far, max over ranks
  std::vector<double> peak_mem_gib_per_rank;  // the same per world rank (empty on the CPU)
  MoeStepReport moe;                          // MoE models: balancing losses and expert load
  // train.nonfinite skip: this step's loss or gradients were NaN/Inf and its update was not applied.
  bool skipped = false;
  int64_t skipped_steps = 0;  // skipped steps of this run so far (since the start or the resume)
};

struct EvalStats {
  double exact_match = -1;  // fraction of held-out problems solved (synthetic tasks with answers)
  double val_loss = -1;     // mean token loss on held-out data
  int64_t problems = 0;
};

class Trainer {
 public:
  Trainer(const Config& cfg, RunComms comms, const Tokenizer& tok, const Dataset& train, const Dataset* val);
  // One optimizer step; collective over all ranks. Returns once the step's loss and norm are known (steps
  // whose end is decided on the device, train.host_sync, are waited for).
  StepStats train_step(int64_t step);
  // One optimizer step on this DP rank's microbatches (full, not CP-sharded; see microbatches()) under a
  // token loss, which normalises itself (post-training). Collective over all ranks.
  StepStats train_step_on(int64_t step, const std::vector<Microbatch>& mbs, TokenLoss& loss);
  // This layout's microbatches of this DP rank's samples (micro_batch per microbatch, or packed). Samples
  // come in groups of `group` consecutive ones that always share a microbatch (DPO pairs). sample_ids index
  // `samples`. Under expert parallelism collective over DP: every DP rank gets the same number of
  // microbatches (packed or padded; pad-only ones where a rank has fewer samples than that number).
  std::vector<Microbatch> microbatches(const std::vector<Sample>& samples, int64_t group = 1) const;
  // The run's communicators (post-training builds its own collectives on them).
  const RunComms& comms() const { return c_; }
  const Config& config() const { return cfg_; }
  EvalStats evaluate();
  // Per-token logprobs and top-k logits of `samples` (original order, on every rank; collective).
  std::vector<SampleScores> score(const std::vector<Sample>& samples, int64_t k);
  // Full run with logging, metrics, loss curve and final weights (rank 0 writes files). on_step gets each
  // step once it is complete, in order (with train.host_sync = log, in batches at log steps); before_step
  // each step's index before it starts.
  void run(std::function<void(const StepStats&)> on_step = nullptr,
           std::function<void(int64_t)> before_step = nullptr);
  // Steps after which run() waits for the device and logs before the next step starts (with steps in flight,
  // train.host_sync = log; a kernel trace's window edges, say).
  void wait_after_steps(std::vector<int64_t> steps) { wait_after_ = std::move(steps); }

  ParamStore& params() { return engine_->params(); }
  PipelineEngine& engine() { return *engine_; }
  Optimizer& optimizer() { return *opt_; }
  // Saves a checkpoint after `steps_done` steps (collective). False when the save failed (the same on every
  // rank; reported by rank 0, the previous checkpoint left valid).
  bool save_checkpoint(int64_t steps_done);
  // Loads a checkpoint written by any layout; training continues at its step (collective).
  // Continue from a checkpoint (any layout); "auto": the newest valid one in the run's checkpoint root,
  // skipping incomplete or corrupt ones, or step 0 when there is none. Collective; errors agreed.
  void resume(const std::string& dir);
  int64_t start_step() const { return start_step_; }
  // Full (global) parameter tensors on EVERY rank (gathered over TP, EP and PP): refit's source.
  std::vector<std::pair<std::string, Tensor>> full_weights();
  // The same on the store's device, for a layout whose stages hold whole tensors (no TP or EP sharding,
  // no second module): each stage broadcasts its fp32 values over the pipeline group (NCCL on GPUs) with
  // no host copy. nullopt (on every rank: it depends on the layout only) for any other layout.
  std::optional<std::vector<std::pair<std::string, Tensor>>> full_weights_on_device();
  // Exchanges this rank's parameter values with `other` (its own slices, as a previous call left them);
  // an empty `other` receives a copy and the weights stay. Local (no collective). Post-training scores
  // with a frozen reference policy by swapping it in and out.
  void swap_weights(std::vector<Tensor>& other);
  // Starts from given full (global) tensors, e.g. imported from Hugging Face: each rank copies its slice.
  void load_weights(const std::vector<std::pair<std::string, Tensor>>& full);
  // Write a Chrome trace of steps 1..3 (forward/backward/send/recv per rank) to `path` at the end of run().
  void set_trace(const std::string& path) { trace_path_ = path; }
  const std::vector<StepStats>& history() const { return history_; }
  // CUDA graphs of the training steps (train.cuda_graphs); null where this run does not use them.
  const StepGraph* step_graph() const { return graph_.get(); }
  // Packed runs group a step's samples into a multiple of this many microbatches (pp under the
  // interleaved schedule, else 1); settable so that a reference run can group like a layout does.
  int64_t pack_count_multiple() const { return pack_count_multiple_; }
  void set_pack_count_multiple(int64_t m) { pack_count_multiple_ = m; }
  int64_t count_params() const;
  // A second module trained in the same steps (a multimodal model's encoder; train/companion.h). Not
  // owned; set before the first step.
  void set_companion(StepCompanion* c);
  StepCompanion* companion() { return companion_; }
  // Called in every step after the gradients of both modules are reduced and before clipping and the update
  // (ndtrain verify compares them there); collective calls inside are allowed (every rank calls it).
  void set_grads_hook(std::function<void(int64_t step)> hook) { grads_hook_ = std::move(hook); }
  // The reduced gradients of this rank's parameters as full (global) tensors, gathered over TP and EP
  // (stage-local under PP), plus a second module's. Only valid inside the grads hook. Collective.
  std::vector<std::pair<std::string, Tensor>> full_grads();

 private:
  Status try_resume(const std::string& dir);  // agreed over the world; OK: state loaded
  std::vector<Microbatch> local_microbatches(int64_t step) const;
  StepStats step_on(int64_t step, const std::vector<Microbatch>& mbs, TokenLoss* token_loss,
                    std::chrono::steady_clock::time_point t0);
  // train_step without the wait: a step decided on the device is left in flight (pending_).
  void launch_step(int64_t step);
  // Whether a step (with these conditions) is decided on the device (train.host_sync).
  bool defers(const TokenLoss* token_loss, bool tracing, bool profiling) const;
  // The reductions, decision and update of a deferred step (after its forward and backward).
  void finish_on_device(StepStats st);
  // Waits for the steps in flight and appends them, complete, to ready_ (collective over the world: their
  // peak memory). Returns the error a step ended the run with (train.nonfinite), the same on every rank;
  // the steps before it are in ready_.
  std::string collect_steps();
  // This rank's peak device memory into st (CUDA; its slot of peak_mem_gib_per_rank), and every rank's for
  // `steps` gathered in one sum over the world (collective where the steps hold slots).
  void note_peak_memory(StepStats& st) const;
  void gather_peak_memory(const std::vector<StepStats*>& steps);
  // Padding rules of this layout's packed microbatches (2·cp per sequence, tp·2·cp per stream under SP).
  PackLayout pack_layout_() const;
  // Rows per forward: train.micro_batch, or this rank's whole share of the batch when it is 0 (training
  // microbatches, scoring, validation).
  int64_t rows_per_microbatch() const {
    return cfg_.train.micro_batch > 0 ? cfg_.train.micro_batch : cfg_.train.global_batch / c_.dp->size();
  }
  // Tokens a microbatch holds at most: the packing budget (data.pack_tokens when set), else its rows of
  // seq_len.
  int64_t microbatch_token_budget() const {
    return cfg_.data.packing && cfg_.data.pack_tokens > 0 ? cfg_.data.pack_tokens
                                                          : rows_per_microbatch() * cfg_.data.seq_len;
  }
  // Whether DP replicas must make the same model calls (expert parallelism exchanges tokens between them).
  bool lockstep() const { return c_.ep_hooks != nullptr; }
  void report_pipeline(bool logger);
  // Prints a graph capture of this step (rank 0), or why it failed (once per reason).
  void report_graph(int64_t step);
  // parallel.dp_embedding_grad: makes embedding_grad_ when the table's gradient is to be gathered.
  void setup_embedding_grad();
  // parallel.dp_grad_window: zeroed NCCL memory for the flat grads, to be registered as a symmetric window of
  // the gradient group once the store is on the device; undefined where the window does not apply (or a rank
  // could not allocate it: then no rank uses it).
  Tensor grads_window_buffer();
  // parallel.dp_reduction = copy_engine with a gradient group of two or more; throws AgreedError (every rank
  // alike) where the layout excludes it.
  bool copy_engine_wanted() const;
  // Makes dp_reduction_ over the gradient group (collective); AgreedError where the ranks cannot map each
  // other's memory (other hosts, no peer access).
  void setup_copy_engine();
  // Whether training steps go through a StepGraph (train.cuda_graphs on a layout that allows them).
  bool step_graphs_apply() const;
  // The non-finite check of a step (docs/reliability.md), collective over the world: every rank gets the
  // same answer, empty when the loss and the reduced gradients are finite, else a message naming
  // the first parameter (registration order) with a non-finite gradient and the ranks that saw it.
  std::string check_nonfinite(double local_loss, double loss, double grad_norm,
                              std::optional<bool> local_grads_finite);
  // train.nonfinite for a step whose values were non-finite (`bad` says which): the error that ends the run
  // (stop, or too many skips in a row), else "" with the skip counted and reported (rank 0). Both the
  // per-step path and the steps read back from the device go through here.
  std::string skip_nonfinite(int64_t step, const std::string& bad);

  Config cfg_;
  RunComms c_;
  std::unique_ptr<Communicator> self_;
  const Tokenizer& tok_;
  const Dataset& train_;
  const Dataset* val_;
  std::unique_ptr<PipelineEngine> engine_;
  std::string trace_path_;
  int64_t start_step_ = 0;
  int64_t pack_count_multiple_ = 1;
  std::vector<pp::TraceEvent> trace_;
  double compute_s_ = 0, step_s_ = 0;  // summed over steps, for the measured pipeline bubble
  double theory_bubble_ = 0;
  std::unique_ptr<Optimizer> opt_;
  std::vector<StepStats> history_;
  std::vector<EvalStats> evals_;
  StepCompanion* companion_ = nullptr;
  std::function<void(int64_t)> grads_hook_;
  std::vector<Fault> faults_;         // debug.fault / NDT_FAULT (train/fault.h)
  std::unique_ptr<StepGraph> graph_;  // train.cuda_graphs on a layout that allows them (else null)
  std::vector<std::pair<int64_t, int64_t>> graph_early_ranges_;  // the captured step's early DP reductions
  std::unique_ptr<GatheredEmbeddingGrad> embedding_grad_;  // DP: the table's gradient gathered (else null)
  std::string graph_failure_told_;                         // the capture failure already printed
  int64_t skipped_steps_ = 0, consecutive_skips_ = 0;
  std::unique_ptr<DeferredSteps> deferred_;  // train.host_sync resolved to log (else null)
  std::vector<StepStats> pending_;           // steps in flight: all but the loss, norm, time and skip
  std::vector<StepStats> ready_;             // complete steps not yet taken (run(), train_step)
  std::vector<int64_t> wait_after_;          // run() waits after these steps too
  // The flat grads' NCCL registration: released first (members go in reverse order), while the
  // communicators (outside the trainer) and the store (engine_) still exist.
  std::shared_ptr<void> grads_registration_;
  // parallel.dp_reduction = copy engines (dist/copy_engine_reduction.h; type-erased: CUDA builds only),
  // shared with the optimizer's range reducer. It maps the peers' gradients: released with opt_ at the
  // latest, before the store (engine_).
  std::shared_ptr<void> dp_reduction_;
};

}  // namespace ndt
