#include "train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>

#include "core/phase_mark.h"
#include "data/packing.h"
#include "data/synthetic.h"
#include "train/evaluate.h"
#include "train/moe_metrics.h"
#include "train/schedule.h"

#ifdef NDT_HAVE_CUDA
#include "cuda/cudnn_attention.h"
#include "cuda/runtime.h"
#include "dist/copy_engine_reduction.h"
#endif
#ifdef NDT_HAVE_NCCL
#include "dist/nccl_communicator.h"
#endif

namespace ndt {
namespace {

// Position of each parameter in the single-process registration order, comparable across ranks (whatever
// stage, TP or EP shard holds it): the embedding, then layer by layer, then the final norm and the head;
// within each of those the store's own order, which is the same on every rank.
std::vector<int64_t> global_order_keys(const ParamStore& ps, int64_t n_layers) {
  std::vector<int64_t> keys;
  std::map<int64_t, int64_t> seen;
  for (const auto& p : ps.all()) {
    int64_t group = n_layers + 1;
    if (p->name.starts_with("embed.")) {
      group = 0;
    } else if (p->name.starts_with("layers.")) {
      group = 1 + std::strtoll(p->name.c_str() + 7, nullptr, 10);
    }
    keys.push_back(group * (int64_t{1} << 20) + seen[group]++);
  }
  return keys;
}

}  // namespace

Trainer::Trainer(const Config& cfg, RunComms comms, const Tokenizer& tok, const Dataset& train,
                 const Dataset* val)
    : cfg_(cfg), c_(comms), tok_(tok), train_(train), val_(val) {
  if (!c_.world || !c_.dp || !c_.tp || !c_.pp || !c_.cp) self_ = make_self_communicator();
  for (Communicator** c : {&c_.world, &c_.dp, &c_.tp, &c_.pp, &c_.cp})
    if (!*c) *c = self_.get();
  if (!c_.grad) c_.grad = c_.dp;
  NDT_CHECK(c_.grad->size() == c_.dp->size() * c_.cp->size(),
            "gradient group has {} ranks, dp x cp = {} x {}", c_.grad->size(), c_.dp->size(), c_.cp->size());
  NDT_CHECK(tok_.vocab_size() <= cfg_.model.vocab_size,
            "tokenizer {} has {} tokens but model.vocab_size is {}", tok_.name(), tok_.vocab_size(),
            cfg_.model.vocab_size);
  if (!c_.expert_dp) c_.expert_dp = c_.grad;
  {
    // Fault injection (off unless asked for): debug.fault, else the environment's NDT_FAULT.
    std::string spec = cfg_.debug.fault, where = "config key 'debug.fault'";
    if (const char* env = std::getenv("NDT_FAULT"); spec.empty() && env != nullptr) {
      spec = env;
      where = "NDT_FAULT";
    }
    auto faults = parse_fault_spec(spec);
    if (!faults) throw AgreedError(fmt::format("{}: {}", where, faults.status().message()));
    faults_ = faults.value();
    for (const Fault& f : faults_) {
      if (f.rank >= c_.world->size())
        throw AgreedError(fmt::format("{}: rank {} is outside the {} rank(s) of this run", where, f.rank,
                                      c_.world->size()));
      if (f.kind == Fault::Kind::GpuHang && cfg_.train.device != "cuda")
        throw AgreedError(fmt::format("{}: gpu_hang needs train.device cuda", where));
    }
    if (!faults_.empty() && c_.world->rank() == 0) {
      std::printf("fault injection (%s): %s\n", where.c_str(), spec.c_str());
      std::fflush(stdout);
    }
  }
  NDT_CHECK(c_.ep_hooks == nullptr || cfg_.parallel.ep == c_.ep_hooks->size(),
            "EP hooks span {} ranks, parallel.ep is {}", c_.ep_hooks ? c_.ep_hooks->size() : 1,
            cfg_.parallel.ep);
  engine_ = std::make_unique<PipelineEngine>(cfg_, *c_.pp, c_.tp_hooks, c_.cp, c_.ep_hooks);
  pack_count_multiple_ =
      cfg_.parallel.virtual_stages > 1 ? c_.pp->size() : 1;  // interleaved needs m % p == 0
  engine_->params().flatten(c_.grad->size(), c_.expert_dp->size());
  engine_->params().init(static_cast<uint64_t>(cfg_.train.seed));
  const bool copy_engine = copy_engine_wanted();  // (throws on every rank where asked for and excluded)
  if (cfg_.train.device == "cuda") {
#ifdef NDT_HAVE_CUDA
    // Initialization ran on the host (layout- and device-independent); the store then moves as a whole.
    cuda::select_device(c_.world->rank());
    if (cfg_.train.attention == "native") cuda::set_cudnn_attention_enabled(false);
    if (cfg_.train.attention == "cudnn") {  // agreed over the world: every rank stops, or none
      int32_t ok = cuda::cudnn_attention_enabled() ? 1 : 0;
      c_.world->all_reduce(&ok, 1, DType::I32, ReduceOp::Min);
      NDT_CHECK(ok == 1, "train.attention is cudnn but cuDNN's attention is not available on every rank ({})",
                cuda::cudnn_attention_status());
    }
    // parallel.dp_reduction / dp_grad_window: the gradients go straight into memory the peers map (copy
    // engines) or NCCL's (symmetric window), with no pool buffer first.
    Tensor grads =
        copy_engine ? ipc_device_zeros(engine_->params().flat_grads().numel()) : grads_window_buffer();
    engine_->params().to_device(Device::CUDA,
                                cfg_.train.effective_precision() == "bf16" ? DType::BF16 : DType::F32, grads);
    if (copy_engine) {
      setup_copy_engine();
    }
#ifdef NDT_HAVE_NCCL
    else if (grads.defined()) {
      grads_registration_ = as_nccl(c_.grad)->register_window(grads.data_ptr(), grads.nbytes());
    }
#endif
#else
    (void)copy_engine;
    NDT_FAIL("train.device is cuda but this ndtrain was built without the CUDA backend");
#endif
  }
  engine_->set_recompute(cfg_.train.recompute);
  OptimizerComms oc;
  oc.dp = c_.grad;
  oc.expert_dp = c_.expert_dp;
  oc.ep = c_.ep;
  oc.tp = c_.tp;
  oc.norm_extra = c_.pp;
  oc.sequence_parallel = cfg_.parallel.sequence_parallel;
  oc.zero1 = cfg_.parallel.zero1;
  if (const char* g = std::getenv("NDT_ZERO1_GATHER"); g && std::string(g) == "step")
    oc.defer_zero1_gather = false;  // (measurements: the gathers at the end of the step)
  opt_ = std::make_unique<Optimizer>(engine_->params(), cfg_.train, oc);
#ifdef NDT_HAVE_CUDA
  if (auto ce = std::static_pointer_cast<CopyEngineReduction>(dp_reduction_)) {
    if (cfg_.parallel.zero1)
      opt_->set_owner_reducer([ce](float* buf, int64_t count, int64_t own_begin, int64_t own_end) {
        return ce->reduce_to_owner_async(buf, count, own_begin, own_end);
      });
    else
      opt_->set_range_reducer([ce](float* buf, int64_t count) { return ce->all_reduce_async(buf, count); });
  }
#endif
  // On GPUs each layer's DP all-reduce starts as soon as its gradients are final, under the backward
  // of the layers before it. The gathered embedding gradient needs the same reports (blocking reductions
  // on other backends).
  setup_embedding_grad();
  if (opt_->overlaps_reduction() || embedding_grad_) {
    engine_->set_grads_ready_hook([this](int64_t b, int64_t e, bool reduced) {
      reduced ? opt_->mark_reduced(b, e) : opt_->reduce_early(b, e);
    });
  }
  if (embedding_grad_) engine_->set_embedding_grad_hook(embedding_grad_.get());
#ifdef NDT_HAVE_CUDA
  if (step_graphs_apply()) {
    // cuDNN's attention (bf16) reads the sequence layout on the host; the built-in kernels on the device.
    const bool cudnn = cfg_.train.effective_precision() == "bf16" && cuda::cudnn_attention_enabled();
    graph_ = std::make_unique<StepGraph>(/*seqlens_on_host=*/cudnn);
  }
#endif
  const std::string& sync = cfg_.train.host_sync;
  if (sync == "log" || (sync == "auto" && cfg_.train.device == "cuda"))
    deferred_ = std::make_unique<DeferredSteps>(engine_->params().device(), cfg_.train);
}

Tensor Trainer::grads_window_buffer() {
#ifdef NDT_HAVE_NCCL
  NcclCommunicator* nc = as_nccl(c_.grad);
  if (!cfg_.parallel.dp_grad_window || !nc || nc->size() < 2) return Tensor();
  // ncclMemAlloc needs CUDA's virtual memory management: where a rank lacks it, every rank keeps the pool.
  Tensor grads;
  Status st = Status::ok();
  try {
    grads = nccl_device_zeros(engine_->params().flat_grads().shape(), DType::F32);
  } catch (const std::exception& e) {
    st = Status::error(e.what());
  }
  st = agree(st, *nc);
  if (!st.is_ok()) {
    if (c_.world->rank() == 0)
      std::printf("parallel.dp_grad_window: gradients stay in ordinary device memory (%s)\n",
                  st.message().c_str());
    return Tensor();
  }
  return grads;
#else
  return Tensor();
#endif
}

bool Trainer::copy_engine_wanted() const {
  if (cfg_.parallel.dp_reduction != "copy_engine" || c_.grad->size() < 2) return false;
  std::string why;  // why this layout cannot use it (the same on every rank)
  if (cfg_.train.device != "cuda")
    why = "the gradients are on the CPU";
  else if (cfg_.model.tied() && cfg_.parallel.dp_embedding_grad == "gather")
    why = "the gathered rows of a tied table are added after NCCL's reduction of its head part";
#ifdef NDT_HAVE_NCCL
  else if (!as_nccl(c_.grad))
    why = "the gradient group is not on NCCL (train.device_comm)";
#else
  else
    why = "this ndtrain was built without NCCL";
#endif
  if (why.empty()) return true;
  throw AgreedError(fmt::format("parallel.dp_reduction = copy_engine: {}; use nccl", why));
}

void Trainer::setup_copy_engine() {
#ifdef NDT_HAVE_CUDA
  std::string why;
  std::unique_ptr<CopyEngineReduction> ce =
      CopyEngineReduction::create(*c_.grad, engine_->params().flat_grads(), why);
  if (ce) {
    dp_reduction_ = std::shared_ptr<CopyEngineReduction>(std::move(ce));
    if (c_.world->rank() == 0)
      std::printf("parallel.dp_reduction: gradients %s by copy engines over %d ranks\n",
                  cfg_.parallel.zero1 ? "reduced to their ZeRO-1 owners" : "all-reduced", c_.grad->size());
    return;
  }
  throw AgreedError(fmt::format("parallel.dp_reduction = copy_engine: {}; use nccl", why));
#endif
}

bool Trainer::step_graphs_apply() const {
  // Dense data parallelism alone (one rank included): the forward and backward enqueue nothing that depends
  // on values read back (MoE routes on the host), and their collectives, the gradient reductions, are the
  // same ranges in the same order whatever the step's shapes, so each rank may replay, capture or launch
  // eagerly on its own. (Model parallelism exchanges activations sized by the step. A gathered embedding
  // gradient, parallel.dp_embedding_grad, gathers sizes agreed over DP, part of the graph's signature.)
  // NDT_CUDA_GRAPHS=0 turns them off like train.cuda_graphs=false (A/B runs).
  const char* graphs_env = std::getenv("NDT_CUDA_GRAPHS");
  const bool graphs = cfg_.train.cuda_graphs && !(graphs_env && std::string(graphs_env) == "0");
  const bool dp_only = c_.world->size() == c_.grad->size() && c_.cp->size() == 1 && c_.ep_hooks == nullptr;
  const bool dp_graphable = c_.world->size() == 1 || opt_->overlaps_reduction();
  return cfg_.train.device == "cuda" && graphs && dp_only && dp_graphable && !cfg_.model.moe.enabled();
}

void Trainer::setup_embedding_grad() {
  const std::string& mode = cfg_.parallel.dp_embedding_grad;
  if (c_.grad->size() == 1 || mode == "all_reduce") return;
  std::string why;  // why this layout cannot gather (the same on every rank)
  if (!opt_->can_reduce_early())
    why = "ZeRO-1 reduce-scatters the gradients after the backward on this backend (CPU)";
  else if (cfg_.model.tied() && c_.pp->size() > 1)  // (every rank decides alike, not only the table's)
    why = "the table is tied to the output head of another pipeline stage";
  if (!why.empty()) {
    if (mode == "gather")
      throw AgreedError(fmt::format("parallel.dp_embedding_grad = gather: {}; use auto or all_reduce", why));
    return;
  }
  if (mode == "auto") {
    // Measured (docs/performance.md, 2026-11-27): a tied table gains nothing (its head part is reduced
    // anyway, only earlier, and the compute beside it slows as much), an untied one loses its reduction,
    // which pays where the gathers move at most half its bytes.
    // Where steps replay from CUDA graphs the all-reduce was faster (the 1B Llama's dp2 on 2 x H200, both
    // graphed: 211.4 and 212.2 ms all-reduced against 214.1 and 215.0 gathered).
    const ModelConfig& m = cfg_.model;
    if (!opt_->overlaps_reduction() || m.tied() || step_graphs_apply()) return;  // (CPU: no overlap to gain)
    const int64_t rows = (microbatch_token_budget() + c_.cp->size() - 1) / c_.cp->size();
    const int64_t per_rank = cfg_.train.global_batch / c_.dp->size(), mbs = rows_per_microbatch();
    const int64_t microbatches = std::max<int64_t>(1, (per_rank + mbs - 1) / mbs);
    const int64_t dx_bytes = engine_->params().compute_dtype() == DType::BF16 ? 2 : 4;
    if (!gather_beats_reduction(c_.grad->size(), microbatches, rows, m.vocab_size / c_.tp->size(), m.d_model,
                                dx_bytes, cfg_.parallel.zero1))
      return;
  }
  embedding_grad_ = std::make_unique<GatheredEmbeddingGrad>(*c_.grad);
}

void Trainer::set_companion(StepCompanion* c) {
  companion_ = c;
  engine_->set_embed_hooks(c ? c->embed_hooks() : nullptr);
}

PackLayout Trainer::pack_layout_() const {
  return pack_layout(c_.cp->size(), c_.tp->size(), cfg_.parallel.sequence_parallel, cfg_.data.seq_len);
}

std::vector<Microbatch> Trainer::local_microbatches(int64_t step) const {
  const int64_t gb = cfg_.train.global_batch, dp = c_.dp->size();
  const int64_t per_rank = gb / dp;
  std::vector<Sample> samples;
  for (int64_t i = 0; i < per_rank; ++i) {
    const int64_t j = c_.dp->rank() * per_rank + i;  // position in the global batch
    samples.push_back(  // (the model's microbatches take tokens; a second module fetches its own inputs)
        train_.get_tokens(sample_index(cfg_.data.seed, step, j, gb, train_.size(), cfg_.data.shuffle)));
  }
  return microbatches(samples);
}

std::vector<Microbatch> Trainer::microbatches(const std::vector<Sample>& samples, int64_t group) const {
  const int64_t n = static_cast<int64_t>(samples.size());
  const int64_t mbs = rows_per_microbatch();
  NDT_CHECK(n % group == 0, "{} samples do not form groups of {}", n, group);
  std::vector<Microbatch> out;
  if (!cfg_.data.packing) {  // every sample padded to seq_len, micro_batch samples per microbatch
    NDT_CHECK(mbs % group == 0, "train.micro_batch ({}) must be a multiple of {} (samples that share a loss)",
              mbs, group);
    const int64_t items = n / group, per_mb = mbs / group;
    int64_t count = (items + per_mb - 1) / per_mb;
    bool spread = false;
    if (c_.ep_hooks && c_.dp->size() > 1) {
      // Expert parallelism couples the DP replicas in every MoE layer: all of them run the same number of
      // microbatches, the largest any of them needs (post-training blocks of rollouts or pairs can differ by
      // one sample). A rank that needs fewer spreads its samples evenly over that many (each chunk stays
      // within micro_batch), with pad-only microbatches where it has fewer samples than microbatches.
      int64_t m = count;
      c_.dp->all_reduce(&m, 1, DType::I64, ReduceOp::Max);
      spread = m != count;
      count = m;
    }
    for (int64_t c = 0; c < count; ++c) {
      const int64_t first = group * (spread ? c * items / count : c * per_mb),
                    last = group * (spread ? (c + 1) * items / count : std::min(items, (c + 1) * per_mb));
      if (first == last) {
        out.push_back(pack_samples({}, tok_.pad_id(), pack_layout_()));
        continue;
      }
      out.push_back(make_microbatch({samples.begin() + first, samples.begin() + last}, cfg_.data.seq_len,
                                    tok_.pad_id()));
      for (int64_t& id : out.back().sample_ids) id += first;
    }
    return out;
  }
  // Packed: the same samples, grouped by the packing policy under the token budget (data/packing.h); a
  // group of samples (a DPO pair) is packed as one item so that it shares a microbatch.
  const PackLayout layout = pack_layout_();
  std::vector<int64_t> lengths;
  for (int64_t g = 0; g < n; g += group) {
    int64_t len = 0;
    for (int64_t i = g; i < g + group; ++i) len += packed_length(samples[static_cast<size_t>(i)], layout);
    lengths.push_back(len);
  }
  const int64_t budget = microbatch_token_budget();
  auto bins = pack_into_microbatches(lengths, budget, pack_count_multiple_);
  if (c_.ep_hooks && c_.dp->size() > 1) {
    // Expert parallelism couples the DP replicas in every MoE layer: all of them run the same number of
    // microbatches (the largest any of them needs).
    int64_t m = static_cast<int64_t>(bins.size());
    c_.dp->all_reduce(&m, 1, DType::I64, ReduceOp::Max);
    if (m != static_cast<int64_t>(bins.size()))
      bins = pack_into_microbatches(lengths, budget, pack_count_multiple_, m);
  }
  for (const auto& bin : bins) {
    std::vector<Sample> items;
    std::vector<int64_t> ids;
    for (int64_t b : bin)
      for (int64_t i = b * group; i < (b + 1) * group; ++i) {
        items.push_back(samples[static_cast<size_t>(i)]);
        ids.push_back(i);
      }
    out.push_back(pack_samples(items, tok_.pad_id(), layout));
    for (int64_t& id : out.back().sample_ids)
      if (id >= 0) id = ids[static_cast<size_t>(id)];
  }
  return out;
}

StepStats Trainer::train_step(int64_t step) {
  launch_step(step);
  const std::string error = collect_steps();
  if (!error.empty()) throw AgreedError(error);
  NDT_CHECK(!ready_.empty(), "step {}: no statistics", step);
  StepStats st = ready_.back();
  ready_.clear();
  return st;
}

void Trainer::launch_step(int64_t step) {
  apply_process_faults(faults_, step, c_.world->rank(),
                       cfg_.train.device == "cuda");  // (reliability tests; none unless configured)
  const auto t0 = std::chrono::steady_clock::now();
  StepStats st = step_on(step, local_microbatches(step), nullptr, t0);
  if (pending_.empty() || pending_.back().step != step) ready_.push_back(std::move(st));
}

bool Trainer::defers(const TokenLoss* token_loss, bool tracing, bool profiling) const {
  return deferred_ && !token_loss && !companion_ && !grads_hook_ && !tracing && !profiling &&
         engine_->moe_layers().empty();
}

StepStats Trainer::train_step_on(int64_t step, const std::vector<Microbatch>& mbs, TokenLoss& loss) {
  return step_on(step, mbs, &loss, std::chrono::steady_clock::now());
}

StepStats Trainer::step_on(int64_t step, const std::vector<Microbatch>& mbs, TokenLoss* token_loss,
                           std::chrono::steady_clock::time_point t0) {
  // Loss-bearing tokens, real sequences and real tokens of the whole global batch, known before any
  // backward (the normalisers of the loss and of the MoE balancing losses).
  int64_t counts[3] = {0, 0, 0};
  for (const auto& mb : mbs) {
    counts[0] += mb.num_loss_tokens;
    counts[1] += mb.num_real_seqs();
    counts[2] += mb.num_real_tokens();
  }
  // Full microbatches: every CP rank of a replica holds the same ones, so DP alone sums the global count
  // (the same as summing each CP shard's count over DP x CP).
  c_.dp->all_reduce(counts, 3, DType::I64, ReduceOp::Sum);
  const int64_t n_tokens = counts[0];
  std::vector<int64_t> gather_signature;
  if (embedding_grad_) {
    // The gathers' plan, agreed over DP (each CP rank holds 1/cp of every microbatch): one per microbatch
    // when every replica runs as many, sized by the longest microbatch; else one, sized by the largest sum.
    const int64_t m = static_cast<int64_t>(mbs.size());
    int64_t plan[4] = {m, -m, 0, 0};  // max count, -min count, longest microbatch, largest sum
    for (const auto& mb : mbs) {
      plan[2] = std::max(plan[2], mb.num_tokens());
      plan[3] += mb.num_tokens();
    }
    c_.dp->all_reduce(plan, 4, DType::I64, ReduceOp::Max);
    const bool per_microbatch = plan[0] == -plan[1];
    const int64_t cp = c_.cp->size();
    const int64_t rows = ((per_microbatch ? plan[2] : plan[3]) + cp - 1) / cp;
    embedding_grad_->set_step(rows, per_microbatch);
    gather_signature = {rows, per_microbatch ? 1 : 0};  // (a replay never gathers sizes the others dropped)
  }
  NDT_CHECK(n_tokens > 0, "step {}: the global batch has no loss-bearing tokens", step);
  const float scale = 1.0f / static_cast<float>(n_tokens);

  const bool tracing = !trace_path_.empty() && step >= 1 && step <= 3;
  bool profiling = false;
#ifdef NDT_HAVE_CUDA
  profiling = cuda::profiling_enabled();
#endif
  const bool defer = defers(token_loss, tracing, profiling);
  if (!defer && !pending_.empty()) {  // (a step that waits: the ones in flight first)
    const std::string error = collect_steps();
    if (!error.empty()) throw AgreedError(error);
  }
  if (defer) deferred_->begin_step(opt_->steps_taken(), consecutive_skips_);
  const double t0_us =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
  // A replayed step zeroes the gradients inside its graph.
  const bool graphed = graph_ && !token_loss && !companion_ && !tracing && !profiling;
  if (!graphed) {
    phase_mark(engine_->params().device(), "zero grads");
    engine_->params().zero_grad();
    phase_mark(engine_->params().device(), "other");
  }
  if (companion_) {
    NDT_CHECK(token_loss == nullptr, "post-training steps do not take a second module (multimodal) yet");
    companion_->begin_step(step);  // phase 1: encoder forward, bridged to this rank's samples
  }
  engine_->begin_moe_step(static_cast<double>(counts[1]), static_cast<double>(counts[2]));
  double loss_sum = 0;
  if (graphed) {
    bool ran = false;
    const auto work = [&](const std::vector<Microbatch>& dev) {
      opt_->discard_early();  // (what a failed capture of this step left)
      engine_->params().zero_grad();
      engine_->train(dev, scale, nullptr, t0_us, nullptr);
      // DP: the reductions started under the backward end inside the work (a capture must join them);
      // a replay skips this host code, so the ranges it reduced are kept for reduce_grads.
      opt_->join_early();
      graph_early_ranges_ = opt_->early_ranges();
      ran = true;
    };
    graph_->run(mbs, scale, work, gather_signature);
    if (!ran) opt_->set_early_ranges(graph_early_ranges_);
    report_graph(step);
  } else {
    loss_sum = engine_->train(mbs, scale, tracing ? &trace_ : nullptr, t0_us, token_loss);
  }
  engine_->end_moe_step();
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (step > 0) {  // step 0 includes one-time allocation
    compute_s_ += engine_->last_compute_seconds();
    step_s_ += engine_->last_span_seconds() > 0 ? engine_->last_span_seconds() : wall;
  }
  theory_bubble_ = engine_->theoretical_bubble(static_cast<int>(mbs.size()));
  engine_->sync_tied_grads();
  if (companion_) companion_->finish_backward();  // phase 3: encoder backward
  if (auto v = fault_value(faults_, /*grad=*/true, step, c_.world->rank())) {
    // After backward, before the reduction: element 0 of the first local parameter's gradient.
    engine_->params().all().front()->grad.view_at(0, {1}).copy_from(Tensor::full({1}, *v));
  }
  phase_mark(engine_->params().device(), "grad reduce, norm");
  StepStats st;
  st.step = step;
  st.tokens = n_tokens;
  st.lr = lr_at(step, cfg_.train.steps, cfg_.train.warmup_steps, cfg_.train.lr, cfg_.train.min_lr);
  if (defer) {
    finish_on_device(std::move(st));
    return pending_.back();
  }
  const std::optional<bool> local_grads_finite = opt_->local_grads_finite();
  st.grad_norm = opt_->reduce_grads();
  // Both modules' gradients are reduced only now, after phase 3, and clipped by their joint norm.
  if (companion_) st.grad_norm = std::hypot(st.grad_norm, companion_->reduce_grads());
  // The loss is read only now: the norm's read-back above has waited for the device already.
  loss_sum += engine_->take_loss();
  if (auto v = fault_value(faults_, /*grad=*/false, step, c_.world->rank())) loss_sum = *v;
  const double local_loss = loss_sum;
  c_.pp->all_reduce(&loss_sum, 1, DType::F64, ReduceOp::Sum);    // only the last stage holds a loss
  c_.grad->all_reduce(&loss_sum, 1, DType::F64, ReduceOp::Sum);  // each CP rank holds its shard's part
  st.loss = token_loss ? loss_sum : loss_sum / static_cast<double>(n_tokens);  // token losses normalise
  if (grads_hook_) grads_hook_(step);
  // Non-finite loss or gradients: the same decision on every rank of the world (docs/reliability.md).
  if (const std::string bad = check_nonfinite(local_loss, st.loss, st.grad_norm, local_grads_finite);
      !bad.empty()) {
    if (const std::string error = skip_nonfinite(step, bad); !error.empty()) throw AgreedError(error);
    st.skipped = true;
  } else {
    consecutive_skips_ = 0;
    phase_mark(engine_->params().device(), "optimizer");
    opt_->clip_grads(st.grad_norm, cfg_.train.grad_clip);
    opt_->step(st.lr);
    if (companion_) companion_->clip_and_step(st.grad_norm, cfg_.train.grad_clip, st.lr);
  }
  phase_mark(engine_->params().device(), "other");
  st.skipped_steps = skipped_steps_;
  if (const auto moe = engine_->moe_layers(); !moe.empty())
    st.moe = finish_moe_step(cfg_, moe, *c_.grad, *c_.tp, *c_.pp, /*update_bias=*/!st.skipped);
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  note_peak_memory(st);
  gather_peak_memory({&st});
  history_.push_back(st);
  return st;
}

void Trainer::note_peak_memory(StepStats& st) const {
#ifdef NDT_HAVE_CUDA
  if (engine_->params().device() == Device::CUDA) {
    st.peak_mem_gib_per_rank.assign(static_cast<size_t>(c_.world->size()), 0.0);
    st.peak_mem_gib_per_rank[static_cast<size_t>(c_.world->rank())] = cuda::memory_stats().peak_allocated_gib;
  }
#endif
}

void Trainer::gather_peak_memory(const std::vector<StepStats*>& steps) {
  // Every rank fills its own slots; one sum over the world gathers them (host buffers: over MPI).
  const size_t n = static_cast<size_t>(c_.world->size());
  std::vector<double> all;
  for (StepStats* st : steps)
    if (st->peak_mem_gib_per_rank.size() == n)
      all.insert(all.end(), st->peak_mem_gib_per_rank.begin(), st->peak_mem_gib_per_rank.end());
  if (all.empty()) return;
  c_.world->all_reduce(all.data(), static_cast<int64_t>(all.size()), DType::F64, ReduceOp::Sum);
  size_t at = 0;
  for (StepStats* st : steps) {
    if (st->peak_mem_gib_per_rank.size() != n) continue;
    std::copy(all.begin() + static_cast<std::ptrdiff_t>(at),
              all.begin() + static_cast<std::ptrdiff_t>(at + n), st->peak_mem_gib_per_rank.begin());
    at += n;
    st->peak_mem_gib = *std::max_element(st->peak_mem_gib_per_rank.begin(), st->peak_mem_gib_per_rank.end());
  }
}

void Trainer::report_graph(int64_t step) {
  // (Each DP rank decides on its own: rank 0 tells its captures, any rank its failures.)
  if (graph_->just_captured() && c_.world->rank() == 0) {
    std::printf(
        "cuda graphs: step %lld's forward and backward captured; steps of the same shape replay them\n",
        static_cast<long long>(step));
    std::fflush(stdout);
  }
  if (!graph_->failure().empty() && graph_->failure() != graph_failure_told_) {
    graph_failure_told_ = graph_->failure();
    std::printf("cuda graphs: rank %d: step %lld could not be captured and ran eagerly: %s\n",
                c_.world->rank(), static_cast<long long>(step), graph_failure_told_.c_str());
    std::fflush(stdout);
  }
}

std::string Trainer::skip_nonfinite(int64_t step, const std::string& bad) {
  const TrainConfig& tc = cfg_.train;
  if (tc.nonfinite == "stop")
    return fmt::format("non-finite values at step {} (train.nonfinite = stop): {}", step, bad);
  ++skipped_steps_;
  ++consecutive_skips_;
  if (consecutive_skips_ >= tc.max_consecutive_skips)
    return fmt::format(
        "{} consecutive steps skipped for non-finite values (train.max_consecutive_skips = {}); the last, "
        "step {}: {}",
        consecutive_skips_, tc.max_consecutive_skips, step, bad);
  if (c_.world->rank() == 0) {
    std::printf(
        "step %lld skipped (train.nonfinite = skip; weights and optimizer state unchanged): %s [%lld in "
        "a row, %lld in total]\n",
        static_cast<long long>(step), bad.c_str(), static_cast<long long>(consecutive_skips_),
        static_cast<long long>(skipped_steps_));
    std::fflush(stdout);
  }
  return {};
}

std::string Trainer::check_nonfinite(double local_loss, double loss, double grad_norm,
                                     std::optional<bool> local_grads_finite) {
  // kGrad: this rank owns a non-finite reduced gradient; kNorm: the global norm is non-finite.
  enum : int32_t { kLocalLoss = 1, kLoss = 2, kLocalGrad = 4, kGrad = 8, kNorm = 16 };
  // The norm is summed over every shard of every parameter: NaN or Inf on every rank when any gradient is.
  const int64_t first = std::isfinite(grad_norm) ? -1 : opt_->first_nonfinite_grad();
  int32_t flags = (std::isfinite(local_loss) ? 0 : kLocalLoss) | (std::isfinite(loss) ? 0 : kLoss) |
                  (local_grads_finite.value_or(true) ? 0 : kLocalGrad) | (first < 0 ? 0 : kGrad) |
                  (std::isfinite(grad_norm) ? 0 : kNorm);
  Communicator& w = *c_.world;
  int32_t any = flags;
  w.all_reduce(&any, 1, DType::I32, ReduceOp::Max);  // the one collective of a finite step
  if (any == 0) return {};
  // Failure path: who saw what, and the first bad parameter over the world with its name.
  std::vector<int32_t> all(static_cast<size_t>(w.size()));
  w.all_gather(&flags, all.data(), 1, DType::I32);
  const std::vector<int64_t> keys = global_order_keys(engine_->params(), cfg_.model.n_layers);
  constexpr int64_t kNone = std::numeric_limits<int64_t>::max();
  const int64_t key = first >= 0 ? keys[static_cast<size_t>(first)] : kNone;
  int64_t min_key = key;
  w.all_reduce(&min_key, 1, DType::I64, ReduceOp::Min);
  std::string name;
  if (min_key != kNone) {
    int32_t owner = key == min_key ? w.rank() : std::numeric_limits<int32_t>::max();
    w.all_reduce(&owner, 1, DType::I32, ReduceOp::Min);
    if (w.rank() == owner) name = engine_->params().all()[static_cast<size_t>(first)]->name;
    int64_t len = static_cast<int64_t>(name.size());
    w.broadcast(&len, 1, DType::I64, owner);
    std::vector<int32_t> chars(name.begin(), name.end());
    chars.resize(static_cast<size_t>(len));
    w.broadcast(chars.data(), len, DType::I32, owner);
    name.assign(chars.begin(), chars.end());
  }
  auto ranks = [&](int32_t bit) {
    std::string out;
    for (size_t r = 0; r < all.size(); ++r)
      if (all[r] & bit) out += (out.empty() ? "" : ",") + std::to_string(r);
    return out;
  };
  std::string msg;
  if (!ranks(kGrad).empty() || !ranks(kNorm).empty()) {
    msg = name.empty() ? fmt::format("non-finite gradient norm on rank(s) {}", ranks(kNorm))
                       : fmt::format(
                             "non-finite gradient in '{}' (the first parameter, in registration order, "
                             "with a non-finite gradient)",
                             name);
    if (!name.empty()) msg += fmt::format(" on rank(s) {} after the reduction", ranks(kGrad));
    if (!ranks(kLocalGrad).empty())
      msg +=
          fmt::format("; local gradients non-finite before the reduction on rank(s) {}", ranks(kLocalGrad));
  }
  if (!ranks(kLoss).empty() || !ranks(kLocalLoss).empty()) {
    if (!msg.empty()) msg += "; ";
    msg += fmt::format("non-finite loss on rank(s) {} after the reduction", ranks(kLoss));
    if (!ranks(kLocalLoss).empty())
      msg += fmt::format(" (local loss non-finite before the reduction on rank(s) {})", ranks(kLocalLoss));
    if (ranks(kGrad).empty() && ranks(kNorm).empty()) msg += "; gradients finite";
  }
  return msg;
}

std::vector<SampleScores> Trainer::score(const std::vector<Sample>& samples, int64_t k) {
  if (companion_) companion_->prepare_scoring(samples);
  return score_samples(*engine_, samples, k, pack_layout_(), tok_.pad_id(), *c_.dp, rows_per_microbatch(),
                       lockstep());
}

EvalStats Trainer::evaluate() {
  EvalStats ev;
  const PackLayout layout = pack_layout_();
  if (cfg_.data.task == "addition") {
    auto problems =
        addition_eval_problems(cfg_.data.addition_digits, cfg_.data.seed, cfg_.train.eval_samples, tok_);
    ev.problems = static_cast<int64_t>(problems.size());
    ArgmaxFn fn = [this](const Microbatch& mb, const std::vector<int64_t>& rows) {
      return engine_->argmax(mb, rows);
    };
    ev.exact_match =
        exact_match(fn, tok_, problems, cfg_.data.addition_digits + 2, *c_.dp, layout, lockstep());
  }
  if (companion_) {
    ArgmaxFn fn = [this](const Microbatch& mb, const std::vector<int64_t>& rows) {
      return engine_->argmax(mb, rows);
    };
    if (auto em = companion_->exact_match(fn)) std::tie(ev.exact_match, ev.problems) = *em;
  }
  if (val_ && !companion_) {  // (a second module's inputs exist only for its own problems and batches)
    // Forward passes of a training microbatch: a whole per-rank batch (GPT-2's preset: 32 x 16 rows of
    // 1024 tokens) would not fit where training does.
    ev.val_loss = validation_loss([this](const Microbatch& mb) { return engine_->loss_sum(mb); }, *val_,
                                  cfg_.train.eval_samples, cfg_.data.seq_len, tok_.pad_id(),
                                  rows_per_microbatch(), *c_.dp, layout, lockstep());
  }
  evals_.push_back(ev);
  return ev;
}

}  // namespace ndt
