// Tests of the data layer: tokenizers, synthetic tasks, token shards, SFT JSONL, batching and order.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "core/rng.h"
#include "data/make_dataset.h"
#include "data/sft.h"
#include "data/shards.h"
#include "data/synthetic.h"
#include "temp_dir.h"

namespace fs = std::filesystem;
using ndt::testing::TempDir;
using ndt::testing::write_text;
using namespace ndt;

namespace {

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}

bool same(const Sample& a, const Sample& b) { return a.tokens == b.tokens && a.loss_mask == b.loss_mask; }

// Decodes the tokens of `s` whose mask is `m`.
std::string masked_text(const Tokenizer& tok, const Sample& s, uint8_t m) {
  std::vector<int32_t> ids;
  for (size_t i = 0; i < s.tokens.size(); ++i)
    if (s.loss_mask[i] == m) ids.push_back(s.tokens[i]);
  return tok.decode(ids);
}

}  // namespace

// ---- tokenizers -----------------------------------------------------------------------------------

TEST(DataTokenizer, ByteRoundTripAndSpecials) {
  auto tok = make_byte_tokenizer();
  EXPECT_EQ(tok->vocab_size(), 259);
  EXPECT_EQ(tok->bos_id(), 256);
  EXPECT_EQ(tok->eos_id(), 257);
  EXPECT_EQ(tok->pad_id(), 258);
  const std::string text = "héllo\n\x01\xff world";
  auto ids = tok->encode(text);
  EXPECT_EQ(ids.size(), text.size());
  for (int32_t id : ids) EXPECT_TRUE(id >= 0 && id < 256);
  EXPECT_EQ(tok->decode(ids), text);
  std::vector<int32_t> with_specials = {256, 'h', 258, 'i', 257};
  EXPECT_EQ(tok->decode(with_specials), "hi");
  auto t2 = make_tokenizer("byte");
  ASSERT_TRUE(t2.is_ok());
  EXPECT_EQ(t2.value()->name(), "byte");
}

TEST(DataTokenizer, PreTokenizedIds) {
  auto tok = make_tokenizer("ids:50257").value();
  EXPECT_EQ(tok->vocab_size(), 50257);
  EXPECT_EQ(tok->eos_id(), 50256);
  EXPECT_EQ(tok->encode(" 15496 11  995 "), (std::vector<int32_t>{15496, 11, 995}));
  EXPECT_EQ(tok->decode({15496, 11, 50256, 995}), "15496 11 995");
  EXPECT_THROW(tok->encode("12 50257"), Error);
  EXPECT_THROW(tok->encode("12 x"), Error);
  for (const char* bad : {"ids:", "ids:1", "ids:12x", "ids:-5"}) {
    auto r = make_tokenizer(bad);
    ASSERT_FALSE(r) << bad;
    EXPECT_NE(r.status().message().find("ids:N"), std::string::npos) << r.status().message();
  }
}

TEST(DataTokenizer, MissingModelNamesFile) {
  auto r = make_tokenizer("/nonexistent/dir/tok.model");
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("/nonexistent/dir/tok.model"), std::string::npos)
      << r.status().message();
  auto r2 = load_sentencepiece_tokenizer("/nonexistent/x.model");
  ASSERT_FALSE(r2.is_ok());
  EXPECT_NE(r2.status().message().find("/nonexistent/x.model"), std::string::npos);
}

TEST(DataTokenizer, CorruptModelNamesFile) {
  TempDir d;
  write_text(d.file("bad.model"), "this is not a protobuf");
  auto r = make_tokenizer(d.file("bad.model"));
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find(d.file("bad.model")), std::string::npos) << r.status().message();
}

