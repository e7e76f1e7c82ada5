// Run-output IO: safetensors (round trip, format details, corruption), token shard headers, metrics.jsonl,
// SVG loss curve; and regressions found by fuzzing (tests/fuzz): tokenizer files, config.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <tuple>

#include "data/bpe_tokenizer.h"
#include "data/shards.h"
#include "train/config.h"
#include "train/metrics.h"
#include "train/safetensors.h"

namespace fs = std::filesystem;
using ndt::DType;
using ndt::Tensor;
using nlohmann::json;

namespace {

class IoFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("ndt_io_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) + "_" +
            std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

std::string slurp(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}
void dump(const std::string& p, const std::string& bytes) { std::ofstream(p, std::ios::binary) << bytes; }

// Builds a raw safetensors file from a header string and a data buffer (for corruption cases).
std::string raw_file(const std::string& header, const std::string& data, int64_t len_override = -1) {
  const uint64_t n = len_override >= 0 ? static_cast<uint64_t>(len_override) : header.size();
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + data;
}

#define EXPECT_HAS(haystack, needle) \
  EXPECT_NE((haystack).find(needle), std::string::npos) << "'" << (needle) << "' not in: " << (haystack)

std::vector<std::pair<std::string, Tensor>> sample_tensors() {
  std::vector<float> w(2 * 3);
  for (size_t i = 0; i < w.size(); ++i) w[i] = 0.25f * static_cast<float>(i) - 1.1f;
  std::vector<int32_t> ids = {7, -3, 2147483647, 0, 42};
  std::vector<uint16_t> bf = {0x3f80, 0xbf80, 0x7f80, 0x0001};  // 1, -1, inf, denormal: raw words
  std::vector<int64_t> big = {int64_t{1} << 40, -5};
  return {{"layers.0.attn.wq", Tensor::from_vector(w, {2, 3})},
          {"tokens", Tensor::from_vector(ids, {5})},
          {"bf16.weight", Tensor::from_vector(bf, {2, 2})},
          {"scalar_i64", Tensor::from_vector(big, {2})},
          {"empty", Tensor::from_vector(std::vector<float>{}, {0, 4})}};
}

}  // namespace

TEST_F(IoFiles, SafetensorsRoundTrip) {
  const auto p = path("sub/dir/model.safetensors");
  const auto ts = sample_tensors();
  ASSERT_TRUE(ndt::save_safetensors(p, ts, {{"format", "pt"}, {"step", "12"}}).is_ok());
  EXPECT_FALSE(fs::exists(p + ".tmp"));
  auto r = ndt::open_safetensors(p);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  const auto& f = r.value();
  ASSERT_EQ(f.names().size(), ts.size());
  for (size_t i = 0; i < ts.size(); ++i)
    EXPECT_EQ(f.names()[i], ts[i].first);  // data-buffer order = order given
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(f.metadata().at("step"), "12");
  for (const auto& [name, t] : ts) {
    Tensor back = f.read(name);
    EXPECT_EQ(back.dtype(), t.dtype()) << name;
    EXPECT_EQ(back.shape(), t.shape()) << name;
    ASSERT_EQ(back.nbytes(), t.nbytes());
    if (t.nbytes()) {
      EXPECT_EQ(std::memcmp(back.data_ptr(), t.data_ptr(), t.nbytes()), 0) << name;
    }
  }
  EXPECT_EQ(f.info("tokens").dtype, DType::I32);
  EXPECT_EQ(f.info("bf16.weight").end - f.info("bf16.weight").begin, 8u);
  EXPECT_TRUE(f.contains("tokens"));
  EXPECT_FALSE(f.contains("nope"));
  EXPECT_THROW(f.read("nope"), ndt::Error);

  // read_into checks dtype and shape.
  Tensor dst = Tensor::zeros({2, 3});
  ASSERT_TRUE(f.read_into("layers.0.attn.wq", dst).is_ok());
  EXPECT_FLOAT_EQ(dst.f32()[5], 0.25f * 5 - 1.1f);
  Tensor wrong = Tensor::zeros({3, 2});
  EXPECT_HAS(f.read_into("layers.0.attn.wq", wrong).message(), "layers.0.attn.wq");
}

TEST_F(IoFiles, SafetensorsHeaderIsAlignedStandardJson) {
  const auto p = path("m.safetensors");
  ASSERT_TRUE(ndt::save_safetensors(p, sample_tensors(), {{"k", "v"}}).is_ok());
  const std::string bytes = slurp(p);
  ASSERT_GE(bytes.size(), 8u);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(static_cast<uint8_t>(bytes[i])) << (8 * i);
  EXPECT_EQ(n % 8, 0u);
  ASSERT_LE(8 + n, bytes.size());
  const json h = json::parse(bytes.substr(8, n));  // trailing spaces are JSON whitespace
  EXPECT_EQ(h["__metadata__"]["k"], "v");
  EXPECT_EQ(h["layers.0.attn.wq"]["dtype"], "F32");
  EXPECT_EQ(h["layers.0.attn.wq"]["shape"], json::array({2, 3}));
  EXPECT_EQ(h["layers.0.attn.wq"]["data_offsets"], json::array({0, 24}));
  EXPECT_EQ(h["tokens"]["dtype"], "I32");
  EXPECT_EQ(h["tokens"]["data_offsets"], json::array({24, 44}));
  EXPECT_EQ(h["bf16.weight"]["dtype"], "BF16");
  EXPECT_EQ(h["scalar_i64"]["dtype"], "I64");
  EXPECT_EQ(h["empty"]["shape"], json::array({0, 4}));
  // The buffer is exactly the tensors, back to back.
  EXPECT_EQ(bytes.size() - 8 - n, 24u + 20u + 8u + 16u + 0u);
  float w0;
  std::memcpy(&w0, bytes.data() + 8 + n, 4);
  EXPECT_FLOAT_EQ(w0, -1.1f);
}

TEST_F(IoFiles, SafetensorsSaveRejectsBadInput) {
  Tensor t = Tensor::zeros({2});
  EXPECT_HAS(ndt::save_safetensors(path("a"), {{"x", t}, {"x", t}}).message(), "duplicate tensor name 'x'");
  EXPECT_HAS(ndt::save_safetensors(path("a"), {{"", t}}).message(), "empty tensor name");
  EXPECT_HAS(ndt::save_safetensors(path("a"), {{"u", Tensor()}}).message(), "'u' is undefined");
  EXPECT_HAS(ndt::save_safetensors(path("a"), {{"__metadata__", t}}).message(), "reserved");
  EXPECT_FALSE(fs::exists(path("a")));
}

TEST_F(IoFiles, SafetensorsCorruptionRejected) {
  const std::string f32_2x2 = R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})";
  const std::string data16(16, '\x01');
  std::string ones65 = "1";
  for (int i = 0; i < 64; ++i) ones65 += ",1";
  struct Case {
    std::string name, bytes, needle;
  };
  const std::vector<Case> cases = {
      {"short", std::string(5, '\0'), "file too short"},
      {"hlen", raw_file(f32_2x2, data16, 1000), "header length 1000 is larger than the file"},
      {"json", raw_file("{\"w\": {\"dtype\": ", ""), "not valid JSON"},
      {"notobj", raw_file("[1,2,3]", ""), "must be a JSON object"},
      {"dtype", raw_file(R"({"w":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}})", std::string(4, 'x')),
       "tensor 'w': unknown or unsupported dtype 'F16'"},
      {"missing", raw_file(R"({"w":{"dtype":"F32","shape":[2]}})", ""), "tensor 'w': entry needs"},
      {"negshape",
       raw_file(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", std::string(8, 'x')),
       "tensor 'w': shape"},
      {"oob", raw_file(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})", std::string(8, 'x')),
       "tensor 'w': data_offsets [0, 16] out of bounds"},
      {"sizemismatch",
       raw_file(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}})", std::string(12, 'x')),
       "tensor 'w': data_offsets [0, 12] hold 12 bytes but F32 (2, 2) needs 16"},
      {"reversed", raw_file(R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", std::string(8, 'x')),
       "end before begin"},
      {"overlap",
       raw_file(
           R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
           std::string(12, 'x')),
       "tensor 'b' data_offsets [4, 12] overlap tensor 'a'"},
      {"gap",
       raw_file(
           R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
           std::string(12, 'x')),
       "gap in the data buffer"},
      {"trailing", raw_file(f32_2x2, data16 + "xxxx"), "data buffer is 20 bytes but the tensors cover 16"},
      {"meta", raw_file(R"({"__metadata__":{"a":1}})", ""), "__metadata__ value for 'a' is not a string"},
      // Absurd sizes (found by fuzzing, docs/reliability.md): a zero dim must not let a dim above INT64_MAX
      // through (it became a negative shape), and numel * 8 must not wrap around to the 0 bytes given.
      {"hugedim",
       raw_file(R"({"w":{"dtype":"F32","shape":[0,18446744073709551615],"data_offsets":[0,0]}})", ""),
       "tensor 'w': shape [0,18446744073709551615] is absurdly large"},
      {"wrap", raw_file(R"({"w":{"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,0]}})", ""),
       "tensor 'w': shape [2305843009213693952] is absurdly large"},
      {"manydims",
       raw_file(R"({"w":{"dtype":"F32","shape":[)" + ones65 + R"(],"data_offsets":[0,4]}})", "xxxx"),
       "tensor 'w': shape has 65 dims"},
  };
  for (const auto& c : cases) {
    const auto p = path(c.name + ".safetensors");
    dump(p, c.bytes);
    auto r = ndt::open_safetensors(p);
    ASSERT_FALSE(r.is_ok()) << c.name;
    EXPECT_HAS(r.status().message(), c.needle);
    EXPECT_HAS(r.status().message(), p);  // every error names the file
  }
  EXPECT_HAS(ndt::open_safetensors(path("absent.safetensors")).status().message(), "not found");
  // A header length of 2^64 - 1 is refused before anything is allocated.
  dump(path("hlen_max.safetensors"), std::string(8, '\xff') + "{}");
  EXPECT_HAS(ndt::open_safetensors(path("hlen_max.safetensors")).status().message(),
             "header length 18446744073709551615 is larger than the file allows (2 bytes after the length)");
  // Sanity: the hand-built valid file opens (so the cases above fail for the stated reason).
  dump(path("ok.safetensors"), raw_file(f32_2x2, data16));
  auto ok = ndt::open_safetensors(path("ok.safetensors"));
  ASSERT_TRUE(ok.is_ok()) << ok.status().message();
  EXPECT_EQ(ok.value().read("w").shape(), (ndt::Shape{2, 2}));
}

