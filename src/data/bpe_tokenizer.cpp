#include "data/bpe_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <fmt/format.h>
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <climits>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>

#include "core/check.h"

namespace fs = std::filesystem;

namespace ndt {
namespace {

// GPT-2's pre-tokenizer pattern (ByteLevel with use_regex).
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

std::string utf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

// GPT-2's bytes_to_unicode: printable bytes map to themselves, the others to 256 + n, as UTF-8 strings.
struct ByteTable {
  std::array<std::string, 256> to_unicode;
  std::unordered_map<std::string, uint8_t> to_byte;
  ByteTable() {
    std::array<bool, 256> printable{};
    for (int b = '!'; b <= '~'; ++b) printable[b] = true;
    for (int b = 0xA1; b <= 0xAC; ++b) printable[b] = true;
    for (int b = 0xAE; b <= 0xFF; ++b) printable[b] = true;
    uint32_t n = 0;
    for (int b = 0; b < 256; ++b) {
      to_unicode[b] = utf8(printable[b] ? static_cast<uint32_t>(b) : 256 + n++);
      to_byte[to_unicode[b]] = static_cast<uint8_t>(b);
    }
  }
};
const ByteTable& bytes() {
  static const ByteTable t;
  return t;
}

// Length of the UTF-8 character starting at s[i] (1 for a stray byte).
size_t char_len(const std::string& s, size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  const size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
  return std::min(n, s.size() - i);
}

class BpeTokenizer final : public Tokenizer {
 public:
  std::unordered_map<std::string, int32_t> vocab;
  std::vector<std::string> id_to_token;
  std::map<std::pair<std::string, std::string>, int32_t> ranks;
  std::vector<std::pair<std::string, int32_t>> added;  // content -> id, longest first
  std::vector<bool> special;                           // by id: skipped by decode
  bool ignore_merges = false;
  int32_t bos = -1, eos = -1, pad = -1;
  std::string source;
  pcre2_code* re = nullptr;

  ~BpeTokenizer() override {
    if (re) pcre2_code_free(re);
  }

  std::vector<int32_t> encode(const std::string& text) const override {
    std::vector<int32_t> out;
    size_t start = 0;
    for (size_t i = 0; i < text.size();) {
      const std::pair<std::string, int32_t>* hit = nullptr;
      for (const auto& a : added)
        if (text.compare(i, a.first.size(), a.first) == 0) {
          hit = &a;
          break;
        }
      if (!hit) {
        ++i;
        continue;
      }
      encode_text(text.substr(start, i - start), out);
      out.push_back(hit->second);
      i += hit->first.size();
      start = i;
    }
    encode_text(text.substr(start), out);
    return out;
  }

  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string chars, out;
    for (int32_t id : ids) {
      if (id < 0 || id >= static_cast<int32_t>(id_to_token.size()) || special[static_cast<size_t>(id)])
        continue;
      chars += id_to_token[static_cast<size_t>(id)];
    }
    const auto& tb = bytes().to_byte;
    for (size_t i = 0; i < chars.size();) {
      const size_t n = char_len(chars, i);
      auto it = tb.find(chars.substr(i, n));
      if (it != tb.end())
        out += static_cast<char>(it->second);
      else
        out += chars.substr(i, n);  // a non-byte-level added token's text
      i += n;
    }
    return out;
  }

  int64_t vocab_size() const override { return static_cast<int64_t>(id_to_token.size()); }
  int32_t bos_id() const override { return bos; }
  int32_t eos_id() const override { return eos; }
  int32_t pad_id() const override { return pad; }
  std::string name() const override { return "bpe:" + source; }

 private:
  void encode_text(const std::string& text, std::vector<int32_t>& out) const {
    if (text.empty()) return;
    // Freed on every path: bpe() throws on a symbol missing from the vocabulary.
    const std::unique_ptr<pcre2_match_data, void (*)(pcre2_match_data*)> owner(
        pcre2_match_data_create_from_pattern(re, nullptr), pcre2_match_data_free);
    pcre2_match_data* md = owner.get();
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    size_t pos = 0, last = 0;
    while (pos <= text.size()) {
      // The subject's UTF-8 is validated by the first call only (PCRE2 would check the whole subject on
      // every call: quadratic in the text length).
      const int rc =
          pcre2_match(re, subject, text.size(), pos, pos == 0 ? 0 : PCRE2_NO_UTF_CHECK, md, nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof(msg));
        NDT_FAIL("tokenizer {}: cannot split the text at byte {}: {} (invalid UTF-8?)", source, pos,
                 reinterpret_cast<const char*>(msg));
      }
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      const size_t b = ov[0], e = ov[1];
      if (b > last) bpe(text.substr(last, b - last), out);  // text between matches (Isolated)
      if (e > b) bpe(text.substr(b, e - b), out);
      last = e;
      pos = e > b ? e : e + char_len(text, e);
      if (e == text.size()) break;
    }
    if (last < text.size()) bpe(text.substr(last), out);
  }

