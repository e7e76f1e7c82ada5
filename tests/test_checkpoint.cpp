// Checkpoints: round trip, resharding between layouts, rotation, crash safety, bad input, HF interop.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <tuple>

#include "data/packing.h"
#include "dist/communicator.h"
#include "model/transformer.h"
#include "tiny_model.h"
#include "train/checkpoint.h"
#include "train/hf_interop.h"
#include "train/safetensors.h"

namespace fs = std::filesystem;

namespace ndt {
namespace {

struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& tag) {
    path = fs::temp_directory_path() / ("ndt_ckpt_" + tag + "_" + std::to_string(::getpid()));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string str(const std::string& sub = "") const {
    return sub.empty() ? path.string() : (path / sub).string();
  }
};

Tensor random_like(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.f, 1.f);
  Tensor t = Tensor::empty({n});
  for (int64_t i = 0; i < n; ++i) t.f32()[i] = d(rng);
  return t;
}

std::unique_ptr<Transformer> make_model(const ModelConfig& cfg, uint64_t seed, TpHooks* tp = nullptr,
                                        StageSpec stage = StageSpec{}) {
  auto m = std::make_unique<Transformer>(cfg, stage, tp);
  m->params().flatten();
  m->params().init(seed);
  return m;
}

bool bit_equal(const Tensor& a, const Tensor& b) {
  return a.numel() == b.numel() && std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0;
}

// Moments of a shard store derived from the full store's moments (same values at the same global index).
Tensor shard_moments(ParamStore& shard, ParamStore& full, const Tensor& full_m) {
  Tensor out = Tensor::zeros({shard.flat_values().numel()});
  for (auto& p : shard.all()) {
    const Param& f = full.get(p->name);
    const int64_t so = shard.offset_of(*p), fo = full.offset_of(f);
    for (int64_t i = 0; i < p->numel(); ++i) out.f32()[so + i] = full_m.f32()[fo + p->global_index(i)];
  }
  return out;
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return nlohmann::json::parse(ss.str());
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

CheckpointMeta meta_for(int64_t step) {
  CheckpointMeta m;
  m.step = step;
  m.optimizer_steps = step * 10;
  m.config_yaml = "model:\n  style: llama\n";
  m.layout = "tp=1 pp=1 dp=1";
  return m;
}

TEST(CheckpointRoundTrip, ValuesAndMomentsBitExact) {
  for (const std::string style : {"llama", "gpt2"}) {
    TempDir tmp("rt_" + style);
    const ModelConfig cfg = testing::tiny_model(style);
    auto a = make_model(cfg, 7);
    const int64_t n = a->params().flat_values().numel();
    Tensor m = random_like(n, 1), v = random_like(n, 2);
    auto comm = make_self_communicator();
    const std::string dir = tmp.str("ckpt");
    Status st = save_checkpoint(dir, a->params(), m, v, meta_for(5), true, 0, *comm);
    ASSERT_TRUE(st) << st.message();

    auto resolved = resolve_checkpoint(dir);
    ASSERT_TRUE(resolved) << resolved.status().message();
    EXPECT_EQ(resolved.value(), dir + "/step-00000005");
    EXPECT_FALSE(fs::exists(dir + ".tmp-5"));

    auto b = make_model(cfg, 99);
    Tensor m2 = Tensor::zeros({n}), v2 = Tensor::zeros({n});
    st = load_checkpoint(resolved.value(), b->params(), &m2, &v2);
    ASSERT_TRUE(st) << st.message();
    EXPECT_TRUE(bit_equal(a->params().flat_values(), b->params().flat_values())) << style;
    EXPECT_TRUE(bit_equal(m, m2)) << style;
    EXPECT_TRUE(bit_equal(v, v2)) << style;

    // Values only, into yet another store.
    auto c = make_model(cfg, 98);
    ASSERT_TRUE(load_checkpoint(resolved.value(), c->params(), nullptr, nullptr));
    EXPECT_TRUE(bit_equal(a->params().flat_values(), c->params().flat_values()));

    auto meta = read_checkpoint_meta(resolved.value());
    ASSERT_TRUE(meta) << meta.status().message();
    EXPECT_EQ(meta.value().step, 5);
    EXPECT_EQ(meta.value().optimizer_steps, 50);
    EXPECT_EQ(meta.value().config_yaml, meta_for(5).config_yaml);
    EXPECT_EQ(meta.value().layout, meta_for(5).layout);

    nlohmann::json idx = read_json(resolved.value() + "/index.json");
    EXPECT_EQ(idx["format"], "ndtrain-checkpoint");
    EXPECT_EQ(idx["version"], 1);
    EXPECT_EQ(idx["step"], 5);
    EXPECT_EQ(idx["optimizer_steps"], 50);
    EXPECT_EQ(idx["config"], meta_for(5).config_yaml);
    EXPECT_EQ(idx["tensors"].size(), a->params().all().size());
    for (auto& p : a->params().all()) {
      ASSERT_TRUE(idx["tensors"].contains(p->name)) << p->name;
      const auto& e = idx["tensors"][p->name];
      EXPECT_EQ(e["shape"].get<Shape>(), p->global_shape);
      EXPECT_EQ(e["dtype"], "F32");
      ASSERT_EQ(e["slices"].size(), 1u);
      EXPECT_EQ(e["slices"][0]["file"], "shard-0.safetensors");
    }
    // The shard holds values and both moments under global names.
    auto f = open_safetensors(resolved.value() + "/shard-0.safetensors");
    ASSERT_TRUE(f) << f.status().message();
    EXPECT_TRUE(f.value().contains("layers.1.attn.wq.weight:exp_avg"));
    EXPECT_TRUE(f.value().contains("layers.1.attn.wq.weight:exp_avg_sq"));
  }
}

// Writes one shard per simulated rank (TP x PP) into a staging dir and publishes it.
void save_simulated(const std::string& dir, int64_t step, const std::vector<ParamStore*>& stores,
                    const std::vector<Tensor>& ms, const std::vector<Tensor>& vs) {
  const std::string tmp = dir + ".tmp-" + std::to_string(step);
  std::vector<CheckpointSlice> all;
  for (size_t r = 0; r < stores.size(); ++r) {
    auto got =
        write_checkpoint_shard(tmp, "shard-" + std::to_string(r) + ".safetensors", *stores[r], ms[r], vs[r]);
    ASSERT_TRUE(got) << got.status().message();
    // Through JSON, as save_checkpoint sends them between ranks.
    auto back = checkpoint_slices_from_json(checkpoint_slices_to_json(got.value()));
    ASSERT_TRUE(back) << back.status().message();
    all.insert(all.end(), back.value().begin(), back.value().end());
  }
  Status st = write_checkpoint_index(tmp, all, meta_for(step), true);
  ASSERT_TRUE(st) << st.message();
  st = publish_checkpoint(dir, tmp, step, 0);
  ASSERT_TRUE(st) << st.message();
}

TEST(CheckpointReshard, TpPpShardsIntoUnshardedAndBack) {
  for (const std::string style : {"llama", "gpt2"}) {
    for (int pp : {1, 2}) {
      TempDir tmp("rs_" + style + std::to_string(pp));
      const ModelConfig cfg = testing::tiny_model(style);
      auto full = make_model(cfg, 5);
      const int64_t n = full->params().flat_values().numel();
      Tensor fm = random_like(n, 3), fv = random_like(n, 4);

      // Simulated ranks: TP=2 x PP=pp, each with its own store, values and moments.
      std::vector<std::unique_ptr<testing::FakeTp>> tps;
      std::vector<std::unique_ptr<Transformer>> shards;
      std::vector<StageSpec> stages;
      if (pp == 1)
        stages.push_back(StageSpec{});
      else
        stages = {StageSpec{0, 1, true, false}, StageSpec{1, 2, false, true}};
      std::vector<ParamStore*> stores;
      std::vector<Tensor> ms, vs;
      for (const StageSpec& sp : stages)
        for (int r = 0; r < 2; ++r) {
          tps.push_back(std::make_unique<testing::FakeTp>(2, r));
          shards.push_back(make_model(cfg, 5, tps.back().get(), sp));
          stores.push_back(&shards.back()->params());
          ms.push_back(shard_moments(*stores.back(), full->params(), fm));
          vs.push_back(shard_moments(*stores.back(), full->params(), fv));
        }

      // Sharded save -> unsharded load.
      const std::string dir = tmp.str("sharded");
      save_simulated(dir, 3, stores, ms, vs);
      nlohmann::json idx = read_json(dir + "/step-00000003/index.json");
      EXPECT_EQ(idx["tensors"]["layers.0.attn.wq.weight"]["slices"].size(), 2u);
      EXPECT_EQ(idx["tensors"]["layers.1.attn.wo.weight"]["slices"][1]["shard_dim"], 1);
      EXPECT_EQ(idx["tensors"]["final_norm.weight"]["slices"].size(), 1u);  // replicated: listed once
      EXPECT_EQ(idx["tensors"]["embed.tokens.weight"]["slices"].size(),
                2u);  // tied copy on the last stage deduped
      auto loaded = make_model(cfg, 123);
      const int64_t ln = loaded->params().flat_values().numel();
      Tensor lm = Tensor::zeros({ln}), lv = Tensor::zeros({ln});
      Status st = load_checkpoint(dir + "/step-00000003", loaded->params(), &lm, &lv);
      ASSERT_TRUE(st) << st.message();
      EXPECT_TRUE(bit_equal(full->params().flat_values(), loaded->params().flat_values()))
          << style << " pp" << pp;
      EXPECT_TRUE(bit_equal(fm, lm)) << style;
      EXPECT_TRUE(bit_equal(fv, lv)) << style;

      // Unsharded save -> sharded load.
      auto comm = make_self_communicator();
      const std::string dir2 = tmp.str("full");
      st = save_checkpoint(dir2, full->params(), fm, fv, meta_for(4), true, 0, *comm);
      ASSERT_TRUE(st) << st.message();
      for (size_t i = 0; i < stages.size(); ++i)
        for (int r = 0; r < 2; ++r) {
          const size_t k = i * 2 + r;
          testing::FakeTp tp(2, r);
          auto s = make_model(cfg, 321, &tp, stages[i]);
          const int64_t sn = s->params().flat_values().numel();
          Tensor sm = Tensor::zeros({sn}), sv = Tensor::zeros({sn});
          st = load_checkpoint(dir2 + "/step-00000004", s->params(), &sm, &sv);
          ASSERT_TRUE(st) << st.message();
          EXPECT_TRUE(bit_equal(stores[k]->flat_values(), s->params().flat_values()))
              << style << " rank " << k;
          EXPECT_TRUE(bit_equal(ms[k], sm)) << style << " rank " << k;
          EXPECT_TRUE(bit_equal(vs[k], sv)) << style << " rank " << k;
        }
    }
  }
}

TEST(CheckpointReshard, Tp2IntoTp4) {
  // A different split: the TP=2 slices straddle the TP=4 ones in halves.
  ModelConfig cfg = testing::tiny_model("llama");
  cfg.n_kv_heads = 4;
  TempDir tmp("tp24");
  std::vector<std::unique_ptr<testing::FakeTp>> tps;
  std::vector<std::unique_ptr<Transformer>> shards;
  std::vector<ParamStore*> stores;
  std::vector<Tensor> ms, vs;
  for (int r = 0; r < 2; ++r) {
    tps.push_back(std::make_unique<testing::FakeTp>(2, r));
    shards.push_back(make_model(cfg, 8, tps.back().get()));
    stores.push_back(&shards.back()->params());
    const int64_t sn = stores.back()->flat_values().numel();
    ms.push_back(random_like(sn, 10 + r));
    vs.push_back(random_like(sn, 20 + r));
  }
  save_simulated(tmp.str("c"), 1, stores, ms, vs);
  auto full = make_model(cfg, 1);
  const int64_t n = full->params().flat_values().numel();
  Tensor fm = Tensor::zeros({n}), fv = Tensor::zeros({n});
  ASSERT_TRUE(load_checkpoint(tmp.str("c/step-00000001"), full->params(), &fm, &fv));
  for (int r = 0; r < 4; ++r) {
    testing::FakeTp tp(4, r);
    auto s = make_model(cfg, 2, &tp);
    const int64_t sn = s->params().flat_values().numel();
    Tensor sm = Tensor::zeros({sn}), sv = Tensor::zeros({sn});
    Status st = load_checkpoint(tmp.str("c/step-00000001"), s->params(), &sm, &sv);
    ASSERT_TRUE(st) << st.message();
    EXPECT_TRUE(bit_equal(shard_moments(s->params(), full->params(), full->params().flat_values()),
                          s->params().flat_values()));
    EXPECT_TRUE(bit_equal(shard_moments(s->params(), full->params(), fm), sm));
    EXPECT_TRUE(bit_equal(shard_moments(s->params(), full->params(), fv), sv));
  }
}

TEST(CheckpointRotation, KeepLastAndLatest) {
  TempDir tmp("rot");
  auto a = make_model(testing::tiny_model("llama"), 7);
  auto comm = make_self_communicator();
  const std::string dir = tmp.str("ckpt");
  for (int64_t step : {10, 20, 30, 40}) {
    Status st = save_checkpoint(dir, a->params(), Tensor(), Tensor(), meta_for(step), true, 2, *comm);
    ASSERT_TRUE(st) << st.message();
  }
  EXPECT_FALSE(fs::exists(dir + "/step-00000010"));
  EXPECT_FALSE(fs::exists(dir + "/step-00000020"));
  EXPECT_TRUE(fs::exists(dir + "/step-00000030/index.json"));
  EXPECT_TRUE(fs::exists(dir + "/step-00000040/index.json"));
  EXPECT_EQ(read_file(dir + "/latest"), "step-00000040\n");
  auto r = resolve_checkpoint(dir);
  ASSERT_TRUE(r) << r.status().message();
  EXPECT_EQ(r.value(), dir + "/step-00000040");
  auto r2 = resolve_checkpoint(dir + "/step-00000030/");
  ASSERT_TRUE(r2) << r2.status().message();
  EXPECT_EQ(r2.value(), dir + "/step-00000030");
  auto bad = resolve_checkpoint(tmp.str("nope"));
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.status().message().find("nope"), std::string::npos);

  // Re-saving an existing step replaces it.
  ASSERT_TRUE(save_checkpoint(dir, a->params(), Tensor(), Tensor(), meta_for(40), true, 2, *comm));
  EXPECT_TRUE(fs::exists(dir + "/step-00000040/index.json"));
  EXPECT_TRUE(fs::exists(dir + "/step-00000030/index.json"));
  // keep_last = 0 keeps everything.
  ASSERT_TRUE(save_checkpoint(dir, a->params(), Tensor(), Tensor(), meta_for(50), true, 0, *comm));
  EXPECT_TRUE(fs::exists(dir + "/step-00000030"));
  // A directory whose step number does not fit an int64 is not a checkpoint of ours: rotation leaves it
  // (std::stoll threw std::out_of_range on it, ending the save).
  fs::create_directories(dir + "/step-99999999999999999999");
  ASSERT_TRUE(save_checkpoint(dir, a->params(), Tensor(), Tensor(), meta_for(60), true, 2, *comm));
  EXPECT_TRUE(fs::exists(dir + "/step-99999999999999999999"));
  EXPECT_TRUE(fs::exists(dir + "/step-00000060/index.json"));
}

