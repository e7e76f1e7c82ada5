// The post-training loop's pieces on one process: the session's evaluation and a GRPO step.
#include <gtest/gtest.h>

#include "data/make_dataset.h"
#include "dist/communicator.h"
#include "posttrain/grpo.h"
#include "posttrain/grpo_loss.h"
#include "posttrain/run.h"
#include "train/trainer.h"

namespace ndt {
namespace {

Config grpo_config(const std::vector<std::string>& extra = {}) {
  std::vector<std::string> sets = {"model.style=llama",
                                   "model.vocab_size=264",
                                   "model.d_model=32",
                                   "model.n_layers=2",
                                   "model.n_heads=4",
                                   "model.n_kv_heads=2",
                                   "model.max_seq_len=32",
                                   "data.seq_len=16",
                                   "train.global_batch=8",
                                   "train.steps=2",
                                   "train.warmup_steps=0",
                                   "train.lr=0.01",
                                   "posttrain.algo=grpo",
                                   "posttrain.task=addition",
                                   "posttrain.prompts_per_step=2",
                                   "posttrain.samples_per_prompt=4",
                                   "posttrain.max_new_tokens=6"};
  sets.insert(sets.end(), extra.begin(), extra.end());
  return parse_config_string("{}", sets).value();
}

TEST(PosttrainSession, EvaluateWithoutEvalSamplesIsAnEmptyObject) {
  // posttrain.eval_samples: 0 turns held-out evaluation off; the loop still merges the (empty) result into
  // its eval record, which threw "cannot use update() with null" when evaluate() returned a null JSON.
  const Config cfg = grpo_config({"posttrain.eval_samples=0"});
  auto tok = make_tokenizer("byte").value();
  auto data = make_dataset(cfg.data, *tok, false).value();
  Trainer trainer(cfg, RunComms{}, *tok, *data, nullptr);
  auto self = make_self_communicator();
  PosttrainSession session(trainer, *tok, *self);
  const nlohmann::ordered_json j = session.evaluate();
  EXPECT_TRUE(j.is_object());
  EXPECT_TRUE(j.empty());
  nlohmann::ordered_json record = {{"type", "eval"}, {"step", 0}};
  EXPECT_NO_THROW(record.update(j));
}

TEST(GrpoStep, MovesThePolicyTowardTheRewardedCompletion) {
  // One optimizer step of the GRPO loss on two completions of one prompt, advantages +1 and -1: the
  // rewarded completion's logprob rises, the other's falls (the sign of the seed, the loss mask on the
  // completion rows, and the row <-> token alignment of the old logprobs all matter here).
  const Config cfg = grpo_config({"train.lr=0.003"});
  auto tok = make_tokenizer("byte").value();
  auto data = make_dataset(cfg.data, *tok, false).value();
  Trainer trainer(cfg, RunComms{}, *tok, *data, nullptr);
  std::vector<Sample> samples;
  for (const std::string completion : {"975", "123"}) {
    Sample s;
    s.tokens.push_back(tok->bos_id());
    for (int32_t t : tok->encode("12+34=")) s.tokens.push_back(t);
    const size_t plen = s.tokens.size();
    for (int32_t t : tok->encode(completion)) s.tokens.push_back(t);
    s.tokens.push_back(tok->eos_id());
    s.loss_mask.assign(s.tokens.size(), 0);
    std::fill(s.loss_mask.begin() + static_cast<std::ptrdiff_t>(plen), s.loss_mask.end(), 1);
    samples.push_back(s);
  }
  auto completion_lp = [&](const std::vector<SampleScores>& sc, size_t k) {
    double sum = 0;
    for (size_t j = 1; j < samples[k].tokens.size(); ++j)
      if (samples[k].loss_mask[j]) sum += sc[k].logprob[j - 1];
    return sum;
  };
  const std::vector<SampleScores> before = trainer.score(samples, 1);
  std::vector<GrpoSample> gs(2);
  int64_t tokens = 0;
  for (size_t k = 0; k < 2; ++k) {
    gs[k].advantage = k == 0 ? 1.0 : -1.0;
    gs[k].old_lp.assign(samples[k].tokens.size(), 0.0f);
    gs[k].gen_lp.assign(samples[k].tokens.size(), 0.0f);
    for (size_t j = 1; j < samples[k].tokens.size(); ++j) gs[k].old_lp[j] = before[k].logprob[j - 1];
    gs[k].gen_lp = gs[k].old_lp;
    gs[k].loss_tokens = 4;
    tokens += 4;
  }
  GrpoLossOptions lo;
  lo.global_tokens = static_cast<double>(tokens);
  lo.global_samples = 2;
  GrpoLoss loss(gs, lo);
  const StepStats st = trainer.train_step_on(0, trainer.microbatches(samples), loss);
  EXPECT_GT(st.grad_norm, 0.0);
  EXPECT_NEAR(loss.sums().ratio / loss.sums().tokens, 1.0, 1e-6);  // on-policy: ratio 1 on every row
  const std::vector<SampleScores> after = trainer.score(samples, 1);
  EXPECT_GT(completion_lp(after, 0), completion_lp(before, 0) + 1e-3);
  EXPECT_LT(completion_lp(after, 1), completion_lp(before, 1) - 1e-3);
}

}  // namespace
}  // namespace ndt
