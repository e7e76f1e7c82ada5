// Fuzz target: BPE tokenizer files (byte-level and byte_fallback) (data/bpe_tokenizer.h). The input is a
// tokenizer.json, or, when it holds a line "#merges.txt", a vocab.json (the text before that line) with its
// merges.txt (the text after). A further line "#tokenizer_config.json" starts a tokenizer_config.json beside
// them. A tokenizer that loads encodes a few fixed texts (a vocabulary that lacks a byte, with no unk_token,
// may refuse with an ndt::Error) and decodes arbitrary ids, in range or not.
#include "data/bpe_tokenizer.h"
#include "fuzz_common.h"

using namespace ndt;

namespace {

// Cuts `text` at the first line equal to marker (without its newline); returns the rest, or "" and leaves
// text whole when there is no such line. `found` says which.
std::string cut(std::string& text, const std::string& marker, bool& found) {
  const std::string line = marker + "\n";
  size_t at = std::string::npos, rest = 0;
  if (text.rfind(line, 0) == 0) {
    at = 0;
    rest = line.size();
  } else if (const size_t p = text.find("\n" + line); p != std::string::npos) {
    at = p + 1;
    rest = at + line.size();
  }
  found = at != std::string::npos;
  if (!found) return "";
  std::string tail = text.substr(rest);
  text.resize(at);
  return tail;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string main_text(fuzz::as_text(data, size));
  bool has_config = false, has_merges = false;
  const std::string config = cut(main_text, "#tokenizer_config.json", has_config);
  const std::string merges = cut(main_text, "#merges.txt", has_merges);
  // A fresh directory per input (tokenizer_config.json is looked up beside the file).
  static int64_t n = 0;
  const std::string dir = fmt::format("tok{}", n++ % 2);
  std::filesystem::remove_all(fuzz::path(dir));
  std::string file;
  if (has_merges) {
    file = fuzz::write_file(dir + "/vocab.json", main_text);
    fuzz::write_file(dir + "/merges.txt", merges);
  } else {
    file = fuzz::write_file(dir + "/tokenizer.json", main_text);
  }
  if (has_config) fuzz::write_file(dir + "/tokenizer_config.json", config);
  try {
    auto t = load_bpe_tokenizer(file);
    if (!t) return 0;
    const Tokenizer& tok = *t.value();
    const int32_t v = static_cast<int32_t>(tok.vocab_size());
    for (int32_t id : {tok.bos_id(), tok.eos_id(), tok.pad_id()})
      if (id < 0 || id >= v) fuzz::property_failed("special id", "outside the vocabulary");
    (void)tok.decode({-1, 0, 1, v - 1, v, 1 << 30, tok.eos_id()});
    for (const char* s : {"", "Hello world!  It's 2024: caf\xc3\xa9, \xe6\x97\xa5\xe6\x9c\xac. ", "\n\n\t x",
                          "<|endoftext|>a<s></s>", "\xf0\x9f\x98\x80 ok"}) {
      try {
        const std::vector<int32_t> ids = tok.encode(s);
        for (int32_t id : ids)
          if (id < 0 || id >= v) fuzz::property_failed("encode", "id outside the vocabulary");
        (void)tok.decode(ids);
      } catch (const Error&) {
      }
    }
  } catch (const Error&) {
  }
  return 0;
}
