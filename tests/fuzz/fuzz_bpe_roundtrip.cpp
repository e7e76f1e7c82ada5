// Fuzz target: byte-level BPE encode / decode (data/bpe_tokenizer.h) on arbitrary text. Two tokenizers made
// at start-up cover the 256 byte symbols, a few merges and one special token: GPT-2 style (ByteLevel
// pre-tokenizer) and Llama-3 style (Split with its regex, ignore_merges). The input is the text. Properties:
//   - valid UTF-8 encodes without error, every id inside the vocabulary, and decode(encode(text)) == text
//     (unless the text holds the special token, which decode skips by design);
//   - invalid UTF-8 encodes and round-trips as well, or is refused with an ndt::Error;
//   - the byte tokenizer always round-trips.
#include <nlohmann/json.hpp>

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
    j["pre_tokenizer"] = {
        {"type", "Sequence"},
        {"pretokenizers",
         {{{"type", "Split"},
           {"pattern",
            {{"Regex",
              R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"}}},
           {"behavior", "Isolated"},
           {"invert", false}},
          {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
  else
    j["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};
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
                                          bytes = make_byte_tokenizer();
  const std::string text(fuzz::as_text(data, size));
  const bool utf8 = valid_utf8(text);
  const bool special = text.find("<|endoftext|>") != std::string::npos;
  for (const Tokenizer* tok : {gpt2.get(), llama3.get(), bytes.get()}) {
    std::vector<int32_t> ids;
    try {
      ids = tok->encode(text);
    } catch (const Error& e) {
      if (utf8 || tok == bytes.get()) fuzz::property_failed("encode of valid UTF-8 failed", e.what());
      continue;
    }
    for (int32_t id : ids)
      if (id < 0 || id >= tok->vocab_size()) fuzz::property_failed("encode", "id outside the vocabulary");
    if (!special && tok->decode(ids) != text)
      fuzz::property_failed("round trip", tok->name() + ": decode(encode(text)) != text");
  }
  return 0;
}
