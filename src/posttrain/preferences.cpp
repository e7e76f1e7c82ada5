#include "posttrain/preferences.h"

#include <fstream>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/rng.h"
#include "data/sft.h"
#include "posttrain/tasks.h"

namespace ndt {

namespace {

std::vector<int32_t> with_eos(const Tokenizer& tok, const std::string& text) {
  std::vector<int32_t> ids = tok.encode(text);
  ids.push_back(tok.eos_id());
  return ids;
}

// Pairs from a reward task's training prompts: one digit of the answer moved by 1..9 (mod 10).
class TaskPairs final : public PreferenceData {
 public:
  TaskPairs(std::unique_ptr<RewardTask> task, uint64_t seed, const Tokenizer& tok)
      : task_(std::move(task)), seed_(seed), tok_(tok) {}
  int64_t size() const override { return -1; }
  PreferencePair get(int64_t index) const override {
    const RlPrompt p = task_->prompt(index);
    CounterRng rng(seed_ ^ 0xd90u, static_cast<uint64_t>(index));
    std::string wrong = p.answer;
    const auto at = static_cast<size_t>(rng.uniform_int(0, static_cast<int64_t>(wrong.size()) - 1));
    wrong[at] = static_cast<char>('0' + (wrong[at] - '0' + rng.uniform_int(1, 9)) % 10);
    return {p.prompt, with_eos(tok_, p.answer), with_eos(tok_, wrong)};
  }

 private:
  std::unique_ptr<RewardTask> task_;
  uint64_t seed_;
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

}  // namespace

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
  if (pc.task != "jsonl") {
    auto task = make_reward_task(cfg, tok);
    if (!task) return task.status();
    return std::unique_ptr<PreferenceData>(
        new TaskPairs(std::move(task.value()), static_cast<uint64_t>(cfg.data.seed), tok));
  }
  const std::string& path = pc.data_path;
  if (path.empty()) return Status::error("posttrain.task jsonl needs posttrain.data_path");
  std::ifstream f(path);
  if (!f) return Status::error(fmt::format("posttrain.data_path '{}': cannot open file", path));
  std::vector<PreferencePair> pairs;
  std::string line;
  int64_t lineno = 0;
  while (std::getline(f, line)) {
    ++lineno;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) return Status::error(fmt::format("{}:{}: invalid JSON", path, lineno));
    for (const char* k : {"prompt", "chosen", "rejected"})
      if (!j.is_object() || !j.contains(k) || !j[k].is_string())
        return Status::error(fmt::format("{}:{}: \"{}\" must be a string", path, lineno, k));
    const std::string c = j["chosen"].get<std::string>(), r = j["rejected"].get<std::string>();
    if (c == r)
      return Status::error(fmt::format("{}:{}: chosen and rejected are the same text", path, lineno));
    pairs.push_back(
        {sft_prompt_tokens(tok, j["prompt"].get<std::string>()), with_eos(tok, c), with_eos(tok, r)});
  }
  if (pairs.empty())
    return Status::error(fmt::format("posttrain.data_path '{}': empty file (no pairs)", path));
  return std::unique_ptr<PreferenceData>(new JsonlPairs(std::move(pairs)));
}

}  // namespace ndt