TEST(CheckpointCrash, KillDuringSaveLeavesPreviousCheckpoint) {
  TempDir tmp("crash");
  const ModelConfig cfg = testing::tiny_model("llama");
  auto a = make_model(cfg, 7);
  const int64_t n = a->params().flat_values().numel();
  Tensor m = random_like(n, 1), v = random_like(n, 2);
  auto comm = make_self_communicator();
  const std::string dir = tmp.str("ckpt");
  ASSERT_TRUE(save_checkpoint(dir, a->params(), m, v, meta_for(1), true, 0, *comm));

  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::setenv("NDT_CHECKPOINT_CRASH_AFTER_SHARDS", "1", 1);
    // No OpenMP in the child (a forked libgomp pool can deadlock): change the weights by hand.
    auto self = make_self_communicator();
    Tensor& w = a->params().flat_values();
    for (int64_t i = 0; i < w.numel(); ++i) w.f32()[i] += 1.0f;
    Status st = save_checkpoint(dir, a->params(), m, v, meta_for(2), true, 0, *self);
    std::_Exit(st ? 0 : 1);  // not reached when the hook fires
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 3);
  EXPECT_TRUE(fs::exists(dir + ".tmp-2/shard-0.safetensors"));  // the shards were written
  EXPECT_FALSE(fs::exists(dir + "/step-00000002"));
  EXPECT_EQ(read_file(dir + "/latest"), "step-00000001\n");
  auto r = resolve_checkpoint(dir);
  ASSERT_TRUE(r) << r.status().message();
  EXPECT_EQ(r.value(), dir + "/step-00000001");
  auto c = make_model(cfg, 9);
  Tensor m2 = Tensor::zeros({n}), v2 = Tensor::zeros({n});
  Status st = load_checkpoint(r.value(), c->params(), &m2, &v2);
  ASSERT_TRUE(st) << st.message();
  EXPECT_TRUE(bit_equal(a->params().flat_values(), c->params().flat_values()));
  EXPECT_TRUE(bit_equal(m, m2));

  // The next save of step 2 discards the stale staging dir and succeeds.
  ASSERT_TRUE(save_checkpoint(dir, a->params(), m, v, meta_for(2), true, 0, *comm));
  EXPECT_FALSE(fs::exists(dir + ".tmp-2"));
  EXPECT_EQ(read_file(dir + "/latest"), "step-00000002\n");
}