TEST(DataTokenizer, SentencePieceTrainLoadRoundTrip) {
  if (std::system("command -v spm_train > /dev/null 2>&1") != 0) GTEST_SKIP() << "spm_train not installed";
  TempDir d;
  {
    std::ofstream f(d.file("corpus.txt"));
    auto byte = make_byte_tokenizer();
    LmTask lm(200, 7, *byte);
    for (int i = 0; i < 200; ++i) f << lm.text(i) << "\n";
    f << "1+2=3 45+67=112 0123456789 9+9=81 hello world\n";
  }
  const std::string prefix = d.file("tiny");
  const std::string cmd = fmt::format(
      "spm_train --input={} --model_prefix={} --vocab_size=100 --model_type=bpe --character_coverage=1.0 "
      "--minloglevel=2 > {} 2>&1",
      d.file("corpus.txt"), prefix, d.file("spm.log"));
  ASSERT_EQ(std::system(cmd.c_str()), 0) << read_bytes(d.file("spm.log"));
  auto r = make_tokenizer(prefix + ".model");
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  const Tokenizer& tok = *r.value();
  EXPECT_EQ(tok.vocab_size(), 100);
  EXPECT_GE(tok.eos_id(), 0);
  EXPECT_GE(tok.bos_id(), 0);
  EXPECT_GE(tok.pad_id(), 0);  // spm_train's default model has no pad piece: falls back to EOS
  EXPECT_LT(tok.pad_id(), 100);
  EXPECT_NE(tok.name().find("tiny.model"), std::string::npos);
  const std::string text = "the small cat sees a dog . three four five .";
  auto ids = tok.encode(text);
  EXPECT_LT(ids.size(), text.size());  // merges happened
  for (int32_t id : ids) EXPECT_TRUE(id >= 0 && id < 100);
  EXPECT_EQ(tok.decode(ids), text);
  std::vector<int32_t> wrapped = {tok.bos_id()};
  wrapped.insert(wrapped.end(), ids.begin(), ids.end());
  wrapped.push_back(tok.eos_id());
  wrapped.push_back(tok.pad_id());
  EXPECT_EQ(tok.decode(wrapped), text);

  // Tasks and shards work with it too.
  AdditionTask add(3, 1, tok);
  Sample s = add.get(0);
  EXPECT_EQ(s.tokens.front(), tok.bos_id());
  EXPECT_EQ(s.tokens.back(), tok.eos_id());
  EXPECT_EQ(masked_text(tok, s, 1), add.problem(0).reversed_answer());
  int64_t total = 0;
  write_text(d.file("doc.txt"), text);
  ASSERT_TRUE(tokenize_text_files({d.file("doc.txt")}, tok, d.file("sp"), 1000, &total).is_ok());
  auto back = read_token_shard(d.file("sp_000000.bin"));
  ASSERT_TRUE(back.is_ok());
  EXPECT_EQ(static_cast<int64_t>(back.value().size()), total);
  EXPECT_EQ(tok.decode(back.value()), text);
}

// ---- synthetic tasks ------------------------------------------------------------------------------

TEST(DataAddition, DeterministicAndSeedDependent) {
  auto tok = make_byte_tokenizer();
  AdditionTask a(3, 11, *tok), b(3, 11, *tok), c(3, 12, *tok);
  EXPECT_EQ(a.size(), -1);
  int differ = 0;
  for (int64_t i = 0; i < 200; ++i) {
    EXPECT_TRUE(same(a.get(i), b.get(i)));
    differ += !same(a.get(i), c.get(i));
  }
  EXPECT_GT(differ, 150);
  // Querying out of order gives the same sample (pure function of the index).
  EXPECT_TRUE(same(a.get(123), AdditionTask(3, 11, *tok).get(123)));
}

TEST(DataAddition, CarryDroppedAnswer) {
  EXPECT_EQ((AdditionProblem{57, 68}.carry_dropped_answer()), "51");  // 7+8 -> 5, 5+6 -> 1 (right: "521")
  EXPECT_EQ((AdditionProblem{999, 1}.carry_dropped_answer()), "099");
  EXPECT_EQ((AdditionProblem{123, 45}.carry_dropped_answer()), "861");  // no carry: the right answer
  EXPECT_EQ((AdditionProblem{123, 45}.reversed_answer()), "861");
  EXPECT_EQ((AdditionProblem{0, 0}.carry_dropped_answer()), "0");
}

TEST(DataAddition, LabelNoiseDropsCarriesOnItsShareOfTrainingSamples) {
  auto tok = make_byte_tokenizer();
  const double noise = 0.6;
  AdditionTask clean(3, 5, *tok), noisy(3, 5, *tok, false, noise), val(3, 5, *tok, true, noise);
  AdditionTask val_clean(3, 5, *tok, true);
  int64_t flipped = 0, n = 4000;
  for (int64_t i = 0; i < n; ++i) {
    const AdditionProblem p = noisy.problem(i);
    EXPECT_EQ(p.a, clean.problem(i).a);  // the same problems as without noise
    EXPECT_EQ(p.b, clean.problem(i).b);
    const std::string ans = masked_text(*tok, noisy.get(i), 1);
    ASSERT_TRUE(ans == p.reversed_answer() || ans == p.carry_dropped_answer()) << p.prompt() << ans;
    // Counted where the two differ: the noise is drawn independently of the problem.
    if (p.reversed_answer() != p.carry_dropped_answer()) flipped += ans == p.carry_dropped_answer();
    EXPECT_TRUE(same(noisy.get(i), AdditionTask(3, 5, *tok, false, noise).get(i)));  // deterministic
    if (i < 300) EXPECT_TRUE(same(val.get(i), val_clean.get(i)));  // held-out answers stay right
  }
  int64_t carries = 0;
  for (int64_t i = 0; i < n; ++i)
    carries += noisy.problem(i).reversed_answer() != noisy.problem(i).carry_dropped_answer();
  ASSERT_GT(carries, 1000);
  const double share = static_cast<double>(flipped) / static_cast<double>(carries);
  EXPECT_NEAR(share, noise, 0.05) << flipped << " of " << carries;  // binomial sd ~0.01
  EXPECT_THROW(AdditionTask(3, 5, *tok, false, 1.5), Error);
}

