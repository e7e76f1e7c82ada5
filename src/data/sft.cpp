#include "data/sft.h"

#include <fmt/format.h>

#include <fstream>
#include <nlohmann/json.hpp>

namespace ndt {

namespace {

// Formats one parsed line; returns an error text (without the file:line prefix) or "".
std::string format_line(const nlohmann::json& j, const Tokenizer& tok, const ChatTemplate& tmpl, Sample& s) {
  if (!j.is_object()) return "expected a JSON object";
  if (j.contains("messages")) {
    std::vector<ChatMessage> msgs;
    std::string err = parse_chat_messages(j["messages"], msgs);
    if (!err.empty()) return err;
    return tmpl.conversation(tok, msgs, s);
  }
  if (!j.contains("prompt"))
    return "expected \"prompt\" and \"response\", or \"messages\"; \"prompt\" is missing";
  if (!j.contains("response")) return "\"response\" is missing";
  if (!j["prompt"].is_string()) return "\"prompt\" must be a string";
  if (!j["response"].is_string()) return "\"response\" must be a string";
  s = tmpl.prompt_response(tok, j["prompt"].get<std::string>(), j["response"].get<std::string>());
  return "";
}

}  // namespace

Result<std::unique_ptr<SftDataset>> SftDataset::load(const std::string& path, const Tokenizer& tok,
                                                     int64_t seq_len, const ChatTemplate& tmpl) {
  if (seq_len < 1)
    return Status::error(fmt::format("SFT data '{}': seq_len must be >= 1 (got {})", path, seq_len));
  std::ifstream f(path);
  if (!f) return Status::error(fmt::format("SFT data '{}': cannot open file", path));
  std::unique_ptr<SftDataset> d(new SftDataset());
  std::string line;
  int64_t lineno = 0;
  while (std::getline(f, line)) {
    ++lineno;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) return Status::error(fmt::format("{}:{}: invalid JSON", path, lineno));
    Sample s;
    std::string err = format_line(j, tok, tmpl, s);
    if (!err.empty()) return Status::error(fmt::format("{}:{}: {}", path, lineno, err));
    if (static_cast<int64_t>(s.tokens.size()) > seq_len + 1) {
      s.tokens.resize(static_cast<size_t>(seq_len + 1));
      s.loss_mask.resize(static_cast<size_t>(seq_len + 1));
      ++d->truncated_;
    }
    d->samples_.push_back(std::move(s));
  }
  if (d->samples_.empty()) return Status::error(fmt::format("SFT data '{}': empty file (no examples)", path));
  return d;
}

Sample SftDataset::get(int64_t index) const {
  NDT_CHECK(index >= 0 && index < size(), "SFT sample {} outside [0, {})", index, size());
  return samples_[static_cast<size_t>(index)];
}

std::vector<int32_t> sft_prompt_tokens(const Tokenizer& tok, const std::string& prompt) {
  return ChatTemplate().text_prompt(tok, prompt);
}

std::vector<int32_t> sft_chat_prompt_tokens(
    const Tokenizer& tok, const std::vector<std::pair<std::string, std::string>>& role_content) {
  std::vector<ChatMessage> msgs;
  for (const auto& [role, content] : role_content) msgs.push_back({role, content});
  return ChatTemplate().chat_prompt(tok, msgs);
}

}  // namespace ndt