class CheckpointBadInput : public ::testing::Test {
 protected:
  void SetUp() override {
    tmp_ = std::make_unique<TempDir>("bad");
    model_ = make_model(testing::tiny_model("llama"), 7);
    auto comm = make_self_communicator();
    const int64_t n = model_->params().flat_values().numel();
    ASSERT_TRUE(save_checkpoint(tmp_->str("ckpt"), model_->params(), random_like(n, 1), random_like(n, 2),
                                meta_for(1), true, 0, *comm));
    step_ = tmp_->str("ckpt/step-00000001");
  }
  std::string load_error(const ModelConfig& cfg, bool moments = false) {
    auto m = make_model(cfg, 3);
    const int64_t n = m->params().flat_values().numel();
    Tensor a = Tensor::zeros({n}), b = Tensor::zeros({n});
    Status st = load_checkpoint(step_, m->params(), moments ? &a : nullptr, moments ? &b : nullptr);
    EXPECT_FALSE(st) << "load unexpectedly succeeded";
    return st.message();
  }
  static void expect_has(const std::string& msg, const std::vector<std::string>& parts) {
    for (const std::string& p : parts)
      EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  }
  std::unique_ptr<TempDir> tmp_;
  std::unique_ptr<Transformer> model_;
  std::string step_;
};

TEST_F(CheckpointBadInput, TruncatedShard) {
  const std::string shard = step_ + "/shard-0.safetensors";
  fs::resize_file(shard, fs::file_size(shard) / 2);
  expect_has(load_error(testing::tiny_model("llama")), {"shard-0.safetensors", "embed.tokens.weight"});
}

TEST_F(CheckpointBadInput, CorruptIndexJson) {
  std::ofstream(step_ + "/index.json", std::ios::trunc)
      << "{\"format\": \"ndtrain-checkpoint\", \"tensors\": {";
  expect_has(load_error(testing::tiny_model("llama")), {"index.json", "invalid JSON"});
  auto meta = read_checkpoint_meta(step_);
  ASSERT_FALSE(meta);
  expect_has(meta.status().message(), {"index.json"});
}

TEST_F(CheckpointBadInput, MalformedIndexEntry) {
  nlohmann::json idx = read_json(step_ + "/index.json");
  idx["tensors"]["layers.0.mlp.w2.weight"]["slices"][0]["shape"] = "oops";
  std::ofstream(step_ + "/index.json", std::ios::trunc) << idx.dump();
  expect_has(load_error(testing::tiny_model("llama")), {"index.json", "layers.0.mlp.w2.weight"});
}

TEST_F(CheckpointBadInput, SlicesNotCovering) {
  nlohmann::json idx = read_json(step_ + "/index.json");
  auto& s = idx["tensors"]["layers.1.attn.wq.weight"]["slices"][0];
  s["shard_dim"] = 0;
  s["shape"][0] = s["shape"][0].get<int64_t>() / 2;
  std::ofstream(step_ + "/index.json", std::ios::trunc) << idx.dump();
  expect_has(load_error(testing::tiny_model("llama")), {"index.json", "layers.1.attn.wq.weight", "cover"});
}

TEST_F(CheckpointBadInput, MissingShardFile) {
  fs::remove(step_ + "/shard-0.safetensors");
  expect_has(load_error(testing::tiny_model("llama")),
             {"shard-0.safetensors", "embed.tokens.weight", "missing"});
}

TEST_F(CheckpointBadInput, TensorMissing) {
  ModelConfig cfg = testing::tiny_model("llama");
  cfg.n_layers = 3;
  expect_has(load_error(cfg), {"index.json", "layers.2.attn_norm.weight", "missing"});
}

TEST_F(CheckpointBadInput, ShapeMismatch) {
  ModelConfig cfg = testing::tiny_model("llama");
  cfg.d_model = 32;
  expect_has(load_error(cfg),
             {"index.json", "embed.tokens.weight", shape_str({32, 16}), shape_str({32, 32})});
}

TEST_F(CheckpointBadInput, TensorMissingFromShard) {
  // The index lists a tensor the shard file does not hold (a shard from another save).
  const std::string shard = step_ + "/shard-0.safetensors";
  std::vector<std::pair<std::string, Tensor>> only;
  only.emplace_back("embed.tokens.weight", model_->params().get("embed.tokens.weight").value);
  ASSERT_TRUE(save_safetensors(shard, only));
  expect_has(load_error(testing::tiny_model("llama")), {"shard-0.safetensors", "layers.0.attn_norm.weight"});
}

TEST_F(CheckpointBadInput, MomentsAbsent) {
  auto comm = make_self_communicator();
  ASSERT_TRUE(
      save_checkpoint(tmp_->str("nomom"), model_->params(), Tensor(), Tensor(), meta_for(1), true, 0, *comm));
  step_ = tmp_->str("nomom/step-00000001");
  EXPECT_TRUE(load_checkpoint(step_, model_->params(), nullptr, nullptr));
  expect_has(load_error(testing::tiny_model("llama"), /*moments=*/true),
             {"index.json", "optimizer state", "embed.tokens.weight"});
}

// Shard file names in an index must be plain names inside the step directory: "../x", an absolute path, "."
// or ".." would read files elsewhere.
TEST_F(CheckpointBadInput, ShardFileOutsideStepDirRefused) {
  const nlohmann::json good = read_json(step_ + "/index.json");
  for (const std::string file : {"../shard-0.safetensors", "/etc/passwd", "..", ".",
                                 "sub/shard-0.safetensors", "..\\shard-0.safetensors", ""}) {
    nlohmann::json idx = good;
    idx["tensors"]["layers.0.attn_norm.weight"]["slices"][0]["file"] = file;
    std::ofstream(step_ + "/index.json", std::ios::trunc) << idx.dump();
    auto meta = read_checkpoint_meta(step_);
    ASSERT_FALSE(meta) << file;
    expect_has(meta.status().message(),
               {"index.json", "layers.0.attn_norm.weight", "bad shard file name '" + file + "'"});
    expect_has(load_error(testing::tiny_model("llama")), {"bad shard file name"});
  }
  // The `latest` pointer of a checkpoint directory likewise names a step directory inside it.
  for (const std::string name : {"..", ".", "../ckpt/step-00000001", "/tmp"}) {
    std::ofstream(tmp_->str("ckpt/latest"), std::ios::trunc) << name << "\n";
    auto r = resolve_checkpoint(tmp_->str("ckpt"));
    ASSERT_FALSE(r) << name;
    expect_has(r.status().message(), {"latest", "does not name a step directory"});
  }
}