TEST(DataAddition, SamplesAreCorrectArithmeticWithAnswerMask) {
  auto tok = make_byte_tokenizer();
  const int64_t digits = 4;
  AdditionTask task(digits, 5, *tok);
  std::set<int64_t> digit_counts;
  for (int64_t i = 0; i < 500; ++i) {
    Sample s = task.get(i);
    ASSERT_EQ(s.tokens.size(), s.loss_mask.size());
    EXPECT_EQ(s.tokens.front(), tok->bos_id());
    EXPECT_EQ(s.tokens.back(), tok->eos_id());
    EXPECT_EQ(s.loss_mask.front(), 0);
    EXPECT_EQ(s.loss_mask.back(), 1);
    const std::string text = tok->decode(s.tokens);
    const size_t plus = text.find('+'), eq = text.find('=');
    ASSERT_NE(plus, std::string::npos);
    ASSERT_NE(eq, std::string::npos);
    const int64_t a = std::stoll(text.substr(0, plus)), b = std::stoll(text.substr(plus + 1, eq - plus - 1));
    std::string ans = text.substr(eq + 1);
    std::reverse(ans.begin(), ans.end());
    EXPECT_EQ(std::stoll(ans), a + b) << text;
    EXPECT_LT(a, 10000);
    EXPECT_LT(b, 10000);
    digit_counts.insert(static_cast<int64_t>(std::to_string(a).size()));
    // Mask: 0 on BOS and "a+b=", 1 on every answer digit and EOS.
    const size_t answer_start = 1 + eq + 1;
    for (size_t k = 0; k < s.tokens.size(); ++k) EXPECT_EQ(s.loss_mask[k], k >= answer_start ? 1 : 0) << text;
    EXPECT_EQ(masked_text(*tok, s, 1), task.problem(i).reversed_answer());
    EXPECT_FALSE(addition_is_eval(a, b));
  }
  EXPECT_EQ(digit_counts.size(), static_cast<size_t>(digits));  // 1..digits digits all drawn
}

TEST(DataAddition, ReversedAnswer) {
  AdditionProblem p{57, 68};
  EXPECT_EQ(p.prompt(), "57+68=");
  EXPECT_EQ(p.reversed_answer(), "521");
  AdditionProblem z{0, 0};
  EXPECT_EQ(z.reversed_answer(), "0");
}

TEST(DataAddition, EvalProblemsNeverInTraining) {
  auto tok = make_byte_tokenizer();
  for (int64_t digits : {1, 2, 3}) {
    auto evals = addition_eval_problems(digits, 3, 100);
    ASSERT_EQ(evals.size(), 100u);
    std::set<std::string> eval_prompts;
    for (const auto& e : evals) {
      EXPECT_EQ(e.prompt.front(), tok->bos_id());
      const std::string prompt = tok->decode(e.prompt);
      ASSERT_EQ(prompt.back(), '=');
      const size_t plus = prompt.find('+');
      const int64_t a = std::stoll(prompt.substr(0, plus)), b = std::stoll(prompt.substr(plus + 1));
      EXPECT_TRUE(addition_is_eval(a, b));
      std::string ans = e.answer;
      std::reverse(ans.begin(), ans.end());
      EXPECT_EQ(std::stoll(ans), a + b);
      eval_prompts.insert(prompt);
    }
    AdditionTask train(digits, 3, *tok);
    for (int64_t i = 0; i < 3000; ++i) {
      Sample s = train.get(i);
      const std::string text = tok->decode(s.tokens);
      EXPECT_EQ(eval_prompts.count(text.substr(0, text.find('=') + 1)), 0u) << text;
    }
  }
  // Deterministic, and the validation dataset yields exactly the eval problems.
  auto e1 = addition_eval_problems(3, 9, 50), e2 = addition_eval_problems(3, 9, 50);
  AdditionTask val(3, 9, *tok, /*eval_split=*/true);
  for (size_t i = 0; i < e1.size(); ++i) {
    EXPECT_EQ(e1[i].prompt, e2[i].prompt);
    EXPECT_EQ(e1[i].answer, e2[i].answer);
    Sample s = val.get(static_cast<int64_t>(i));
    EXPECT_EQ(std::vector<int32_t>(s.tokens.begin(), s.tokens.begin() + e1[i].prompt.size()), e1[i].prompt);
    EXPECT_EQ(masked_text(*tok, s, 1), e1[i].answer);
  }
}

