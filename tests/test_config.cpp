// Config parsing: defaults, presets in configs/, overrides, and every class of error naming its key.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "train/config.h"

namespace fs = std::filesystem;
using ndt::Config;
using ndt::load_config;
using ndt::parse_config_string;

namespace {

// A fresh temp directory per test, removed afterwards.
class ConfigFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("ndt_config_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) +
            "_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string write(const std::string& name, const std::string& text) {
    const fs::path p = dir_ / name;
    std::ofstream(p) << text;
    return p.string();
  }
  fs::path dir_;
};

std::string error_of(const ndt::Result<Config>& r) {
  EXPECT_FALSE(r.is_ok()) << "expected an error";
  return r.status().message();
}

#define EXPECT_HAS(haystack, needle) \
  EXPECT_NE((haystack).find(needle), std::string::npos) << "'" << (needle) << "' not in: " << (haystack)

}  // namespace

TEST(ConfigDefaults, AreValid) {
  Config c;
  EXPECT_TRUE(ndt::validate_config(c).is_ok()) << ndt::validate_config(c).message();
  auto r = parse_config_string("", {});
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  EXPECT_EQ(r.value().model.d_model, c.model.d_model);
  EXPECT_EQ(r.value().source, "<string>");
}

TEST(ConfigDefaults, FfnDimRule) {
  ndt::ModelConfig m;
  m.style = "gpt2";
  m.d_model = 768;
  EXPECT_EQ(m.ffn_dim(), 3072);
  m.style = "llama";
  m.d_model = 128;
  EXPECT_EQ(m.ffn_dim(), 352);  // 8*128/3 = 341 -> 352
  m.d_model = 64;
  EXPECT_EQ(m.ffn_dim(), 192);  // 170 -> 192
  m.d_model = 768;
  EXPECT_EQ(m.ffn_dim(), 2048);  // exact
  m.d_ff = 100;
  EXPECT_EQ(m.ffn_dim(), 100);
}

TEST(ConfigPresets, EveryFileInConfigsLoadsAndValidates) {
  const fs::path dir = fs::path(NDT_SOURCE_DIR) / "configs";
  int n = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() != ".yaml") continue;
    ++n;
    auto r = load_config(e.path().string(), {});
    ASSERT_TRUE(r.is_ok()) << e.path() << ": " << r.status().message();
    EXPECT_TRUE(ndt::validate_config(r.value()).is_ok());
    // The top comment says what the file is for.
    std::ifstream in(e.path());
    std::string first;
    std::getline(in, first);
    EXPECT_EQ(first.rfind("# ", 0), 0u) << e.path() << " lacks a top comment";
  }
  EXPECT_GE(n, 6);
}

TEST(ConfigPresets, KnownValues) {
  const fs::path dir = fs::path(NDT_SOURCE_DIR) / "configs";
  auto a = load_config((dir / "addition.yaml").string(), {});
  ASSERT_TRUE(a.is_ok()) << a.status().message();
  EXPECT_EQ(a.value().data.task, "addition");
  EXPECT_EQ(a.value().model.vocab_size, 264);
  auto t = load_config((dir / "tiny-llama.yaml").string(), {});
  ASSERT_TRUE(t.is_ok());
  EXPECT_EQ(t.value().model.kv_heads(), 2);
  EXPECT_FALSE(t.value().model.tied());
  auto g = load_config((dir / "tiny-gpt2.yaml").string(), {});
  ASSERT_TRUE(g.is_ok());
  EXPECT_TRUE(g.value().model.tied());
}

TEST_F(ConfigFiles, OverridesApply) {
  const auto p = write("a.yaml", "model:\n  d_model: 64\ntrain:\n  lr: 0.01\n");
  auto r = load_config(p, {"train.lr=3e-4", "model.n_layers=5", "parallel.zero1=true", "data.path='a b.bin'",
                           "model.style=gpt2", "train.steps=1e4", "parallel.dp_grad_window=false",
                           "parallel.dp_reduction=copy_engine"});
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  const Config& c = r.value();
  EXPECT_TRUE(Config().parallel.dp_grad_window);  // default: DP's gradients in an NCCL window on GPUs
  EXPECT_FALSE(c.parallel.dp_grad_window);
  EXPECT_EQ(Config().parallel.dp_reduction, "nccl");
  EXPECT_EQ(c.parallel.dp_reduction, "copy_engine");
  EXPECT_DOUBLE_EQ(c.train.lr, 3e-4);
  EXPECT_EQ(c.model.n_layers, 5);
  EXPECT_EQ(c.model.d_model, 64);
  EXPECT_TRUE(c.parallel.zero1);
  EXPECT_EQ(c.data.path, "a b.bin");
  EXPECT_EQ(c.model.style, "gpt2");
  EXPECT_EQ(c.train.steps, 10000);
  EXPECT_EQ(c.source, p);
}

