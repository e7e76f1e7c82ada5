// Multimodal config validation: the encoder's layout against the LLM's, before any work starts.
#include <gtest/gtest.h>

#include "train/config.h"

namespace ndt {
namespace {

Status parse(const std::vector<std::string>& sets) {
  std::vector<std::string> all = {"encoder.image_size=8", "encoder.patch_size=4", "data.task=image_caption",
                                  "data.seq_len=8", "model.max_seq_len=16"};
  all.insert(all.end(), sets.begin(), sets.end());
  return parse_config_string("{}", all).status();
}

void expect_error(const std::vector<std::string>& sets, const std::string& needle) {
  const Status st = parse(sets);
  ASSERT_FALSE(st) << "accepted: " << needle;
  EXPECT_NE(st.message().find(needle), std::string::npos) << st.message();
}

TEST(MimoConfig, AcceptsColocatedLayouts) {
  EXPECT_TRUE(parse({}));
  EXPECT_TRUE(parse({"parallel.dp=2", "parallel.tp=2", "encoder.parallel.tp=1"}));  // enc dp4 -> LLM dp2
  EXPECT_TRUE(parse({"parallel.dp=4", "encoder.parallel.tp=2"}));                   // enc dp2 -> LLM dp4
  EXPECT_TRUE(parse({"parallel.pp=2", "parallel.cp=2", "encoder.parallel.dp=4"}));
}

TEST(MimoConfig, RejectsBadEncoderLayouts) {
  expect_error({"encoder.parallel.pp=2"}, "the encoder runs without context or pipeline parallelism");
  expect_error({"encoder.parallel.cp=2"}, "the encoder runs without context or pipeline parallelism");
  // 6 ranks: LLM tp3 x dp2, encoder tp2 x dp3: 3 and 2 do not divide one another.
  expect_error({"parallel.tp=3", "parallel.dp=2", "model.n_heads=6", "model.n_kv_heads=3", "model.d_model=48",
                "model.vocab_size=264", "train.global_batch=6", "encoder.parallel.tp=2"},
               "encoder.parallel.dp (3) and parallel.dp (2) must divide one another");
  expect_error({"parallel.dp=2", "encoder.parallel.tp=1", "encoder.parallel.dp=4"}, "covers 4 rank(s)");
  expect_error({"parallel.dp=4", "encoder.parallel.tp=3"}, "encoder.parallel.tp (3) must divide");
  expect_error({"parallel.dp=2", "parallel.tp=2", "train.global_batch=6"},
               "train.global_batch (6) must be divisible by encoder.parallel.dp (4)");
}

TEST(MimoConfig, RejectsBadShapes) {
  expect_error({"encoder.image_size=10"},
               "encoder.image_size (10) must be divisible by encoder.patch_size (4)");
  expect_error({"data.caption_digits=4"}, "captions longer than the context");
  expect_error({"encoder.image_size=0"}, "data.task image_caption needs an image encoder");
  expect_error({"encoder.d_model=30"}, "encoder.d_model (30) must be divisible by encoder.n_heads (4)");
}

}  // namespace
}  // namespace ndt