TEST(DataLm, DeterministicStructuredText) {
  auto tok = make_byte_tokenizer();
  const int64_t T = 64;
  LmTask a(T, 1, *tok), b(T, 1, *tok), c(T, 2, *tok), v(T, 1, *tok, "val");
  EXPECT_EQ(a.size(), -1);
  int differ_seed = 0, differ_stream = 0;
  for (int64_t i = 0; i < 100; ++i) {
    Sample s = a.get(i);
    EXPECT_TRUE(same(s, b.get(i)));
    differ_seed += !same(s, c.get(i));
    differ_stream += !same(s, v.get(i));
    ASSERT_EQ(s.tokens.size(), static_cast<size_t>(T + 1));
    EXPECT_EQ(s.tokens[0], tok->bos_id());
    EXPECT_EQ(s.loss_mask[0], 0);
    for (size_t k = 1; k < s.loss_mask.size(); ++k) EXPECT_EQ(s.loss_mask[k], 1);
  }
  EXPECT_GT(differ_seed, 90);
  EXPECT_GT(differ_stream, 90);
  const std::string text = a.text(0);
  EXPECT_NE(text.find(" ."), std::string::npos) << text;
  // Number agreement: singular subjects take "is", plural "are".
  for (int64_t i = 0; i < 50; ++i) {
    const std::string t = a.text(i);
    EXPECT_EQ(t.find("cats is"), std::string::npos) << t;
    EXPECT_EQ(t.find("cat are"), std::string::npos) << t;
  }
}

// ---- shards ---------------------------------------------------------------------------------------

TEST(DataShards, RoundTrip2And4ByteTokens) {
  TempDir d;
  for (int64_t vocab : {259, 65536, 70000, 1 << 20}) {
    std::vector<int32_t> toks;
    for (int64_t i = 0; i < 1000; ++i) toks.push_back(static_cast<int32_t>(philox_u64(1, 2, i) % vocab));
    toks.push_back(static_cast<int32_t>(vocab - 1));
    const std::string path = d.file(fmt::format("v{}.bin", vocab));
    ASSERT_TRUE(write_token_shard(path, toks, vocab).is_ok());
    const uint32_t tb = vocab <= 65536 ? 2 : 4;
    EXPECT_EQ(fs::file_size(path), 64u + toks.size() * tb);
    const std::string raw = read_bytes(path);
    EXPECT_EQ(raw.substr(0, 8), "NDTSHARD");
    ShardHeader h;
    auto back = read_token_shard(path, &h);
    ASSERT_TRUE(back.is_ok()) << back.status().message();
    EXPECT_EQ(back.value(), toks);
    EXPECT_EQ(h.version, 1u);
    EXPECT_EQ(h.token_bytes, tb);
    EXPECT_EQ(h.num_tokens, toks.size());
    EXPECT_EQ(h.vocab_size, static_cast<uint64_t>(vocab));
    for (int k = 32; k < 64; ++k) EXPECT_EQ(raw[k], 0);
  }
  EXPECT_FALSE(write_token_shard(d.file("bad.bin"), {1, 2, 300}, 259).is_ok());
}

