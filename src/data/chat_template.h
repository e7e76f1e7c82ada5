#pragma once
// Chat templates (docs/data.md, "Chat templates"): how a conversation [{role, content}, ...] becomes
// tokens and a loss mask for SFT, and how the same conversation becomes a generation prompt for DPO/GRPO.
// One template per run, `data.chat_template`:
//
//   simple (default; the format from before templates existed, unchanged)
//     [BOS] per message: "<|role|>\n" C "\n"; the last assistant message ends with [EOS] instead of "\n".
//     Loss on every assistant content and on the final EOS. Generation prompt: ... "<|assistant|>\n".
//   chatml
//     [BOS] per message: "<|im_start|>" role "\n" C "<|im_end|>" "\n"
//   llama3
//     [BOS] "<|begin_of_text|>" per message: "<|start_header_id|>" role "<|end_header_id|>\n\n" C
//     "<|eot_id|>"
//
// chatml / llama3: every assistant turn is content + end marker + [EOS], all loss-bearing (the marker is
// several tokens with the byte tokenizer; the EOS token after it is what generation stops on). For chatml
// the "\n" separator follows the EOS and bears no loss. The sample ends with the EOS of the last assistant
// turn (later messages carry no loss and are dropped). The generation prompt is [BOS] (+ text marker) +
// the conversation so far, formatted the same way, + the assistant header; the completion is content +
// marker + EOS, and completion_text() strips the marker from its decoded text.
//
// Every piece (header, content, marker, separator) is tokenized separately, so mask boundaries fall
// exactly between pieces and a sample equals the concatenation prompt + response.
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "core/status.h"
#include "data/dataset.h"
#include "data/tokenizer.h"

namespace ndt {

struct ChatMessage {
  std::string role;  // "system", "user" or "assistant"
  std::string content;
};

// Reads a JSON array of {"role", "content"} objects; returns "" or an error text naming the field
// (e.g. `messages[2].role is "bot", expected system, user or assistant`).
std::string parse_chat_messages(const nlohmann::json& messages, std::vector<ChatMessage>& out);

class ChatTemplate {
 public:
  enum class Kind { kSimple, kChatml, kLlama3 };
  // "simple", "chatml" or "llama3"; other names are an error naming data.chat_template.
  static Result<ChatTemplate> named(const std::string& name);
  explicit ChatTemplate(Kind kind = Kind::kSimple) : kind_(kind) {}
  Kind kind() const { return kind_; }
  std::string name() const;

  // SFT sample of a conversation: tokens + loss mask as documented above. Returns "" or an error text
  // (no assistant message).
  std::string conversation(const Tokenizer& tok, const std::vector<ChatMessage>& msgs, Sample& out) const;
  // SFT sample of {"prompt": P, "response": R}: simple: [BOS] P "\n" R [EOS] (loss on R and EOS); the
  // chat templates: the conversation [user P, assistant R].
  Sample prompt_response(const Tokenizer& tok, const std::string& prompt, const std::string& response) const;

  // Generation prompt of the conversation so far (its messages formatted as in training) + the assistant
  // header.
  std::vector<int32_t> chat_prompt(const Tokenizer& tok, const std::vector<ChatMessage>& msgs) const;
  // Generation prompt of a plain text prompt: simple: [BOS] P "\n"; the chat templates: chat_prompt of
  // one user message P. prompt_response's sample starts with exactly these tokens.
  std::vector<int32_t> text_prompt(const Tokenizer& tok, const std::string& prompt) const;
  // Tokens of an assistant response after a prompt: C [EOS] (simple) or C marker [EOS], all loss-bearing
  // in training.
  std::vector<int32_t> response(const Tokenizer& tok, const std::string& content) const;

  // The end-of-turn marker text: "" (simple), "<|im_end|>" or "<|eot_id|>".
  std::string end_marker() const;
  // A completion's decoded text (EOS already removed) without its trailing end marker, if it has one.
  std::string completion_text(const std::string& decoded) const;

 private:
  void append_turn(const Tokenizer& tok, const ChatMessage& m, bool last, Sample& s) const;
  void append_start(const Tokenizer& tok, Sample& s) const;
  Kind kind_;
};

}  // namespace ndt