// Absurd sizes and non-integer numbers in an index are refused with a message, before any arithmetic on
// them (found by fuzzing: an offset near INT64_MAX overflowed `offset + extent`; a float shard_dim of 1e300
// was an out-of-range conversion; a slice list with a short shape read past its end).
TEST_F(CheckpointBadInput, AbsurdIndexValuesRefused) {
  const nlohmann::json good = read_json(step_ + "/index.json");
  const std::string t = "layers.1.attn.wq.weight";
  struct Case {
    std::string what;
    std::function<void(nlohmann::json&)> edit;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {"offset overflow",
       [&](nlohmann::json& j) {
         auto& s = j["tensors"][t]["slices"][0];
         s["shard_dim"] = 0;
         s["offset"] = INT64_MAX - 2;
       },
       "is outside the global extent"},
      {"negative global dim", [&](nlohmann::json& j) { j["tensors"][t]["shape"][0] = -16; },
       "is negative or absurdly large"},
      {"global numel overflow",
       [&](nlohmann::json& j) {
         j["tensors"][t]["shape"] = {int64_t{1} << 40, int64_t{1} << 40};
         j["tensors"][t]["slices"][0]["shape"] = {int64_t{1} << 40, int64_t{1} << 40};
       },
       "is negative or absurdly large"},
      {"float shard_dim", [&](nlohmann::json& j) { j["tensors"][t]["slices"][0]["shard_dim"] = 1e300; },
       "\"shard_dim\" must be an integer, got 1e+300"},
      {"huge shard_dim",
       [&](nlohmann::json& j) { j["tensors"][t]["slices"][0]["shard_dim"] = int64_t{1} << 40; },
       "\"shard_dim\" is out of range"},
      {"float offset", [&](nlohmann::json& j) { j["tensors"][t]["slices"][0]["offset"] = 0.5; },
       "\"offset\" must be an integer"},
      {"float shape", [&](nlohmann::json& j) { j["tensors"][t]["shape"][1] = 1e30; },
       "\"shape\" must be an integer"},
      {"unsigned step", [&](nlohmann::json& j) { j["step"] = ~uint64_t{0}; }, "\"step\" must be an integer"},
      {"float version", [&](nlohmann::json& j) { j["version"] = 1e300; }, "\"version\" must be an integer"},
      {"slices not an array", [&](nlohmann::json& j) { j["tensors"][t]["slices"] = 3; },
       "\"slices\" is not an array"},
  };
  for (const Case& c : cases) {
    nlohmann::json idx = good;
    c.edit(idx);
    std::ofstream(step_ + "/index.json", std::ios::trunc) << idx.dump();
    auto meta = read_checkpoint_meta(step_);
    ASSERT_FALSE(meta) << c.what;
    expect_has(meta.status().message(), {"index.json", c.needle});
  }

  // A slice list from another rank is validated the same way, before write_checkpoint_index uses it.
  const std::string short_shape =
      R"([{"name":"c","global_shape":[3,4,2],"dtype":"F32","file":"shard-1.safetensors","shard_dim":1,)"
      R"("offset":2,"shape":[3]}])";
  auto sl = checkpoint_slices_from_json(short_shape);
  ASSERT_FALSE(sl);
  expect_has(sl.status().message(), {"checkpoint slice list: tensor c", "different rank"});
  sl = checkpoint_slices_from_json(
      R"([{"name":"c","global_shape":[4],"dtype":"F32","file":"../x","shard_dim":-1,"offset":0,"shape":[4]}])");
  ASSERT_FALSE(sl);
  expect_has(sl.status().message(), {"bad shard file name '../x'"});
  CheckpointSlice bad{"c", {3, 4, 2}, "F32", "shard-0.safetensors", 1, 0, {3}};
  Status st = write_checkpoint_index(tmp_->str("direct"), {bad}, meta_for(1), false);
  ASSERT_FALSE(st);
  expect_has(st.message(), {"tensor c", "different rank"});
}

std::vector<std::pair<std::string, Tensor>> full_params_of(Transformer& m) {
  std::vector<std::pair<std::string, Tensor>> out;
  for (auto& p : m.params().all()) out.emplace_back(p->name, p->value.clone());
  return out;
}

TEST(CheckpointHf, ExportImportBitExactAndIndependentHeaderParse) {
  for (int tied : {0, 1}) {
    TempDir tmp("hf" + std::to_string(tied));
    ModelConfig cfg = testing::tiny_model("llama");
    cfg.tie_embeddings = tied;
    cfg.rope_theta = 500000.0;
    cfg.norm_eps = 1e-6;
    auto m = make_model(cfg, 11);
    auto params = full_params_of(*m);
    const std::string out = tmp.str("hf");
    Status st = export_hf(out, cfg, params);
    ASSERT_TRUE(st) << st.message();

    // config.json
    nlohmann::json c = read_json(out + "/config.json");
    EXPECT_EQ(c["architectures"][0], "LlamaForCausalLM");
    EXPECT_EQ(c["model_type"], "llama");
    EXPECT_EQ(c["hidden_size"], 16);
    EXPECT_EQ(c["intermediate_size"], 24);
    EXPECT_EQ(c["num_hidden_layers"], 2);
    EXPECT_EQ(c["num_attention_heads"], 4);
    EXPECT_EQ(c["num_key_value_heads"], 2);
    EXPECT_EQ(c["vocab_size"], 32);
    EXPECT_EQ(c["max_position_embeddings"], 16);
    EXPECT_EQ(c["rms_norm_eps"].get<double>(), 1e-6);
    EXPECT_EQ(c["rope_theta"].get<double>(), 500000.0);
    EXPECT_EQ(c["tie_word_embeddings"], tied == 1);
    EXPECT_EQ(c["torch_dtype"], "float32");

    // model.safetensors, parsed independently of our reader.
    const std::string bytes = read_file(out + "/model.safetensors");
    ASSERT_GE(bytes.size(), 8u);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; --i) hlen = (hlen << 8) | static_cast<uint8_t>(bytes[i]);
    EXPECT_EQ(hlen % 8, 0u);
    ASSERT_LE(8 + hlen, bytes.size());
    nlohmann::json h = nlohmann::json::parse(bytes.substr(8, hlen));
    const uint64_t data_size = bytes.size() - 8 - hlen;
    std::vector<std::pair<uint64_t, uint64_t>> ranges;
    std::set<std::string> names;
    for (auto it = h.begin(); it != h.end(); ++it) {
      if (it.key() == "__metadata__") {
        EXPECT_EQ(it.value()["format"], "pt");
        continue;
      }
      names.insert(it.key());
      EXPECT_EQ(it.value()["dtype"], "F32") << it.key();
      const Shape shape = it.value()["shape"].get<Shape>();
      const uint64_t b = it.value()["data_offsets"][0], e = it.value()["data_offsets"][1];
      EXPECT_EQ(e - b, static_cast<uint64_t>(shape_numel(shape)) * 4) << it.key();
      ranges.emplace_back(b, e);
    }
    std::sort(ranges.begin(), ranges.end());
    uint64_t pos = 0;
    for (auto [b, e] : ranges) {
      EXPECT_EQ(b, pos);
      pos = e;
    }
    EXPECT_EQ(pos, data_size);
    std::set<std::string> want = {"model.embed_tokens.weight", "model.norm.weight"};
    if (!tied) want.insert("lm_head.weight");
    for (int l = 0; l < 2; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      for (const char* s :
           {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
            "input_layernorm.weight", "post_attention_layernorm.weight"})
        want.insert(p + s);
    }
    EXPECT_EQ(names, want);
    EXPECT_EQ(h["model.layers.1.self_attn.k_proj.weight"]["shape"].get<Shape>(), (Shape{8, 16}));
    EXPECT_EQ(h["model.layers.0.mlp.down_proj.weight"]["shape"].get<Shape>(), (Shape{16, 24}));
    // Raw bytes of one tensor are ours (gate_proj = w1).
    {
      const Tensor& w1 = m->params().get("layers.1.mlp.w1.weight").value;
      const uint64_t b = h["model.layers.1.mlp.gate_proj.weight"]["data_offsets"][0];
      EXPECT_EQ(std::memcmp(bytes.data() + 8 + hlen + b, w1.data_ptr(), w1.nbytes()), 0);
    }

    auto imp = import_hf(out);
    ASSERT_TRUE(imp) << imp.status().message();
    const ModelConfig& ic = imp.value().first;
    EXPECT_EQ(ic.style, "llama");
    EXPECT_EQ(ic.d_model, cfg.d_model);
    EXPECT_EQ(ic.n_layers, cfg.n_layers);
    EXPECT_EQ(ic.n_heads, cfg.n_heads);
    EXPECT_EQ(ic.kv_heads(), cfg.kv_heads());
    EXPECT_EQ(ic.ffn_dim(), cfg.ffn_dim());
    EXPECT_EQ(ic.vocab_size, cfg.vocab_size);
    EXPECT_EQ(ic.max_seq_len, cfg.max_seq_len);
    EXPECT_EQ(ic.norm_eps, cfg.norm_eps);
    EXPECT_EQ(ic.rope_theta, cfg.rope_theta);
    EXPECT_EQ(ic.tied(), cfg.tied());
    const auto& got = imp.value().second;
    ASSERT_EQ(got.size(), params.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].first, params[i].first);
      EXPECT_EQ(got[i].second.shape(), params[i].second.shape()) << got[i].first;
      EXPECT_TRUE(bit_equal(got[i].second, params[i].second)) << got[i].first;
      EXPECT_EQ(hf_name_for(params[i].first).empty(), false) << params[i].first;
    }
    // The imported config builds a model whose parameters are exactly the imported ones.
    Transformer rebuilt(ic, StageSpec{}, nullptr);
    ASSERT_EQ(rebuilt.params().all().size(), got.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(rebuilt.params().all()[i]->name, got[i].first);
  }
}

