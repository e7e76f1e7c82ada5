#pragma once
// Pretraining token shards (format in docs/data.md).
//
// File layout, little-endian:
//   offset  0: magic "NDTSHARD" (8 bytes)
//   offset  8: uint32 version (= 1)
//   offset 12: uint32 token_bytes (2 or 4)
//   offset 16: uint64 num_tokens
//   offset 24: uint64 vocab_size (every token id is < vocab_size)
//   offset 32: 32 reserved bytes, zero
//   offset 64: num_tokens tokens, uint16 or uint32 each
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "data/dataset.h"
#include "data/tokenizer.h"

namespace ndt {

inline constexpr char kShardMagic[8] = {'N', 'D', 'T', 'S', 'H', 'A', 'R', 'D'};
inline constexpr uint32_t kShardVersion = 1;
inline constexpr int64_t kShardHeaderBytes = 64;

struct ShardHeader {
  uint32_t version = kShardVersion;
  uint32_t token_bytes = 2;
  uint64_t num_tokens = 0;
  uint64_t vocab_size = 0;
};

// 2 when every id fits uint16 (vocab_size <= 65536), else 4.
uint32_t shard_token_bytes(int64_t vocab_size);

// Writes one shard; fails on ids outside [0, vocab_size) or IO errors (the message names the file).
Status write_token_shard(const std::string& path, const std::vector<int32_t>& tokens, int64_t vocab_size);

// A validated, memory-mapped, read-only shard. open() checks the magic, version, token width, that the
// file size matches the header, and that every id is < vocab_size; each error names the file.
class TokenShard {
 public:
  static Result<std::unique_ptr<TokenShard>> open(const std::string& path);
  ~TokenShard();
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;

  const std::string& path() const { return path_; }
  const ShardHeader& header() const { return header_; }
  int64_t num_tokens() const { return static_cast<int64_t>(header_.num_tokens); }
  int64_t vocab_size() const { return static_cast<int64_t>(header_.vocab_size); }
  int32_t token(int64_t i) const;
  // Copies tokens [begin, begin + n) to out.
  void read(int64_t begin, int64_t n, int32_t* out) const;

 private:
  TokenShard() = default;
  std::string path_;
  ShardHeader header_;
  const uint8_t* map_ = nullptr;
  size_t map_bytes_ = 0;
};

// Reads a whole shard into memory (validated as in TokenShard::open).
Result<std::vector<int32_t>> read_token_shard(const std::string& path, ShardHeader* header = nullptr);

// Pretraining windows over the concatenated token stream of one .bin file or of every *.bin file of a
// directory (sorted by name): sample i is tokens [i * seq_len, i * seq_len + seq_len + 1), loss on all
// tokens but the first; windows may span shard boundaries. size() = (total_tokens - 1) / seq_len.
class ShardDataset final : public Dataset {
 public:
  static Result<std::unique_ptr<ShardDataset>> open(const std::string& path, int64_t seq_len);
  int64_t size() const override { return size_; }
  Sample get(int64_t index) const override;
  int64_t total_tokens() const { return total_; }
  int64_t vocab_size() const { return vocab_; }  // the largest vocab_size of the shards
  int64_t num_shards() const { return static_cast<int64_t>(shards_.size()); }

 private:
  std::vector<std::unique_ptr<TokenShard>> shards_;
  std::vector<int64_t> starts_;  // global offset of each shard's first token (+ total at the end)
  int64_t seq_len_ = 0, total_ = 0, size_ = 0, vocab_ = 0;
};

// Tokenizes text files into shards out_prefix_000000.bin, out_prefix_000001.bin, ... of at most
// tokens_per_shard tokens. Each document is followed by EOS; a document is a whole file, or one line
// {"text": "..."} of a .jsonl file (blank lines skipped). Ids are stored in 2 bytes when the
// tokenizer's vocab <= 65536, else 4. Errors name the file (and the line for .jsonl).
Status tokenize_text_files(const std::vector<std::string>& inputs, const Tokenizer& tok,
                           const std::string& out_prefix, int64_t tokens_per_shard, int64_t* total_tokens);

}  // namespace ndt
