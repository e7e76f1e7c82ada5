#include "data/chat_template.h"

#include <fmt/format.h>

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

}  // namespace

std::string parse_chat_messages(const nlohmann::json& msgs, std::vector<ChatMessage>& out) {
  if (!msgs.is_array()) return "\"messages\" must be an array";
  out.clear();
  for (size_t i = 0; i < msgs.size(); ++i) {
    const auto& m = msgs[i];
    if (!m.is_object()) return fmt::format("messages[{}] must be an object", i);
    if (!m.contains("role")) return fmt::format("messages[{}] is missing \"role\"", i);
    if (!m.contains("content")) return fmt::format("messages[{}] is missing \"content\"", i);
    if (!m["role"].is_string()) return fmt::format("messages[{}].role must be a string", i);
    if (!m["content"].is_string()) return fmt::format("messages[{}].content must be a string", i);
    std::string role = m["role"].get<std::string>();
    if (!valid_role(role))
      return fmt::format("messages[{}].role is \"{}\", expected system, user or assistant", i, role);
    out.push_back({std::move(role), m["content"].get<std::string>()});
  }
  return "";
}

Result<ChatTemplate> ChatTemplate::named(const std::string& name) {
  if (name == "simple") return ChatTemplate(Kind::kSimple);
  if (name == "chatml") return ChatTemplate(Kind::kChatml);
  if (name == "llama3") return ChatTemplate(Kind::kLlama3);
  return Status::error(fmt::format("data.chat_template is '{}'; expected simple, chatml or llama3", name));
}

std::string ChatTemplate::name() const {
  switch (kind_) {
    case Kind::kChatml:
      return "chatml";
    case Kind::kLlama3:
      return "llama3";
    default:
      return "simple";
  }
}

std::string ChatTemplate::end_marker() const {
  switch (kind_) {
    case Kind::kChatml:
      return "<|im_end|>";
    case Kind::kLlama3:
      return "<|eot_id|>";
    default:
      return "";
  }
}

void ChatTemplate::append_start(const Tokenizer& tok, Sample& s) const {
  append(s, tok.bos_id(), 0);
  if (kind_ == Kind::kLlama3) append(s, tok.encode("<|begin_of_text|>"), 0);
}

// One message. `last`: the final assistant turn of a training sample (nothing follows it).
void ChatTemplate::append_turn(const Tokenizer& tok, const ChatMessage& m, bool last, Sample& s) const {
  const bool assistant = m.role == "assistant";
  const uint8_t mask = assistant ? 1 : 0;
  switch (kind_) {
    case Kind::kSimple:
      append(s, tok.encode("<|" + m.role + "|>\n"), 0);
      append(s, tok.encode(m.content), mask);
      if (last)
        append(s, tok.eos_id(), 1);
      else
        append(s, tok.encode("\n"), 0);
      return;
    case Kind::kChatml:
      append(s, tok.encode("<|im_start|>" + m.role + "\n"), 0);
      break;
    case Kind::kLlama3:
      append(s, tok.encode("<|start_header_id|>" + m.role + "<|end_header_id|>\n\n"), 0);
      break;
  }
  append(s, tok.encode(m.content), mask);
  append(s, tok.encode(end_marker()), mask);
  if (assistant) append(s, tok.eos_id(), 1);
  if (kind_ == Kind::kChatml && !last) append(s, tok.encode("\n"), 0);
}

std::string ChatTemplate::conversation(const Tokenizer& tok, const std::vector<ChatMessage>& msgs,
                                       Sample& out) const {
  int64_t last_assistant = -1;
  for (size_t i = 0; i < msgs.size(); ++i)
    if (msgs[i].role == "assistant") last_assistant = static_cast<int64_t>(i);
  if (last_assistant < 0) return "conversation has no assistant message (nothing to learn)";
  append_start(tok, out);
  for (int64_t i = 0; i <= last_assistant; ++i)
    append_turn(tok, msgs[static_cast<size_t>(i)], i == last_assistant, out);
  return "";
}

Sample ChatTemplate::prompt_response(const Tokenizer& tok, const std::string& prompt,
                                     const std::string& response) const {
  Sample s;
  if (kind_ == Kind::kSimple) {
    append(s, tok.bos_id(), 0);
    append(s, tok.encode(prompt + "\n"), 0);
    append(s, tok.encode(response), 1);
    append(s, tok.eos_id(), 1);
    return s;
  }
  const std::string err = conversation(tok, {{"user", prompt}, {"assistant", response}}, s);
  NDT_CHECK(err.empty(), "{}", err);
  return s;
}

std::vector<int32_t> ChatTemplate::chat_prompt(const Tokenizer& tok,
                                               const std::vector<ChatMessage>& msgs) const {
  Sample s;
  append_start(tok, s);
  for (const ChatMessage& m : msgs) append_turn(tok, m, /*last=*/false, s);
  switch (kind_) {
    case Kind::kSimple:
      append(s, tok.encode("<|assistant|>\n"), 0);
      break;
    case Kind::kChatml:
      append(s, tok.encode("<|im_start|>assistant\n"), 0);
      break;
    case Kind::kLlama3:
      append(s, tok.encode("<|start_header_id|>assistant<|end_header_id|>\n\n"), 0);
      break;
  }
  return s.tokens;
}

std::vector<int32_t> ChatTemplate::text_prompt(const Tokenizer& tok, const std::string& prompt) const {
  if (kind_ != Kind::kSimple) return chat_prompt(tok, {{"user", prompt}});
  std::vector<int32_t> ids{tok.bos_id()};
  for (int32_t t : tok.encode(prompt + "\n")) ids.push_back(t);
  return ids;
}

std::vector<int32_t> ChatTemplate::response(const Tokenizer& tok, const std::string& content) const {
  std::vector<int32_t> ids = tok.encode(content);
  if (kind_ != Kind::kSimple)
    for (int32_t t : tok.encode(end_marker())) ids.push_back(t);
  ids.push_back(tok.eos_id());
  return ids;
}

std::string ChatTemplate::completion_text(const std::string& decoded) const {
  const std::string m = end_marker();
  if (!m.empty() && decoded.size() >= m.size() &&
      decoded.compare(decoded.size() - m.size(), m.size(), m) == 0)
    return decoded.substr(0, decoded.size() - m.size());
  return decoded;
}

}  // namespace ndt
