#pragma once
// Multimodal colocated training (docs/multimodal.md): the image encoder (model/vision_encoder.h) on its
// own tensor x data parallel layout over every rank, the LLM on its layout (the Trainer), joined by the
// bridge (parallel/bridge/bridge.h). MimoEncoder is the trainer's StepCompanion and the LLM's EmbedHooks:
//
//   phase 1  begin_step: the encoder's forward on this rank's encoder shard of the global batch (all of it
//            at once, whatever the LLM's microbatching), bridged into this rank's LLM shard: the rows the
//            LLM's first stage injects at the image placeholder tokens
//   phase 2  the LLM's schedule (any pipeline schedule) over its microbatches; take_grad collects the
//            gradient of the injected rows on whichever ranks hold them (first stage; CP/SP pieces)
//   phase 3  finish_backward: the bridge's backward (the sum over the LLM replica's partial holders, then
//            routing back to the encoder shards) and the encoder's backward on its whole shard
//   then     the encoder's gradients are reduced over ITS data-parallel group once, clipped by the norm
//            over both modules, and stepped (the trainer does the same for the LLM).
//
// The loss normaliser is the trainer's: the loss-bearing tokens of the whole global batch, which every rank
// counts from the same full microbatches, so the encoder's gradient carries the same 1/N on every rank.
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "data/dataset.h"
#include "data/tokenizer.h"
#include "dist/communicator.h"
#include "dist/grid.h"
#include "model/embed_hooks.h"
#include "model/vision_encoder.h"
#include "parallel/bridge/bridge.h"
#include "parallel/tp/comm_tp_hooks.h"
#include "train/companion.h"
#include "train/config.h"
#include "train/optimizer.h"

namespace ndt {

class MimoEncoder final : public StepCompanion, private EmbedHooks {
 public:
  // world: every rank (the encoder's grid is built over it; collective). llm_dp: this rank's LLM
  // data-parallel group; llm_replica: the LLM ranks whose injected-row gradients are partial sums
  // (Layout::bridge_group(); null = one). Not owned; they and the dataset must outlive this object.
  MimoEncoder(const Config& cfg, Communicator& world, Communicator& llm_dp, Communicator* llm_replica,
              const Tokenizer& tok, const Dataset& train);

  EmbedHooks* embed_hooks() override { return this; }
  void begin_step(int64_t step) override;
  void finish_backward() override;
  double reduce_grads() override;
  void clip_and_step(double total_norm, double clip, double lr) override;
  void prepare_scoring(const std::vector<Sample>& samples) override;
  std::optional<std::pair<double, int64_t>> exact_match(const ArgmaxFn& llm) override;
  void load_weights(const std::vector<std::pair<std::string, Tensor>>& full) override;
  std::vector<std::pair<std::string, Tensor>> full_weights() override;
  int64_t count_params() const override;
  std::vector<std::pair<std::string, Tensor>> full_grads() override;
  std::string report(double mean_step_seconds) const override;
  void save_checkpoint(const std::string& root, int64_t step) override;
  Status load_checkpoint(const std::string& root, int64_t step) override;

  ParamStore& params() { return store_; }
  std::string describe() const;  // "encoder tp=1 dp=4 -> LLM dp=2 (fan-in)"
  // Test hooks that re-create the classic bugs, so that directed tests can show verify catching them
  // (env NDT_MIMO_TEST_FAULT in `ndtrain verify`): "skip_bridge_sum" drops the bridge's sum over the LLM
  // replica's partial gradients; "early_reduce" reduces the encoder's gradients over DP in phase 1, before
  // they exist, and not after phase 3. Empty: none. Errors on anything else.
  void set_test_fault(const std::string& fault);

 private:
  void inject(const Microbatch& mb, int64_t tok0, Tensor& x) override;
  void take_grad(const Microbatch& mb, int64_t tok0, Tensor& dx) override;
  // The rows of x (tok0-relative) that are image placeholders, and the table rows they take.
  void placeholder_rows(const Microbatch& mb, int64_t tok0, int64_t Tl, std::vector<int64_t>& x_rows,
                        std::vector<int64_t>& table_rows) const;
  // Encodes `images` (this rank's encoder shard) and bridges them into the table of this rank's LLM shard,
  // whose samples have their first placeholder at first_pos.
  void fill_table(const Bridge& bridge, const Tensor& images, EncoderActs& acts,
                  std::vector<int64_t> first_pos);
  // The same for a list of n items (image and tokens) outside training, padded to m.batch by repetition
  // (item j % n) and moved by map m: held-out problems, samples to score.
  void encode_items(BridgeMap m, int64_t n, const std::function<const Sample&(int64_t)>& item);
  int64_t index_at(int64_t step, int64_t j) const;
  std::vector<float> render(int64_t step) const;  // this rank's encoder shard of step `step`, (Be, ch, H, W)
                                                  // // dataset index of global batch position j
  int64_t first_placeholder(const std::vector<int32_t>& tokens) const;

  Config cfg_;
  Communicator& world_;
  Communicator& llm_dp_;
  Communicator* llm_replica_;
  const Tokenizer& tok_;
  const Dataset& train_;
  int32_t image_token_;
  int64_t patches_;
  std::unique_ptr<Grid> grid_;  // the encoder's layout: tp x dp over the world
  Communicator* tp_ = nullptr;  // encoder groups (NCCL views on GPUs)
  Communicator* dp_ = nullptr;
  std::vector<std::unique_ptr<Communicator>> device_comms_;
  std::unique_ptr<CommTpHooks> tp_hooks_;
  ParamStore store_;
  std::unique_ptr<VisionEncoder> enc_;
  std::unique_ptr<Optimizer> opt_;
  BridgeMap map_;  // batch = the global batch
  std::unique_ptr<Bridge> bridge_;
  EncoderActs acts_;
  Tensor table_, dtable_;  // (samples of this LLM shard * patches, C): injected rows and their gradient
  std::vector<int64_t> first_pos_;
  bool skip_replica_sum_ = false, early_reduce_ = false;
  // Time per phase piece, summed over steps after the first (NDT_MIMO_TIMING=1 on a GPU synchronizes at
  // each boundary so that the pieces are exact; on the CPU they always are).
  struct Times {
    double data = 0, enc_fwd = 0, bridge_fwd = 0, bridge_bwd = 0, enc_bwd = 0;
    int64_t steps = -1;
  } times_;
  bool sync_timing_ = false;
  std::future<std::vector<float>> prefetch_;  // the next step's images (GPU runs), rendered during this step
  int64_t prefetch_step_ = -1;
  double now() const;
};

class Layout;
class Trainer;
// The encoder of the trainer's config attached to it as its companion, or null for a text-only model.
// layout: the LLM's layout (its bridge group); null = one process. world must be the layout's world (a
// one-rank communicator without a layout). Collective.
std::unique_ptr<MimoEncoder> attach_encoder(Trainer& trainer, Communicator& world, Layout* layout,
                                            const Tokenizer& tok, const Dataset& train);

}  // namespace ndt