TEST(DataShards, MalformedShardsRejectedWithNamedMessage) {
  TempDir d;
  const std::string good = d.file("good.bin");
  ASSERT_TRUE(write_token_shard(good, {1, 2, 3, 4, 5}, 259).is_ok());
  const std::string raw = read_bytes(good);
  struct Case {
    std::string name, bytes, expect;
  };
  auto patch32 = [&](size_t off, uint32_t v) {
    std::string s = raw;
    std::memcpy(s.data() + off, &v, 4);
    return s;
  };
  auto patch64 = [&](size_t off, uint64_t v) {
    std::string s = raw;
    std::memcpy(s.data() + off, &v, 8);
    return s;
  };
  std::string magic = raw;
  magic[3] = 'X';
  std::string bad_token = raw;
  const uint16_t big = 259;
  std::memcpy(bad_token.data() + 64 + 2 * 2, &big, 2);
  std::vector<Case> cases = {
      {"magic.bin", magic, "magic"},
      {"version.bin", patch32(8, 2), "version 2"},
      {"width.bin", patch32(12, 3), "token_bytes is 3"},
      {"trunc.bin", raw.substr(0, raw.size() - 1), "truncated"},
      {"longer.bin", raw + std::string(2, '\0'), "does not match"},
      {"count.bin", patch64(16, 1000), "truncated"},
      {"header.bin", raw.substr(0, 40), "truncated"},
      {"token.bin", bad_token, "token id 259 at position 2 is >= vocab_size 259"},
  };
  for (const Case& c : cases) {
    const std::string path = d.file(c.name);
    write_text(path, c.bytes);
    auto r = read_token_shard(path);
    ASSERT_FALSE(r.is_ok()) << c.name;
    EXPECT_NE(r.status().message().find(path), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find(c.expect), std::string::npos) << r.status().message();
    auto ds = ShardDataset::open(path, 2);
    ASSERT_FALSE(ds.is_ok());
    EXPECT_NE(ds.status().message().find(path), std::string::npos);
  }
  auto missing = ShardDataset::open(d.file("nope.bin"), 4);
  ASSERT_FALSE(missing.is_ok());
  EXPECT_NE(missing.status().message().find("nope.bin"), std::string::npos);
}

TEST(DataShards, DatasetWindowsSpanShards) {
  TempDir d;
  fs::create_directories(d.path() / "dir");
  // Stream 0..99 split over three files (written out of name order, plus an empty shard and a non-.bin).
  std::vector<int32_t> all(100);
  for (int i = 0; i < 100; ++i) all[static_cast<size_t>(i)] = i;
  ASSERT_TRUE(write_token_shard(d.file("dir/b.bin"), {all.begin() + 30, all.begin() + 45}, 259).is_ok());
  ASSERT_TRUE(write_token_shard(d.file("dir/a.bin"), {all.begin(), all.begin() + 30}, 259).is_ok());
  ASSERT_TRUE(write_token_shard(d.file("dir/bb.bin"), {}, 259).is_ok());
  ASSERT_TRUE(write_token_shard(d.file("dir/c.bin"), {all.begin() + 45, all.end()}, 259).is_ok());
  write_text(d.file("dir/readme.txt"), "not a shard");
  const int64_t T = 8;
  auto r = ShardDataset::open(d.path().string() + "/dir", T);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  const ShardDataset& ds = *r.value();
  EXPECT_EQ(ds.total_tokens(), 100);
  EXPECT_EQ(ds.num_shards(), 4);
  EXPECT_EQ(ds.size(), (100 - 1) / T);
  for (int64_t i = 0; i < ds.size(); ++i) {
    Sample s = ds.get(i);
    ASSERT_EQ(s.tokens.size(), static_cast<size_t>(T + 1));
    for (int64_t k = 0; k <= T; ++k) EXPECT_EQ(s.tokens[static_cast<size_t>(k)], i * T + k);
    EXPECT_EQ(s.loss_mask[0], 0);
    for (size_t k = 1; k < s.loss_mask.size(); ++k) EXPECT_EQ(s.loss_mask[k], 1);
  }
  EXPECT_FALSE(ShardDataset::open(d.file("dir/bb.bin"), T).is_ok());  // too few tokens
  fs::create_directories(d.path() / "empty");
  auto e = ShardDataset::open(d.path().string() + "/empty", T);
  ASSERT_FALSE(e.is_ok());
  EXPECT_NE(e.status().message().find("no .bin"), std::string::npos);
}