// Absurd counts in a token shard's header are refused before anything is read or allocated: 2^63 tokens of
// 2 bytes would wrap around to the 0-byte payload of a header-only file; a vocab_size above 2^31 is invalid.
TEST_F(IoFiles, ShardHeaderAbsurdCountsRejected) {
  const std::string good = path("good.bin");
  ASSERT_TRUE(ndt::write_token_shard(good, {}, 259).is_ok());
  const std::string header = slurp(good);
  ASSERT_EQ(header.size(), 64u);
  auto patched = [&](size_t off, uint64_t v) {
    std::string s = header;
    std::memcpy(s.data() + off, &v, 8);
    return s;
  };
  const std::vector<std::tuple<std::string, std::string, std::string>> cases = {
      {"wrap.bin", patched(16, uint64_t{1} << 63), "does not match the header (9223372036854775808 tokens"},
      {"max.bin", patched(16, ~uint64_t{0}), "does not match the header"},
      {"vocab.bin", patched(24, ~uint64_t{0}), "invalid vocab_size 18446744073709551615"},
  };
  for (const auto& [name, bytes, needle] : cases) {
    dump(path(name), bytes);
    auto r = ndt::read_token_shard(path(name));
    ASSERT_FALSE(r.is_ok()) << name;
    EXPECT_HAS(r.status().message(), needle);
    EXPECT_HAS(r.status().message(), path(name));
  }
  ASSERT_TRUE(ndt::read_token_shard(good).is_ok());  // the unpatched header reads (0 tokens)
}

