// The encoder + LLM pair in one process: the gradient the encoder receives through the bridge and the
// LLM's injected rows is the derivative of the training loss (central differences on whole training
// losses), and the LLM's output depends on the image.
#include <gtest/gtest.h>

#include <cmath>

#include "data/make_dataset.h"
#include "data/tokenizer.h"
#include "mimo/mimo.h"
#include "train/trainer.h"

namespace ndt {
namespace {

Config tiny_mimo() {
  auto cfg =
      load_config(std::string(NDT_SOURCE_DIR) + "/configs/tiny-mimo.yaml",
                  {"train.grad_clip=0", "train.weight_decay=0", "train.steps=1", "train.warmup_steps=0"});
  EXPECT_TRUE(cfg) << cfg.status().message();
  return cfg.value();
}

struct Pair {
  Config cfg = tiny_mimo();
  std::unique_ptr<Tokenizer> tok = make_tokenizer("byte").value();
  std::unique_ptr<Dataset> data = make_dataset(cfg.data, *tok, false, cfg.encoder).value();
  std::unique_ptr<Communicator> self = make_self_communicator();
  Trainer trainer{cfg, RunComms{}, *tok, *data, nullptr};
  std::unique_ptr<MimoEncoder> enc = attach_encoder(trainer, *self, nullptr, *tok, *data);
};

// Loss of step 0 with encoder element `i` of `name` shifted by delta (the step's loss is computed before
// its update).
double loss_with(const std::string& name, int64_t i, float delta) {
  Pair p;
  p.enc->params().get(name).value.f32()[i] += delta;
  return p.trainer.train_step(0).loss;
}

TEST(Mimo, EncoderGradientIsTheLossDerivative) {
  Pair p;
  p.trainer.train_step(0);
  // Gradient check tolerance as in tests/gradcheck.h: |num - ana| <= 1e-3 * scale + 1e-2 |num|, where the
  // loss is a mean over tokens (gradients ~1e-3), so the absolute part is scaled to the largest gradient.
  const char* names[] = {"encoder.patch_embed.weight", "encoder.layers.0.attn.wv.weight",
                         "encoder.layers.1.mlp.fc.weight", "projector.fc1.weight", "projector.fc2.bias"};
  int checked = 0;
  for (const char* name : names) {
    const Param& w = p.enc->params().get(name);
    double gmax = 0;
    for (int64_t i = 0; i < w.numel(); ++i)
      gmax = std::max(gmax, std::abs(static_cast<double>(w.grad.f32()[i])));
    ASSERT_GT(gmax, 0) << name << " has no gradient";
    for (int64_t i : {int64_t{0}, w.numel() / 3, w.numel() - 1}) {
      const float eps = 1e-2f;
      const double num = (loss_with(name, i, eps) - loss_with(name, i, -eps)) / (2.0 * eps);
      const double ana = w.grad.f32()[i];
      EXPECT_LE(std::abs(num - ana), 1e-2 * gmax + 1e-2 * std::abs(num)) << name << "[" << i << "]";
      ++checked;
    }
  }
  EXPECT_EQ(checked, 15);
}

}  // namespace
}  // namespace ndt
