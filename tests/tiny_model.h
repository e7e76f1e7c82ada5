#pragma once
// Shared fixtures for single-process model tests: a tiny model config and a fake TP rank.
#include <random>
#include <string>
#include <vector>

#include "data/packing.h"
#include "model/tp_hooks.h"
#include "model/transformer.h"
#include "train/config.h"

namespace ndt::testing {

// A tiny vision encoder (2 layers, 2 heads, 4x4 patches). projector_hidden differs from both widths it
// connects, so a transposed shape cannot pass. GPU tests ask for d_model 128 (head dim 64).
inline EncoderConfig tiny_encoder(const std::string& style, int64_t d_model = 16, int64_t image_size = 8,
                                  int64_t channels = 2, int64_t projector_hidden = 24) {
  EncoderConfig e;
  e.image_size = image_size;
  e.patch_size = 4;
  e.channels = channels;
  e.style = style;
  e.d_model = d_model;
  e.n_layers = 2;
  e.n_heads = 2;
  e.projector_hidden = projector_hidden;
  return e;
}

inline ModelConfig tiny_model(const std::string& style) {
  ModelConfig m;
  m.style = style;
  m.vocab_size = 32;
  m.d_model = 16;
  m.n_layers = 2;
  m.n_heads = 4;
  m.n_kv_heads = style == "llama" ? 2 : 0;
  m.d_ff = 24;
  m.max_seq_len = 16;
  m.init_std = 0.3;  // large enough that every path carries gradient well above fp32 noise
  return m;
}

// Three sequences of different lengths (7, 4, 9) with partial loss masks, packed (THD) under `layout`.
inline Microbatch three_sequences(std::mt19937& rng, int64_t vocab, const PackLayout& layout = {}) {
  std::uniform_int_distribution<int> tokd(0, static_cast<int>(vocab) - 1);
  std::vector<Sample> samples;
  for (int len : {7, 4, 9}) {
    Sample s;
    for (int i = 0; i < len; ++i) {
      s.tokens.push_back(tokd(rng));
      s.loss_mask.push_back(i > 1 && i % 3 != 0);
    }
    samples.push_back(s);
  }
  return pack_samples(samples, 0, layout);
}

// A TP rank without communication: only shapes and offsets matter (initialization, checkpoint slices).
class FakeTp : public TpHooks {
 public:
  FakeTp(int size, int rank) : size_(size), rank_(rank) {}
  int size() const override { return size_; }
  int rank() const override { return rank_; }

 private:
  int size_, rank_;
};

// Every parameter of a one-device model of cfg, full, random N(0, 0.3) (norm weights around 1): biases and
// norms included, so that nothing hides behind zeros and ones (checkpoint and interop tests).
inline std::vector<std::pair<std::string, Tensor>> random_full_params(const ModelConfig& cfg, uint32_t seed) {
  Transformer m(cfg, StageSpec{}, nullptr);
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 0.3f);
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& p : m.params().all()) {
    Tensor t = Tensor::empty(p->global_shape);
    for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = d(rng) + (p->init == InitKind::Ones ? 1.0f : 0.0f);
    out.emplace_back(p->name, t);
  }
  return out;
}

}  // namespace ndt::testing
