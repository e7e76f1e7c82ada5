#include "data/bpe_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <fmt/format.h>
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <climits>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <queue>
#include <string_view>
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
size_t char_len(std::string_view s, size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  const size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
  return std::min(n, s.size() - i);
}

// Length of the well-formed UTF-8 character at s[i], or 1 for a byte that starts none: such a byte is a
// symbol of its own (it then goes through the byte fallback), so invalid UTF-8 still round-trips.
size_t valid_char_len(std::string_view s, size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  if (c < 0x80) return 1;
  const size_t n = (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
  if (n == 0 || i + n > s.size()) return 1;
  uint32_t cp = c & (0x7F >> n);
  for (size_t k = 1; k < n; ++k) {
    const auto d = static_cast<unsigned char>(s[i + k]);
    if ((d >> 6) != 2) return 1;
    cp = (cp << 6) | (d & 0x3F);
  }
  const bool ok = n == 2   ? cp >= 0x80
                  : n == 3 ? cp >= 0x800 && (cp < 0xD800 || cp > 0xDFFF)
                           : cp >= 0x10000 && cp <= 0x10FFFF;
  return ok ? n : 1;
}

// The code point of the character at s[i] (valid_char_len n); U+FFFD for a stray byte.
uint32_t code_point(std::string_view s, size_t i, size_t n) {
  const auto c = static_cast<unsigned char>(s[i]);
  if (n == 1) return c < 0x80 ? c : 0xFFFD;
  uint32_t cp = c & (0x7F >> n);
  for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  return cp;
}

// Unicode White_Space: what an added token's lstrip / rstrip absorb.
bool is_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

std::string replace_all(std::string_view s, std::string_view from, std::string_view to) {
  std::string out;
  size_t i = 0;
  for (size_t j; (j = s.find(from, i)) != std::string_view::npos; i = j + from.size()) {
    out.append(s.substr(i, j - i));
    out.append(to);
  }
  out.append(s.substr(i));
  return out;
}

// The byte of a byte-fallback token "<0xAB>", or -1.
int byte_token(std::string_view t) {
  if (t.size() != 6 || t.substr(0, 3) != "<0x" || t[5] != '>') return -1;
  int v = 0;
  for (char c : t.substr(3, 2)) {
    const int d = c >= '0' && c <= '9'   ? c - '0'
                  : c >= 'A' && c <= 'F' ? c - 'A' + 10
                  : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                         : -1;
    if (d < 0) return -1;
    v = v * 16 + d;
  }
  return v;
}

// SentencePiece-style pipeline pieces of a tokenizer.json (docs/data.md), applied as the reference
// library applies them.
enum class Prepend { kAlways, kFirst, kNever };

struct NormStep {  // normalizer: prepend `to` to non-empty text (Prepend), or replace `from` by `to`
  bool prepend = false;
  std::string from, to;
};

struct Metaspace {  // pre-tokenizer: spaces become `replacement`, which is prepended and may split
  std::string replacement;
  Prepend prepend = Prepend::kAlways;
  bool split = true;
};

struct DecodeStep {
  enum Kind { kReplace, kByteFallback, kFuse, kStrip, kMetaspace } kind = kFuse;
  std::string from, to;                // kReplace; kStrip and kMetaspace: `from` is the character
  int64_t start = 0, stop = 0;         // kStrip: at most this many at each end of a token
  Prepend prepend = Prepend::kAlways;  // kMetaspace
};

struct AddedToken {
  std::string content;
  std::string match;  // what the text is searched for: content, or the normalized content
  int32_t id = -1;
  bool special = false, normalized = false, lstrip = false, rstrip = false;
};

// Added tokens searched in one pass (leftmost, then longest), with the first bytes they can start with.
struct AddedMatcher {
  std::vector<const AddedToken*> longest_first;
  std::array<bool, 256> first{};
};

class BpeTokenizer final : public Tokenizer {
 public:
  std::unordered_map<std::string, int32_t> vocab;
  std::vector<std::string> id_to_token;
  // (left id, right id) -> (rank, merged id): merges act on ids, as in the reference implementation.
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;
  std::vector<AddedToken> added;  // file order
  std::vector<bool> special;      // by id: skipped by decode
  bool ignore_merges = false, byte_fallback = false, fuse_unk = false;
  int32_t unk = -1;
  int32_t bos = -1, eos = -1, pad = -1;
  std::string source;
  // Byte-level (GPT-2 style) or SentencePiece style: Unicode characters as the initial symbols, the
  // normalizer, a Metaspace pre-tokenizer, byte fallback and the decoder chain below.
  bool byte_level = true;
  pcre2_code* re = nullptr;  // byte-level only
  std::vector<NormStep> normalizer;
  std::optional<Metaspace> metaspace;
  std::vector<DecodeStep> decoder;
  // Byte-level: the id of each byte's character; with byte_fallback: the id of <0xXX>; -1 if absent.
  std::array<int32_t, 256> byte_ids{};
  // The word-start mark ("▁") before which a piece may be cut (see bpe_words), or "" when it may not.
  std::string cut_before;

  ~BpeTokenizer() override {
    if (re) pcre2_code_free(re);
  }

  static uint64_t pair_key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }

  std::string normalize(std::string_view s) const {
    std::string out(s);
    for (const NormStep& n : normalizer) {
      if (!n.prepend)
        out = replace_all(out, n.from, n.to);
      else if (!out.empty())
        out.insert(0, n.to);
    }
    return out;
  }

  // After loading: the byte symbol ids and the two passes of added tokens (those matched on the raw text,
  // then the normalized ones, matched on normalized text), as the reference library splits them.
  Status prepare() {
    byte_ids.fill(-1);
    for (int b = 0; b < 256; ++b) {
      auto it = vocab.find(byte_level ? bytes().to_unicode[b] : fmt::format("<0x{:02X}>", b));
      if (it != vocab.end()) byte_ids[b] = it->second;
    }
    for (AddedToken& a : added) {
      a.match = a.normalized && !normalizer.empty() ? normalize(a.content) : a.content;
      if (a.match.empty())
        return Status::error(
            fmt::format("tokenizer {}: added token '{}' normalizes to nothing", source, a.content));
      AddedMatcher& m = a.normalized ? normalized_ : raw_;
      m.longest_first.push_back(&a);
      m.first[static_cast<unsigned char>(a.match[0])] = true;
    }
    for (AddedMatcher* m : {&raw_, &normalized_})
      std::stable_sort(
          m->longest_first.begin(), m->longest_first.end(),
          [](const AddedToken* a, const AddedToken* b) { return a->match.size() > b->match.size(); });
    return Status::ok();
  }

  std::vector<int32_t> encode(const std::string& text) const override {
    std::vector<int32_t> out;
    for (const Part& p : cut_added(text, raw_)) {
      if (p.id >= 0) {
        out.push_back(p.id);
        continue;
      }
      const std::string seg = normalize(std::string_view(text).substr(p.begin, p.end - p.begin));
      for (const Part& q : cut_added(seg, normalized_)) {
        if (q.id >= 0)
          out.push_back(q.id);
        else
          pre_tokenize(std::string_view(seg).substr(q.begin, q.end - q.begin), p.begin == 0 && q.begin == 0,
                       out);
      }
    }
    return out;
  }

  std::string decode(const std::vector<int32_t>& ids) const override {
    std::vector<std::string> tokens;
    for (int32_t id : ids) {
      if (id < 0 || id >= static_cast<int32_t>(id_to_token.size()) || special[static_cast<size_t>(id)])
        continue;
      tokens.push_back(id_to_token[static_cast<size_t>(id)]);
    }
    if (!byte_level) return decode_chain(std::move(tokens));
    std::string chars, out;
    for (const std::string& t : tokens) chars += t;
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
  struct Part {
    size_t begin, end;
    int32_t id;  // an added token's, or -1 for text
  };

  // Cuts text at the matcher's added tokens, leftmost first, then longest; lstrip / rstrip take the
  // whitespace beside a token into it.
  std::vector<Part> cut_added(std::string_view text, const AddedMatcher& m) const {
    std::vector<Part> parts;
    size_t last = 0;
    for (size_t i = 0; i < text.size();) {
      const AddedToken* hit = nullptr;
      if (m.first[static_cast<unsigned char>(text[i])])
        for (const AddedToken* a : m.longest_first)
          if (text.substr(i, a->match.size()) == a->match) {
            hit = a;
            break;
          }
      if (!hit) {
        ++i;
        continue;
      }
      size_t b = i, e = i + hit->match.size();
      if (hit->lstrip)
        while (b > last) {
          size_t s = b - 1;
          while (s > last && b - s < 4 && (static_cast<unsigned char>(text[s]) >> 6) == 2) --s;
          const size_t n = valid_char_len(text, s);
          if (s + n != b || !is_space(code_point(text, s, n))) break;
          b = s;
        }
      if (hit->rstrip)
        while (e < text.size()) {
          const size_t n = valid_char_len(text, e);
          if (!is_space(code_point(text, e, n))) break;
          e += n;
        }
      if (b > last) parts.push_back({last, b, -1});
      parts.push_back({b, e, hit->id});
      i = last = e;
    }
    if (last < text.size()) parts.push_back({last, text.size(), -1});
    return parts;
  }

  // One normalized stretch of text between added tokens; at_start: it begins the whole text.
  void pre_tokenize(std::string_view text, bool at_start, std::vector<int32_t>& out) const {
    if (text.empty()) return;
    if (byte_level) return split_regex(text, out);
    if (!metaspace) return bpe_words(text, out);
    const std::string& rep = metaspace->replacement;
    std::string s = replace_all(text, " ", rep);
    const bool prepend =
        metaspace->prepend == Prepend::kAlways || (metaspace->prepend == Prepend::kFirst && at_start);
    if (prepend && s.compare(0, rep.size(), rep) != 0) s.insert(0, rep);
    if (!metaspace->split) return bpe_words(s, out);
    // Every replacement character starts a piece (the reference's MergedWithNext).
    for (size_t b = 0; b < s.size();) {
      const size_t e = std::min(s.find(rep, b + 1), s.size());
      bpe(std::string_view(s).substr(b, e - b), out);
      b = e;
    }
  }

  // Without a splitting pre-tokenizer a whole document is one piece. When no merge joins a symbol that does
  // not end with the word-start mark to one that starts with it (checked at load), the merges never cross
  // the point before a mark that follows another character: cutting there gives the same ids, in short
  // pieces that the cache serves.
  void bpe_words(std::string_view s, std::vector<int32_t>& out) const {
    const std::string& w = cut_before;
    if (w.empty()) return bpe(s, out);
    size_t b = 0;
    for (size_t at = s.find(w, 1); at != std::string_view::npos; at = s.find(w, at + w.size())) {
      if (at >= w.size() && s.compare(at - w.size(), w.size(), w) == 0) continue;  // a run of marks
      bpe(s.substr(b, at - b), out);
      b = at;
    }
    bpe(s.substr(b), out);
  }

  void split_regex(std::string_view text, std::vector<int32_t>& out) const {
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

  // One piece: its initial symbols (byte-level characters, or Unicode characters with the byte fallback),
  // merged by rank; with ignore_merges a piece that is itself in the vocabulary is one token.
  void bpe(std::string_view piece, std::vector<int32_t>& out) const {
    // Whole documents are single pieces without a splitting pre-tokenizer: only short pieces are cached.
    const bool cacheable = piece.size() <= 256;
    std::string key;
    if (cacheable) {
      key.assign(piece);
      std::lock_guard<std::mutex> lock(cache_mu_);
      auto it = cache_.find(key);
      if (it != cache_.end()) {
        out.insert(out.end(), it->second.begin(), it->second.end());
        return;
      }
    }
    std::vector<int32_t> ids;
    if (ignore_merges) {
      std::string whole;
      if (byte_level)
        for (unsigned char c : piece) whole += bytes().to_unicode[c];
      else
        whole.assign(piece);
      if (auto it = vocab.find(whole); it != vocab.end()) ids.push_back(it->second);
    }
    if (ids.empty()) {
      ids = initial_symbols(piece);
      merge(ids);
    }
    out.insert(out.end(), ids.begin(), ids.end());
    if (!cacheable) return;
    std::lock_guard<std::mutex> lock(cache_mu_);
    if (cache_.size() < 200000) cache_.emplace(std::move(key), std::move(ids));
  }

  std::vector<int32_t> initial_symbols(std::string_view piece) const {
    std::vector<int32_t> ids;
    ids.reserve(piece.size());
    bool after_unk = false;  // fuse_unk: a run of unknown symbols is one unk token
    for (size_t i = 0; i < piece.size();) {
      const size_t n = byte_level ? 1 : valid_char_len(piece, i);
      int32_t id = -1;
      if (byte_level) {
        id = byte_ids[static_cast<unsigned char>(piece[i])];
      } else if (auto it = vocab.find(std::string(piece.substr(i, n))); it != vocab.end()) {
        id = it->second;
      }
      if (id >= 0) {
        ids.push_back(id);
        after_unk = false;
      } else if (!byte_level && byte_fallback) {  // every <0xXX> exists (checked at load)
        for (size_t k = 0; k < n; ++k) ids.push_back(byte_ids[static_cast<unsigned char>(piece[i + k])]);
        after_unk = false;
      } else if (unk >= 0) {
        if (!(fuse_unk && after_unk)) ids.push_back(unk);
        after_unk = true;
      } else {
        const uint32_t cp = byte_level ? static_cast<unsigned char>(piece[i]) : code_point(piece, i, n);
        NDT_FAIL("tokenizer {}: {} {:#x} is not in the vocabulary (and there is no {}unk_token)", source,
                 byte_level ? "byte" : "character", cp, byte_level ? "" : "byte fallback or ");
      }
      i += n;
    }
    return ids;
  }

  // Merges the lowest-ranked adjacent pair first, the leftmost among equals, until no pair has a merge
  // (the reference implementation's order; a heap keeps whole documents, one piece without a splitting
  // pre-tokenizer, O(n log n)).
  void merge(std::vector<int32_t>& ids) const {
    if (ids.size() < 2 || merges.empty()) return;
    const auto n = static_cast<int32_t>(ids.size());
    std::vector<int32_t> prev(static_cast<size_t>(n)), next(static_cast<size_t>(n));
    for (int32_t i = 0; i < n; ++i) {
      prev[static_cast<size_t>(i)] = i - 1;
      next[static_cast<size_t>(i)] = i + 1 < n ? i + 1 : -1;
    }
    struct Cand {
      int32_t rank, pos, id;
    };
    auto after = [](const Cand& a, const Cand& b) {
      return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
    };
    std::priority_queue<Cand, std::vector<Cand>, decltype(after)> heap(after);
    auto push = [&](int32_t pos) {
      const int32_t nx = next[static_cast<size_t>(pos)];
      if (nx < 0) return;
      auto it = merges.find(pair_key(ids[static_cast<size_t>(pos)], ids[static_cast<size_t>(nx)]));
      if (it != merges.end()) heap.push({it->second.first, pos, it->second.second});
    };
    for (int32_t i = 0; i + 1 < n; ++i) push(i);
    while (!heap.empty()) {
      const Cand c = heap.top();
      heap.pop();
      const auto pos = static_cast<size_t>(c.pos);
      const int32_t nx = next[pos];
      if (ids[pos] < 0 || nx < 0) continue;  // merged into its left neighbour, or now the last symbol
      auto it = merges.find(pair_key(ids[pos], ids[static_cast<size_t>(nx)]));
      if (it == merges.end() || it->second.second != c.id) continue;  // stale: the right neighbour changed
      ids[pos] = c.id;
      ids[static_cast<size_t>(nx)] = -1;
      next[pos] = next[static_cast<size_t>(nx)];
      if (next[pos] >= 0) prev[static_cast<size_t>(next[pos])] = c.pos;
      if (prev[pos] >= 0) push(prev[pos]);
      push(c.pos);
    }
    std::erase(ids, -1);
  }

  // The tokenizer.json decoder steps over the token strings, then their concatenation. ByteFallback keeps
  // the bytes as they are (the reference writes U+FFFD for a run that is not valid UTF-8).
  std::string decode_chain(std::vector<std::string> tokens) const {
    for (const DecodeStep& d : decoder) {
      switch (d.kind) {
        case DecodeStep::kReplace:
          for (std::string& t : tokens) t = replace_all(t, d.from, d.to);
          break;
        case DecodeStep::kByteFallback: {
          std::vector<std::string> out;
          std::string run;
          bool in_run = false;
          for (std::string& t : tokens) {
            const int b = byte_token(t);
            if (b >= 0) {
              run += static_cast<char>(b);
              in_run = true;
              continue;
            }
            if (in_run) out.push_back(std::move(run));
            run.clear();
            in_run = false;
            out.push_back(std::move(t));
          }
          if (in_run) out.push_back(std::move(run));
          tokens = std::move(out);
          break;
        }
        case DecodeStep::kFuse: {
          std::string all;
          for (const std::string& t : tokens) all += t;
          tokens.assign(1, std::move(all));
          break;
        }
        case DecodeStep::kStrip:
          for (std::string& t : tokens) {
            const std::string_view c = d.from;
            size_t b = 0, e = t.size();
            for (int64_t k = 0; k < d.start && t.compare(b, c.size(), c) == 0; ++k) b += c.size();
            for (int64_t k = 0; k < d.stop && e >= b + c.size() && t.compare(e - c.size(), c.size(), c) == 0;
                 ++k)
              e -= c.size();
            t = t.substr(b, e - b);
          }
          break;
        case DecodeStep::kMetaspace:
          for (size_t i = 0; i < tokens.size(); ++i)
            tokens[i] = replace_all(tokens[i], d.from, i == 0 && d.prepend != Prepend::kNever ? "" : " ");
          break;
      }
    }
    std::string out;
    for (const std::string& t : tokens) out += t;
    return out;
  }

  AddedMatcher raw_, normalized_;
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

// Optional fields: absent and null read as the default (files write null for unset options).
bool opt_bool(const nlohmann::json& j, const char* key, bool def) {
  return j.contains(key) && !j[key].is_null() ? j[key].get<bool>() : def;
}
std::string opt_string(const nlohmann::json& j, const char* key) {
  return j.contains(key) && !j[key].is_null() ? j[key].get<std::string>() : std::string();
}

// Merges act on ids (the reference implementation refuses a merge whose parts or result are not in the
// vocabulary; a later duplicate replaces an earlier one).
Status add_merges(BpeTokenizer& t, const std::vector<std::pair<std::string, std::string>>& pairs) {
  int32_t rank = 0;
  for (const auto& [a, b] : pairs) {
    std::array<int32_t, 3> id{};
    const std::array<std::string, 3> sym = {a, b, a + b};
    for (size_t k = 0; k < 3; ++k) {
      auto it = t.vocab.find(sym[k]);
      if (it == t.vocab.end())
        return Status::error(fmt::format("tokenizer '{}': merge {} \"{} {}\": '{}' is not in the vocabulary",
                                         t.source, rank, a, b, sym[k]));
      id[k] = it->second;
    }
    t.merges[BpeTokenizer::pair_key(id[0], id[1])] = {rank++, id[2]};
  }
  return Status::ok();
}

Status finish(BpeTokenizer& t, const std::string& pattern, const fs::path& dir) {
  if (t.byte_level) {
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
  }
  // Ids index a table of the largest id + 1 entries: holes are allowed, but not so many that a small file
  // sizes a huge table (real vocabularies are dense: n == the number of distinct ids).
  int32_t n = 0;
  for (const auto& [tok, id] : t.vocab) n = std::max(n, id + 1);
  for (const AddedToken& a : t.added) n = std::max(n, a.id + 1);
  const int64_t entries = static_cast<int64_t>(t.vocab.size() + t.added.size());
  if (n > 2 * entries + 1024)
    return Status::error(fmt::format(
        "tokenizer {}: the largest token id is {} but there are only {} tokens (ids must be nearly dense)",
        t.source, n - 1, entries));
  t.id_to_token.assign(static_cast<size_t>(n), "");
  t.special.assign(static_cast<size_t>(n), false);
  for (const auto& [tok, id] : t.vocab) t.id_to_token[static_cast<size_t>(id)] = tok;
  for (const AddedToken& a : t.added) {
    t.id_to_token[static_cast<size_t>(a.id)] = a.content;
    t.special[static_cast<size_t>(a.id)] = a.special;
  }
  auto id_of = [&](const std::string& s) -> int32_t {
    if (s.empty()) return -1;
    for (const AddedToken& a : t.added)
      if (a.content == s) return a.id;
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
  return t.prepare();
}

// The pre-tokenizer's parts: a ByteLevel one, a Split pattern, a Metaspace.
struct PreTokenizer {
  bool byte_level = false;
  std::string pattern;
  std::optional<Metaspace> metaspace;
};

Status read_pre_tokenizer(const nlohmann::json& p, const std::string& file, PreTokenizer& pre) {
  if (p.is_null()) return Status::ok();
  const std::string type = p.value("type", std::string());
  if (type == "Sequence") {
    for (const auto& q : p.at("pretokenizers")) {
      Status s = read_pre_tokenizer(q, file, pre);
      if (!s.is_ok()) return s;
    }
  } else if (type == "ByteLevel") {
    if (opt_bool(p, "add_prefix_space", false))
      return Status::error(fmt::format("tokenizer '{}': ByteLevel add_prefix_space is not supported", file));
    pre.byte_level = true;
    if (opt_bool(p, "use_regex", true) && pre.pattern.empty()) pre.pattern = kGpt2Pattern;
  } else if (type == "Split") {
    if (!p.contains("pattern") || !p["pattern"].contains("Regex") || opt_bool(p, "invert", false) ||
        p.value("behavior", std::string("Isolated")) != "Isolated")
      return Status::error(
          fmt::format("tokenizer '{}': only Split pre-tokenizers with a Regex pattern, Isolated, not "
                      "inverted, are supported",
                      file));
    if (!pre.pattern.empty())
      return Status::error(fmt::format("tokenizer '{}': more than one splitting pattern", file));
    pre.pattern = p["pattern"]["Regex"].get<std::string>();
  } else if (type == "Metaspace") {
    if (pre.metaspace) return Status::error(fmt::format("tokenizer '{}': more than one Metaspace", file));
    Metaspace m;
    m.replacement = p.at("replacement").get<std::string>();
    if (m.replacement.empty() || valid_char_len(m.replacement, 0) != m.replacement.size())
      return Status::error(fmt::format("tokenizer '{}': Metaspace replacement must be one character", file));
    // Older files have add_prefix_space instead of prepend_scheme; split was always on then.
    const std::string scheme = opt_string(p, "prepend_scheme");
    if (scheme == "first")
      m.prepend = Prepend::kFirst;
    else if (scheme == "never")
      m.prepend = Prepend::kNever;
    else if (scheme != "always" && !scheme.empty())
      return Status::error(
          fmt::format("tokenizer '{}': Metaspace prepend_scheme \"{}\" is not supported", file, scheme));
    if (scheme.empty() && !opt_bool(p, "add_prefix_space", true)) m.prepend = Prepend::kNever;
    m.split = opt_bool(p, "split", true);
    pre.metaspace = m;
  } else {
    return Status::error(
        fmt::format("tokenizer '{}': pre-tokenizer type \"{}\" is not supported", file, type));
  }
  return Status::ok();
}

Status read_normalizer(const nlohmann::json& n, const std::string& file, std::vector<NormStep>& steps) {
  if (n.is_null()) return Status::ok();
  const std::string type = n.value("type", std::string());
  if (type == "Sequence") {
    for (const auto& q : n.at("normalizers")) {
      Status s = read_normalizer(q, file, steps);
      if (!s.is_ok()) return s;
    }
  } else if (type == "Prepend") {
    steps.push_back({true, "", n.at("prepend").get<std::string>()});
  } else if (type == "Replace" && n.at("pattern").contains("String") &&
             !n["pattern"]["String"].get<std::string>().empty()) {
    steps.push_back({false, n["pattern"]["String"].get<std::string>(), n.at("content").get<std::string>()});
  } else {
    return Status::error(
        fmt::format("tokenizer '{}': normalizer \"{}\" is not supported (only Prepend, Replace of a String "
                    "pattern and Sequence)",
                    file, type == "Replace" ? "Replace with a Regex or empty pattern" : type));
  }
  return Status::ok();
}

Status read_decoder(const nlohmann::json& d, const std::string& file, std::vector<DecodeStep>& steps) {
  const std::string type = d.is_null() ? "none" : d.value("type", std::string());
  DecodeStep s;
  if (type == "Sequence") {
    for (const auto& q : d.at("decoders")) {
      Status st = read_decoder(q, file, steps);
      if (!st.is_ok()) return st;
    }
    return Status::ok();
  } else if (type == "Replace" && d.at("pattern").contains("String") &&
             !d["pattern"]["String"].get<std::string>().empty()) {
    s.kind = DecodeStep::kReplace;
    s.from = d["pattern"]["String"].get<std::string>();
    s.to = d.at("content").get<std::string>();
  } else if (type == "ByteFallback") {
    s.kind = DecodeStep::kByteFallback;
  } else if (type == "Fuse") {
    s.kind = DecodeStep::kFuse;
  } else if (type == "Strip") {
    s.kind = DecodeStep::kStrip;
    s.from = d.at("content").get<std::string>();
    s.start = d.value("start", int64_t{0});
    s.stop = d.value("stop", int64_t{0});
    if (s.from.empty() || valid_char_len(s.from, 0) != s.from.size())
      return Status::error(fmt::format("tokenizer '{}': Strip decoder content must be one character", file));
  } else if (type == "Metaspace") {
    PreTokenizer pre;  // the decoder has the pre-tokenizer's fields
    Status st = read_pre_tokenizer(d, file, pre);
    if (!st.is_ok()) return st;
    s.kind = DecodeStep::kMetaspace;
    s.from = pre.metaspace->replacement;
    s.prepend = pre.metaspace->prepend;
  } else {
    return Status::error(
        fmt::format("tokenizer '{}': decoder \"{}\" is not supported with byte_fallback or Metaspace (only "
                    "Replace of a String pattern, ByteFallback, Fuse, Strip, Metaspace and Sequence)",
                    file, type));
  }
  steps.push_back(s);
  return Status::ok();
}

Result<std::unique_ptr<Tokenizer>> from_tokenizer_json(const fs::path& path) {
  auto j = read_json(path.string());
  if (!j) return j.status();
  const nlohmann::json& tj = j.value();
  const std::string file = path.string();
  auto refuse = [&](const std::string& what) {
    return Status::error(fmt::format("tokenizer '{}': {}", file, what));
  };
  auto t = std::make_unique<BpeTokenizer>();
  t->source = file;
  try {
    const auto& model = tj.at("model");
    if (model.value("type", std::string("BPE")) != "BPE")
      return refuse(
          fmt::format("model type \"{}\" is not supported (only BPE)", model.value("type", std::string())));
    t->ignore_merges = opt_bool(model, "ignore_merges", false);
    t->byte_fallback = opt_bool(model, "byte_fallback", false);
    t->fuse_unk = opt_bool(model, "fuse_unk", false);
    if (model.contains("dropout") && !model["dropout"].is_null() && model["dropout"].get<double>() > 0)
      return refuse("BPE dropout is not supported");
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
      if (!opt_string(model, key).empty()) return refuse(fmt::format("model.{} is not supported", key));
    if (!model.at("vocab").is_object()) return refuse("model.vocab must be an object {token: id}");
    for (auto it = model.at("vocab").begin(); it != model.at("vocab").end(); ++it)
      t->vocab[it.key()] = json_token_id(it.value(), it.key());
    std::vector<std::pair<std::string, std::string>> pairs;
    for (const auto& m : model.at("merges")) {
      if (m.is_string()) {
        const std::string s = m.get<std::string>();
        const size_t sp = s.find(' ');
        if (sp == std::string::npos)
          return refuse(fmt::format("merge {} \"{}\" has no space", pairs.size(), s));
        pairs.emplace_back(s.substr(0, sp), s.substr(sp + 1));
      } else {
        pairs.emplace_back(m.at(0).get<std::string>(), m.at(1).get<std::string>());
      }
    }
    Status st = add_merges(*t, pairs);
    if (!st.is_ok()) return st;
    const std::string u = opt_string(model, "unk_token");
    if (!u.empty()) {
      auto it = t->vocab.find(u);
      if (it == t->vocab.end())
        return refuse(fmt::format("model.unk_token '{}' is not in the vocabulary", u));
      t->unk = it->second;
    }
    if (tj.contains("added_tokens") && tj["added_tokens"].is_array())
      for (const auto& a : tj["added_tokens"]) {
        AddedToken at;
        at.content = a.at("content").get<std::string>();
        if (at.content.empty()) return refuse("an added token has empty content");
        at.id = json_token_id(a.at("id"), at.content);
        at.special = opt_bool(a, "special", false);
        at.normalized = opt_bool(a, "normalized", !at.special);
        at.lstrip = opt_bool(a, "lstrip", false);
        at.rstrip = opt_bool(a, "rstrip", false);
        if (opt_bool(a, "single_word", false))
          return refuse(fmt::format("added token '{}': single_word is not supported", at.content));
        t->added.push_back(at);
      }
    PreTokenizer pre;
    st = read_pre_tokenizer(tj.contains("pre_tokenizer") ? tj["pre_tokenizer"] : nlohmann::json(), file, pre);
    if (!st.is_ok()) return st;
    const nlohmann::json normalizer = tj.contains("normalizer") ? tj["normalizer"] : nlohmann::json();
    // Byte-level unless the file says SentencePiece style: byte_fallback, Metaspace, or a normalizer without
    // a ByteLevel pre-tokenizer (a byte-level file's normalizer, e.g. NFC, is not applied).
    t->byte_level = pre.byte_level || (!t->byte_fallback && !pre.metaspace && normalizer.is_null());
    if (t->byte_level && (t->byte_fallback || pre.metaspace))
      return refuse(fmt::format("{} together with a ByteLevel pre-tokenizer is not supported",
                                t->byte_fallback ? "byte_fallback" : "a Metaspace pre-tokenizer"));
    if (!t->byte_level) {
      if (!pre.pattern.empty())
        return refuse("a Split pre-tokenizer is not supported with byte_fallback BPE");
      t->metaspace = pre.metaspace;
      st = read_normalizer(normalizer, file, t->normalizer);
      if (!st.is_ok()) return st;
      st = read_decoder(tj.contains("decoder") ? tj["decoder"] : nlohmann::json(), file, t->decoder);
      if (!st.is_ok()) return st;
      // Where documents may be cut into words (bpe_words): the mark that spaces become, a token itself; no
      // ignore_merges (it looks the whole piece up); no merge across a point before the mark.
      std::string w = t->metaspace ? t->metaspace->replacement : "";
      for (const NormStep& n : t->normalizer)
        if (!n.prepend && n.from == " ") w = n.to;
      auto ends_with = [](const std::string& s, const std::string& e) {
        return s.size() >= e.size() && s.compare(s.size() - e.size(), e.size(), e) == 0;
      };
      bool cut = !w.empty() && !t->ignore_merges && t->vocab.contains(w) && (u.empty() || !ends_with(u, w));
      for (const auto& [a, b] : pairs)
        if (b.compare(0, w.size(), w) == 0 && !ends_with(a, w)) cut = false;
      if (cut) t->cut_before = w;
      if (t->byte_fallback)
        for (int b = 0; b < 256; ++b)
          if (!t->vocab.contains(fmt::format("<0x{:02X}>", b)))
            return refuse(
                fmt::format("byte_fallback needs the tokens <0x00>..<0xFF>; <0x{:02X}> is missing", b));
    }
    st = finish(*t, pre.pattern.empty() ? kGpt2Pattern : pre.pattern, path.parent_path());
    if (!st.is_ok()) return st;
  } catch (const nlohmann::json::exception& e) {
    return refuse(fmt::format("unexpected structure: {}", e.what()));
  } catch (const Error& e) {
    return refuse(e.what());
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
  std::vector<std::pair<std::string, std::string>> pairs;
  for (int64_t lineno = 1; std::getline(in, line); ++lineno) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || line.rfind("#version", 0) == 0) continue;
    const size_t sp = line.find(' ');
    if (sp == std::string::npos)
      return Status::error(
          fmt::format("{}:{}: expected two symbols separated by a space", merges_path.string(), lineno));
    pairs.emplace_back(line.substr(0, sp), line.substr(sp + 1));
  }
  Status st = add_merges(*t, pairs);
  if (!st.is_ok()) return st;
  // GPT-2's <|endoftext|> is an ordinary vocabulary entry there: make it a special token.
  if (auto it = t->vocab.find("<|endoftext|>"); it != t->vocab.end()) {
    AddedToken a;
    a.content = a.match = it->first;
    a.id = it->second;
    a.special = true;
    t->added.push_back(a);
  }
  st = finish(*t, kGpt2Pattern, vocab_path.parent_path());
  if (!st.is_ok()) return st;
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