TEST_F(IoFiles, MetricsJsonlLinesParse) {
  const auto dir = path("run/nested");
  {
    auto w = ndt::MetricsWriter::open(dir);
    ASSERT_TRUE(w.is_ok()) << w.status().message();
    auto& mw = w.value();
    ASSERT_TRUE(mw.write({{"step", 1}, {"loss", 2.5}, {"lr", 1e-3}}).is_ok());
    ASSERT_TRUE(mw.write({{"step", 2}, {"loss", 2.25}, {"tokens_per_s", 1234.5}}).is_ok());
    ASSERT_TRUE(mw.write({{"step", 2}, {"val_loss", 2.4}, {"note", "eval \"quoted\"\nnewline"}}).is_ok());
    ASSERT_TRUE(mw.write({{"step", 3}, {"loss", std::nan("")}}).is_ok());
    EXPECT_FALSE(mw.write(json::array({1, 2})).is_ok());
  }
  const std::string text = slurp(dir + "/metrics.jsonl");
  std::istringstream in(text);
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    const json j = json::parse(line);  // each line stands alone
    EXPECT_TRUE(j.is_object());
    EXPECT_TRUE(j.contains("step"));
    ++n;
  }
  EXPECT_EQ(n, 4);
  auto recs = ndt::read_metrics_jsonl(dir + "/metrics.jsonl");
  ASSERT_TRUE(recs.is_ok());
  EXPECT_TRUE(recs.value()[3]["loss"].is_null());
  const auto loss = ndt::metric_series(recs.value(), "loss");
  ASSERT_EQ(loss.size(), 2u);  // the NaN became null and is not a number
  EXPECT_EQ(loss[1], (std::pair<int64_t, double>{2, 2.25}));
  EXPECT_EQ(ndt::metric_series(recs.value(), "val_loss").size(), 1u);

  // append=false starts fresh, append=true continues.
  {
    auto w = ndt::MetricsWriter::open(dir, /*append=*/true);
    ASSERT_TRUE(w.value().write({{"step", 4}}).is_ok());
  }
  EXPECT_EQ(ndt::read_metrics_jsonl(dir + "/metrics.jsonl").value().size(), 5u);
  {
    auto w = ndt::MetricsWriter::open(dir);
    ASSERT_TRUE(w.value().write({{"step", 1}}).is_ok());
  }
  EXPECT_EQ(ndt::read_metrics_jsonl(dir + "/metrics.jsonl").value().size(), 1u);
  dump(path("bad.jsonl"), "{\"a\":1}\n{oops\n");
  EXPECT_HAS(ndt::read_metrics_jsonl(path("bad.jsonl")).status().message(), "bad.jsonl:2");
}