TEST(DataShards, TokenizeTextFilesRoundTrip) {
  TempDir d;
  auto tok = make_byte_tokenizer();
  write_text(d.file("a.txt"), "hello world\nsecond line");
  write_text(d.file("b.jsonl"), "{\"text\": \"doc one\"}\n\n{\"text\": \"doc \\u00e9 two\", \"id\": 3}\n");
  int64_t total = 0;
  Status st = tokenize_text_files({d.file("a.txt"), d.file("b.jsonl")}, *tok, d.file("out"), 10, &total);
  ASSERT_TRUE(st.is_ok()) << st.message();
  const std::vector<std::string> docs = {"hello world\nsecond line", "doc one", "doc \xc3\xa9 two"};
  std::vector<int32_t> expect;
  for (const auto& doc : docs) {
    for (int32_t t : tok->encode(doc)) expect.push_back(t);
    expect.push_back(tok->eos_id());
  }
  EXPECT_EQ(total, static_cast<int64_t>(expect.size()));
  std::vector<int32_t> got;
  int shards = 0;
  for (;; ++shards) {
    const std::string p = d.file(fmt::format("out_{:06d}.bin", shards));
    if (!fs::exists(p)) break;
    ShardHeader h;
    auto r = read_token_shard(p, &h);
    ASSERT_TRUE(r.is_ok()) << r.status().message();
    EXPECT_EQ(h.token_bytes, 2u);
    EXPECT_EQ(h.vocab_size, 259u);
    EXPECT_LE(r.value().size(), 10u);
    got.insert(got.end(), r.value().begin(), r.value().end());
  }
  EXPECT_EQ(shards, static_cast<int>((expect.size() + 9) / 10));
  EXPECT_EQ(got, expect);

  // Bad JSONL names file and line.
  write_text(d.file("bad.jsonl"), "{\"text\": \"ok\"}\n{\"txt\": 1}\n");
  st = tokenize_text_files({d.file("bad.jsonl")}, *tok, d.file("bad"), 10, &total);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find(d.file("bad.jsonl") + ":2"), std::string::npos) << st.message();
  st = tokenize_text_files({d.file("missing.txt")}, *tok, d.file("m"), 10, &total);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("missing.txt"), std::string::npos);
}

// ---- SFT ------------------------------------------------------------------------------------------

TEST(DataSft, PromptResponseAndChatMasks) {
  TempDir d;
  auto tok = make_byte_tokenizer();
  const std::string path = d.file("sft.jsonl");
  write_text(
      path,
      "{\"prompt\": \"What is 2+2?\", \"response\": \"4\"}\n"
      "\n"
      "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, {\"role\": \"user\", \"content\": "
      "\"Hi\"}, {\"role\": \"assistant\", \"content\": \"Hello\"}, {\"role\": \"user\", \"content\": "
      "\"Bye\"}, "
      "{\"role\": \"assistant\", \"content\": \"Ciao\"}, {\"role\": \"user\", \"content\": \"dropped\"}]}\n");
  auto r = SftDataset::load(path, *tok, 256);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  const SftDataset& ds = *r.value();
  ASSERT_EQ(ds.size(), 2);

  Sample a = ds.get(0);
  EXPECT_EQ(a.tokens.front(), tok->bos_id());
  EXPECT_EQ(a.tokens.back(), tok->eos_id());
  EXPECT_EQ(tok->decode(a.tokens), "What is 2+2?\n4");
  EXPECT_EQ(masked_text(*tok, a, 1), "4");
  EXPECT_EQ(a.loss_mask.back(), 1);
  EXPECT_EQ(std::count(a.loss_mask.begin(), a.loss_mask.end(), 1), 2);  // "4" + EOS

  Sample c = ds.get(1);
  EXPECT_EQ(tok->decode(c.tokens),
            "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\nHello\n<|user|>\nBye\n<|assistant|>\nCiao");
  EXPECT_EQ(masked_text(*tok, c, 1), "HelloCiao");
  EXPECT_EQ(c.tokens.back(), tok->eos_id());
  EXPECT_EQ(c.loss_mask.back(), 1);
  EXPECT_EQ(std::count(c.loss_mask.begin(), c.loss_mask.end(), 1), 10);  // 9 bytes + EOS

  // Prompt helper matches the sample prefix.
  auto p = sft_prompt_tokens(*tok, "What is 2+2?");
  EXPECT_EQ(std::vector<int32_t>(a.tokens.begin(), a.tokens.begin() + p.size()), p);

  // Truncation to seq_len + 1.
  auto t = SftDataset::load(path, *tok, 10);
  ASSERT_TRUE(t.is_ok());
  EXPECT_EQ(t.value()->get(1).tokens.size(), 11u);
  EXPECT_EQ(t.value()->num_truncated(), 2);
}

