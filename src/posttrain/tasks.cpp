#include "posttrain/tasks.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/rng.h"
#include "data/sft.h"
#include "data/synthetic.h"

namespace ndt {

namespace {

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

std::vector<int32_t> bos_prompt(const Tokenizer& tok, const std::string& text) {
  std::vector<int32_t> ids{tok.bos_id()};
  for (int32_t t : tok.encode(text)) ids.push_back(t);
  return ids;
}

class AdditionRewardTask final : public RewardTask {
 public:
  AdditionRewardTask(int64_t digits, int64_t seed, const Tokenizer& tok)
      : digits_(digits), seed_(seed), tok_(tok) {}
  std::string name() const override { return "addition"; }
  int64_t size() const override { return -1; }
  RlPrompt prompt(int64_t index) const override {
    const AdditionProblem p = draw_addition_problem(digits_, static_cast<uint64_t>(seed_), false, index);
    return {bos_prompt(tok_, p.prompt()), p.reversed_answer()};
  }
  std::vector<RlPrompt> eval_prompts(int64_t n) const override {
    std::vector<RlPrompt> out;
    for (const EvalProblem& e : addition_eval_problems(digits_, seed_, n, tok_))
      out.push_back({e.prompt, e.answer});
    return out;
  }
  double reward(const RlPrompt& p, const std::string& c) const override { return c == p.answer ? 1.0 : 0.0; }
  int64_t max_answer_tokens() const override { return digits_ + 2; }  // digits + carry + EOS

 private:
  int64_t digits_, seed_;
  const Tokenizer& tok_;
};

class SortRewardTask final : public RewardTask {
 public:
  SortRewardTask(int64_t max_len, int64_t seed, const Tokenizer& tok)
      : max_len_(max_len), seed_(seed), tok_(tok) {}
  std::string name() const override { return "sort"; }
  int64_t size() const override { return -1; }
  RlPrompt prompt(int64_t index) const override {
    return make(draw_sort_problem(max_len_, seed_, false, index));
  }
  std::vector<RlPrompt> eval_prompts(int64_t n) const override {
    std::vector<RlPrompt> out;
    for (int64_t i = 0; i < n; ++i) out.push_back(make(draw_sort_problem(max_len_, seed_, true, i)));
    return out;
  }
  double reward(const RlPrompt& p, const std::string& c) const override { return c == p.answer ? 1.0 : 0.0; }
  int64_t max_answer_tokens() const override { return max_len_ + 1; }

 private:
  RlPrompt make(const SortProblem& p) const { return {bos_prompt(tok_, p.prompt()), p.answer()}; }
  int64_t max_len_, seed_;
  const Tokenizer& tok_;
};

class JsonlRewardTask final : public RewardTask {
 public:
  JsonlRewardTask(std::vector<RlPrompt> prompts, std::string rule, int64_t max_tokens)
      : prompts_(std::move(prompts)), rule_(std::move(rule)), max_tokens_(max_tokens) {}
  std::string name() const override { return "jsonl"; }
  int64_t size() const override { return static_cast<int64_t>(prompts_.size()); }
  RlPrompt prompt(int64_t index) const override {
    return prompts_[static_cast<size_t>(index % static_cast<int64_t>(prompts_.size()))];
  }
  // A file has no held-out split of its own: evaluation uses its first n prompts.
  std::vector<RlPrompt> eval_prompts(int64_t n) const override {
    return {prompts_.begin(), prompts_.begin() + std::min<int64_t>(n, size())};
  }
  double reward(const RlPrompt& p, const std::string& c) const override {
    return rule_reward(rule_, p.answer, c);
  }
  int64_t max_answer_tokens() const override { return max_tokens_; }