TEST_F(IoFiles, LossSvgProduced) {
  std::vector<std::pair<int64_t, double>> tr, va;
  for (int64_t s = 1; s <= 500; ++s)
    tr.emplace_back(s, 3.0 * std::exp(-s / 120.0) + 0.2 + 0.05 * std::sin(s));
  for (int64_t s = 100; s <= 500; s += 100) va.emplace_back(s, 3.0 * std::exp(-s / 120.0) + 0.3);
  tr.emplace_back(501, std::nan(""));  // skipped, not a broken path
  for (bool log_y : {false, true}) {
    const auto p = path(log_y ? "plots/loss_log.svg" : "plots/loss.svg");
    ASSERT_TRUE(ndt::write_loss_svg(tr, va, p, "addition <d=3> & friends", log_y).is_ok());
    const std::string svg = slurp(p);
    EXPECT_EQ(svg.rfind("<svg", 0), 0u);
    EXPECT_HAS(svg, "</svg>");
    EXPECT_HAS(svg, "id=\"train_loss\"");
    EXPECT_HAS(svg, "id=\"val_loss\"");
    EXPECT_HAS(svg, "train loss");
    EXPECT_HAS(svg, "validation loss");
    EXPECT_HAS(svg, "addition &lt;d=3&gt; &amp; friends");
    EXPECT_EQ(svg.find("nan"), std::string::npos);
    EXPECT_HAS(svg, ">500<");  // an x tick label
  }
  // Degenerate inputs still give a valid picture.
  ASSERT_TRUE(ndt::write_loss_svg({}, {}, path("empty.svg"), "empty").is_ok());
  EXPECT_HAS(slurp(path("empty.svg")), "no data");
  ASSERT_TRUE(ndt::write_loss_svg({{5, 1.0}}, {}, path("one.svg"), "one").is_ok());
  EXPECT_HAS(slurp(path("one.svg")), "<circle");
}