// Sharded export (max shard bytes, as save_pretrained(max_shard_size=...)): shards of at most that size in
// registration order, an index whose weight_map names every tensor once and whose total_size is the sum
// (checked from the JSON and the shard headers' own offsets), and an import that reads it back bit-exact;
// bf16 export rounds to nearest even (compared with a rounding done here) and imports as those values;
// an index naming a shard outside the directory, or a tensor its shard lacks, is refused.
TEST(CheckpointHf, ShardedAndBf16ExportImport) {
  TempDir tmp("hfshard");
  ModelConfig cfg = testing::tiny_model("llama");
  auto m = make_model(cfg, 5);
  auto params = full_params_of(*m);
  const std::string out = tmp.str("hf");
  HfExportOptions opts;
  opts.shard_bytes = 3000;  // the tiny model's 2048-byte embedding alone, then a few tensors per shard
  ASSERT_TRUE(export_hf(out, cfg, params, opts));
  EXPECT_FALSE(fs::exists(out + "/model.safetensors"));
  nlohmann::json idx = read_json(out + "/model.safetensors.index.json");
  std::map<std::string, int64_t> shard_bytes;
  int64_t total = 0;
  for (const auto& [name, t] : params) {
    const std::string hf = hf_name_for(name);
    ASSERT_TRUE(idx["weight_map"].contains(hf)) << hf;
    shard_bytes[idx["weight_map"][hf].get<std::string>()] += t.numel() * 4;
    total += t.numel() * 4;
  }
  EXPECT_EQ(idx["weight_map"].size(), params.size());
  EXPECT_EQ(idx["metadata"]["total_size"].get<int64_t>(), total);
  EXPECT_GE(shard_bytes.size(), 3u);
  for (const auto& [file, b] : shard_bytes) {
    EXPECT_TRUE(b <= 3000 || b == 32 * 16 * 4) << file << " holds " << b << " bytes";
    EXPECT_NE(file.find("-of-"), std::string::npos);
    // The shard's own header agrees: its data section is exactly these bytes.
    const std::string bytes = read_file(out + "/" + file);
    uint64_t hlen = 0;
    std::memcpy(&hlen, bytes.data(), 8);
    EXPECT_EQ(static_cast<int64_t>(bytes.size() - 8 - hlen), b) << file;
  }
  auto back = import_hf(out);
  ASSERT_TRUE(back) << back.status().message();
  ASSERT_EQ(back.value().second.size(), params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    ASSERT_EQ(back.value().second[i].first, params[i].first);
    EXPECT_EQ(std::memcmp(back.value().second[i].second.data_ptr(), params[i].second.data_ptr(),
                          static_cast<size_t>(params[i].second.numel()) * 4),
              0)
        << params[i].first;
  }

  // bf16: values rounded to nearest even, here by hand.
  const std::string out16 = tmp.str("hf16");
  HfExportOptions o16;
  o16.bf16 = true;
  ASSERT_TRUE(export_hf(out16, cfg, params, o16));
  EXPECT_EQ(read_json(out16 + "/config.json")["torch_dtype"], "bfloat16");
  auto back16 = import_hf(out16);
  ASSERT_TRUE(back16) << back16.status().message();
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor& a = params[i].second;
    const Tensor& b = back16.value().second[i].second;
    for (int64_t j = 0; j < a.numel(); ++j) {
      uint32_t bits;
      std::memcpy(&bits, &a.f32()[j], 4);
      bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
      float want;
      std::memcpy(&want, &bits, 4);
      ASSERT_EQ(b.f32()[j], want) << params[i].first << " " << j;
    }
  }

  // A shard outside the directory, and a tensor its shard lacks.
  idx["weight_map"]["model.norm.weight"] = "../model-00001-of-00002.safetensors";
  std::ofstream(out + "/model.safetensors.index.json") << idx.dump();
  auto bad = import_hf(out);
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.status().message().find("not a plain file name"), std::string::npos)
      << bad.status().message();
  idx["weight_map"]["model.norm.weight"] = idx["weight_map"]["model.embed_tokens.weight"];
  std::ofstream(out + "/model.safetensors.index.json") << idx.dump();
  bad = import_hf(out);
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.status().message().find("is not in its shard"), std::string::npos) << bad.status().message();
}