  // One piece: its bytes as byte-level characters, merged by rank.
  void bpe(const std::string& piece, std::vector<int32_t>& out) const {
    std::vector<std::string> sym;
    std::string whole;
    for (unsigned char c : piece) {
      sym.push_back(bytes().to_unicode[c]);
      whole += sym.back();
    }
    {
      std::lock_guard<std::mutex> lock(cache_mu_);
      auto it = cache_.find(whole);
      if (it != cache_.end()) {
        out.insert(out.end(), it->second.begin(), it->second.end());
        return;
      }
    }
    std::vector<int32_t> ids;
    auto direct = ignore_merges ? vocab.find(whole) : vocab.end();
    if (direct != vocab.end()) {
      ids.push_back(direct->second);
    } else {
      while (sym.size() > 1) {
        int32_t best = INT32_MAX;
        size_t at = 0;
        for (size_t i = 0; i + 1 < sym.size(); ++i) {
          auto it = ranks.find({sym[i], sym[i + 1]});
          if (it != ranks.end() && it->second < best) {
            best = it->second;
            at = i;
          }
        }
        if (best == INT32_MAX) break;
        // Merge every occurrence of this pair, left to right (the reference implementation's rule).
        const std::string a = sym[at], b = sym[at + 1];
        std::vector<std::string> next;
        for (size_t i = 0; i < sym.size();) {
          if (i + 1 < sym.size() && sym[i] == a && sym[i + 1] == b) {
            next.push_back(a + b);
            i += 2;
          } else {
            next.push_back(sym[i++]);
          }
        }
        sym.swap(next);
      }
      for (const auto& s : sym) {
        auto it = vocab.find(s);
        NDT_CHECK(it != vocab.end(), "tokenizer {}: symbol '{}' is not in the vocabulary", source, s);
        ids.push_back(it->second);
      }
    }
    out.insert(out.end(), ids.begin(), ids.end());
    std::lock_guard<std::mutex> lock(cache_mu_);
    if (cache_.size() < 200000) cache_.emplace(whole, std::move(ids));
  }

  mutable std::mutex cache_mu_;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache_;
};

Result<nlohmann::json> read_json(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::error(fmt::format("tokenizer: cannot open '{}'", path));
  nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
  if (j.is_discarded()) return Status::error(fmt::format("tokenizer: '{}': invalid JSON", path));
  return j;
}

// The special token named by tokenizer_config.json's key (a string or {"content": ...}), "" if none.
std::string config_token(const nlohmann::json& cfg, const char* key) {
  if (!cfg.is_object() || !cfg.contains(key)) return "";
  const auto& v = cfg[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string())
    return v["content"].get<std::string>();
  return "";
}

// A token id from a vocabulary file: an integer (a float or a string is refused: converting one is undefined
// when out of range) in [0, INT32_MAX). Throws ndt::Error naming the token; finish() bounds the largest id.
int32_t json_token_id(const nlohmann::json& v, const std::string& token) {
  if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= INT32_MAX ||
      (v.is_number_unsigned() && v.get<uint64_t>() >= uint64_t{INT32_MAX}))
    throw Error(fmt::format("token '{}' has id {}, expected an integer in [0, 2^31 - 1)", token, v.dump()));
  return static_cast<int32_t>(v.get<int64_t>());
}