TEST(IoFormat, DurationAndCount) {
  EXPECT_EQ(ndt::format_duration(83), "1m23s");
  EXPECT_EQ(ndt::format_duration(0.42), "0.42s");
  EXPECT_EQ(ndt::format_duration(12.34), "12.3s");
  EXPECT_EQ(ndt::format_duration(3725), "1h02m");
  EXPECT_EQ(ndt::format_duration(90000), "1d01h");
  EXPECT_EQ(ndt::format_count(12345), "12.3k");
  EXPECT_EQ(ndt::format_count(999), "999");
  EXPECT_EQ(ndt::format_count(999.7), "1.00k");
  EXPECT_EQ(ndt::format_count(1.5e9), "1.50G");
  EXPECT_EQ(ndt::format_count(2.5e6), "2.50M");
  EXPECT_EQ(ndt::format_count(123456), "123k");
  EXPECT_EQ(ndt::format_count(0), "0");
  EXPECT_EQ(ndt::format_count(12.34), "12.3");
}

// ---- Regressions found by fuzzing (tests/fuzz, docs/reliability.md "Fuzzing and sanitizers") ----

// tokenizer.json / vocab.json ids: a negative id wrote before the id table (heap overflow), a float id was an
// out-of-range conversion, a huge id sized a table of 2^31 strings (and id + 1 overflowed), an added token
// with empty content made encode() loop forever.
TEST_F(IoFiles, FuzzRegressionTokenizerIdsRefused) {
  auto tokenizer_json = [](const std::string& vocab, const std::string& added) {
    return R"({"model": {"type": "BPE", "vocab": )" + vocab + R"(, "merges": []}, "added_tokens": )" + added +
           "}";
  };
  const std::string eot = R"([{"id": 2, "content": "<|endoftext|>", "special": true}])";
  struct Case {
    std::string name, text, needle;
  };
  const std::vector<Case> cases = {
      {"negative", tokenizer_json(R"({"a": 0, "b": -1})", eot), "token 'b' has id -1"},
      {"float", tokenizer_json(R"({"a": 0, "b": 1e300})", eot), "token 'b' has id 1e+300"},
      {"max", tokenizer_json(R"({"a": 0, "b": 2147483647})", eot), "token 'b' has id 2147483647"},
      {"sparse", tokenizer_json(R"({"a": 0, "b": 100000000})", eot),
       "the largest token id is 100000000 but there are only 3 tokens"},
      {"added_negative", tokenizer_json(R"({"a": 0, "b": 1})", R"([{"id": -7, "content": "<|x|>"}])"),
       "token '<|x|>' has id -7"},
      {"added_empty", tokenizer_json(R"({"a": 0, "b": 1})", R"([{"id": 2, "content": ""}])"),
       "an added token has empty content"},
  };
  for (const Case& c : cases) {
    fs::create_directories(dir_ / c.name);
    dump(path(c.name + "/tokenizer.json"), c.text);
    auto t = ndt::load_bpe_tokenizer(path(c.name + "/tokenizer.json"));
    ASSERT_FALSE(t.is_ok()) << c.name;
    EXPECT_HAS(t.status().message(), c.needle);
    EXPECT_HAS(t.status().message(), "tokenizer.json");
  }
  // vocab.json (with merges.txt) ids are checked the same way.
  fs::create_directories(dir_ / "vm");
  dump(path("vm/vocab.json"), R"({"a": 0, "<|endoftext|>": -2})");
  dump(path("vm/merges.txt"), "#version: 0.2\n");
  auto vm = ndt::load_bpe_tokenizer(path("vm/vocab.json"));
  ASSERT_FALSE(vm.is_ok());
  EXPECT_HAS(vm.status().message(), "token '<|endoftext|>' has id -2");

  // A merge result missing from the vocabulary is refused at load, as the reference library does.
  fs::create_directories(dir_ / "nomerge");
  std::string text = tokenizer_json(R"({"a": 0, "b": 1})", eot);
  text.replace(text.find(R"("merges": [])"), std::string(R"("merges": [])").size(), R"("merges": ["a b"])");
  dump(path("nomerge/tokenizer.json"), text);
  auto t = ndt::load_bpe_tokenizer(path("nomerge/tokenizer.json"));
  ASSERT_FALSE(t.is_ok());
  EXPECT_HAS(t.status().message(), R"(merge 0 "a b": 'ab' is not in the vocabulary)");
  // A byte missing from the vocabulary (no unk_token) is an ndt::Error from encode, thrown from inside the
  // regex split (no leak of its match data: scripts/sanitize.sh runs this under LeakSanitizer).
  fs::create_directories(dir_ / "nobyte");
  dump(path("nobyte/tokenizer.json"), tokenizer_json(R"({"a": 0, "b": 1})", eot));
  t = ndt::load_bpe_tokenizer(path("nobyte/tokenizer.json"));
  ASSERT_TRUE(t.is_ok()) << t.status().message();
  EXPECT_EQ(t.value()->encode("ba"), (std::vector<int32_t>{1, 0}));
  EXPECT_THROW(t.value()->encode("abc"), ndt::Error);  // "c" is not in the vocabulary
}