TEST(CheckpointHf, RejectsBadInput) {
  TempDir tmp("hfbad");
  ModelConfig g = testing::tiny_model("gpt2");
  g.n_kv_heads = 2;  // GPT-2 has no grouped-query attention
  auto m = make_model(g, 1);
  Status st = export_hf(tmp.str("g"), g, full_params_of(*m));
  ASSERT_FALSE(st);
  EXPECT_NE(st.message().find("grouped-query"), std::string::npos) << st.message();

  ModelConfig l = testing::tiny_model("llama");
  auto lm = make_model(l, 1);
  auto params = full_params_of(*lm);
  params.pop_back();  // lm_head missing
  st = export_hf(tmp.str("l"), l, params);
  ASSERT_FALSE(st);
  EXPECT_NE(st.message().find("lm_head.weight"), std::string::npos) << st.message();

  // Import: config key missing, tensor missing.
  ASSERT_TRUE(export_hf(tmp.str("ok"), l, full_params_of(*lm)));
  nlohmann::json c = read_json(tmp.str("ok/config.json"));
  c.erase("hidden_size");
  std::ofstream(tmp.str("ok/config.json"), std::ios::trunc) << c.dump();
  auto r = import_hf(tmp.str("ok"));
  ASSERT_FALSE(r);
  EXPECT_NE(r.status().message().find("config.json"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("hidden_size"), std::string::npos) << r.status().message();

  ASSERT_TRUE(export_hf(tmp.str("ok2"), l, full_params_of(*lm)));
  std::vector<std::pair<std::string, Tensor>> partial;
  partial.emplace_back("model.embed_tokens.weight", lm->params().get("embed.tokens.weight").value);
  ASSERT_TRUE(save_safetensors(tmp.str("ok2/model.safetensors"), partial, {{"format", "pt"}}));
  r = import_hf(tmp.str("ok2"));
  ASSERT_FALSE(r);
  EXPECT_NE(r.status().message().find("model.safetensors"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("model.layers.0.input_layernorm.weight"), std::string::npos)
      << r.status().message();
}

// Sizes in config.json are integers within the config keys' bounds; absurd values are refused before they
// size anything (found by fuzzing: num_hidden_layers 10^9 listed billions of tensor names; a float
// hidden_size of 1e300 was an out-of-range conversion; n_embd near 2^62 overflowed 4 * n_embd).
TEST(CheckpointHf, AbsurdConfigValuesRefused) {
  TempDir tmp("hfabsurd");
  for (const std::string style : {"llama", "gpt2"}) {
    ModelConfig cfg = testing::tiny_model(style);
    auto m = make_model(cfg, 1);
    ASSERT_TRUE(export_hf(tmp.str(style), cfg, full_params_of(*m)));
  }
  const nlohmann::json llama = read_json(tmp.str("llama/config.json"));
  const nlohmann::json gpt2 = read_json(tmp.str("gpt2/config.json"));
  struct Case {
    std::string dir, key;
    nlohmann::json value;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {"llama", "num_hidden_layers", 1000000000,
       "\"num_hidden_layers\" must be an integer in [1, 4096], got 1000000000"},
      {"llama", "hidden_size", 1e300, "\"hidden_size\" must be an integer in [1, 1048576], got 1e+300"},
      {"llama", "vocab_size", "32", "\"vocab_size\" must be an integer in [1, 2147483648], got \"32\""},
      {"llama", "intermediate_size", 0, "\"intermediate_size\" must be an integer in [1, 4194304], got 0"},
      {"llama", "num_key_value_heads", ~uint64_t{0}, "\"num_key_value_heads\" must be an integer"},
      {"llama", "head_dim", 2.5, "\"head_dim\" must be an integer"},
      {"gpt2", "n_embd", int64_t{1} << 62, "\"n_embd\" must be an integer in [1, 1048576]"},
      {"gpt2", "n_inner", -1, "\"n_inner\" must be an integer in [1, 4194304], got -1"},
  };
  for (const Case& c : cases) {
    nlohmann::json j = c.dir == "llama" ? llama : gpt2;
    j[c.key] = c.value;
    std::ofstream(tmp.str(c.dir + "/config.json"), std::ios::trunc) << j.dump();
    auto r = import_hf(tmp.str(c.dir));
    ASSERT_FALSE(r) << c.key;
    EXPECT_NE(r.status().message().find(c.needle), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find("config.json"), std::string::npos) << r.status().message();
  }
  // In bounds, but far more tensors than the file holds (4096 layers of 65536 experts): refused by count.
  nlohmann::json j = llama;
  j["model_type"] = "mixtral";
  j["num_hidden_layers"] = 4096;
  j["num_local_experts"] = 65536;
  j["num_experts_per_tok"] = 2;
  std::ofstream(tmp.str("llama/config.json"), std::ios::trunc) << j.dump();
  auto r = import_hf(tmp.str("llama"));
  ASSERT_FALSE(r);
  EXPECT_NE(r.status().message().find("config.json implies 805339139 tensors, the weights hold"),
            std::string::npos)
      << r.status().message();
}

// --- Mixture-of-Experts as MixtralForCausalLM -------------------------------------------------------------

ModelConfig tiny_moe(int tied = 0) {
  ModelConfig cfg;
  cfg.style = "llama";
  cfg.vocab_size = 264;
  cfg.d_model = 64;
  cfg.n_layers = 2;
  cfg.n_heads = 4;
  cfg.n_kv_heads = 2;
  cfg.max_seq_len = 32;
  cfg.rope_theta = 500000.0;
  cfg.norm_eps = 1e-6;
  cfg.init_std = 0.2;  // routing, experts and attention all move the logits well above fp32 noise
  cfg.tie_embeddings = tied;
  cfg.moe.num_experts = 4;
  cfg.moe.top_k = 2;
  cfg.moe.d_ff_expert = 32;
  cfg.moe.aux_loss_coef = 0.02;
  return cfg;
}

// A safetensors header parsed without our reader: name -> (dtype, shape, data_offsets), and its length.
nlohmann::json raw_safetensors_header(const std::string& bytes, uint64_t& hlen) {
  hlen = 0;
  for (int i = 7; i >= 0; --i) hlen = (hlen << 8) | static_cast<uint8_t>(bytes[static_cast<size_t>(i)]);
  return nlohmann::json::parse(bytes.substr(8, hlen));
}

TEST(CheckpointHfMixtral, ExportImportBitExactAndIndependentHeaderParse) {
  for (int tied : {0, 1}) {
    TempDir tmp("hfmx" + std::to_string(tied));
    const ModelConfig cfg = tiny_moe(tied);
    auto m = make_model(cfg, 13);
    auto params = full_params_of(*m);
    const std::string out = tmp.str("hf");
    Status st = export_hf(out, cfg, params);
    ASSERT_TRUE(st) << st.message();

    nlohmann::json c = read_json(out + "/config.json");
    EXPECT_EQ(c["architectures"], nlohmann::json::array({"MixtralForCausalLM"}));
    EXPECT_EQ(c["model_type"], "mixtral");
    EXPECT_EQ(c["hidden_size"], 64);
    EXPECT_EQ(c["intermediate_size"], 32);
    EXPECT_EQ(c["num_hidden_layers"], 2);
    EXPECT_EQ(c["num_attention_heads"], 4);
    EXPECT_EQ(c["num_key_value_heads"], 2);
    EXPECT_EQ(c["head_dim"], 16);
    EXPECT_EQ(c["vocab_size"], 264);
    EXPECT_EQ(c["max_position_embeddings"], 32);
    EXPECT_EQ(c["rms_norm_eps"].get<double>(), 1e-6);
    EXPECT_EQ(c["rope_theta"].get<double>(), 500000.0);
    EXPECT_EQ(c["tie_word_embeddings"], tied == 1);
    EXPECT_EQ(c["torch_dtype"], "float32");
    EXPECT_EQ(c["hidden_act"], "silu");
    EXPECT_EQ(c["num_local_experts"], 4);
    EXPECT_EQ(c["num_experts_per_tok"], 2);
    EXPECT_EQ(c["router_aux_loss_coef"].get<double>(), 0.02);
    EXPECT_EQ(c["output_router_logits"], false);
    ASSERT_TRUE(c.contains("sliding_window"));
    EXPECT_TRUE(c["sliding_window"].is_null());

    // model.safetensors: exactly the Mixtral tensor names and shapes, data laid end to end.
    const std::string bytes = read_file(out + "/model.safetensors");
    ASSERT_GE(bytes.size(), 8u);
    uint64_t hlen = 0;
    nlohmann::json h = raw_safetensors_header(bytes, hlen);
    ASSERT_LE(8 + hlen, bytes.size());
    std::map<std::string, Shape> got_shapes;
    std::vector<std::pair<uint64_t, uint64_t>> ranges;
    for (auto it = h.begin(); it != h.end(); ++it) {
      if (it.key() == "__metadata__") {
        EXPECT_EQ(it.value()["format"], "pt");
        continue;
      }
      EXPECT_EQ(it.value()["dtype"], "F32") << it.key();
      got_shapes[it.key()] = it.value()["shape"].get<Shape>();
      const uint64_t b = it.value()["data_offsets"][0], e = it.value()["data_offsets"][1];
      EXPECT_EQ(e - b, static_cast<uint64_t>(shape_numel(got_shapes[it.key()])) * 4) << it.key();
      ranges.emplace_back(b, e);
    }
    std::sort(ranges.begin(), ranges.end());
    uint64_t pos = 0;
    for (auto [b, e] : ranges) {
      EXPECT_EQ(b, pos);
      pos = e;
    }
    EXPECT_EQ(pos, bytes.size() - 8 - hlen);
    std::map<std::string, Shape> want = {{"model.embed_tokens.weight", {264, 64}},
                                         {"model.norm.weight", {64}}};
    if (!tied) want["lm_head.weight"] = {264, 64};
    for (int l = 0; l < 2; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      want[p + "input_layernorm.weight"] = {64};
      want[p + "post_attention_layernorm.weight"] = {64};
      want[p + "self_attn.q_proj.weight"] = {64, 64};
      want[p + "self_attn.k_proj.weight"] = {32, 64};
      want[p + "self_attn.v_proj.weight"] = {32, 64};
      want[p + "self_attn.o_proj.weight"] = {64, 64};
      want[p + "block_sparse_moe.gate.weight"] = {4, 64};
      for (int e = 0; e < 4; ++e) {
        const std::string x = p + "block_sparse_moe.experts." + std::to_string(e) + ".";
        want[x + "w1.weight"] = {32, 64};
        want[x + "w3.weight"] = {32, 64};
        want[x + "w2.weight"] = {64, 32};
      }
    }
    EXPECT_EQ(got_shapes, want);
    // Raw bytes of expert slices are ours: experts.2.w2 of layer 1 = slice 2 of the stacked (E, C, F) w2,
    // experts.3.w1 of layer 0 = slice 3 of (E, F, C) w1.
    const std::vector<std::tuple<std::string, std::string, int64_t>> slices = {
        {"model.layers.1.block_sparse_moe.experts.2.w2.weight", "layers.1.mlp.experts.w2.weight", 2},
        {"model.layers.0.block_sparse_moe.experts.3.w1.weight", "layers.0.mlp.experts.w1.weight", 3},
        {"model.layers.0.block_sparse_moe.gate.weight", "layers.0.mlp.router.weight", 0}};
    for (const auto& [hf, ours, e] : slices) {
      const Tensor& w = m->params().get(ours).value;
      const uint64_t b = h[hf]["data_offsets"][0];
      const size_t n = static_cast<size_t>(shape_numel(h[hf]["shape"].get<Shape>())) * 4;
      EXPECT_EQ(std::memcmp(bytes.data() + 8 + hlen + b, static_cast<const char*>(w.data_ptr()) + e * n, n),
                0)
          << hf;
    }
    EXPECT_EQ(hf_name_for("layers.1.mlp.router.weight"), "model.layers.1.block_sparse_moe.gate.weight");
    EXPECT_EQ(hf_name_for("layers.0.mlp.experts.w3.weight"),
              "model.layers.0.block_sparse_moe.experts.{e}.w3.weight");

    auto imp = import_hf(out);
    ASSERT_TRUE(imp) << imp.status().message();
    const ModelConfig& ic = imp.value().first;
    EXPECT_EQ(ic.style, "llama");
    EXPECT_EQ(ic.d_model, cfg.d_model);
    EXPECT_EQ(ic.n_layers, cfg.n_layers);
    EXPECT_EQ(ic.n_heads, cfg.n_heads);
    EXPECT_EQ(ic.kv_heads(), cfg.kv_heads());
    EXPECT_EQ(ic.vocab_size, cfg.vocab_size);
    EXPECT_EQ(ic.max_seq_len, cfg.max_seq_len);
    EXPECT_EQ(ic.norm_eps, cfg.norm_eps);
    EXPECT_EQ(ic.rope_theta, cfg.rope_theta);
    EXPECT_EQ(ic.tied(), cfg.tied());
    EXPECT_TRUE(ic.moe.enabled());
    EXPECT_EQ(ic.moe.num_experts, 4);
    EXPECT_EQ(ic.moe.top_k, 2);
    EXPECT_EQ(ic.expert_ffn_dim(), 32);
    EXPECT_EQ(ic.moe.router, "softmax");
    EXPECT_TRUE(ic.moe.renormalize);
    EXPECT_EQ(ic.moe.shared_experts, 0);
    EXPECT_EQ(ic.moe.capacity_factor, 0);
    EXPECT_EQ(ic.moe.aux_loss_coef, 0.02);
    for (int64_t l = 0; l < ic.n_layers; ++l) EXPECT_TRUE(ic.is_moe_layer(l)) << l;
    const auto& got = imp.value().second;
    ASSERT_EQ(got.size(), params.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].first, params[i].first);
      EXPECT_EQ(got[i].second.shape(), params[i].second.shape()) << got[i].first;
      EXPECT_TRUE(bit_equal(got[i].second, params[i].second)) << got[i].first;
      EXPECT_FALSE(hf_name_for(params[i].first).empty()) << params[i].first;
    }
    // The imported config builds a model whose parameters are exactly the imported ones, in order.
    Transformer rebuilt(ic, StageSpec{}, nullptr);
    ASSERT_EQ(rebuilt.params().all().size(), got.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(rebuilt.params().all()[i]->name, got[i].first);
      EXPECT_EQ(rebuilt.params().all()[i]->global_shape, got[i].second.shape()) << got[i].first;
    }
  }
}

