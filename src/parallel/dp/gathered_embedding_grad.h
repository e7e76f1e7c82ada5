#pragma once
// The token-embedding table's gradient under data parallelism from gathered rows instead of an all-reduce.
//
// A microbatch's table gradient is a scatter-add of the first stage's input gradient rows dx (T, C) at the
// token ids. Every replica gathers the others' rows and ids (T·C + T elements each) and runs the same
// scatter-add over all of them, so every replica adds the group's sum without reducing the (V, C) table.
// The 1B Llama (untied, 32000 x 2048) on 2 ranks gathers 2 x 8192 bf16 rows of 2048 per microbatch (67 MB)
// where the table's all-reduce moves 262 MB in fp32.
//
// When every replica runs the same number of microbatches, backward() starts one gather per microbatch (on
// NCCL the compute stream does not wait) and finish() waits for them and adds every microbatch's rows in
// microbatch order. When the counts differ (packed data, post-training blocks), per-microbatch gathers would
// not line up with the other replicas' collectives, so backward() only keeps the rows and finish() gathers
// all of them at once.
//
// The caller's contract (PipelineEngine): every microbatch's table gradient goes through here; an untied
// table then needs no reduction at all; a table tied to the output head still has the head's part reduced,
// through the same communicator before the last microbatch's gather, so that on NCCL that reduction has
// finished when finish() (ordered after the last gather on the communicator's stream) adds the rows, and
// over MPI everything is blocking. Every replica
// adds the same rows in the same order (replica by replica, tokens in order, summed per id in sorted order
// on the GPU), so the replicas hold the same bits.
#include <cstdint>
#include <memory>
#include <vector>

#include "dist/communicator.h"
#include "model/embedding_grad_hook.h"

namespace ndt {

class GatheredEmbeddingGrad final : public EmbeddingGradHook {
 public:
  // dp: the group the table's gradient is reduced over (DP x CP); not owned.
  explicit GatheredEmbeddingGrad(Communicator& dp) : dp_(dp) {}
  ~GatheredEmbeddingGrad() override;
  // The next step's plan, the same on every replica: per_microbatch (every replica runs the same number of
  // microbatches) or one gather in finish(); `rows` each replica sends per gather, at least the largest
  // local microbatch (per microbatch) or the largest local sum of the step's microbatches (one gather);
  // shorter ones are padded with ids that add nothing.
  void set_step(int64_t rows, bool per_microbatch) {
    capacity_ = rows;
    per_microbatch_ = per_microbatch;
  }
  // Per microbatch: collective over dp (once per microbatch, in the same order as the other collectives on
  // every replica); else local. dtable, dx and ids are kept until finish().
  void backward(Tensor& dtable, const Tensor& dx, const Tensor& ids, int64_t vocab_start) override;
  // Collective over dp when not per microbatch (every replica calls it once, after its last backward).
  void finish() override;

 private:
  struct Pending {
    Tensor dtable, send_rows, send_ids, rows, ids;  // the sends stay alive until the gather is waited for
    int64_t vocab_start = 0;
    std::unique_ptr<CommHandle> rows_done, ids_done;
  };
  struct Kept {  // a microbatch's rows waiting for the step's one gather
    Tensor dtable, dx, ids;
    int64_t vocab_start = 0;
  };
  // Starts the gather of `rows` (T <= capacity_, C) with their ids (pieces of T in all, host or device)
  // padded to capacity_ (on the device, without a host round trip, when they are there).
  void start_gather(Tensor& dtable, const Tensor& rows, const std::vector<Tensor>& ids, int64_t vocab_start);
  Communicator& dp_;
  int64_t capacity_ = 0;
  bool per_microbatch_ = true;
  std::vector<Pending> pending_;
  std::vector<Kept> kept_;
};

// Whether gathering m microbatches of `rows` tokens per replica over a group of n moves at most half the
// bytes of the table's reduction. Received per replica: gathered (n - 1)·m·rows·(C·dx_bytes + 4); an
// all-reduce moves 2(n - 1)/n·V·C·4, ZeRO-1's reduction to the owners (n - 1)/n·V·C·4.
bool gather_beats_reduction(int64_t n, int64_t m, int64_t rows, int64_t vocab_local, int64_t channels,
                            int64_t dx_bytes, bool zero1);

}  // namespace ndt