// train.micro_batch near INT64_MAX made parallel.dp * train.micro_batch overflow (and a product that wrapped
// to 0 divided by zero).
TEST(FuzzRegression, ConfigMicroBatchOverflowRefused) {
  auto c = ndt::parse_config_string("", {"parallel.dp=4", "train.micro_batch=4611686018427387904"});
  ASSERT_FALSE(c.is_ok());
  EXPECT_HAS(c.status().message(), "train.micro_batch (4611686018427387904) must be <= train.global_batch");
  c = ndt::parse_config_string(
      "", {"parallel.dp=1048576", "train.global_batch=1048576", "train.micro_batch=17592186044416"});
  ASSERT_FALSE(c.is_ok());
  EXPECT_HAS(c.status().message(),
             "train.micro_batch (17592186044416) must be <= train.global_batch / parallel.dp");
}

// A "billion laughs" YAML document (each mapping aliases the previous one twice: 2^40 paths in 40 lines) was
// flattened path by path: a hang. Flattening now stops after 100000 nodes.
TEST(FuzzRegression, ConfigYamlAliasBombRefused) {
  std::string yaml = "l0: &l0 {a: 1, b: 2}\n";
  for (int i = 1; i < 40; ++i) yaml += fmt::format("l{}: &l{} {{p: *l{}, q: *l{}}}\n", i, i, i - 1, i - 1);
  auto c = ndt::parse_config_string(yaml, {}, "bomb.yaml");
  ASSERT_FALSE(c.is_ok());
  EXPECT_HAS(c.status().message(), "config bomb.yaml has more than 100000 keys (nested aliases?)");
}
