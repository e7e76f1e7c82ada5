#pragma once
// Tokenizers: a built-in byte-level one and SentencePiece .model files (through libsentencepiece).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"

namespace ndt {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::vector<int32_t> encode(const std::string& text) const = 0;  // no BOS/EOS added
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;   // special ids are skipped
  virtual int64_t vocab_size() const = 0;
  virtual int32_t bos_id() const = 0;
  virtual int32_t eos_id() const = 0;
  virtual int32_t pad_id() const = 0;
  virtual std::string name() const = 0;
};

// Bytes 0..255 are tokens 0..255; BOS = 256, EOS = 257, PAD = 258; vocab_size() = 259.
std::unique_ptr<Tokenizer> make_byte_tokenizer();
// Loads a SentencePiece model; the error names the file.
Result<std::unique_ptr<Tokenizer>> load_sentencepiece_tokenizer(const std::string& model_path);
// Pre-tokenized data (token shards written by another tokenizer, e.g. GPT-2's): ids 0..n-1; BOS = EOS =
// PAD = n - 1 (GPT-2's <|endoftext|> for n = 50257). Text is whitespace-separated decimal ids both ways.
std::unique_ptr<Tokenizer> make_id_tokenizer(int64_t n);
// "byte", "ids:N" (make_id_tokenizer), a path to a SentencePiece .model file, or a BPE tokenizer
// (data/bpe_tokenizer.h; byte-level or byte_fallback): a tokenizer.json, a vocab.json with merges.txt, or a
// directory.
Result<std::unique_ptr<Tokenizer>> make_tokenizer(const std::string& spec);

}  // namespace ndt
