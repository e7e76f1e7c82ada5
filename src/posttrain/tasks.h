#pragma once
// Verifiable tasks for GRPO (docs/data.md, "Post-training data"): prompts by global index (a pure function
// of (seed, index), so every rank builds the same), a held-out split, and a reward of a completion.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "data/tokenizer.h"
#include "train/config.h"

namespace ndt {

struct RlPrompt {
  std::vector<int32_t> prompt;  // tokens fed to generation
  std::string answer;           // the reference answer text
};

class RewardTask {
 public:
  virtual ~RewardTask() = default;
  virtual std::string name() const = 0;
  virtual int64_t size() const = 0;                                 // -1 = unbounded generator
  virtual RlPrompt prompt(int64_t index) const = 0;                 // training prompts (never held-out ones)
  virtual std::vector<RlPrompt> eval_prompts(int64_t n) const = 0;  // the first n held-out prompts
  // Reward of a completion's text (decoded, stop token removed). May throw; callers report it.
  virtual double reward(const RlPrompt& p, const std::string& completion) const = 0;
  virtual int64_t max_answer_tokens() const = 0;  // a generation budget that fits every answer (+ EOS)
};

// posttrain.task: "addition" (data.addition_digits, data.seed: the prompts and reversed-digit answers of
// data/synthetic.h; reward 1 for the exact answer, else 0), "sort" (digits to sort, below), "jsonl"
// (posttrain.data_path: lines {"prompt": P, "answer": A}; the prompt through sft_prompt_tokens; reward
// posttrain.reward: exact_match after trimming whitespace, contains, numeric within 1e-6 relative).
// Errors name the file and its 1-based line.
Result<std::unique_ptr<RewardTask>> make_reward_task(const Config& cfg, const Tokenizer& tok);

// The sort task: 2..max_len digits ("sort 3 1 2=") whose answer is the digits ascending ("123"). Its
// held-out split: the lists whose stable hash is 0 mod 10. Also an SFT dataset (data.task: sort).
struct SortProblem {
  std::vector<int> digits;
  std::string prompt() const;  // "sort 3 1 2="
  std::string answer() const;  // "123"
};
SortProblem draw_sort_problem(int64_t max_len, uint64_t seed, bool eval_split, int64_t index);

// Reward of a completion against an answer under posttrain.reward's rule (exact_match|contains|numeric).
double rule_reward(const std::string& rule, const std::string& answer, const std::string& completion);

}  // namespace ndt
