// Fuzz target: the JSONL readers of post-training and SFT data, all on the same file (byte tokenizer):
//   - SftDataset::load (data/sft.h), with each chat template;
//   - make_preference_data, posttrain.task jsonl (DPO pairs, posttrain/preferences.h);
//   - make_reward_task, posttrain.task jsonl (GRPO prompts and answers, posttrain/tasks.h), with each reward
//     rule, and the rewards of a few completions;
//   - tokenize_text_files on it as a .jsonl of {"text": ...} documents (data/shards.h), shards read back.
#include "data/sft.h"
#include "data/shards.h"
#include "data/tokenizer.h"
#include "fuzz_common.h"
#include "posttrain/preferences.h"
#include "posttrain/tasks.h"

using namespace ndt;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::unique_ptr<Tokenizer> tok = make_byte_tokenizer();
  const std::string in = fuzz::write_file("in.jsonl", fuzz::as_text(data, size));
  const char* templates[] = {"simple", "chatml", "llama3"};
  for (const char* name : templates)
    fuzz::guarded([&] {
      auto d = SftDataset::load(in, *tok, 16, ChatTemplate::named(name).value());
      if (!d) return;
      for (int64_t i = 0; i < d.value()->size(); ++i) {
        const Sample s = d.value()->get(i);
        if (s.tokens.size() != s.loss_mask.size() || s.tokens.size() > 17)
          fuzz::property_failed("SFT sample", "tokens and loss mask disagree or exceed seq_len + 1");
      }
    });
  for (int k = 0; k < 3; ++k) {
    Config cfg;
    cfg.data.chat_template = templates[k];
    cfg.posttrain.task = "jsonl";
    cfg.posttrain.data_path = in;
    cfg.posttrain.reward = k == 0 ? "exact_match" : k == 1 ? "contains" : "numeric";
    fuzz::guarded([&] {
      auto p = make_preference_data(cfg, *tok);
      if (!p) return;
      for (int64_t i = 0; i < p.value()->size(); ++i) {
        const PreferencePair pair = p.value()->get(i);
        if (pair.chosen.empty() || pair.rejected.empty()) fuzz::property_failed("DPO pair", "empty response");
      }
    });
    fuzz::guarded([&] {
      auto t = make_reward_task(cfg, *tok);
      if (!t) return;
      const RewardTask& task = *t.value();
      std::vector<RlPrompt> prompts = task.eval_prompts(4);
      for (int64_t i = 0; i < 4; ++i) prompts.push_back(task.prompt(i));
      for (const RlPrompt& p : prompts)
        for (const std::string& c : {p.answer, std::string(" 42 "), std::string("<|im_end|>")}) {
          const double r = task.reward(p, c);
          if (r != 0.0 && r != 1.0) fuzz::property_failed("reward", "not 0 or 1");
        }
      if (task.max_answer_tokens() < 1) fuzz::property_failed("budget", "max_answer_tokens < 1");
    });
  }
  fuzz::guarded([&] {
    const std::string prefix = fuzz::path("tok/shard");
    int64_t total = 0;
    if (!tokenize_text_files({in}, *tok, prefix, 64, &total)) return;
    int64_t read = 0;
    for (int i = 0; read < total; ++i) {
      auto s = read_token_shard(fmt::format("{}_{:06d}.bin", prefix, i));
      if (!s) fuzz::property_failed("tokenized shard does not read", s.status().message());
      read += static_cast<int64_t>(s.value().size());
    }
    if (read != total) fuzz::property_failed("tokenized shards", "token count differs");
  });
  return 0;
}