Status finish(BpeTokenizer& t, const std::string& pattern, const fs::path& dir) {
  int err = 0;
  PCRE2_SIZE off = 0;
  t.re = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.c_str()), PCRE2_ZERO_TERMINATED,
                       PCRE2_UTF | PCRE2_UCP, &err, &off, nullptr);
  if (!t.re) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof(msg));
    return Status::error(fmt::format("tokenizer {}: pre-tokenizer regex does not compile at offset {}: {}",
                                     t.source, off, reinterpret_cast<const char*>(msg)));
  }
  pcre2_jit_compile(t.re, PCRE2_JIT_COMPLETE);  // faster when available; matching works without it
  // Ids index a table of the largest id + 1 entries: holes are allowed, but not so many that a small file
  // sizes a huge table (real vocabularies are dense: n == the number of distinct ids).
  int32_t n = 0;
  for (const auto& [tok, id] : t.vocab) n = std::max(n, id + 1);
  for (const auto& [tok, id] : t.added) n = std::max(n, id + 1);
  const int64_t entries = static_cast<int64_t>(t.vocab.size() + t.added.size());
  if (n > 2 * entries + 1024)
    return Status::error(fmt::format(
        "tokenizer {}: the largest token id is {} but there are only {} tokens (ids must be nearly dense)",
        t.source, n - 1, entries));
  t.id_to_token.assign(static_cast<size_t>(n), "");
  t.special.resize(static_cast<size_t>(n), false);
  for (const auto& [tok, id] : t.vocab) t.id_to_token[static_cast<size_t>(id)] = tok;
  std::sort(t.added.begin(), t.added.end(),
            [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  auto id_of = [&](const std::string& s) -> int32_t {
    if (s.empty()) return -1;
    for (const auto& [c, id] : t.added)
      if (c == s) return id;
    auto it = t.vocab.find(s);
    return it == t.vocab.end() ? -1 : it->second;
  };
  nlohmann::json cfg;
  if (fs::exists(dir / "tokenizer_config.json")) {
    auto c = read_json((dir / "tokenizer_config.json").string());
    if (!c) return c.status();
    cfg = c.value();
  }
  t.bos = id_of(config_token(cfg, "bos_token"));
  t.eos = id_of(config_token(cfg, "eos_token"));
  t.pad = id_of(config_token(cfg, "pad_token"));
  for (const char* s : {"<|begin_of_text|>", "<s>", "<|endoftext|>"})
    if (t.bos < 0) t.bos = id_of(s);
  for (const char* s : {"<|end_of_text|>", "<|endoftext|>", "</s>"})
    if (t.eos < 0) t.eos = id_of(s);
  if (t.bos < 0) t.bos = t.eos;
  if (t.pad < 0) t.pad = t.eos;
  if (t.eos < 0)
    return Status::error(
        fmt::format("tokenizer {}: no end-of-text token (tokenizer_config.json eos_token, <|end_of_text|>, "
                    "<|endoftext|> or "
                    "</s>)",
                    t.source));
  return Status::ok();
}

Result<std::unique_ptr<Tokenizer>> from_tokenizer_json(const fs::path& path) {
  auto j = read_json(path.string());
  if (!j) return j.status();
  const nlohmann::json& tj = j.value();
  auto t = std::make_unique<BpeTokenizer>();
  t->source = path.string();
  try {
    const auto& model = tj.at("model");
    if (model.value("type", std::string("BPE")) != "BPE")
      return Status::error(fmt::format("tokenizer '{}': model type \"{}\" is not supported (only BPE)",
                                       path.string(), model.value("type", std::string())));
    if (model.value("byte_fallback", false))
      return Status::error(fmt::format(
          "tokenizer '{}': byte_fallback BPE (SentencePiece-style) is not supported; use the .model file",
          path.string()));
    t->ignore_merges = model.value("ignore_merges", false);
    if (!model.at("vocab").is_object())
      return Status::error(
          fmt::format("tokenizer '{}': model.vocab must be an object {{token: id}}", path.string()));
    for (auto it = model.at("vocab").begin(); it != model.at("vocab").end(); ++it)
      t->vocab[it.key()] = json_token_id(it.value(), it.key());
    int32_t rank = 0;
    for (const auto& m : model.at("merges")) {
      std::string a, b;
      if (m.is_string()) {
        const std::string s = m.get<std::string>();
        const size_t sp = s.find(' ');
        if (sp == std::string::npos)
          return Status::error(
              fmt::format("tokenizer '{}': merge {} \"{}\" has no space", path.string(), rank, s));
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else {
        a = m.at(0).get<std::string>();
        b = m.at(1).get<std::string>();
      }
      t->ranks.emplace(std::make_pair(a, b), rank++);
    }
    if (tj.contains("added_tokens") && tj["added_tokens"].is_array())
      for (const auto& a : tj["added_tokens"]) {
        const std::string content = a.at("content").get<std::string>();
        if (content.empty())
          return Status::error(
              fmt::format("tokenizer '{}': an added token has empty content", path.string()));
        t->added.emplace_back(content, json_token_id(a.at("id"), content));
      }
    // The pre-tokenizer's pattern: GPT-2's for ByteLevel(use_regex), a Split's own otherwise.
    std::string pattern;
    std::function<Status(const nlohmann::json&)> scan = [&](const nlohmann::json& p) -> Status {
      if (p.is_null()) return Status::ok();
      const std::string type = p.value("type", std::string());
      if (type == "Sequence") {
        for (const auto& q : p.at("pretokenizers")) {
          Status s = scan(q);
          if (!s.is_ok()) return s;
        }
      } else if (type == "ByteLevel") {
        if (p.value("add_prefix_space", false))
          return Status::error(
              fmt::format("tokenizer '{}': ByteLevel add_prefix_space is not supported", path.string()));
        if (p.value("use_regex", true) && pattern.empty()) pattern = kGpt2Pattern;
      } else if (type == "Split") {
        if (!p.contains("pattern") || !p["pattern"].contains("Regex") || p.value("invert", false) ||
            p.value("behavior", std::string("Isolated")) != "Isolated")
          return Status::error(
              fmt::format("tokenizer '{}': only Split pre-tokenizers with a Regex pattern, Isolated, not "
                          "inverted, are supported",
                          path.string()));
        if (!pattern.empty())
          return Status::error(fmt::format("tokenizer '{}': more than one splitting pattern", path.string()));
        pattern = p["pattern"]["Regex"].get<std::string>();
      } else {
        return Status::error(
            fmt::format("tokenizer '{}': pre-tokenizer type \"{}\" is not supported", path.string(), type));
      }
      return Status::ok();
    };
    Status s = scan(tj.contains("pre_tokenizer") ? tj["pre_tokenizer"] : nlohmann::json());
    if (!s.is_ok()) return s;
    if (pattern.empty()) pattern = kGpt2Pattern;
    Status f = finish(*t, pattern, path.parent_path());
    if (!f.is_ok()) return f;
    if (tj.contains("added_tokens") && tj["added_tokens"].is_array())
      for (const auto& a : tj["added_tokens"]) {
        const auto id = static_cast<size_t>(a.at("id").get<int32_t>());
        t->id_to_token[id] = a.at("content").get<std::string>();
        t->special[id] = a.value("special", false);
      }
  } catch (const nlohmann::json::exception& e) {
    return Status::error(fmt::format("tokenizer '{}': unexpected structure: {}", path.string(), e.what()));
  } catch (const Error& e) {
    return Status::error(fmt::format("tokenizer '{}': {}", path.string(), e.what()));
  }
  return std::unique_ptr<Tokenizer>(std::move(t));
}

Result<std::unique_ptr<Tokenizer>> from_vocab_merges(const fs::path& vocab_path,
                                                     const fs::path& merges_path) {
  auto j = read_json(vocab_path.string());
  if (!j) return j.status();
  auto t = std::make_unique<BpeTokenizer>();
  t->source = vocab_path.string();
  try {
    if (!j.value().is_object()) throw Error("not an object");
    for (auto it = j.value().begin(); it != j.value().end(); ++it)
      t->vocab[it.key()] = json_token_id(it.value(), it.key());
  } catch (const nlohmann::json::exception& e) {
    return Status::error(
        fmt::format("tokenizer '{}': expected {{token: id}}: {}", vocab_path.string(), e.what()));
  } catch (const Error& e) {
    return Status::error(
        fmt::format("tokenizer '{}': expected {{token: id}}: {}", vocab_path.string(), e.what()));
  }
  std::ifstream in(merges_path);
  if (!in) return Status::error(fmt::format("tokenizer: cannot open '{}'", merges_path.string()));
  std::string line;
  int32_t rank = 0;
  for (int64_t lineno = 1; std::getline(in, line); ++lineno) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || line.rfind("#version", 0) == 0) continue;
    const size_t sp = line.find(' ');
    if (sp == std::string::npos)
      return Status::error(
          fmt::format("{}:{}: expected two symbols separated by a space", merges_path.string(), lineno));
    t->ranks.emplace(std::make_pair(line.substr(0, sp), line.substr(sp + 1)), rank++);
  }
  // GPT-2's <|endoftext|> is an ordinary vocabulary entry there: make it a special token.
  if (auto it = t->vocab.find("<|endoftext|>"); it != t->vocab.end())
    t->added.emplace_back(it->first, it->second);
  Status f = finish(*t, kGpt2Pattern, vocab_path.parent_path());
  if (!f.is_ok()) return f;
  for (const auto& [c, id] : t->added) t->special[static_cast<size_t>(id)] = true;
  return std::unique_ptr<Tokenizer>(std::move(t));
}

}  // namespace

Result<std::unique_ptr<Tokenizer>> load_bpe_tokenizer(const std::string& spec) {
  fs::path p(spec);
  std::error_code ec;
  if (fs::is_directory(p, ec)) {
    if (fs::exists(p / "tokenizer.json")) return from_tokenizer_json(p / "tokenizer.json");
    if (fs::exists(p / "vocab.json")) p = p / "vocab.json";
  }
  if (p.filename() == "vocab.json" || p.extension() == ".json") {
    if (p.filename() != "vocab.json") return from_tokenizer_json(p);
    const fs::path merges = p.parent_path() / "merges.txt";
    if (!fs::exists(merges))
      return Status::error(fmt::format("tokenizer '{}': no merges.txt beside it", spec));
    return from_vocab_merges(p, merges);
  }
  return Status::error(
      fmt::format("tokenizer '{}': expected a tokenizer.json, a vocab.json (with merges.txt) or a directory "
                  "holding one",
                  spec));
}

}  // namespace ndt