TEST(CheckpointHfMixtral, ExportRefusesWhatMixtralCannotExpress) {
  TempDir tmp("hfmxbad");
  const std::vector<std::pair<std::string, std::function<void(MoeConfig&)>>> cases = {
      {"model.moe.router", [](MoeConfig& m) { m.router = "sigmoid"; }},
      {"model.moe.shared_experts", [](MoeConfig& m) { m.shared_experts = 1; }},
      {"model.moe.renormalize", [](MoeConfig& m) { m.renormalize = false; }},
      {"model.moe.first_dense", [](MoeConfig& m) { m.first_dense = 1; }},
      {"model.moe.every", [](MoeConfig& m) { m.every = 2; }},
      {"model.moe.capacity_factor", [](MoeConfig& m) { m.capacity_factor = 1.25; }},
  };
  int i = 0;
  for (const auto& [key, mutate] : cases) {
    ModelConfig cfg = tiny_moe();
    mutate(cfg.moe);
    auto m = make_model(cfg, 1);
    const std::string out = tmp.str("x" + std::to_string(i++));
    Status st = export_hf(out, cfg, full_params_of(*m));
    ASSERT_FALSE(st) << key;
    EXPECT_NE(st.message().find(key), std::string::npos) << st.message();
    EXPECT_NE(st.message().find("Mixtral"), std::string::npos) << st.message();
    EXPECT_FALSE(fs::exists(out)) << key;  // refused before writing anything
  }
}

TEST(CheckpointHfMixtral, ImportConfigVariantsAndErrors) {
  TempDir tmp("hfmximp");
  const ModelConfig cfg = tiny_moe();
  auto m = make_model(cfg, 2);
  auto expect_has = [](const std::string& msg, const std::vector<std::string>& parts) {
    for (const std::string& p : parts)
      EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  };
  // A missing expert tensor.
  ASSERT_TRUE(export_hf(tmp.str("a"), cfg, full_params_of(*m)));
  {
    auto f = open_safetensors(tmp.str("a/model.safetensors"));
    ASSERT_TRUE(f) << f.status().message();
    std::vector<std::pair<std::string, Tensor>> keep;
    for (const auto& n : f.value().names())
      if (n != "model.layers.1.block_sparse_moe.experts.3.w2.weight") keep.emplace_back(n, f.value().read(n));
    ASSERT_TRUE(save_safetensors(tmp.str("a/model.safetensors"), keep, {{"format", "pt"}}));
  }
  auto r = import_hf(tmp.str("a"));
  ASSERT_FALSE(r);
  expect_has(r.status().message(),
             {"model.safetensors", "model.layers.1.block_sparse_moe.experts.3.w2.weight", "missing",
              "layers.1.mlp.experts.w2.weight"});

  // A config key Mixtral needs.
  ASSERT_TRUE(export_hf(tmp.str("b"), cfg, full_params_of(*m)));
  nlohmann::json c = read_json(tmp.str("b/config.json"));
  c.erase("num_local_experts");
  std::ofstream(tmp.str("b/config.json"), std::ios::trunc) << c.dump();
  r = import_hf(tmp.str("b"));
  ASSERT_FALSE(r);
  expect_has(r.status().message(), {"config.json", "num_local_experts"});

  // transformers >= 5 config: rope_parameters instead of rope_theta; a non-default rope_type is refused.
  c = read_json(tmp.str("a/config.json"));
  c.erase("rope_theta");
  c.erase("rope_scaling");
  c["rope_parameters"] = {{"rope_theta", 123456.0}, {"rope_type", "default"}};
  std::ofstream(tmp.str("a/config.json"), std::ios::trunc) << c.dump();
  ASSERT_TRUE(export_hf(tmp.str("c"), cfg, full_params_of(*m)));
  fs::copy_file(tmp.str("a/config.json"), tmp.str("c/config.json"), fs::copy_options::overwrite_existing);
  auto ok = import_hf(tmp.str("c"));
  ASSERT_TRUE(ok) << ok.status().message();
  EXPECT_EQ(ok.value().first.rope_theta, 123456.0);
  c["rope_parameters"]["rope_type"] = "yarn";
  std::ofstream(tmp.str("c/config.json"), std::ios::trunc) << c.dump();
  r = import_hf(tmp.str("c"));
  ASSERT_FALSE(r);
  expect_has(r.status().message(), {"config.json", "rope_parameters", "yarn"});

  // A sliding window shorter than the context: attention would differ.
  c = read_json(tmp.str("a/config.json"));
  c["sliding_window"] = 8;
  std::ofstream(tmp.str("b/config.json"), std::ios::trunc) << c.dump();
  r = import_hf(tmp.str("b"));
  ASSERT_FALSE(r);
  expect_has(r.status().message(), {"config.json", "sliding_window"});
}

