#include "posttrain/preferences.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <functional>
#include <nlohmann/json.hpp>
#include <utility>

#include "core/check.h"
#include "core/rng.h"
#include "data/chat_template.h"
#include "posttrain/tasks.h"

namespace ndt {

namespace {

std::vector<int32_t> with_eos(const Tokenizer& tok, const std::string& text) {
  std::vector<int32_t> ids = tok.encode(text);
  ids.push_back(tok.eos_id());
  return ids;
}

// One digit of a reversed-digit answer moved by +-1; the most significant digit never becomes a leading 0.
std::string digit_slip(std::string r, CounterRng& rng) {
  const auto at = static_cast<size_t>(rng.uniform_int(0, static_cast<int64_t>(r.size()) - 1));
  const int d = r[at] - '0', delta = rng.uniform_int(0, 1) ? 1 : -1;
  int nd = (d + delta + 10) % 10;
  if (nd == 0 && at + 1 == r.size() && r.size() > 1) nd = d - delta;  // d is 1 or 9 here: 2 or 8
  r[at] = static_cast<char>('0' + nd);
  return r;
}

// Pairs on the training prompts of an embedded task: make(index) gives (prompt text, chosen, rejected).
class TaskPairs final : public PreferenceData {
 public:
  using Make = std::function<std::array<std::string, 3>(int64_t)>;
  TaskPairs(Make make, const Tokenizer& tok) : make_(std::move(make)), tok_(tok) {}
  int64_t size() const override { return -1; }
  PreferencePair get(int64_t index) const override {
    const auto [prompt, chosen, rejected] = make_(index);
    PreferencePair p;
    p.prompt.push_back(tok_.bos_id());
    for (int32_t t : tok_.encode(prompt)) p.prompt.push_back(t);
    p.chosen = with_eos(tok_, chosen);
    p.rejected = with_eos(tok_, rejected);
    return p;
  }

 private:
  Make make_;
  const Tokenizer& tok_;
};

class JsonlPairs final : public PreferenceData {
 public:
  explicit JsonlPairs(std::vector<PreferencePair> pairs) : pairs_(std::move(pairs)) {}
  int64_t size() const override { return static_cast<int64_t>(pairs_.size()); }
  PreferencePair get(int64_t index) const override {
    NDT_CHECK(index >= 0 && index < size(), "preference pair {} outside [0, {})", index, size());
    return pairs_[static_cast<size_t>(index)];
  }

