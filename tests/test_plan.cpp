// ndtrain plan (src/plan): the layouts it lists are exactly those the trainer accepts, with the trainer's
// messages; the per-rank parameter, gradient and optimizer sizes equal what the engine allocates; the
// activations its forward replay keeps equal what Transformer::forward keeps; the schedule walk holds as
// many microbatches as the schedule simulator says; and the trade-offs go the right way.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>

#include "parallel/layout.h"
#include "parallel/pp/pipeline.h"
#include "parallel/pp/schedule.h"
#include "plan/act_mirror.h"
#include "plan/plan.h"
#include "plan/report.h"
#include "tiny_model.h"
#include "train/optimizer.h"

namespace ndt {
namespace {

const std::string kConfigs = std::string(NDT_SOURCE_DIR) + "/configs/";

Config load(const std::string& name, const std::vector<std::string>& sets = {}) {
  auto c = load_config(kConfigs + name, sets);
  c.status().throw_if_error();
  return c.value();
}

// A rank of a group of `size` without communication: only size, rank and splitting are used.
class FakeComm : public Communicator {
 public:
  FakeComm(int size, int rank) : size_(size), rank_(rank), world_(static_cast<size_t>(size)) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::vector<int>& world_ranks() const override { return world_; }
  void all_reduce(void*, int64_t, DType, ReduceOp) override { fail(); }
  void all_gather(const void*, void*, int64_t, DType) override { fail(); }
  void reduce_scatter(const void*, void*, int64_t, DType, ReduceOp) override { fail(); }
  void broadcast(void*, int64_t, DType, int) override { fail(); }
  void send(const void*, int64_t, DType, int, int) override { fail(); }
  void recv(void*, int64_t, DType, int, int) override { fail(); }
  void batch_p2p(const std::vector<P2POp>&) override { fail(); }
  void all_to_all_v(const void*, const std::vector<int64_t>&, const std::vector<int64_t>&, void*,
                    const std::vector<int64_t>&, const std::vector<int64_t>&, DType) override {
    fail();
  }
  void barrier() override { fail(); }
  std::unique_ptr<Communicator> subgroup(const std::vector<int>& members) override {
    return std::make_unique<FakeComm>(static_cast<int>(members.size()), 0);
  }

 private:
  static void fail() { NDT_FAIL("FakeComm: no communication in planner tests"); }
  int size_, rank_;
  std::vector<int> world_;
};

class FakeEp : public EpHooks {
 public:
  FakeEp(int size, int rank) : size_(size), rank_(rank) {}
  int size() const override { return size_; }
  int rank() const override { return rank_; }

 private:
  int size_, rank_;
};

// Sequence parallelism's shapes without communication: tokens gathered (x tp) into and scattered (/ tp)
// out of the TP regions, as CommTpHooks does (fresh tensors; values do not matter here).
class FakeSp : public testing::FakeTp {
 public:
  explicit FakeSp(int size) : FakeTp(size, 0) {}
  bool sequence_parallel() const override { return true; }
  Tensor enter_forward(const Tensor& x) override { return rows(x, x.size(0) * size()); }
  Tensor enter_backward(const Tensor& dx) override { return rows(dx, dx.size(0) / size()); }
  Tensor exit_forward(const Tensor& p) override { return rows(p, p.size(0) / size()); }
  Tensor exit_backward(const Tensor& dy) override { return rows(dy, dy.size(0) * size()); }