TEST(DataSft, MalformedFilesRejectedWithLineNumbers) {
  TempDir d;
  auto tok = make_byte_tokenizer();
  const std::string ok = "{\"prompt\": \"p\", \"response\": \"r\"}\n";
  struct Case {
    std::string name, text, expect;
  };
  std::vector<Case> cases = {
      {"json.jsonl", ok + "{\"prompt\": \"p\", \n", ":2: invalid JSON"},
      {"noresp.jsonl", ok + ok + "{\"prompt\": \"p\"}\n", ":3: \"response\" is missing"},
      {"nothing.jsonl", "{\"foo\": 1}\n", ":1: expected \"prompt\""},
      {"type.jsonl", "\n" + ok + "{\"prompt\": 3, \"response\": \"r\"}\n", ":3: \"prompt\" must be a string"},
      {"rtype.jsonl", "{\"prompt\": \"p\", \"response\": [1]}\n", ":1: \"response\" must be a string"},
      {"array.jsonl", "[1, 2]\n", ":1: expected a JSON object"},
      {"msgs.jsonl", ok + "{\"messages\": \"hi\"}\n", ":2: \"messages\" must be an array"},
      {"role.jsonl", "{\"messages\": [{\"role\": \"bot\", \"content\": \"x\"}]}\n",
       ":1: messages[0].role is \"bot\""},
      {"norole.jsonl", "{\"messages\": [{\"content\": \"x\"}]}\n", ":1: messages[0] is missing \"role\""},
      {"content.jsonl", "{\"messages\": [{\"role\": \"user\", \"content\": 5}]}\n",
       ":1: messages[0].content must be a string"},
      {"noassist.jsonl", "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}\n",
       ":1: conversation has no assistant"},
      {"empty.jsonl", "", "empty file"},
      {"blank.jsonl", "\n  \n", "empty file"},
  };
  for (const Case& c : cases) {
    const std::string path = d.file(c.name);
    write_text(path, c.text);
    auto r = SftDataset::load(path, *tok, 64);
    ASSERT_FALSE(r.is_ok()) << c.name;
    EXPECT_NE(r.status().message().find(path), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find(c.expect), std::string::npos) << r.status().message();
  }
  auto missing = SftDataset::load(d.file("missing.jsonl"), *tok, 64);
  ASSERT_FALSE(missing.is_ok());
  EXPECT_NE(missing.status().message().find("missing.jsonl"), std::string::npos);
}

// ---- batching and order ---------------------------------------------------------------------------

TEST(DataBatch, MicrobatchShapesMasksAndCuSeqlens) {
  Sample s1{{10, 11, 12, 13}, {0, 0, 1, 1}};                              // shorter than seq_len: padded
  Sample s2{{20, 21, 22, 23, 24, 25, 26, 27}, {0, 1, 1, 1, 1, 1, 1, 1}};  // longer: truncated to 6
  const int64_t T = 5;
  const int32_t pad = 99;
  Microbatch mb = make_microbatch({s1, s2}, T, pad);
  EXPECT_EQ(mb.nseq, 2);
  EXPECT_EQ(mb.max_seqlen, T);
  EXPECT_EQ(mb.num_tokens(), 2 * T);
  EXPECT_EQ(mb.tokens.dtype(), DType::I32);
  EXPECT_EQ(mb.targets.dtype(), DType::I32);
  EXPECT_EQ(mb.loss_mask.dtype(), DType::F32);
  EXPECT_EQ(mb.positions.dtype(), DType::I32);
  EXPECT_EQ(mb.cu_seqlens.to_vector<int32_t>(), (std::vector<int32_t>{0, 5, 10}));
  EXPECT_EQ(mb.tokens.to_vector<int32_t>(), (std::vector<int32_t>{10, 11, 12, 99, 99, 20, 21, 22, 23, 24}));
  EXPECT_EQ(mb.targets.to_vector<int32_t>(), (std::vector<int32_t>{99, 12, 13, 99, 99, 21, 22, 23, 24, 25}));
  EXPECT_EQ(mb.loss_mask.to_vector<float>(), (std::vector<float>{0, 1, 1, 0, 0, 1, 1, 1, 1, 1}));
  EXPECT_EQ(mb.positions.to_vector<int32_t>(), (std::vector<int32_t>{0, 1, 2, 3, 4, 0, 1, 2, 3, 4}));
  EXPECT_EQ(mb.num_loss_tokens, 7);

  // With real task samples the mask count matches the samples'.
  auto tok = make_byte_tokenizer();
  AdditionTask add(3, 1, *tok);
  std::vector<Sample> ss;
  int64_t want = 0;
  for (int64_t i = 0; i < 8; ++i) {
    ss.push_back(add.get(i));
    want += std::count(ss.back().loss_mask.begin(), ss.back().loss_mask.end(), 1);
  }
  Microbatch m2 = make_microbatch(ss, 16, tok->pad_id());
  EXPECT_EQ(m2.num_loss_tokens, want);
  EXPECT_EQ(m2.num_tokens(), 8 * 16);
}

