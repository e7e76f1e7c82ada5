// Checkpoints: round trip, resharding between layouts, rotation, crash safety, bad input, HF interop.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>

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

TEST(CheckpointHf, RejectsGpt2AndBadInput) {
  TempDir tmp("hfbad");
  ModelConfig g = testing::tiny_model("gpt2");
  auto m = make_model(g, 1);
  Status st = export_hf(tmp.str("g"), g, full_params_of(*m));
  ASSERT_FALSE(st);
  EXPECT_NE(st.message().find("llama"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("gpt2"), std::string::npos) << st.message();

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

}  // namespace
}  // namespace ndt