 private:
  std::vector<RlPrompt> prompts_;
  std::string rule_;
  int64_t max_tokens_;
};

}  // namespace

std::string SortProblem::prompt() const {
  std::string s = "sort";
  for (int d : digits) s += " " + std::to_string(d);
  return s + "=";
}

std::string SortProblem::answer() const {
  std::vector<int> v = digits;
  std::sort(v.begin(), v.end());
  std::string s;
  for (int d : v) s += static_cast<char>('0' + d);
  return s;
}

SortProblem draw_sort_problem(int64_t max_len, uint64_t seed, bool eval_split, int64_t index) {
  NDT_CHECK(max_len >= 2, "sort task: lists need at least 2 digits (max_len {})", max_len);
  CounterRng rng(seed ^ 0x5e11u, (static_cast<uint64_t>(index) << 1) | (eval_split ? 1u : 0u));
  for (;;) {  // rejection keeps the two splits disjoint
    SortProblem p;
    const int64_t n = rng.uniform_int(2, max_len);
    for (int64_t i = 0; i < n; ++i) p.digits.push_back(static_cast<int>(rng.uniform_int(0, 9)));
    if ((stable_hash(p.prompt()) % 10 == 0) == eval_split) return p;
  }
}

double rule_reward(const std::string& rule, const std::string& answer, const std::string& completion) {
  const std::string a = trim(answer), c = trim(completion);
  if (rule == "exact_match") return a == c ? 1.0 : 0.0;
  if (rule == "contains") return c.find(a) != std::string::npos ? 1.0 : 0.0;
  if (rule == "numeric") {
    char* end = nullptr;
    const double x = std::strtod(a.c_str(), &end);
    NDT_CHECK(end && *end == '\0' && !a.empty(), "numeric reward: the answer '{}' is not a number", a);
    const double y = std::strtod(c.c_str(), &end);
    if (c.empty() || *end != '\0') return 0.0;  // a completion that is no number earns nothing
    return std::abs(x - y) <= 1e-6 * std::max(1.0, std::abs(x)) ? 1.0 : 0.0;
  }
  NDT_FAIL("unknown reward rule '{}' (exact_match, contains, numeric)", rule);
}

Result<std::unique_ptr<RewardTask>> make_reward_task(const Config& cfg, const Tokenizer& tok) {
  const PosttrainConfig& pc = cfg.posttrain;
  if (pc.task == "addition")
    return std::unique_ptr<RewardTask>(new AdditionRewardTask(cfg.data.addition_digits, cfg.data.seed, tok));
  if (pc.task == "sort")
    return std::unique_ptr<RewardTask>(new SortRewardTask(cfg.data.addition_digits + 2, cfg.data.seed, tok));
  if (pc.task != "jsonl")
    return Status::error(fmt::format("posttrain.task '{}' is not a reward task", pc.task));
  const std::string& path = pc.data_path;
  if (path.empty()) return Status::error("posttrain.task jsonl needs posttrain.data_path");
  std::ifstream f(path);
  if (!f) return Status::error(fmt::format("posttrain.data_path '{}': cannot open file", path));
  std::vector<RlPrompt> prompts;
  int64_t max_tokens = 1, lineno = 0;
  std::string line;
  while (std::getline(f, line)) {
    ++lineno;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) return Status::error(fmt::format("{}:{}: invalid JSON", path, lineno));
    for (const char* k : {"prompt", "answer"})
      if (!j.is_object() || !j.contains(k) || !j[k].is_string())
        return Status::error(fmt::format("{}:{}: \"{}\" must be a string", path, lineno, k));
    const std::string answer = j["answer"].get<std::string>();
    if (pc.reward == "numeric") {
      char* end = nullptr;
      const std::string a = trim(answer);
      std::strtod(a.c_str(), &end);
      if (a.empty() || *end != '\0')
        return Status::error(fmt::format("{}:{}: answer '{}' is not a number (posttrain.reward numeric)",
                                         path, lineno, answer));
    }
    prompts.push_back({sft_prompt_tokens(tok, j["prompt"].get<std::string>()), answer});
    max_tokens = std::max<int64_t>(max_tokens, static_cast<int64_t>(tok.encode(answer).size()) + 1);
  }
  if (prompts.empty())
    return Status::error(fmt::format("posttrain.data_path '{}': empty file (no prompts)", path));
  return std::unique_ptr<RewardTask>(new JsonlRewardTask(std::move(prompts), pc.reward, max_tokens));
}

}  // namespace ndt
