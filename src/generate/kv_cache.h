#pragma once
// A contiguous KV cache for the generation engine (model/kv_hooks.h): per layer, K and V of shape
// (slots * max_len, KVl, D) on the model's device in its compute dtype; slot b owns rows
// [b * max_len, (b + 1) * max_len), row p holding the token at position p.
//
// A forward (prefill: whole prompts; decode: one token per active sequence) names the slot of each of
// its sequences, in increasing slot order; its rows are appended to their slots at their positions and
// its queries attend to the cache through the general attention op (visible iff pos_k <= pos_q), with
// key segment i = [slot_i * max_len, slot_{i+1} * max_len). Rows not written yet and the rows of slots
// not in this forward carry a position beyond any query, so they are masked without compacting the
// cache: the segment's positions stay sorted (0..len-1, then the sentinel), on the CPU a masked key costs
// one comparison, and the CUDA flash kernel stops at the last visible key (binary search on pos_k), so the
// masked tail is never loaded. Compaction would instead copy every cached row once per step and layer.
#include <cstdint>
#include <vector>

#include "model/kv_hooks.h"

namespace ndt {

class KvCache final : public KvHooks {
 public:
  KvCache(int64_t layers, int64_t slots, int64_t max_len, int64_t kv_heads, int64_t head_dim, DType dt,
          Device dev);
  // Before each forward: sequence s of mb goes to slot slots[s] (strictly increasing); its rows are the
  // slot's next tokens (positions length(slot), length(slot) + 1, ...). Checks that, then advances the
  // slot lengths and prepares the attention metadata of this forward. A decode forward (one row per
  // sequence) keeps its metadata at the same device addresses every time.
  void begin(const Microbatch& mb, const std::vector<int64_t>& slots);
  // Decode steps prepared on the device: advance() (inside a decode forward's work, after sampling) moves
  // this forward's inputs and cache metadata one row further (ops::decode_advance: tokens = sampled,
  // positions + 1); begin_ahead() then stands for begin() of the next decode forward of the same slots,
  // checking and advancing the slot lengths on the host without uploading anything.
  void advance(Tensor& tokens, Tensor& positions, const Tensor& sampled);
  void begin_ahead(const std::vector<int64_t>& slots);
  void attention_forward(int64_t layer, const Microbatch& mb, const Tensor& q, const Tensor& k,
                         const Tensor& v, Tensor& out, Tensor& lse, float scale) override;
  bool store_target(int64_t layer, Tensor& K, Tensor& V, Tensor& rows) override;
  int64_t length(int64_t slot) const { return len_.at(static_cast<size_t>(slot)); }
  int64_t max_len() const { return max_len_; }

 private:
  int64_t slots_, max_len_;
  Device dev_;
  std::vector<Tensor> k_, v_;
  std::vector<int64_t> len_;
  // This forward's attention metadata on the cache's device.
  bool decode_ = false;                                 // this forward has one new row per sequence
  Tensor dst_rows_, cu_q_, cu_k_, pos_q_, pos_k_;       // dst_rows_: the cache row of each microbatch row
  Tensor dec_rows_, dec_cu_k_, dec_pos_q_, dec_pos_k_;  // decode forwards' metadata (fixed addresses)
  std::vector<int64_t> slots_now_;                      // the slots of this forward
};

}  // namespace ndt