TEST_F(ConfigFiles, OverrideErrors) {
  const auto p = write("a.yaml", "");
  EXPECT_HAS(error_of(load_config(p, {"train.lr"})), "key=value");
  EXPECT_HAS(error_of(load_config(p, {"train.lrr=1"})), "unknown config key 'train.lrr'");
  EXPECT_HAS(error_of(load_config(p, {"train.lr=abc"})), "config key 'train.lr' expects a number, got 'abc'");
}

TEST_F(ConfigFiles, UnknownKeyNamesKeyFileAndSuggestion) {
  const auto p = write("typo.yaml", "model:\n  d_model: 64\n  n_layer: 3\n");
  const auto msg = error_of(load_config(p, {}));
  EXPECT_HAS(msg, "unknown config key 'model.n_layer' in " + p);
  EXPECT_HAS(msg, ":3");  // line
  EXPECT_HAS(msg, "did you mean 'model.n_layers'");
  // Unknown section and unknown top-level scalar.
  EXPECT_HAS(error_of(parse_config_string("optim:\n  lr: 1\n", {})), "unknown config key 'optim.lr'");
  EXPECT_HAS(error_of(parse_config_string("lr: 1\n", {})), "unknown config key 'lr'");
  // Right leaf under the wrong section.
  EXPECT_HAS(error_of(parse_config_string("train:\n  seq_len: 8\n", {})), "did you mean 'data.seq_len'");
}

TEST_F(ConfigFiles, WrongTypeNamesKey) {
  const auto p = write("t.yaml", "train:\n  lr: abc\n");
  const auto msg = error_of(load_config(p, {}));
  EXPECT_HAS(msg, "config key 'train.lr' expects a number, got 'abc'");
  EXPECT_HAS(msg, p);
  EXPECT_HAS(error_of(parse_config_string("model:\n  n_layers: 2.5\n", {})),
             "'model.n_layers' expects an integer");
  EXPECT_HAS(error_of(parse_config_string("parallel:\n  zero1: maybe\n", {})),
             "'parallel.zero1' expects true or false");
  EXPECT_HAS(error_of(parse_config_string("model:\n  d_model: [1, 2]\n", {})),
             "'model.d_model' expects a single value");
  EXPECT_HAS(error_of(parse_config_string("model:\n  d_model:\n", {})), "'model.d_model' expects an integer");
  EXPECT_HAS(error_of(parse_config_string("model: 3\n", {})), "unknown config key 'model'");
}

TEST_F(ConfigFiles, OutOfRangeNamesKey) {
  EXPECT_HAS(error_of(parse_config_string("model:\n  n_layers: 0\n", {})),
             "config key 'model.n_layers' must be >= 1, got 0");
  EXPECT_HAS(error_of(parse_config_string("train:\n  beta2: 1.5\n", {})),
             "config key 'train.beta2' must be <= 1");
  EXPECT_HAS(error_of(parse_config_string("model:\n  style: gtp2\n", {})),
             "config key 'model.style' must be one of gpt2, llama, got 'gtp2'");
  EXPECT_HAS(error_of(parse_config_string("parallel:\n  schedule: zb\n", {})),
             "'parallel.schedule' must be one of");
  EXPECT_HAS(error_of(parse_config_string("data:\n  task: images\n", {})), "'data.task' must be one of");
}

TEST_F(ConfigFiles, MissingFile) {
  EXPECT_HAS(error_of(load_config((dir_ / "nope.yaml").string(), {})),
             "config file '" + (dir_ / "nope.yaml").string() + "' not found");
}

TEST_F(ConfigFiles, YamlSyntaxErrorNamesFileAndLine) {
  const auto p = write("bad.yaml", "model:\n  d_model: 64\n  n_heads: [4\ntrain:\n  lr: 1\n");
  const auto msg = error_of(load_config(p, {}));
  EXPECT_HAS(msg, "YAML syntax error in " + p);
  EXPECT_HAS(msg, "line ");
  const auto p2 = write("bad2.yaml", "model:\n  d_model: 64\n n_heads: 4\n");
  EXPECT_HAS(error_of(load_config(p2, {})), "YAML syntax error in " + p2 + " at line 3");
}