// Mixtral's forward, written from the HF modeling code's definition and fed only the exported directory
// (config.json + per-expert tensors): RMSNorm, rotate-half RoPE, GQA causal attention, and the sparse MoE
// block (softmax over all experts, top-k, gates renormalized, experts w2(silu(w1 x) * w3 x)). Double
// precision. Returns logits (T, V) of the token ids; `experts_used` collects the chosen (layer, expert)s.
std::vector<double> mixtral_reference_logits(const std::string& dir, const std::vector<int32_t>& ids,
                                             std::set<std::pair<int64_t, int64_t>>* experts_used,
                                             bool swap_gate_up = false) {
  const nlohmann::json c = read_json(dir + "/config.json");
  auto opened = open_safetensors(dir + "/model.safetensors");
  NDT_CHECK(opened.is_ok(), "{}", opened.status().message());
  const SafetensorsFile& file = opened.value();
  auto W = [&](const std::string& n) { return file.read(n).to_vector<float>(); };
  const int64_t C = c["hidden_size"], H = c["num_attention_heads"], KV = c["num_key_value_heads"],
                L = c["num_hidden_layers"], V = c["vocab_size"], E = c["num_local_experts"],
                K = c["num_experts_per_tok"], F = c["intermediate_size"];
  const int64_t D = C / H, T = static_cast<int64_t>(ids.size()), G = H / KV;
  const double eps = c["rms_norm_eps"], theta = c["rope_theta"];
  // y (rows, out) = x (rows, in) W^T with W (out, in) row-major.
  auto linear = [](const std::vector<double>& x, const std::vector<float>& w, int64_t rows, int64_t in,
                   int64_t out) {
    std::vector<double> y(static_cast<size_t>(rows * out), 0.0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t o = 0; o < out; ++o) {
        double s = 0;
        for (int64_t i = 0; i < in; ++i)
          s += x[static_cast<size_t>(r * in + i)] * w[static_cast<size_t>(o * in + i)];
        y[static_cast<size_t>(r * out + o)] = s;
      }
    return y;
  };
  auto rmsnorm = [&](const std::vector<double>& x, const std::vector<float>& w) {
    std::vector<double> y(x.size());
    for (int64_t t = 0; t < T; ++t) {
      double ms = 0;
      for (int64_t i = 0; i < C; ++i)
        ms += x[static_cast<size_t>(t * C + i)] * x[static_cast<size_t>(t * C + i)];
      const double r = 1.0 / std::sqrt(ms / static_cast<double>(C) + eps);
      for (int64_t i = 0; i < C; ++i)
        y[static_cast<size_t>(t * C + i)] = x[static_cast<size_t>(t * C + i)] * r * w[static_cast<size_t>(i)];
    }
    return y;
  };
  // Rotate-half RoPE in place on (T, heads, D): pairs (i, i + D/2), angle = pos * theta^(-2i/D).
  auto rope = [&](std::vector<double>& x, int64_t heads) {
    for (int64_t t = 0; t < T; ++t)
      for (int64_t hh = 0; hh < heads; ++hh)
        for (int64_t i = 0; i < D / 2; ++i) {
          const double ang = static_cast<double>(t) *
                             std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(D));
          double& a = x[static_cast<size_t>((t * heads + hh) * D + i)];
          double& b = x[static_cast<size_t>((t * heads + hh) * D + i + D / 2)];
          const double a0 = a, b0 = b;
          a = a0 * std::cos(ang) - b0 * std::sin(ang);
          b = b0 * std::cos(ang) + a0 * std::sin(ang);
        }
  };
  const std::vector<float> emb = W("model.embed_tokens.weight");
  std::vector<double> h(static_cast<size_t>(T * C));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < C; ++i)
      h[static_cast<size_t>(t * C + i)] = emb[static_cast<size_t>(ids[static_cast<size_t>(t)] * C + i)];
  for (int64_t l = 0; l < L; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    std::vector<double> x = rmsnorm(h, W(p + "input_layernorm.weight"));
    std::vector<double> q = linear(x, W(p + "self_attn.q_proj.weight"), T, C, H * D);
    std::vector<double> k = linear(x, W(p + "self_attn.k_proj.weight"), T, C, KV * D);
    const std::vector<double> v = linear(x, W(p + "self_attn.v_proj.weight"), T, C, KV * D);
    rope(q, H);
    rope(k, KV);
    std::vector<double> att(static_cast<size_t>(T * H * D), 0.0);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t hh = 0; hh < H; ++hh) {
        const int64_t g = hh / G;  // repeat_kv: query head hh reads kv head hh / (H / KV)
        std::vector<double> s(static_cast<size_t>(t + 1));
        double mx = -1e300;
        for (int64_t u = 0; u <= t; ++u) {
          double d = 0;
          for (int64_t i = 0; i < D; ++i)
            d += q[static_cast<size_t>((t * H + hh) * D + i)] * k[static_cast<size_t>((u * KV + g) * D + i)];
          s[static_cast<size_t>(u)] = d / std::sqrt(static_cast<double>(D));
          mx = std::max(mx, s[static_cast<size_t>(u)]);
        }
        double sum = 0;
        for (double& e : s) sum += (e = std::exp(e - mx));
        for (int64_t u = 0; u <= t; ++u)
          for (int64_t i = 0; i < D; ++i)
            att[static_cast<size_t>((t * H + hh) * D + i)] +=
                s[static_cast<size_t>(u)] / sum * v[static_cast<size_t>((u * KV + g) * D + i)];
      }
    const std::vector<double> o = linear(att, W(p + "self_attn.o_proj.weight"), T, H * D, C);
    for (size_t i = 0; i < h.size(); ++i) h[i] += o[i];

    x = rmsnorm(h, W(p + "post_attention_layernorm.weight"));
    const std::vector<double> router = linear(x, W(p + "block_sparse_moe.gate.weight"), T, C, E);
    std::vector<std::vector<float>> w1(static_cast<size_t>(E)), w3(static_cast<size_t>(E)),
        w2(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) {
      const std::string x_ = p + "block_sparse_moe.experts." + std::to_string(e) + ".";
      w1[static_cast<size_t>(e)] = W(x_ + (swap_gate_up ? "w3.weight" : "w1.weight"));
      w3[static_cast<size_t>(e)] = W(x_ + (swap_gate_up ? "w1.weight" : "w3.weight"));
      w2[static_cast<size_t>(e)] = W(x_ + "w2.weight");
    }
    for (int64_t t = 0; t < T; ++t) {
      // routing_weights = softmax(router_logits); topk; routing_weights /= sum.
      std::vector<double> pr(router.begin() + t * E, router.begin() + (t + 1) * E);
      const double mx = *std::max_element(pr.begin(), pr.end());
      double sum = 0;
      for (double& e : pr) sum += (e = std::exp(e - mx));
      for (double& e : pr) e /= sum;
      std::vector<int64_t> order(static_cast<size_t>(E));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
        return pr[static_cast<size_t>(a)] > pr[static_cast<size_t>(b)];
      });
      double ksum = 0;
      for (int64_t j = 0; j < K; ++j) ksum += pr[static_cast<size_t>(order[static_cast<size_t>(j)])];
      const std::vector<double> xt(x.begin() + t * C, x.begin() + (t + 1) * C);
      for (int64_t j = 0; j < K; ++j) {
        const int64_t e = order[static_cast<size_t>(j)];
        if (experts_used) experts_used->insert({l, e});
        const double gate = pr[static_cast<size_t>(e)] / ksum;
        const std::vector<double> a = linear(xt, w1[static_cast<size_t>(e)], 1, C, F);
        const std::vector<double> b = linear(xt, w3[static_cast<size_t>(e)], 1, C, F);
        std::vector<double> act(static_cast<size_t>(F));
        for (int64_t i = 0; i < F; ++i)
          act[static_cast<size_t>(i)] = a[static_cast<size_t>(i)] /
                                        (1.0 + std::exp(-a[static_cast<size_t>(i)])) *
                                        b[static_cast<size_t>(i)];
        const std::vector<double> y = linear(act, w2[static_cast<size_t>(e)], 1, F, C);
        for (int64_t i = 0; i < C; ++i) h[static_cast<size_t>(t * C + i)] += gate * y[static_cast<size_t>(i)];
      }
    }
  }
  const std::vector<double> x = rmsnorm(h, W("model.norm.weight"));
  return linear(x, c["tie_word_embeddings"].get<bool>() ? emb : W("lm_head.weight"), T, C, V);
}

TEST(CheckpointHfMixtral, LogitsMatchIndependentMixtralForward) {
  for (int tied : {0, 1}) {
    TempDir tmp("hfmxlog" + std::to_string(tied));
    const ModelConfig cfg = tiny_moe(tied);
    auto m = make_model(cfg, 21 + tied);
    const std::string out = tmp.str("hf");
    ASSERT_TRUE(export_hf(out, cfg, full_params_of(*m)));

    // One sequence of 12 inputs (+1 target), through our Transformer.
    std::mt19937 rng(5);
    Sample s;
    for (int i = 0; i < 13; ++i) {
      s.tokens.push_back(static_cast<int32_t>(rng() % 264));
      s.loss_mask.push_back(i > 0);
    }
    const std::vector<int32_t> ids(s.tokens.begin(), s.tokens.end() - 1);
    const Microbatch mb = pack_samples({s}, 0);
    ASSERT_EQ(mb.num_tokens(), 12);
    Activations acts;
    m->forward(mb, Tensor(), acts);
    const std::vector<float> ours = acts.logits.to_vector<float>();
    ASSERT_EQ(ours.size(), 12u * 264u);

    std::set<std::pair<int64_t, int64_t>> used;
    const std::vector<double> ref = mixtral_reference_logits(out, ids, &used);
    ASSERT_EQ(ref.size(), ours.size());
    double max_diff = 0, max_abs = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      max_diff = std::max(max_diff, std::abs(ref[i] - static_cast<double>(ours[i])));
      max_abs = std::max(max_abs, std::abs(ref[i]));
    }
    EXPECT_LE(max_diff, 1e-4) << "tied " << tied;
    // The check has teeth: logits are O(1), most experts are used, and swapping the gate (w1) and up (w3)
    // projections of the experts moves the logits far beyond the tolerance.
    EXPECT_GT(max_abs, 0.5);
    EXPECT_GE(used.size(), 6u);
    const std::vector<double> swapped = mixtral_reference_logits(out, ids, nullptr, /*swap_gate_up=*/true);
    double swap_diff = 0;
    for (size_t i = 0; i < ref.size(); ++i) swap_diff = std::max(swap_diff, std::abs(ref[i] - swapped[i]));
    EXPECT_GT(swap_diff, 1e-2);
    std::printf(
        "[mixtral logits] tied %d: max |ours - reference| %.3g, max |logit| %.3g, experts used %zu/8, "
        "w1<->w3 swapped moves %.3g\n",
        tied, max_diff, max_abs, used.size(), swap_diff);
  }
}

}  // namespace
}  // namespace ndt
