#pragma once
// A second module trained in the same optimizer steps as the language model: the image encoder of a
// multimodal model (mimo/). The trainer calls it at fixed points of every step and otherwise knows
// nothing about it (docs/multimodal.md):
//
//   begin_step       phase 1: the module's forward on this rank's share of the step, its outputs handed to
//                    the LLM through embed_hooks() (the LLM's first stage injects them)
//   (the LLM's pipeline: forward and backward of every microbatch; the hooks collect input gradients)
//   finish_backward  phase 3: the module's backward
//   reduce_grads     the module's data-parallel gradient reduction, once, after phase 3; its norm
//   clip_and_step    clipped by the norm over BOTH modules, then its optimizer step
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "model/embed_hooks.h"
#include "train/evaluate.h"

namespace ndt {

class StepCompanion {
 public:
  virtual ~StepCompanion() = default;
  // Where the LLM's first stage takes the module's outputs from.
  virtual EmbedHooks* embed_hooks() = 0;
  // Phase 1 of training step `step` (the trainer's global batch of that step). Collective.
  virtual void begin_step(int64_t step) = 0;
  // Phase 3, after the LLM's backward of every microbatch of the step. Collective.
  virtual void finish_backward() = 0;
  // Reduces the module's gradients over its own replicas; returns its global gradient norm (every rank).
  virtual double reduce_grads() = 0;
  // Clips by `total_norm` (over both modules) like the LLM's optimizer, then updates.
  virtual void clip_and_step(double total_norm, double clip, double lr) = 0;
  // Before the LLM scores `samples` (Trainer::score; microbatches then carry indices into `samples` as
  // sample ids): the module's outputs for all of them. Collective.
  virtual void prepare_scoring(const std::vector<Sample>& samples) = 0;
  // Exact match of greedy generations on the module's held-out problems (collective), or nullopt.
  virtual std::optional<std::pair<double, int64_t>> exact_match(const ArgmaxFn& llm) = 0;
  // Starts from given full tensors (a run's model.safetensors): the module's own names; when none of them
  // is present (an LLM-only checkpoint) the module keeps its initialization. Local.
  virtual void load_weights(const std::vector<std::pair<std::string, Tensor>>& full) = 0;
  // The module's full (global) parameter tensors on every rank, and their element count.
  virtual std::vector<std::pair<std::string, Tensor>> full_weights() = 0;
  virtual int64_t count_params() const = 0;
  // After reduce_grads: the module's reduced gradients as full tensors on every rank. Collective.
  virtual std::vector<std::pair<std::string, Tensor>> full_grads() = 0;
  // A line on where the module's time went, given the trainer's mean step time (logged at the end).
  virtual std::string report(double mean_step_seconds) const = 0;
  // Checkpoints: the module's weights and optimizer state after `step` steps, as a checkpoint of its own
  // under `root` (collective), and back (local; the caller agrees on the status).
  virtual void save_checkpoint(const std::string& root, int64_t step) = 0;
  virtual Status load_checkpoint(const std::string& root, int64_t step) = 0;
};

}  // namespace ndt
