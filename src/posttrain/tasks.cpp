#include "posttrain/tasks.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/rng.h"
#include "data/chat_template.h"
#include "data/dataset.h"

namespace ndt {

namespace {

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

// The whole (trimmed) text as a finite number; from_chars, unlike strtod, takes no hex, inf or nan.
bool parse_number(const std::string& text, double& out) {
  std::string t = trim(text);
  if (!t.empty() && t[0] == '+') t.erase(0, 1);
  if (t.empty()) return false;
  const auto r = std::from_chars(t.data(), t.data() + t.size(), out);
  return r.ec == std::errc() && r.ptr == t.data() + t.size() && std::isfinite(out);
}

std::vector<int32_t> bos_prompt(const Tokenizer& tok, const std::string& text) {
  std::vector<int32_t> ids{tok.bos_id()};
  for (int32_t t : tok.encode(text)) ids.push_back(t);
  return ids;
}

// Tokens of a digit answer of up to `chars` digits, + EOS: exact for the byte tokenizer; the max with an
// encoded run of 9s covers subword tokenizers that add a word-start piece.
int64_t digit_budget(const Tokenizer& tok, int64_t chars) {
  const auto enc = static_cast<int64_t>(tok.encode(std::string(static_cast<size_t>(chars), '9')).size());
  return std::max(chars, enc) + 1;
}

std::vector<RlPrompt> to_rl(const std::vector<EvalProblem>& problems) {
  std::vector<RlPrompt> out;
  out.reserve(problems.size());
  for (const EvalProblem& e : problems) out.push_back({e.prompt, e.answer});
  return out;
}

// Reward of a built-in task's completion: the exact answer, or partial credit per position.
double builtin_reward(bool partial, const std::string& answer, const std::string& completion) {
  return partial ? rule_reward("partial_match", answer, completion) : (completion == answer ? 1.0 : 0.0);
}

class AdditionRewardTask final : public RewardTask {
 public:
  AdditionRewardTask(int64_t digits, int64_t seed, bool partial, const Tokenizer& tok)
      : digits_(digits), seed_(seed), partial_(partial), tok_(tok), budget_(digit_budget(tok, digits + 1)) {}
  std::string name() const override { return "addition"; }
  int64_t size() const override { return -1; }
  RlPrompt prompt(int64_t index) const override {
    const AdditionProblem p = draw_addition_problem(digits_, static_cast<uint64_t>(seed_), false, index);
    return {bos_prompt(tok_, p.prompt()), p.reversed_answer()};
  }
  std::vector<RlPrompt> eval_prompts(int64_t n) const override {
    return to_rl(addition_eval_problems(digits_, seed_, n, tok_));
  }
  double reward(const RlPrompt& p, const std::string& c) const override {
    return builtin_reward(partial_, p.answer, c);
  }
  int64_t max_answer_tokens() const override { return budget_; }

 private:
  int64_t digits_, seed_;
  bool partial_;
  const Tokenizer& tok_;
  int64_t budget_;
};

class SortRewardTask final : public RewardTask {
 public:
  SortRewardTask(int64_t max_len, int64_t seed, bool partial, const Tokenizer& tok)
      : max_len_(max_len), seed_(seed), partial_(partial), tok_(tok), budget_(digit_budget(tok, max_len)) {}
  std::string name() const override { return "sort"; }
  int64_t size() const override { return -1; }
  RlPrompt prompt(int64_t index) const override {
    const SortProblem p = draw_sort_problem(max_len_, static_cast<uint64_t>(seed_), false, index);
    return {bos_prompt(tok_, p.prompt()), p.answer()};
  }
  std::vector<RlPrompt> eval_prompts(int64_t n) const override {
    return to_rl(sort_eval_problems(max_len_, seed_, n, tok_));
  }
  double reward(const RlPrompt& p, const std::string& c) const override {
    return builtin_reward(partial_, p.answer, c);
  }
  int64_t max_answer_tokens() const override { return budget_; }