 private:
  static Tensor rows(const Tensor& t, int64_t n) {
    return Tensor::zeros({n, t.size(1)}, t.dtype(), t.device());
  }
};

// (a) Every candidate gets the verdict `ndtrain train` would give it: the config parsed with the layout's
// --set strings (load_config: validate_config), then validate_layout, with the same message.
void expect_trainer_verdicts(const std::string& config, const std::vector<std::string>& sets, int gpus) {
  const Config base = load(config, sets);
  plan::PlanOptions o;
  o.gpus = gpus;
  o.gpu_mem_gib = 1e6;  // only divisibility decides here
  const plan::PlanResult r = plan::plan(base, o);
  std::set<std::vector<int64_t>> degrees;
  int accepted = 0, refused = 0;
  for (const plan::LayoutPlan& l : r.layouts) {
    std::vector<std::string> all = sets;
    for (const std::string& s : l.layout.overrides()) all.push_back(s);
    auto cfg = load_config(kConfigs + config, all);
    Status st = cfg.status();
    if (st) st = validate_layout(cfg.value(), gpus);
    SCOPED_TRACE(l.layout.degrees() + " " + l.layout.flags());
    if (st) {
      EXPECT_NE(l.verdict, plan::Verdict::Invalid) << l.reason;
      ++accepted;
    } else {
      EXPECT_EQ(l.verdict, plan::Verdict::Invalid);
      EXPECT_EQ(l.reason, st.message());
      ++refused;
    }
    degrees.insert({l.layout.tp, l.layout.cp, l.layout.dp, l.layout.pp});
  }
  EXPECT_GT(accepted, 0);
  EXPECT_GT(refused, 0);
  // Every way of writing gpus as tp * cp * dp * pp is tried.
  int factorizations = 0;
  for (int tp = 1; tp <= gpus; ++tp)
    for (int cp = 1; cp <= gpus; ++cp)
      for (int dp = 1; dp <= gpus; ++dp)
        for (int pp = 1; pp <= gpus; ++pp) factorizations += tp * cp * dp * pp == gpus;
  EXPECT_EQ(static_cast<int>(degrees.size()), factorizations);
}

TEST(Plan, ListsExactlyTheLayoutsTheTrainerAccepts) {
  expect_trainer_verdicts("tiny-llama.yaml", {"model.n_layers=4", "train.micro_batch=1"}, 8);
  expect_trainer_verdicts("tiny-gpt2.yaml",
                          {"train.global_batch=12", "data.seq_len=30", "model.max_seq_len=32"}, 8);
}

TEST(Plan, ListsExactlyTheLayoutsTheTrainerAcceptsMoe) {
  expect_trainer_verdicts("tiny-moe.yaml", {"model.moe.num_experts=4", "train.micro_batch=2"}, 8);
}

TEST(Plan, RefusalsCarryTheTrainersMessage) {
  const Config base = load("tiny-llama.yaml");  // 4 heads, 2 KV heads, 2 layers
  plan::PlanOptions o;
  o.gpus = 8;
  plan::Layout l;
  l.tp = 8;
  const plan::LayoutPlan p = plan::plan_layout(base, l, o);
  EXPECT_EQ(p.verdict, plan::Verdict::Invalid);
  EXPECT_NE(p.reason.find("tp=8 does not divide n_heads=4"), std::string::npos) << p.reason;
}

// (b) Weights, gradients and optimizer state per rank: the engine's own ParamStore (registered by its
// PipelineEngine on fake groups), flattened as the Trainer does, and its Optimizer.
void expect_engine_sizes(const std::string& config, const std::vector<std::string>& sets) {
  const Config cfg = load(config, sets);
  const ParallelConfig& p = cfg.parallel;
  SCOPED_TRACE(config + " " + plan::layout_of(cfg).degrees() + " " + plan::layout_of(cfg).flags());
  ASSERT_TRUE(validate_layout(cfg, static_cast<int>(p.tp * p.cp * p.dp * p.pp)));
  const int g = static_cast<int>(p.dp * p.cp), edp = g / static_cast<int>(p.ep);
  for (int r = 0; r < p.pp; ++r) {
    FakeComm pp(static_cast<int>(p.pp), r), cp(static_cast<int>(p.cp), 0), grad(g, 0), expert_dp(edp, 0),
        tp(static_cast<int>(p.tp), 0), ep_comm(static_cast<int>(p.ep), 0);
    testing::FakeTp tp_hooks(static_cast<int>(p.tp), 0);
    FakeEp ep(static_cast<int>(p.ep), 0);
    PipelineEngine engine(cfg, pp, p.tp > 1 ? &tp_hooks : nullptr, &cp, p.ep > 1 ? &ep : nullptr);
    ParamStore& store = engine.params();
    store.flatten(g, edp);  // Trainer's constructor
    OptimizerComms oc;
    oc.dp = &grad;
    oc.expert_dp = &expert_dp;
    oc.ep = &ep_comm;
    oc.tp = &tp;
    oc.zero1 = p.zero1;
    Optimizer opt(store, cfg.train, oc);

    const plan::ParamCounts n = plan::rank_params(cfg, r);
    const plan::FlatSizes f = plan::flat_sizes(cfg, n);
    int64_t dense = 0, expert = 0;
    for (const auto& q : store.all()) (q->expert ? expert : dense) += q->numel();
    EXPECT_EQ(n.dense, dense) << "pp rank " << r;
    EXPECT_EQ(n.expert, expert) << "pp rank " << r;
    EXPECT_EQ(f.total(), store.flat_values().numel()) << "pp rank " << r;
    if (expert > 0) EXPECT_EQ(f.dense_len, store.expert_begin()) << "pp rank " << r;
    EXPECT_EQ(f.state, opt.moment_elements()) << "pp rank " << r;
    EXPECT_EQ(f.shard_dense + f.shard_expert, opt.shard_grad_elements()) << "pp rank " << r;
  }
}

TEST(Plan, ParameterAndOptimizerSizesEqualTheEngines) {
  expect_engine_sizes("tiny-llama.yaml", {"model.n_layers=4", "parallel.tp=2", "parallel.pp=2",
                                          "parallel.dp=2", "parallel.zero1=true", "train.micro_batch=2"});
  expect_engine_sizes("tiny-llama.yaml",
                      {"model.n_layers=4", "parallel.pp=2", "parallel.virtual_stages=2",
                       "parallel.schedule=interleaved", "parallel.dp=3", "train.global_batch=6",
                       "train.micro_batch=1", "model.qkv_bias=true", "model.qk_norm=true"});
  // gpt2: tied embedding on the first and last stage, learned positions, biases; odd sizes need padding.
  expect_engine_sizes("tiny-gpt2.yaml", {"parallel.tp=2", "parallel.pp=2", "parallel.cp=2", "parallel.dp=2",
                                         "parallel.zero1=true", "data.seq_len=28", "model.max_seq_len=28",
                                         "model.vocab_size=266"});
  expect_engine_sizes("tiny-gpt2.yaml", {"parallel.dp=3", "train.global_batch=6", "parallel.zero1=true"});
  // MoE: the expert region is sharded over EP and its optimizer state over the expert-data-parallel group.
  expect_engine_sizes("tiny-moe.yaml", {"parallel.dp=4", "parallel.ep=2", "parallel.zero1=true"});
  expect_engine_sizes("tiny-moe.yaml", {"parallel.dp=2", "parallel.cp=2", "parallel.ep=4", "parallel.pp=2",
                                        "parallel.zero1=true", "model.moe.router=sigmoid"});
  expect_engine_sizes("tiny-moe.yaml",
                      {"model.style=gpt2", "parallel.tp=2", "parallel.dp=3", "train.global_batch=6",
                       "parallel.ep=3", "model.moe.num_experts=6", "parallel.zero1=true"});
}

// What one chunk's forward keeps: every tensor Activations holds after Transformer::forward (distinct
// storage; the stage input left out), in exact bytes, against the replay with no allocation rounding.
int64_t kept_bytes(const Activations& acts, const Tensor& out, const Tensor& input) {
  std::map<const void*, int64_t> seen;
  auto add = [&](const Tensor& t) {
    if (t.defined() && (!input.defined() || t.data_ptr() != input.data_ptr()))
      seen[t.data_ptr()] = t.nbytes();
  };
  for (const LayerActs& a : acts.layers) {
    for (const Tensor* t : {&a.x_in,    &a.n1,      &a.n1_mean, &a.n1_rstd, &a.a_in, &a.q,   &a.k, &a.v,
                            &a.q_raw,   &a.k_raw,   &a.q_rstd,  &a.k_rstd,  &a.att,  &a.lse, &a.h, &a.n2,
                            &a.n2_mean, &a.n2_rstd, &a.m_in,    &a.fc1,     &a.fc3,  &a.act})
      add(*t);
    const MoeActs& m = a.moe;
    const RoutedTokens& r = m.routed;
    for (const Tensor* t : {&m.x,         &m.xf,       &m.logits,       &r.score,      &r.choice,
                            &r.gate,      &r.lse,      &r.pnorm,        &r.slot_pos,   &r.kept_gate,
                            &r.row_token, &r.row_gate, &m.loss.tok_seq, &m.loss.aux_w, &m.loss.aux_cnt,
                            &m.xe,        &m.h1,       &m.h3,           &m.act,        &m.yp})
      add(*t);
  }
  for (const Tensor* t : {&acts.x_final, &acts.fn, &acts.fn_mean, &acts.fn_rstd, &acts.head_in, &acts.logits,
                          &acts.rowmax, &acts.sumexp, &acts.logprob, &out})
    add(*t);
  int64_t n = 0;
  for (const auto& [p, b] : seen) n += b;
  return n;
}

void expect_kept_activations(ModelConfig m, int tp, bool sp, bool recompute) {
  Config cfg;
  cfg.model = m;
  cfg.parallel.tp = tp;
  cfg.parallel.sequence_parallel = sp;
  cfg.train.recompute = recompute;
  cfg.train.precision = "fp32";  // the CPU computes in fp32: 4-byte activations
  std::unique_ptr<TpHooks> hooks;
  if (tp > 1)
    hooks = sp ? std::unique_ptr<TpHooks>(new FakeSp(tp)) : std::make_unique<testing::FakeTp>(tp, 0);
  std::mt19937 rng(5);
  const Microbatch mb = testing::three_sequences(rng, m.vocab_size, pack_layout(1, tp, sp));
  const int64_t T = mb.num_tokens(), Tl = sp ? T / tp : T;
  plan::ActDims d = plan::act_dims(cfg, T);
  d.granule = 1;
  d.moe_aux = d.moe_z = false;  // the forward below runs without a step context: no MoE loss terms
  const int64_t L = m.n_layers;
  for (const plan::ChunkSpec c : {plan::ChunkSpec{0, L, true, true}, plan::ChunkSpec{0, 1, true, false},
                                  plan::ChunkSpec{1, L, false, true}}) {
    SCOPED_TRACE(fmt::format(
        "{} tp={} sp={} recompute={} moe={} qk_norm={} layers [{}, {}) embedding={} head={}", m.style, tp, sp,
        recompute, m.moe.enabled(), m.qk_norm, c.first_layer, c.last_layer, c.has_embedding, c.has_head));
    Transformer model(m, StageSpec{c.first_layer, c.last_layer, c.has_embedding, c.has_head}, hooks.get());
    model.params().init(3);
    model.set_recompute(recompute);
    Activations acts;
    acts.loss_in_backward = true;  // as the engine asks in training; the forward keeps it on one TP rank
    const Tensor input = c.has_embedding ? Tensor() : Tensor::zeros({Tl, m.d_model});
    const Tensor out = model.forward(mb, input, acts);
    EXPECT_EQ(acts.loss_in_backward, c.has_head && tp == 1);
    EXPECT_EQ(d.loss_in_backward, tp == 1);
    const plan::ChunkProfile p = plan::chunk_profile(cfg, d, c);
    EXPECT_EQ(p.retained, kept_bytes(acts, out, input));
    EXPECT_GT(p.retained, Tl * m.d_model * 4 * (c.last_layer - c.first_layer));
    EXPECT_GE(p.fwd_peak, p.retained);
    EXPECT_EQ(p.bwd_delta, -(p.retained + p.input + p.dy) + p.dx_out);
  }
}

TEST(Plan, KeptActivationsEqualWhatTheForwardKeeps) {
  ModelConfig llama = testing::tiny_model("llama"), gpt2 = testing::tiny_model("gpt2");
  for (bool recompute : {false, true}) {
    expect_kept_activations(llama, 1, false, recompute);
    expect_kept_activations(gpt2, 1, false, recompute);
    expect_kept_activations(llama, 2, false, recompute);
    expect_kept_activations(gpt2, 2, true, recompute);
  }
  ModelConfig qwen3 = llama;
  qwen3.qk_norm = true;
  qwen3.qkv_bias = true;
  expect_kept_activations(qwen3, 2, true, false);
  ModelConfig moe = llama;
  moe.moe.num_experts = 4;
  moe.moe.top_k = 2;
  moe.moe.shared_experts = 1;
  moe.moe.d_ff_expert = 8;
  expect_kept_activations(moe, 1, false, false);
  expect_kept_activations(moe, 2, true, false);
  moe.style = "gpt2";
  moe.n_kv_heads = 0;
  moe.moe.shared_experts = 0;
  expect_kept_activations(moe, 2, false, true);
}

// The schedule walk holds as many (microbatch, chunk) activations as the schedule simulator counts.
TEST(Plan, InFlightMicrobatchesFollowTheSchedule) {
  for (const auto& [schedule, v] :
       std::vector<std::pair<std::string, int>>{{"1f1b", 1}, {"gpipe", 1}, {"interleaved", 2}}) {
    const Config cfg = load("tiny-llama.yaml", {"model.n_layers=8", "parallel.pp=4", "train.global_batch=8",
                                                "train.micro_batch=1", "parallel.schedule=" + schedule,
                                                fmt::format("parallel.virtual_stages={}", v)});
    auto sched = pp::make_schedule(schedule, 4, v, 8);
    auto sim = pp::simulate_schedule(sched.value(), 4, v, 8);
    ASSERT_TRUE(sim.status());
    for (int r = 0; r < 4; ++r)
      EXPECT_EQ(plan::stage_memory(cfg, r).max_in_flight,
                sim.value().max_in_flight_per_rank[static_cast<size_t>(r)])
          << schedule << " rank " << r;
  }
}

// (c) The trade-offs: recomputation lowers activation memory, ZeRO-1 divides the optimizer state by about
// dp, and a model far too large for the GPUs is refused as not fitting, with the reason.
TEST(Plan, RecomputeAndZeroLowerMemory) {
  const Config base = load("llama-1b.yaml");
  plan::PlanOptions o;
  o.gpus = 8;
  plan::Layout l;
  l.dp = 8;
  const plan::LayoutPlan plain = plan::plan_layout(base, l, o);
  l.recompute = true;
  const plan::LayoutPlan recompute = plan::plan_layout(base, l, o);
  l.recompute = false;
  l.zero1 = true;
  const plan::LayoutPlan zero = plan::plan_layout(base, l, o);
  ASSERT_EQ(plain.verdict, plan::Verdict::Fits) << plain.reason;
  const plan::StageMemory &a = plain.stages[0], &b = recompute.stages[0], &z = zero.stages[0];
  EXPECT_LT(b.activation_peak, a.activation_peak / 2);
  EXPECT_LT(b.act_per_microbatch, a.act_per_microbatch / 5);
  EXPECT_EQ(a.persistent.optimizer, b.persistent.optimizer);
  // m and v shrink by dp = 8 (GPUs over NCCL keep no reduced-gradient shard)...
  const double ratio =
      static_cast<double>(a.persistent.optimizer) / static_cast<double>(z.persistent.optimizer);
  EXPECT_NEAR(ratio, 8.0, 0.01);
  // ...while staged through MPI the shard adds half of one of them back.
  Config mpi = base;
  mpi.train.device_comm = "mpi";
  const plan::LayoutPlan zero_mpi = plan::plan_layout(mpi, l, o);
  const plan::StageMemory& zm = zero_mpi.stages[0];
  EXPECT_NEAR(static_cast<double>(a.persistent.optimizer) / static_cast<double>(zm.persistent.optimizer),
              8.0 / 1.5, 0.01);
  EXPECT_EQ(a.persistent.weights, z.persistent.weights);
  EXPECT_GT(recompute.time.compute_s, plain.time.compute_s);
}

TEST(Plan, ModelTooLargeIsRefusedWithTheReason) {
  // 10B parameters: 10 bytes each of weights, gradients and bf16 copy alone exceed 4 GiB on each of 8 GPUs.
  const Config base = load("llama-1b.yaml", {"model.n_layers=160"});
  plan::PlanOptions o;
  o.gpus = 8;
  o.gpu_mem_gib = 4;
  const plan::PlanResult r = plan::plan(base, o);
  int valid = 0;
  for (const plan::LayoutPlan& l : r.layouts) {
    if (l.verdict == plan::Verdict::Invalid) continue;
    ++valid;
    EXPECT_EQ(l.verdict, plan::Verdict::DoesNotFit) << l.layout.degrees() << " " << l.layout.flags();
    EXPECT_NE(l.reason.find("GiB > 4.00 GiB of GPU memory"), std::string::npos) << l.reason;
  }
  EXPECT_GT(valid, 0);
  const std::string text = plan::format_report(r, o, base);
  EXPECT_NE(text.find("layouts that fit (0"), std::string::npos);
  EXPECT_NE(text.find("does not fit: predicted"), std::string::npos);
}

TEST(Plan, JsonHasEveryRanksPrediction) {
  const Config base = load("llama-1b.yaml", {"parallel.tp=2", "parallel.dp=2", "parallel.pp=2"});
  plan::PlanOptions o;
  o.gpus = 8;
  const plan::PlanResult r = plan::plan(base, o, /*as_configured=*/true);
  ASSERT_EQ(r.layouts.size(), 1u);
  const nlohmann::json j = plan::to_json(r, o, base);
  const nlohmann::json& l = j["layouts"][0];
  EXPECT_EQ(l["status"], "fits");
  ASSERT_EQ(l["peak_mem_gib_per_rank"].size(), 8u);
  // Order tp-cp-ep-dp-pp: world ranks 0-3 are pipeline stage 0, 4-7 stage 1.
  EXPECT_EQ(l["peak_mem_gib_per_rank"][0], l["stages"][0]["peak_gib"]);
  EXPECT_EQ(l["peak_mem_gib_per_rank"][4], l["stages"][1]["peak_gib"]);
  EXPECT_GT(l["time"]["step_s"].get<double>(), 0);
}

}  // namespace
}  // namespace ndt