 private:
  std::vector<PreferencePair> pairs_;
};

Result<std::unique_ptr<PreferenceData>> load_jsonl_pairs(const std::string& path, const Tokenizer& tok,
                                                         const std::string& template_name) {
  if (path.empty()) return Status::error("posttrain.task jsonl needs posttrain.data_path");
  auto named = ChatTemplate::named(template_name);
  if (!named) return named.status();
  const ChatTemplate tmpl = named.value();
  std::vector<PreferencePair> pairs;
  Status st = read_jsonl(path, "preference pairs", [&](const nlohmann::json& j, int64_t) -> std::string {
    if (!j.is_object()) return "expected a JSON object {\"prompt\": ..., \"chosen\": ..., \"rejected\": ...}";
    std::vector<int32_t> prompt;
    std::string text;
    if (std::string err = chat_prompt_of(j, tok, tmpl, prompt, text); !err.empty()) return err;
    for (const char* k : {"chosen", "rejected"}) {
      if (!j.contains(k)) return fmt::format("\"{}\" is missing", k);
      if (!j[k].is_string()) return fmt::format("\"{}\" must be a string", k);
    }
    const std::string c = j["chosen"].get<std::string>(), r = j["rejected"].get<std::string>();
    if (c == r) return "\"chosen\" and \"rejected\" are the same text (the pair carries no preference)";
    pairs.push_back({std::move(prompt), tmpl.response(tok, c), tmpl.response(tok, r)});
    return "";
  });
  if (!st) return st;
  return std::unique_ptr<PreferenceData>(new JsonlPairs(std::move(pairs)));
}

}  // namespace

std::string wrong_addition_answer(const AdditionProblem& p, uint64_t key) {
  CounterRng rng(key, stable_hash("pairs/wrong_addition"));
  const std::string right = p.reversed_answer();
  const size_t n = std::max(std::to_string(p.a).size(), std::to_string(p.b).size());
  std::string wrong;
  switch (rng.uniform_int(0, 2)) {
    case 1:  // every carry dropped: digit-wise sums mod 10
      wrong = p.carry_dropped_answer();
      break;
    case 2:  // the final carry digit dropped
      if (right.size() > n) wrong = right.substr(0, n);
      break;
    default:
      break;
  }
  // Mistakes that need a carry fall back to a digit slip on carry-free sums.
  if (wrong.empty() || wrong == right) wrong = digit_slip(right, rng);
  NDT_CHECK(wrong != right, "wrong addition answer equals the right one for {}", p.prompt());
  return wrong;
}

std::string wrong_sort_answer(const SortProblem& p, uint64_t key) {
  CounterRng rng(key, stable_hash("pairs/wrong_sort"));
  const std::string right = p.answer();
  std::string wrong;
  switch (rng.uniform_int(0, 2)) {
    case 0: {  // two adjacent different digits swapped
      std::vector<size_t> at;
      for (size_t i = 0; i + 1 < right.size(); ++i)
        if (right[i] != right[i + 1]) at.push_back(i);
      if (!at.empty()) {
        const size_t i = at[static_cast<size_t>(rng.uniform_int(0, static_cast<int64_t>(at.size()) - 1))];
        wrong = right;
        std::swap(wrong[i], wrong[i + 1]);
      }
      break;
    }
    case 1:  // the input order echoed
      for (int d : p.digits) wrong += static_cast<char>('0' + d);
      break;
    default:
      break;
  }
  // One digit left out: always wrong (the length differs), the fallback when the others are not.
  if (wrong.empty() || wrong == right) {
    wrong = right;
    wrong.erase(static_cast<size_t>(rng.uniform_int(0, static_cast<int64_t>(right.size()) - 1)), 1);
  }
  NDT_CHECK(wrong != right, "wrong sort answer equals the right one for {}", p.prompt());
  return wrong;
}

Sample prompt_response_sample(const std::vector<int32_t>& prompt, const std::vector<int32_t>& response) {
  Sample s;
  s.tokens = prompt;
  s.tokens.insert(s.tokens.end(), response.begin(), response.end());
  s.loss_mask.assign(prompt.size(), 0);
  s.loss_mask.resize(s.tokens.size(), 1);
  return s;
}

Result<std::unique_ptr<PreferenceData>> make_preference_data(const Config& cfg, const Tokenizer& tok) {
  const PosttrainConfig& pc = cfg.posttrain;
  if (pc.task == "jsonl") return load_jsonl_pairs(pc.data_path, tok, cfg.data.chat_template);
  const int64_t digits = cfg.data.addition_digits;
  if ((pc.task == "addition" || pc.task == "sort") && (digits < 1 || digits > 18))
    return Status::error(fmt::format("data.addition_digits must be in 1..18 (got {})", digits));
  const auto seed = static_cast<uint64_t>(cfg.data.seed);
  static const uint64_t kStream = stable_hash("pairs/key");
  // The mistake's key: independent of the problem's own stream, a pure function of (seed, index).
  auto key = [seed](int64_t i) { return philox_u64(seed, kStream, static_cast<uint64_t>(i)); };
  TaskPairs::Make make;
  if (pc.task == "addition") {
    make = [digits, seed, key](int64_t i) {
      const AdditionProblem p = draw_addition_problem(digits, seed, false, i);
      return std::array<std::string, 3>{p.prompt(), p.reversed_answer(), wrong_addition_answer(p, key(i))};
    };
  } else if (pc.task == "sort") {
    make = [max_len = sort_max_len(digits), seed, key](int64_t i) {
      const SortProblem p = draw_sort_problem(max_len, seed, false, i);
      return std::array<std::string, 3>{p.prompt(), p.answer(), wrong_sort_answer(p, key(i))};
    };
  } else {
    return Status::error(fmt::format("posttrain.task is '{}'; expected addition, sort or jsonl", pc.task));
  }
  return std::unique_ptr<PreferenceData>(new TaskPairs(std::move(make), tok));
}

}  // namespace ndt
