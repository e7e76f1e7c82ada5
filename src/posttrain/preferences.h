#pragma once
// Preference pairs for DPO (docs/data.md, "Post-training data and rewards"): generated from an embedded
// task's training prompts (chosen = the correct answer, rejected = a plausible wrong one), or read from
// JSONL.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "data/dataset.h"
#include "data/synthetic.h"
#include "data/tokenizer.h"
#include "train/config.h"

namespace ndt {

struct PreferencePair {
  std::vector<int32_t> prompt;    // [BOS] + prompt tokens
  std::vector<int32_t> chosen;    // response tokens (+ the template's end marker), EOS-terminated
  std::vector<int32_t> rejected;  // response tokens (+ the template's end marker), EOS-terminated
};

class PreferenceData {
 public:
  virtual ~PreferenceData() = default;
  virtual int64_t size() const = 0;  // -1 = unbounded
  virtual PreferencePair get(int64_t index) const = 0;
};

// posttrain.task "addition" / "sort": pair i is built on training prompt i of make_reward_task's task
// (same prompt tokens); chosen = its answer, rejected = wrong_*_answer keyed by (data.seed, i).
// "jsonl": posttrain.data_path lines {"prompt", "chosen", "rejected"} or {"messages", "chosen", "rejected"}
// (the prompt through chat_prompt_of with data.chat_template, responses through ChatTemplate::response:
// content [+ end marker] + EOS); errors name file and line (invalid JSON, missing or non-string fields,
// bad messages, chosen == rejected, empty file).
Result<std::unique_ptr<PreferenceData>> make_preference_data(const Config& cfg, const Tokenizer& tok);

// Sample (tokens + loss mask) of prompt + response: loss mask 1 exactly on the response tokens (incl. EOS).
Sample prompt_response_sample(const std::vector<int32_t>& prompt, const std::vector<int32_t>& response);

// Plausible wrong answers, always different from the correct one; `key` picks the mistake. Addition
// (reversed digits): one digit off by one, all carries dropped, or the final carry digit dropped. Sort: two
// adjacent different digits swapped, the input order echoed, or one digit left out.
std::string wrong_addition_answer(const AdditionProblem& p, uint64_t key);
std::string wrong_sort_answer(const SortProblem& p, uint64_t key);

}  // namespace ndt