TEST_F(ConfigFiles, PresetMergesAndChains) {
  write("base.yaml", "model:\n  d_model: 96\n  n_heads: 4\n  n_layers: 3\ntrain:\n  lr: 0.002\n");
  write("mid.yaml", "preset: base\nmodel:\n  n_layers: 5\n");
  const auto p =
      write("top.yaml", "model:\n  n_heads: 2\npreset: mid\n");  // position of preset: does not matter
  auto r = load_config(p, {"train.steps=70"});
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  EXPECT_EQ(r.value().model.d_model, 96);  // from base
  EXPECT_EQ(r.value().model.n_layers, 5);  // mid overrides base
  EXPECT_EQ(r.value().model.n_heads, 2);   // top overrides base
  EXPECT_DOUBLE_EQ(r.value().train.lr, 0.002);
  EXPECT_EQ(r.value().train.steps, 70);
}

TEST_F(ConfigFiles, PresetFromRepoConfigs) {
  const auto p = write("mine.yaml", "preset: tiny-llama\ntrain:\n  steps: 3\n  warmup_steps: 1\n");
  auto r = load_config(p, {});
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  EXPECT_EQ(r.value().model.d_model, 64);
  EXPECT_EQ(r.value().train.steps, 3);
  EXPECT_HAS(error_of(load_config(write("x.yaml", "preset: no-such-preset\n"), {})),
             "preset 'no-such-preset'");
}

TEST_F(ConfigFiles, PresetCycleRejected) {
  write("a.yaml", "preset: b\n");
  write("b.yaml", "preset: c\n");
  write("c.yaml", "preset: a\n");
  const auto msg = error_of(load_config((dir_ / "a.yaml").string(), {}));
  EXPECT_HAS(msg, "preset cycle");
  EXPECT_HAS(msg, "c.yaml");
  EXPECT_HAS(error_of(load_config(write("self.yaml", "preset: self\n"), {})), "preset cycle");
}

TEST_F(ConfigFiles, ErrorsInPresetNameThePreset) {
  write("base.yaml", "model:\n  n_layerz: 2\n");
  const auto msg = error_of(load_config(write("top.yaml", "preset: base\n"), {}));
  EXPECT_HAS(msg, "'model.n_layerz'");
  EXPECT_HAS(msg, "base.yaml:2");
}

TEST(ConfigValidate, CrossFieldChecksNameKeys) {
  struct Case {
    std::vector<std::string> overrides;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {{"model.d_model=100", "model.n_heads=3"},
       "model.d_model (100) must be divisible by model.n_heads (3)"},
      {{"model.n_heads=4", "model.n_kv_heads=3"}, "model.n_kv_heads"},
      {{"model.d_model=12", "model.n_heads=4"}, "must be even for style llama"},
      {{"data.seq_len=512", "model.max_seq_len=256"},
       "data.seq_len (512) must be <= model.max_seq_len (256)"},
      {{"train.global_batch=30", "parallel.dp=4"},
       "train.global_batch (30) must be divisible by parallel.dp (4)"},
      {{"train.global_batch=32", "parallel.dp=2", "train.micro_batch=3"}, "parallel.dp * train.micro_batch"},
      {{"train.lr=0"}, "train.lr must be > 0"},
      {{"train.lr=1e-3", "train.min_lr=1e-2"}, "train.min_lr"},
      {{"train.steps=10", "train.warmup_steps=20"}, "train.warmup_steps (20) must be <= train.steps (10)"},
      {{"data.task=shards"}, "data.path is required for data.task shards"},
      {{"data.task=sft"}, "data.path is required for data.task sft"},
      {{"parallel.order=tp-cp-dp-pp"}, "parallel.order"},
      {{"parallel.order=tp-tp-ep-dp-pp"}, "parallel.order"},
      {{"parallel.virtual_stages=2"}, "parallel.virtual_stages"},
      {{"model.style=gpt2", "model.n_kv_heads=2"}, "style gpt2"},
      {{"train.device=cuda", "model.d_model=64", "model.n_heads=4"},
       "train.device cuda needs a head dim of 64 or 128 (the GPU attention kernels), got model.d_model / "
       "model.n_heads = 64 / 4 = 16"},
      {{"train.device=cuda", "model.d_model=64", "model.n_heads=4", "model.head_dim=96"},
       "train.device cuda needs a head dim of 64 or 128 (the GPU attention kernels), got model.head_dim = "
       "96"},
      {{"model.head_dim=5"}, "the head dim 5 (model.head_dim) must be even for style llama"},
      {{"model.style=gpt2", "model.qk_norm=true"}, "model.qk_norm is for style llama"},
      {{"train.attention=cudnn"}, "train.attention cudnn needs train.device cuda"},
      {{"train.attention=flash"}, "train.attention"},
  };
  for (const auto& c : cases) {
    auto r = parse_config_string("", c.overrides);
    ASSERT_FALSE(r.is_ok()) << c.needle;
    EXPECT_HAS(r.status().message(), c.needle);
  }
  // And the valid neighbours pass.
  EXPECT_TRUE(
      parse_config_string("", {"train.global_batch=32", "parallel.dp=2", "train.micro_batch=4"}).is_ok());
  EXPECT_TRUE(
      parse_config_string("", {"parallel.virtual_stages=2", "parallel.schedule=interleaved"}).is_ok());
  EXPECT_TRUE(parse_config_string("", {"data.task=sft", "data.path=x.jsonl"}).is_ok());
  EXPECT_TRUE(parse_config_string("", {"parallel.order=pp-dp-ep-cp-tp"}).is_ok());
  // An explicit head width lifts d_model % n_heads (Qwen3-0.6B: hidden 1024, 16 heads of 128).
  EXPECT_TRUE(parse_config_string("", {"model.d_model=100", "model.n_heads=3", "model.head_dim=32"}).is_ok());
  {
    auto q = parse_config_string("", {"model.d_model=1024", "model.n_heads=16", "model.n_kv_heads=8",
                                      "model.head_dim=128", "model.qk_norm=true"});
    ASSERT_TRUE(q.is_ok()) << q.status().message();
    EXPECT_EQ(q.value().model.head_dim(), 128);
    EXPECT_TRUE(q.value().model.qk_norm);
    EXPECT_EQ(parse_config_string("", {}).value().model.head_dim(), 128 / 4);  // 0: d_model / n_heads
  }
  // validate_config also guards configs built in code.
  Config c;
  c.parallel.tp = 0;
  EXPECT_HAS(ndt::validate_config(c).message(), "parallel.tp");
  c = Config();
  c.model.style = "bert";
  EXPECT_HAS(ndt::validate_config(c).message(), "model.style");
}

