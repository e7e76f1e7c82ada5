#pragma once
// Supervised fine-tuning data: a JSONL file, one example per line (blank lines skipped), formatted with
// the chat template of data.chat_template (data/chat_template.h, docs/data.md):
//   {"prompt": P, "response": R}
//       -> ChatTemplate::prompt_response; simple: [BOS] P "\n" R [EOS], loss on R and EOS
//   {"messages": [{"role": "system"|"user"|"assistant", "content": C}, ...]}
//       -> ChatTemplate::conversation; loss on every assistant turn (content, and its end marker + EOS
//          for chatml/llama3; the last one's EOS for simple), messages after the last assistant dropped.
// Every piece is tokenized separately, so mask boundaries fall exactly between pieces. Samples longer
// than seq_len + 1 tokens are truncated (their tail loses its loss tokens).
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/status.h"
#include "data/chat_template.h"
#include "data/dataset.h"
#include "data/tokenizer.h"

namespace ndt {

class SftDataset final : public Dataset {
 public:
  // Reads and tokenizes the whole file. Errors (missing file, invalid JSON, missing or mistyped fields,
  // unknown role, no assistant message, empty file) name the file and the 1-based line.
  static Result<std::unique_ptr<SftDataset>> load(const std::string& path, const Tokenizer& tok,
                                                  int64_t seq_len, const ChatTemplate& tmpl = ChatTemplate());
  int64_t size() const override { return static_cast<int64_t>(samples_.size()); }
  Sample get(int64_t index) const override;
  int64_t num_truncated() const { return truncated_; }  // samples cut to seq_len + 1 tokens

 private:
  std::vector<Sample> samples_;
  int64_t truncated_ = 0;
};

// The prompt side of the simple template, for generation: [BOS] P "\n", and for a chat the formatted
// messages followed by "<|assistant|>\n" (ChatTemplate().text_prompt / chat_prompt).
std::vector<int32_t> sft_prompt_tokens(const Tokenizer& tok, const std::string& prompt);
std::vector<int32_t> sft_chat_prompt_tokens(
    const Tokenizer& tok, const std::vector<std::pair<std::string, std::string>>& role_content);

}  // namespace ndt