 private:
  int64_t max_len_, seed_;
  bool partial_;
  const Tokenizer& tok_;
  int64_t budget_;
};

class JsonlRewardTask final : public RewardTask {
 public:
  JsonlRewardTask(std::vector<RlPrompt> train, std::vector<RlPrompt> eval, std::string rule, int64_t budget,
                  int64_t seed, bool shuffle, ChatTemplate tmpl)
      : tmpl_(tmpl),
        train_(std::move(train)),
        eval_(std::move(eval)),
        rule_(std::move(rule)),
        budget_(budget),
        seed_(seed),
        shuffle_(shuffle) {}
  std::string name() const override { return "jsonl"; }
  int64_t size() const override { return static_cast<int64_t>(train_.size()); }
  RlPrompt prompt(int64_t index) const override {
    NDT_CHECK(index >= 0, "negative prompt index {}", index);
    // As one-sample steps of the SFT data order: epoch-wise permutations of the file.
    return train_[static_cast<size_t>(sample_index(seed_, index, 0, 1, size(), shuffle_))];
  }
  std::vector<RlPrompt> eval_prompts(int64_t n) const override {
    const auto k = static_cast<size_t>(std::clamp<int64_t>(n, 0, static_cast<int64_t>(eval_.size())));
    return {eval_.begin(), eval_.begin() + static_cast<std::ptrdiff_t>(k)};
  }
  // The completion ends with the template's end marker (before the EOS the caller removed): not part of
  // the answer.
  double reward(const RlPrompt& p, const std::string& c) const override {
    return rule_reward(rule_, p.answer, tmpl_.completion_text(c));
  }
  int64_t max_answer_tokens() const override { return budget_; }

 private:
  ChatTemplate tmpl_;
  std::vector<RlPrompt> train_, eval_;
  std::string rule_;
  int64_t budget_, seed_;
  bool shuffle_;
};

Result<std::unique_ptr<RewardTask>> load_jsonl_task(const Config& cfg, const Tokenizer& tok) {
  const PosttrainConfig& pc = cfg.posttrain;
  const std::string& path = pc.data_path;
  if (path.empty()) return Status::error("posttrain.task jsonl needs posttrain.data_path");
  if (pc.reward != "exact_match" && pc.reward != "partial_match" && pc.reward != "contains" &&
      pc.reward != "numeric")
    return Status::error(fmt::format(
        "posttrain.reward is '{}'; expected exact_match, partial_match, contains or numeric", pc.reward));
  auto named = ChatTemplate::named(cfg.data.chat_template);
  if (!named) return named.status();
  const ChatTemplate tmpl = named.value();
  std::vector<RlPrompt> train, eval;
  int64_t budget = 1;
  Status st = read_jsonl(path, "prompts", [&](const nlohmann::json& j, int64_t) -> std::string {
    if (!j.is_object()) return "expected a JSON object {\"prompt\": ..., \"answer\": ...}";
    std::vector<int32_t> prompt_tokens;
    std::string split_key;  // what decides the held-out split
    if (std::string err = chat_prompt_of(j, tok, tmpl, prompt_tokens, split_key); !err.empty()) return err;
    if (!j.contains("answer")) return "\"answer\" is missing";
    const auto& a = j["answer"];
    if (!a.is_string() && !a.is_number()) return "\"answer\" must be a string or a number";
    const std::string answer = a.is_string() ? a.get<std::string>() : a.dump();
    // An empty answer is contained in every completion: a reward that cannot fail teaches nothing.
    if (trim(answer).empty()) return "\"answer\" is empty";
    double x = 0;
    if (pc.reward == "numeric" && !parse_number(answer, x))
      return fmt::format("\"answer\" '{}' is not a number (posttrain.reward: numeric)", answer);
    RlPrompt p{std::move(prompt_tokens), answer};
    (is_held_out_text(split_key) ? eval : train).push_back(std::move(p));
    budget = std::max<int64_t>(budget, static_cast<int64_t>(tmpl.response(tok, answer).size()));
    return "";
  });
  if (!st) return st;
  if (train.empty())
    return Status::error(
        fmt::format("posttrain.data_path '{}': all {} prompt(s) fall in the held-out split (1 in 10 by a "
                    "hash of the prompt), none is left to train on; add prompts",
                    path, eval.size()));
  return std::unique_ptr<RewardTask>(new JsonlRewardTask(std::move(train), std::move(eval), pc.reward, budget,
                                                         cfg.data.seed, cfg.data.shuffle, tmpl));
}

}  // namespace

double rule_reward(const std::string& rule, const std::string& answer, const std::string& completion) {
  if (rule == "exact_match") return trim(answer) == trim(completion) ? 1.0 : 0.0;
  if (rule == "partial_match") {
    const std::string a = trim(answer), c = trim(completion);
    const size_t n = std::max(a.size(), c.size());
    if (n == 0) return 1.0;
    size_t same = 0;
    for (size_t i = 0; i < std::min(a.size(), c.size()); ++i) same += a[i] == c[i];
    return static_cast<double>(same) / static_cast<double>(n);
  }
  if (rule == "contains") {
    const std::string a = trim(answer);
    NDT_CHECK(!a.empty(), "contains reward: empty answer");
    return completion.find(a) != std::string::npos ? 1.0 : 0.0;
  }
  if (rule == "numeric") {
    double a = 0, c = 0;
    NDT_CHECK(parse_number(answer, a), "numeric reward: the answer '{}' is not a number", answer);
    if (!parse_number(completion, c)) return 0.0;
    return std::abs(a - c) <= 1e-6 * std::max(std::abs(a), std::abs(c)) ? 1.0 : 0.0;
  }
  NDT_FAIL("unknown reward rule '{}' (exact_match, partial_match, contains, numeric)", rule);
}

std::string chat_prompt_of(const nlohmann::json& j, const Tokenizer& tok, const ChatTemplate& tmpl,
                           std::vector<int32_t>& prompt, std::string& text) {
  const bool has_prompt = j.contains("prompt"), has_messages = j.contains("messages");
  if (has_prompt && has_messages) return "give either \"prompt\" or \"messages\", not both";
  if (has_messages) {
    std::vector<ChatMessage> msgs;
    if (std::string err = parse_chat_messages(j["messages"], msgs); !err.empty()) return err;
    if (msgs.empty()) return "\"messages\" is empty (the conversation so far needs a message)";
    if (msgs.back().role == "assistant")
      return fmt::format(
          "messages[{}] is an assistant message; the conversation so far must end with a user or system "
          "message (the response is generated, or given separately)",
          msgs.size() - 1);
    prompt = tmpl.chat_prompt(tok, msgs);
    text = j["messages"].dump();
    return "";
  }
  if (!has_prompt) return "\"prompt\" is missing (or give \"messages\")";
  if (!j["prompt"].is_string()) return "\"prompt\" must be a string";
  text = j["prompt"].get<std::string>();
  prompt = tmpl.text_prompt(tok, text);
  return "";
}

Status read_jsonl(const std::string& path, const std::string& what,
                  const std::function<std::string(const nlohmann::json&, int64_t)>& on_line) {
  std::ifstream f(path);
  if (!f) return Status::error(fmt::format("posttrain data '{}': cannot open file", path));
  std::string line;
  int64_t lineno = 0, lines = 0;
  while (std::getline(f, line)) {
    ++lineno;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    ++lines;
    auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) return Status::error(fmt::format("{}:{}: invalid JSON", path, lineno));
    const std::string err = on_line(j, lineno);
    if (!err.empty()) return Status::error(fmt::format("{}:{}: {}", path, lineno, err));
  }
  if (lines == 0) return Status::error(fmt::format("posttrain data '{}': empty file (no {})", path, what));
  return Status::ok();
}