TEST(DataBatch, SampleIndexIsAPermutationPerEpoch) {
  for (int64_t n : {1, 2, 3, 7, 64, 100, 1000}) {
    const int64_t gb = 4;
    std::vector<std::vector<int64_t>> epochs(3);
    for (int64_t g = 0; g < 3 * n; ++g) {
      const int64_t idx = sample_index(77, g / gb, g % gb, gb, n);
      ASSERT_GE(idx, 0);
      ASSERT_LT(idx, n);
      epochs[static_cast<size_t>(g / n)].push_back(idx);
    }
    for (auto& e : epochs) {
      std::vector<int64_t> sorted = e;
      std::sort(sorted.begin(), sorted.end());
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(sorted[static_cast<size_t>(i)], i) << "n=" << n;
    }
    if (n >= 64) {
      EXPECT_NE(epochs[0], epochs[1]);  // reshuffled each epoch
      std::vector<int64_t> identity(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) identity[static_cast<size_t>(i)] = i;
      EXPECT_NE(epochs[0], identity);
    }
  }
  // Deterministic, seed dependent, and independent of how the global batch is cut into steps.
  std::vector<int64_t> a, b, c;
  for (int64_t g = 0; g < 500; ++g) {
    a.push_back(sample_index(5, g / 10, g % 10, 10, 500));
    b.push_back(sample_index(5, g / 25, g % 25, 25, 500));
    c.push_back(sample_index(6, g / 10, g % 10, 10, 500));
  }
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  // Unbounded datasets: plain counter.
  EXPECT_EQ(sample_index(5, 3, 2, 8, -1), 3 * 8 + 2);
}

TEST(DataMakeDataset, TasksAndErrors) {
  TempDir d;
  auto tok = make_byte_tokenizer();
  DataConfig cfg;
  cfg.task = "addition";
  auto tr = make_dataset(cfg, *tok, false), va = make_dataset(cfg, *tok, true);
  ASSERT_TRUE(tr.is_ok() && va.is_ok());
  EXPECT_EQ(tr.value()->size(), -1);
  EXPECT_FALSE(same(tr.value()->get(0), va.value()->get(0)));
  cfg.task = "lm";
  auto lt = make_dataset(cfg, *tok, false), lv = make_dataset(cfg, *tok, true);
  ASSERT_TRUE(lt.is_ok() && lv.is_ok());
  EXPECT_EQ(lt.value()->get(0).tokens.size(), static_cast<size_t>(cfg.seq_len + 1));
  EXPECT_FALSE(same(lt.value()->get(0), lv.value()->get(0)));

  cfg.task = "shards";
  cfg.seq_len = 4;
  cfg.path = d.file("s.bin");
  ASSERT_TRUE(write_token_shard(cfg.path, std::vector<int32_t>(41, 7), 259).is_ok());
  auto sh = make_dataset(cfg, *tok, false);
  ASSERT_TRUE(sh.is_ok()) << sh.status().message();
  EXPECT_EQ(sh.value()->size(), 10);
  auto shv = make_dataset(cfg, *tok, true);
  ASSERT_FALSE(shv.is_ok());
  EXPECT_NE(shv.status().message().find("val_path"), std::string::npos);
  ASSERT_TRUE(write_token_shard(d.file("big.bin"), {1, 2, 3, 4, 5, 6}, 70000).is_ok());
  cfg.val_path = d.file("big.bin");
  auto big = make_dataset(cfg, *tok, true);
  ASSERT_FALSE(big.is_ok());
  EXPECT_NE(big.status().message().find("70000"), std::string::npos);

  cfg.task = "sft";
  cfg.path = d.file("t.jsonl");
  cfg.val_path = d.file("v.jsonl");
  write_text(cfg.path, "{\"prompt\": \"a\", \"response\": \"b\"}\n");
  write_text(cfg.val_path,
             "{\"prompt\": \"c\", \"response\": \"d\"}\n{\"prompt\": \"e\", \"response\": \"f\"}\n");
  auto st = make_dataset(cfg, *tok, false), sv = make_dataset(cfg, *tok, true);
  ASSERT_TRUE(st.is_ok() && sv.is_ok());
  EXPECT_EQ(st.value()->size(), 1);
  EXPECT_EQ(sv.value()->size(), 2);

  cfg.task = "images";
  auto bad = make_dataset(cfg, *tok, false);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("images"), std::string::npos);
}
