#include "data/tokenizer.h"

#include <fmt/format.h>
#include <sentencepiece_processor.h>

#include <cstdlib>
#include <filesystem>
#include <sstream>

#include "data/bpe_tokenizer.h"

namespace ndt {

namespace {

class ByteTokenizer final : public Tokenizer {
 public:
  static constexpr int32_t kBos = 256, kEos = 257, kPad = 258;
  std::vector<int32_t> encode(const std::string& text) const override {
    std::vector<int32_t> ids(text.size());
    for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
    return ids;
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string s;
    s.reserve(ids.size());
    for (int32_t id : ids)
      if (id >= 0 && id < 256) s.push_back(static_cast<char>(id));  // specials and junk ids are skipped
    return s;
  }
  int64_t vocab_size() const override { return 259; }
  int32_t bos_id() const override { return kBos; }
  int32_t eos_id() const override { return kEos; }
  int32_t pad_id() const override { return kPad; }
  std::string name() const override { return "byte"; }
};

class SentencePieceTokenizer final : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(std::string path) : path_(std::move(path)) {}

  Status load() {
    auto st = sp_.Load(path_);
    if (!st.ok())
      return Status::error(fmt::format("cannot load SentencePiece model '{}': {}", path_, st.ToString()));
    vocab_ = sp_.GetPieceSize();
    eos_ = sp_.eos_id();
    // Documents are terminated by EOS and generation stops at it, so the model must have one.
    if (eos_ < 0)
      return Status::error(fmt::format("SentencePiece model '{}' has no EOS piece (eos_id = -1)", path_));
    // Without a BOS piece, documents start with EOS (GPT-2 style separator); without PAD, padding uses EOS
    // (padded positions never bear loss, so the id only has to be a valid embedding row).
    bos_ = sp_.bos_id() >= 0 ? sp_.bos_id() : eos_;
    pad_ = sp_.pad_id() >= 0 ? sp_.pad_id() : eos_;
    return Status::ok();
  }

  std::vector<int32_t> encode(const std::string& text) const override {
    std::vector<int> ids;
    auto st = sp_.Encode(text, &ids);
    NDT_CHECK(st.ok(), "SentencePiece encode failed ({}): {}", path_, st.ToString());
    return {ids.begin(), ids.end()};
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    std::vector<int> keep;
    keep.reserve(ids.size());
    for (int32_t id : ids) {
      if (id < 0 || id >= vocab_ || id == bos_ || id == eos_ || id == pad_ || sp_.IsControl(id)) continue;
      keep.push_back(id);
    }
    std::string out;
    auto st = sp_.Decode(keep, &out);
    NDT_CHECK(st.ok(), "SentencePiece decode failed ({}): {}", path_, st.ToString());
    return out;
  }
  int64_t vocab_size() const override { return vocab_; }
  int32_t bos_id() const override { return bos_; }
  int32_t eos_id() const override { return eos_; }
  int32_t pad_id() const override { return pad_; }
  std::string name() const override { return "sentencepiece:" + path_; }

 private:
  std::string path_;
  sentencepiece::SentencePieceProcessor sp_;
  int32_t vocab_ = 0, bos_ = -1, eos_ = -1, pad_ = -1;
};

}  // namespace

std::unique_ptr<Tokenizer> make_byte_tokenizer() { return std::make_unique<ByteTokenizer>(); }

Result<std::unique_ptr<Tokenizer>> load_sentencepiece_tokenizer(const std::string& model_path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(model_path, ec))
    return Status::error(fmt::format("SentencePiece model '{}': no such file", model_path));
  auto tok = std::make_unique<SentencePieceTokenizer>(model_path);
  Status st = tok->load();
  if (!st) return st;
  return std::unique_ptr<Tokenizer>(std::move(tok));
}

namespace {

class IdTokenizer : public Tokenizer {
 public:
  explicit IdTokenizer(int64_t n) : n_(n) {}
  std::vector<int32_t> encode(const std::string& text) const override {
    std::vector<int32_t> ids;
    std::istringstream in(text);
    std::string word;
    while (in >> word) {
      char* end = nullptr;
      const long long id = std::strtoll(word.c_str(), &end, 10);
      NDT_CHECK(*end == '\0' && id >= 0 && id < n_, "tokenizer ids:{}: '{}' is not an id in [0, {})", n_,
                word, n_);
      ids.push_back(static_cast<int32_t>(id));
    }
    return ids;
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string out;
    for (int32_t id : ids)
      if (id != eos_id()) out += (out.empty() ? "" : " ") + std::to_string(id);
    return out;
  }
  int64_t vocab_size() const override { return n_; }
  int32_t bos_id() const override { return static_cast<int32_t>(n_ - 1); }
  int32_t eos_id() const override { return static_cast<int32_t>(n_ - 1); }
  int32_t pad_id() const override { return static_cast<int32_t>(n_ - 1); }
  std::string name() const override { return "ids:" + std::to_string(n_); }

 private:
  int64_t n_;
};

}  // namespace

std::unique_ptr<Tokenizer> make_id_tokenizer(int64_t n) { return std::make_unique<IdTokenizer>(n); }

Result<std::unique_ptr<Tokenizer>> make_tokenizer(const std::string& spec) {
  if (spec == "byte") return make_byte_tokenizer();
  if (spec.rfind("ids:", 0) == 0) {
    char* end = nullptr;
    const long long n = std::strtoll(spec.c_str() + 4, &end, 10);
    if (spec.size() == 4 || *end != '\0' || n < 2 || n > (1LL << 31) - 1)
      return Status::error(
          fmt::format("tokenizer '{}': expected ids:N with N an integer in [2, 2^31)", spec));
    return std::unique_ptr<Tokenizer>(make_id_tokenizer(n));
  }
  std::error_code ec;
  const std::filesystem::path p(spec);
  if (std::filesystem::is_directory(p, ec) || p.extension() == ".json") return load_bpe_tokenizer(spec);
  if (!std::filesystem::is_regular_file(spec, ec))
    return Status::error(
        fmt::format("tokenizer '{}': not \"byte\", \"ids:N\", a SentencePiece .model file, a tokenizer.json "
                    "/ vocab.json or "
                    "a directory holding one",
                    spec));
  return load_sentencepiece_tokenizer(spec);
}

}  // namespace ndt