Result<std::unique_ptr<RewardTask>> make_reward_task(const Config& cfg, const Tokenizer& tok) {
  const PosttrainConfig& pc = cfg.posttrain;
  const int64_t digits = cfg.data.addition_digits;
  const bool builtin = pc.task == "addition" || pc.task == "sort";
  if (builtin && (digits < 1 || digits > 18))
    return Status::error(fmt::format("data.addition_digits must be in 1..18 (got {})", digits));
  if (builtin && pc.reward != "exact_match" && pc.reward != "partial_match")
    return Status::error(fmt::format(
        "posttrain.reward '{}' applies to posttrain.task jsonl; task {} takes exact_match or partial_match",
        pc.reward, pc.task));
  const bool partial = pc.reward == "partial_match";
  if (pc.task == "addition")
    return std::unique_ptr<RewardTask>(new AdditionRewardTask(digits, cfg.data.seed, partial, tok));
  if (pc.task == "sort")
    return std::unique_ptr<RewardTask>(new SortRewardTask(sort_max_len(digits), cfg.data.seed, partial, tok));
  if (pc.task == "jsonl") return load_jsonl_task(cfg, tok);
  return Status::error(fmt::format("posttrain.task is '{}'; expected addition, sort or jsonl", pc.task));
}

}  // namespace ndt
