#pragma once
// Preference pairs for DPO (docs/data.md, "Post-training data"): generated from an embedded task's
// training prompts (chosen = the correct answer, rejected = a wrong one), or read from JSONL.
#include <cstdint>
#include <memory>
#include <vector>

#include "core/status.h"
#include "data/dataset.h"
#include "data/tokenizer.h"
#include "train/config.h"

namespace ndt {

struct PreferencePair {
  std::vector<int32_t> prompt;    // [BOS] + prompt tokens
  std::vector<int32_t> chosen;    // response tokens, EOS-terminated
  std::vector<int32_t> rejected;  // response tokens, EOS-terminated
};

class PreferenceData {
 public:
  virtual ~PreferenceData() = default;
  virtual int64_t size() const = 0;  // -1 = unbounded
  virtual PreferencePair get(int64_t index) const = 0;
};

// posttrain.task "addition" / "sort": pairs from the task's training prompts; the rejected answer changes
// one character of the correct one (a digit off by 1..9, chosen by (seed, index)). "jsonl":
// posttrain.data_path lines {"prompt", "chosen", "rejected"} (prompt through sft_prompt_tokens, responses
// tokenized + EOS); errors name file and line (invalid JSON, missing or non-string fields, chosen ==
// rejected, empty file).
Result<std::unique_ptr<PreferenceData>> make_preference_data(const Config& cfg, const Tokenizer& tok);

// prompt + response as a sample whose loss mask is 1 exactly on the response tokens.
Sample prompt_response_sample(const std::vector<int32_t>& prompt, const std::vector<int32_t>& response);

}  // namespace ndt
