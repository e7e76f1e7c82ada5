#include "data/sft.h"

#include <fmt/format.h>

#include <fstream>
#include <nlohmann/json.hpp>

namespace ndt {

namespace {

void append(Sample& s, const std::vector<int32_t>& ids, uint8_t mask) {
  s.tokens.insert(s.tokens.end(), ids.begin(), ids.end());
  s.loss_mask.insert(s.loss_mask.end(), ids.size(), mask);
}
void append(Sample& s, int32_t id, uint8_t mask) {
  s.tokens.push_back(id);
  s.loss_mask.push_back(mask);
}

bool valid_role(const std::string& r) { return r == "system" || r == "user" || r == "assistant"; }

// Formats one parsed line; returns an error text (without the file:line prefix) or "".
std::string format_line(const nlohmann::json& j, const Tokenizer& tok, Sample& s) {
  if (!j.is_object()) return "expected a JSON object";
  append(s, tok.bos_id(), 0);
  if (j.contains("messages")) {
    const auto& msgs = j["messages"];
    if (!msgs.is_array()) return "\"messages\" must be an array";
    int64_t last_assistant = -1;
    for (size_t i = 0; i < msgs.size(); ++i) {
      const auto& m = msgs[i];
      if (!m.is_object()) return fmt::format("messages[{}] must be an object", i);
      if (!m.contains("role")) return fmt::format("messages[{}] is missing \"role\"", i);
      if (!m.contains("content")) return fmt::format("messages[{}] is missing \"content\"", i);
      if (!m["role"].is_string()) return fmt::format("messages[{}].role must be a string", i);
      if (!m["content"].is_string()) return fmt::format("messages[{}].content must be a string", i);
      const std::string role = m["role"].get<std::string>();
      if (!valid_role(role))
        return fmt::format("messages[{}].role is \"{}\", expected system, user or assistant", i, role);
      if (role == "assistant") last_assistant = static_cast<int64_t>(i);
    }
    if (last_assistant < 0) return "conversation has no assistant message (nothing to learn)";
    for (int64_t i = 0; i <= last_assistant; ++i) {
      const auto& m = msgs[static_cast<size_t>(i)];
      const std::string role = m["role"].get<std::string>();
      const uint8_t mask = role == "assistant" ? 1 : 0;
      append(s, tok.encode("<|" + role + "|>\n"), 0);
      append(s, tok.encode(m["content"].get<std::string>()), mask);
      if (i == last_assistant)
        append(s, tok.eos_id(), 1);
      else
        append(s, tok.encode("\n"), 0);
    }
    return "";
  }
  if (!j.contains("prompt"))
    return "expected \"prompt\" and \"response\", or \"messages\"; \"prompt\" is missing";
  if (!j.contains("response")) return "\"response\" is missing";
  if (!j["prompt"].is_string()) return "\"prompt\" must be a string";
  if (!j["response"].is_string()) return "\"response\" must be a string";
  append(s, tok.encode(j["prompt"].get<std::string>() + "\n"), 0);
  append(s, tok.encode(j["response"].get<std::string>()), 1);
  append(s, tok.eos_id(), 1);
  return "";
}

}  // namespace

Result<std::unique_ptr<SftDataset>> SftDataset::load(const std::string& path, const Tokenizer& tok,
                                                     int64_t seq_len) {
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
    std::string err = format_line(j, tok, s);
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
  std::vector<int32_t> ids{tok.bos_id()};
  for (int32_t t : tok.encode(prompt + "\n")) ids.push_back(t);
  return ids;
}

std::vector<int32_t> sft_chat_prompt_tokens(
    const Tokenizer& tok, const std::vector<std::pair<std::string, std::string>>& role_content) {
  Sample s;
  append(s, tok.bos_id(), 0);
  for (const auto& [role, content] : role_content) {
    append(s, tok.encode("<|" + role + "|>\n"), 0);
    append(s, tok.encode(content), 0);
    append(s, tok.encode("\n"), 0);
  }
  append(s, tok.encode("<|assistant|>\n"), 0);
  return s.tokens;
}

}  // namespace ndt