TEST(ConfigRoundTrip, ToYamlParsesBackIdentically) {
  auto r =
      parse_config_string("", {"model.style=gpt2", "model.d_model=96", "model.n_heads=3", "train.lr=0.00123",
                               "train.adam_eps=1e-10", "data.path=has \"quotes\" and: colon # hash",
                               "data.val_path=", "parallel.zero1=true", "model.tie_embeddings=0",
                               "train.out_dir=runs/x y", "model.rope_theta=500000.5", "model.head_dim=40"});
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  const std::string y1 = ndt::config_to_yaml(r.value());
  auto back = parse_config_string(y1, {}, "roundtrip");
  ASSERT_TRUE(back.is_ok()) << back.status().message() << "\n" << y1;
  const Config& a = r.value();
  const Config& b = back.value();
  EXPECT_EQ(b.model.style, "gpt2");
  EXPECT_EQ(b.model.d_model, 96);
  EXPECT_EQ(b.train.lr, a.train.lr);  // exact: shortest round-trip formatting
  EXPECT_EQ(b.train.adam_eps, a.train.adam_eps);
  EXPECT_EQ(b.model.rope_theta, a.model.rope_theta);
  EXPECT_EQ(b.data.path, a.data.path);
  EXPECT_EQ(b.train.out_dir, "runs/x y");
  EXPECT_TRUE(b.parallel.zero1);
  EXPECT_EQ(b.model.tie_embeddings, 0);
  EXPECT_EQ(b.model.head_dim(), 40);
  // Idempotent apart from the source comment.
  std::string y2 = ndt::config_to_yaml(b);
  y2 = y2.substr(y2.find('\n'));
  EXPECT_EQ(y1.substr(y1.find('\n')), y2);
  // Every key appears.
  for (const char* k :
       {"style:", "vocab_size:", "rope_theta:", "task:", "addition_digits:", "warmup_steps:", "max_seconds:",
        "virtual_stages:", "schedule:", "order:", "head_dim: 40", "qk_norm: false"})
    EXPECT_HAS(y1, k);
  // A derived head width is written as 0 with its value as a comment.
  EXPECT_HAS(ndt::config_to_yaml(parse_config_string("", {}).value()), "head_dim: 0  # = 32");
}

TEST(ConfigRoundTrip, DefaultsAndPresets) {
  Config d;
  auto back = parse_config_string(ndt::config_to_yaml(d), {});
  ASSERT_TRUE(back.is_ok()) << back.status().message();
  auto body = [](const std::string& y) { return y.substr(y.find('\n')); };  // drop the source comment
  EXPECT_EQ(body(ndt::config_to_yaml(back.value())), body(ndt::config_to_yaml(d)));
  auto g = load_config(std::string(NDT_SOURCE_DIR) + "/configs/gpt2-124m.yaml", {});
  ASSERT_TRUE(g.is_ok()) << g.status().message();
  auto g2 = parse_config_string(ndt::config_to_yaml(g.value()), {});
  ASSERT_TRUE(g2.is_ok()) << g2.status().message();
  EXPECT_EQ(g2.value().model.vocab_size, 50304);
  EXPECT_EQ(g2.value().train.micro_batch, 16);
}
