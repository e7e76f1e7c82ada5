// Fuzz target: BPE encode / decode (data/bpe_tokenizer.h) on arbitrary text. Three tokenizers made at
// start-up: GPT-2 style (ByteLevel pre-tokenizer) and Llama-3 style (Split with its regex, ignore_merges),
// both with the 256 byte symbols, a few merges and one special token, and Llama-2 style (byte_fallback with
// <0x00>..<0xFF>, the Prepend / Replace normalizer, <unk> <s> </s>). The input is the text. Properties:
//   - valid UTF-8 encodes without error, every id inside the vocabulary, and decode(encode(text)) == text
//     (unless the text holds a special token, which decode skips by design);
//   - invalid UTF-8 encodes and round-trips as well, or is refused with an ndt::Error (byte-level);
//   - the byte_fallback tokenizer encodes any bytes and round-trips them unless they hold "▁" (decoded as a
//     space) or a special token; the byte tokenizer always round-trips.
#include <array>
#include <nlohmann/json.hpp>

#include "../bpe_fixtures.h"
#include "data/bpe_tokenizer.h"
#include "data/tokenizer.h"
#include "fuzz_common.h"

using namespace ndt;

namespace {

// GPT-2's bytes_to_unicode, as UTF-8 strings.
std::vector<std::string> byte_symbols() {
  std::vector<std::string> out;
  int n = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    const uint32_t cp = printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + n++);
    std::string s;
    if (cp < 0x80) {
      s += static_cast<char>(cp);
    } else {
      s += static_cast<char>(0xC0 | (cp >> 6));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    }
    out.push_back(s);
  }
  return out;
}

std::unique_ptr<Tokenizer> make(const std::string& name, bool llama3) {
  const std::vector<std::string> sym = byte_symbols();
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) vocab[sym[b]] = b;
  const std::string sp = sym[' '], nl = sym['\n'];
  const std::vector<std::pair<std::string, std::string>> merges = {
      {sp, "t"},        {"h", "e"},
      {sp + "t", "he"}, {"i", "n"},
      {sp, "a"},        {"e", "r"},
      {nl, nl},         {sp, sp},
      {"o", "n"},       {sp, "w"},
      {"r", "e"},       {sp + "w", "o"},
      {"0", "0"},       {"\xc3\x83", "\xc2\xa9"}};  // the last: "é" (C3 A9) as byte symbols
  nlohmann::json jm = nlohmann::json::array();
  int32_t id = 256;
  for (const auto& [a, b] : merges) {
    jm.push_back(a + " " + b);
    if (!vocab.contains(a + b)) vocab[a + b] = id++;
  }
  nlohmann::json j;
  j["model"] = {{"type", "BPE"}, {"vocab", vocab}, {"merges", jm}, {"ignore_merges", llama3}};
  j["added_tokens"] = {{{"id", id}, {"content", "<|endoftext|>"}, {"special", true}}};
  if (llama3)
    j["pre_tokenizer"] = testing::llama3_pre_tokenizer();
  else
    j["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};
  const std::string path = fuzz::write_file(name + "/tokenizer.json", j.dump());
  return load_bpe_tokenizer(path).value();
}

// Llama 2 layout: <unk> <s> </s> = 0 1 2, <0x00>..<0xFF> = 3..258, then characters and merges.
std::unique_ptr<Tokenizer> make_byte_fallback(const std::string& name) {
  const std::string meta = "\u2581";
  nlohmann::json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
  for (int b = 0; b < 256; ++b) vocab[fmt::format("<0x{:02X}>", b)] = 3 + b;
  int32_t id = 259;
  for (const std::string c : {meta, std::string("t"), std::string("h"), std::string("e"), std::string("a"),
                              std::string("n"), std::string("\u00e9"), std::string("\u4e2d")})
    vocab[c] = id++;
  const std::vector<std::pair<std::string, std::string>> merges = {
      {meta, "t"}, {"h", "e"}, {meta + "t", "he"}, {meta, "a"}, {"a", "n"}, {meta, meta}, {meta + "a", "n"}};
  nlohmann::json jm = nlohmann::json::array();
  for (const auto& [a, b] : merges) {
    jm.push_back(a + " " + b);
    if (!vocab.contains(a + b)) vocab[a + b] = id++;
  }
  nlohmann::json j;
  j["model"] = {{"type", "BPE"},         {"vocab", vocab},       {"merges", jm},
                {"byte_fallback", true}, {"unk_token", "<unk>"}, {"fuse_unk", true}};
  j["added_tokens"] = nlohmann::json::array();
  for (int i = 0; i < 3; ++i)
    j["added_tokens"].push_back({{"id", i},
                                 {"content", std::array{"<unk>", "<s>", "</s>"}[i]},
                                 {"normalized", false},
                                 {"special", true}});
  j["normalizer"] = {{"type", "Sequence"},
                     {"normalizers",
                      {{{"type", "Prepend"}, {"prepend", meta}},
                       {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", meta}}}}};
  j["decoder"] = {{"type", "Sequence"},
                  {"decoders",
                   {{{"type", "Replace"}, {"pattern", {{"String", meta}}}, {"content", " "}},
                    {{"type", "ByteFallback"}},
                    {{"type", "Fuse"}},
                    {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}};
  const std::string path = fuzz::write_file(name + "/tokenizer.json", j.dump());
  return load_bpe_tokenizer(path).value();
}

bool valid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      i += 1;
      continue;
    } else if ((c >> 5) == 6) {
      n = 2, cp = c & 0x1F;
    } else if ((c >> 4) == 14) {
      n = 3, cp = c & 0x0F;
    } else if ((c >> 3) == 30) {
      n = 4, cp = c & 0x07;
    } else {
      return false;
    }
    if (i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      const auto d = static_cast<unsigned char>(s[i + k]);
      if ((d >> 6) != 2) return false;
      cp = (cp << 6) | (d & 0x3F);
    }
    if ((n == 2 && cp < 0x80) || (n == 3 && cp < 0x800) || (n == 4 && (cp < 0x10000 || cp > 0x10FFFF)) ||
        (cp >= 0xD800 && cp <= 0xDFFF))
      return false;
    i += n;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::unique_ptr<Tokenizer> gpt2 = make("gpt2", false), llama3 = make("llama3", true),
                                          llama2 = make_byte_fallback("llama2"),
                                          bytes = make_byte_tokenizer();
  const std::string text(fuzz::as_text(data, size));
  const bool utf8 = valid_utf8(text);
  const bool special = text.find("<|endoftext|>") != std::string::npos;
  const bool sp_special = text.find("\u2581") != std::string::npos || text.find("<s>") != std::string::npos ||
                          text.find("</s>") != std::string::npos || text.find("<unk>") != std::string::npos;
  for (const Tokenizer* tok : {gpt2.get(), llama3.get(), llama2.get(), bytes.get()}) {
    std::vector<int32_t> ids;
    try {
      ids = tok->encode(text);
    } catch (const Error& e) {
      if (utf8 || tok == bytes.get() || tok == llama2.get())
        fuzz::property_failed(utf8 ? "encode of valid UTF-8 failed" : "encode failed", e.what());
      continue;
    }
    for (int32_t id : ids)
      if (id < 0 || id >= tok->vocab_size()) fuzz::property_failed("encode", "id outside the vocabulary");
    if (!(tok == llama2.get() ? sp_special : special) && tok->decode(ids) != text)
      fuzz::property_failed("round trip", tok->name() + ": decode(encode(text)) != text");
  }
  return 0;
}
