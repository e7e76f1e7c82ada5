#pragma once
// Verifiable tasks for GRPO (docs/data.md, "Post-training data and rewards"): prompts by global index (a
// pure function of (seed, index), so every rank builds the same), a held-out split, and a reward of a
// completion.
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "core/status.h"
#include "data/chat_template.h"
#include "data/synthetic.h"
#include "data/tokenizer.h"
#include "train/config.h"

namespace ndt {

struct RlPrompt {
  std::vector<int32_t> prompt;  // tokens fed to generation: [BOS] + prompt text (+ delimiter)
  std::string answer;           // reference answer text (what exact match compares with)
};

class RewardTask {
 public:
  virtual ~RewardTask() = default;
  virtual std::string name() const = 0;
  virtual int64_t size() const = 0;  // -1 = unbounded generator
  // Training prompts (never held-out ones). A finite task accepts any index >= 0: indices past size()
  // run through further epochs, each a Philox permutation of the prompts (file order when !data.shuffle).
  virtual RlPrompt prompt(int64_t index) const = 0;
  // The first n held-out prompts (fewer when a file holds fewer; unbounded tasks may repeat prompts).
  virtual std::vector<RlPrompt> eval_prompts(int64_t n) const = 0;
  // Reward of a completion's text (decoded, stop token removed). May throw; callers report it.
  virtual double reward(const RlPrompt& p, const std::string& completion) const = 0;
  virtual int64_t max_answer_tokens() const = 0;  // generation budget that fits every answer (+ EOS)
};

// posttrain.task:
//   "addition": data.addition_digits, data.seed; the prompts and reversed-digit answers of data/synthetic.h
//               ([BOS] "a+b="), reward 1 for the exact answer, else 0 (posttrain.reward exact_match) or
//               the partial_match credit below.
//   "sort":     lists of 2..sort_max_len(data.addition_digits) digits ([BOS] "sort 3 1 2=", answer "123"),
//               rewarded like addition.
//   "jsonl":    posttrain.data_path, lines {"prompt": P, "answer": A} or {"messages": [...], "answer": A}
//               (A a string or a number); the prompt is chat_prompt_of (data.chat_template), the reward
//               rule_reward(posttrain.reward, A, completion without the template's end marker).
//               Held out: the lines with is_held_out_text(P) (P the prompt, or the messages' JSON text;
//               1 in 10; identical prompts share a split).
// Errors name the file and its 1-based line.
Result<std::unique_ptr<RewardTask>> make_reward_task(const Config& cfg, const Tokenizer& tok);

// Reward of a completion under posttrain.reward's rule, in [0, 1]:
//   exact_match: 1 if equal after trimming whitespace on both sides, else 0;
//   partial_match: (trimmed) characters equal position by position / the longer length; 1 only when
//                exact. Dense credit for answers that are right in some digits;
//   contains:    1 if the trimmed answer occurs in the completion, else 0;
//   numeric:     1 if both (trimmed) parse entirely as finite numbers and |a - c| <= 1e-6 max(|a|, |c|).
// Throws on an unknown rule or an answer that is not a number under "numeric" (a completion that is not
// a number just earns 0).
double rule_reward(const std::string& rule, const std::string& answer, const std::string& completion);

// The generation prompt of a post-training JSONL line: "prompt": P (a string) through tmpl.text_prompt, or
// "messages": the conversation so far ({role, content} objects, the last one not the assistant's) through
// tmpl.chat_prompt, which ends with the assistant header. `text` gets P or the messages' JSON text (a key
// for the held-out split). Returns "" or an error text (both or neither given, wrong types, bad messages).
std::string chat_prompt_of(const nlohmann::json& j, const Tokenizer& tok, const ChatTemplate& tmpl,
                           std::vector<int32_t>& prompt, std::string& text);

// Reads a JSONL file (blank lines skipped), calling on_line(json, line number) for each line; on_line
// returns "" or an error text, which comes back prefixed with "path:line: ". Also an error: a file that
// cannot be opened, invalid JSON, and a file without any line (`what` names its expected content).
Status read_jsonl(const std::string& path, const std::string& what,
                  const std::function<std::string(const nlohmann::json&, int64_t)>& on_line);

}  // namespace ndt
