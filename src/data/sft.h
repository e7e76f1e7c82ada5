#pragma once
// Supervised fine-tuning data: a JSONL file, one example per line (blank lines skipped), formatted with
// a fixed template (docs/data.md):
//   {"prompt": P, "response": R}
//       -> [BOS] P "\n" R [EOS]                          loss on R and EOS
//   {"messages": [{"role": "system"|"user"|"assistant", "content": C}, ...]}
//       -> [BOS] for each message: "<|role|>\n" C "\n"   loss on assistant contents only;
//          the last assistant message ends with [EOS] (loss-bearing) instead of "\n", and messages after
//          it are dropped (they would carry no loss).
// Every piece is tokenized separately, so mask boundaries fall exactly between pieces. Samples longer
// than seq_len + 1 tokens are truncated (their tail loses its loss tokens).
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/status.h"
#include "data/dataset.h"
#include "data/tokenizer.h"

namespace ndt {

class SftDataset final : public Dataset {
 public:
  // Reads and tokenizes the whole file. Errors (missing file, invalid JSON, missing or mistyped fields,
  // unknown role, no assistant message, empty file) name the file and the 1-based line.
  static Result<std::unique_ptr<SftDataset>> load(const std::string& path, const Tokenizer& tok,
                                                  int64_t seq_len);
  int64_t size() const override { return static_cast<int64_t>(samples_.size()); }
  Sample get(int64_t index) const override;
  int64_t num_truncated() const { return truncated_; }  // samples cut to seq_len + 1 tokens

 private:
  std::vector<Sample> samples_;
  int64_t truncated_ = 0;
};

// The prompt side of the templates, for generation: [BOS] P "\n", and for a chat the formatted
// messages followed by "<|assistant|>\n".
std::vector<int32_t> sft_prompt_tokens(const Tokenizer& tok, const std::string& prompt);
std::vector<int32_t> sft_chat_prompt_tokens(
    const Tokenizer& tok, const std::vector<std::pair<std::string, std::string>>& role_content);

}  // namespace ndt
