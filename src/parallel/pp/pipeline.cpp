#include "parallel/pp/pipeline.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <limits>

#include "ops/ops.h"
#include "parallel/cp/cp_shard.h"
#ifdef NDT_HAVE_CUDA
#include "cuda/runtime.h"
#endif

namespace ndt {
namespace {

constexpr int kTagAct = 1, kTagGrad = 2;

double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

Result<std::vector<int64_t>> stage_boundaries(const ParallelConfig& par, int64_t n_layers) {
  const int64_t S = par.pp * par.virtual_stages;
  std::vector<int64_t> b{0};
  if (par.stage_layers.empty()) {
    if (n_layers % S != 0)
      return Status::error(
          fmt::format("{} layers do not split evenly into pp={} x virtual_stages={} stages; set "
                      "parallel.stage_layers for an uneven split",
                      n_layers, par.pp, par.virtual_stages));
    for (int64_t s = 1; s <= S; ++s) b.push_back(s * (n_layers / S));
    return b;
  }
  std::string item;
  for (size_t i = 0; i <= par.stage_layers.size(); ++i) {
    const char ch = i < par.stage_layers.size() ? par.stage_layers[i] : ',';
    if (ch != ',') {
      item += ch;
      continue;
    }
    char* end = nullptr;
    const long long n = std::strtoll(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || n < 1)
      return Status::error(fmt::format("parallel.stage_layers '{}': '{}' is not a positive layer count",
                                       par.stage_layers, item));
    b.push_back(b.back() + n);
    item.clear();
  }
  if (static_cast<int64_t>(b.size()) - 1 != S || b.back() != n_layers)
    return Status::error(
        fmt::format("parallel.stage_layers '{}' lists {} stages with {} layers; the layout has "
                    "pp={} x virtual_stages={} = {} stages and the model {} layers",
                    par.stage_layers, b.size() - 1, b.back(), par.pp, par.virtual_stages, S, n_layers));
  return b;
}

PipelineEngine::PipelineEngine(const Config& cfg, Communicator& pp, TpHooks* tp, Communicator* cp,
                               EpHooks* ep)
    : cfg_(cfg),
      pp_(pp),
      tp_(tp),
      cp_(cp && cp->size() > 1 ? cp : nullptr),
      p_(pp.size()),
      v_(static_cast<int>(cfg.parallel.virtual_stages)),
      rank_(pp.rank()) {
  const int64_t S = static_cast<int64_t>(p_) * v_;
  NDT_CHECK(cfg_.parallel.pp == p_, "pipeline communicator has {} ranks, parallel.pp is {}", p_,
            cfg_.parallel.pp);
  const std::vector<int64_t> b = stage_boundaries(cfg_.parallel, cfg_.model.n_layers).value();
  for (int c = 0; c < v_; ++c) {
    const int64_t s = stage_of(c);
    StageSpec spec{b[static_cast<size_t>(s)], b[static_cast<size_t>(s) + 1], s == 0, s == S - 1};
    chunks_.push_back(std::make_unique<Transformer>(cfg_.model, spec, tp_, &store_, ep));
    chunks_.back()->set_moe_context(&moe_ctx_);
  }
  if (cp_) {
    cp_attention_ = std::make_unique<CpAttention>(*cp_, cfg_.parallel.cp_attention == "allgather"
                                                            ? CpAttention::Mode::AllGather
                                                            : CpAttention::Mode::Ring);
    for (auto& c : chunks_) c->set_cp(cp_attention_.get());
  }
  const bool tied = cfg_.model.tied() && p_ > 1;
  if (tied) {
    tied_ = pp_.subgroup({0, p_ - 1});
    // The last stage's copy of the tied table is the same parameter: count it once in the norm.
    if (rank_ == p_ - 1) store_.get("embed.tokens.weight").count_in_norm = false;
  }
}

Microbatch PipelineEngine::shard(const Microbatch& full) const {
  return cp_ ? cp_shard(full, cp_->size(), cp_->rank()) : full;
}

int64_t PipelineEngine::local_tokens(const Microbatch& mb) const {
  const int64_t T = mb.num_tokens();
  return (tp_ && tp_->sequence_parallel()) ? T / tp_->size() : T;
}

void PipelineEngine::connect_peers() {
  // NCCL opens a point-to-point connection at the first send/recv between two ranks, and the host call
  // blocks until the peer joins it. A schedule's first contacts happen at different points on different
  // ranks (the interleaved ring's p-1 -> 0 edge much later than 0 -> 1); a rank waiting to connect while
  // its peer waits on the GPU for that rank's earlier work deadlocked pp4 interleaved on GPUs. So every
  // rank connects to both ring neighbours at once, before the first schedule.
  if (peers_connected_ || p_ == 1) return;
  peers_connected_ = true;
  const int next = (rank_ + 1) % p_, prev = (rank_ + p_ - 1) % p_;
  Tensor out = Tensor::zeros({2}, DType::F32, store_.device()),
         in = Tensor::zeros({2}, DType::F32, store_.device());
  float* o = out.f32();
  float* i = in.f32();
  pp_.batch_p2p({{P2POp::Send, o, 1, DType::F32, next, kTagAct},
                 {P2POp::Recv, i, 1, DType::F32, prev, kTagAct},
                 {P2POp::Send, o + 1, 1, DType::F32, prev, kTagGrad},
                 {P2POp::Recv, i + 1, 1, DType::F32, next, kTagGrad}});
}

Tensor PipelineEngine::act_buffer(int64_t rows) const {
  return Tensor::empty({rows, cfg_.model.d_model}, store_.compute_dtype(), store_.device());
}

std::pair<int64_t, int64_t> PipelineEngine::layer_range(int64_t l) {
  if (auto it = layer_ranges_.find(l); it != layer_ranges_.end()) return it->second;
  const std::string prefix = fmt::format("layers.{}.", l);
  int64_t b = std::numeric_limits<int64_t>::max(), e = 0, n = 0;
  for (const auto& p : store_.all()) {
    // Expert weights live in the store's expert region and reduce over their own group at the end.
    if (p->expert || p->name.rfind(prefix, 0) != 0) continue;
    b = std::min(b, store_.offset_of(*p));
    e = std::max(e, store_.offset_of(*p) + p->numel());
    n += p->numel();
  }
  const std::pair<int64_t, int64_t> r =
      n > 0 && e - b == n ? std::pair{b, e} : std::pair<int64_t, int64_t>{0, 0};
  return layer_ranges_[l] = r;
}

void PipelineEngine::report_ready(std::initializer_list<const char*> names, bool reduced) {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (const char* name : names)
    if (const Param* p = store_.find(name); p != nullptr && !p->expert && p->numel() > 0)
      ranges.emplace_back(store_.offset_of(*p), store_.offset_of(*p) + p->numel());
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 0; i < ranges.size();) {
    auto [b, e] = ranges[i];
    for (++i; i < ranges.size() && ranges[i].first == e; ++i) e = ranges[i].second;
    grads_ready_(b, e, reduced);
  }
}

void PipelineEngine::set_embedding_grad_hook(EmbeddingGradHook* hook) {
  NDT_CHECK(
      !hook || (!tied_ && grads_ready_),
      "a gathered embedding gradient needs the grads-ready hook, and the table and the head it is tied to "
      "on one pipeline stage");
  embedding_grad_ = hook;
}

std::vector<std::pair<int64_t, MoeLayer*>> PipelineEngine::moe_layers() {
  std::vector<std::pair<int64_t, MoeLayer*>> out;
  for (auto& c : chunks_)
    for (auto& [l, m] : c->moe_layers()) out.emplace_back(l, m.get());
  return out;
}

void PipelineEngine::begin_moe_step(double seqs, double tokens) {
  moe_ctx_.seqs = std::max(seqs, 1.0);
  moe_ctx_.tokens = std::max(tokens, 1.0);
  moe_ctx_.record = true;
  for (auto& [l, m] : moe_layers()) m->stats().clear(cfg_.model.moe.num_experts);
}

double PipelineEngine::theoretical_bubble(int m) const {
  return pp::theoretical_bubble(v_ > 1 ? "interleaved" : cfg_.parallel.schedule, p_, v_, m);
}

double PipelineEngine::train(const std::vector<Microbatch>& full_mbs, float loss_scale,
                             std::vector<pp::TraceEvent>* trace, double t0_us, TokenLoss* token_loss) {
  connect_peers();
  std::vector<Microbatch> mbs;
  for (const Microbatch& mb : full_mbs) mbs.push_back(shard(mb));
  const int m = static_cast<int>(mbs.size());
  const std::string kind = v_ > 1 ? "interleaved" : (p_ == 1 ? "1f1b" : cfg_.parallel.schedule);
  auto sched = pp::make_schedule(kind, p_, v_, m);
  sched.status().throw_if_error();
  const std::vector<pp::PpAction>& actions = sched.value()[static_cast<size_t>(rank_)];

  using Key = std::pair<int, int>;  // (microbatch, chunk)
  std::map<Key, Activations> acts;
  std::map<Key, Tensor> x_in, y_out, dy_in, dx_out, seeds;
  double loss = 0;
  // One buffer for the run (a captured step adds into it at a fixed address), zeroed on the stream.
  if (!loss_acc_.defined()) loss_acc_ = Tensor::zeros({1}, DType::F64, store_.device());
  loss_acc_.zero_();
  compute_s_ = span_s_ = 0;
  const bool gpu_timed = store_.device() == Device::CUDA && p_ > 1;
#ifdef NDT_HAVE_CUDA
  if (gpu_timed) {
    if (!gpu_clock_) gpu_clock_ = std::make_shared<cuda::IntervalClock>();
    gpu_clock_->start();
  }
  auto gpu_clock = [&](bool begin) {
    if (gpu_timed) begin ? gpu_clock_->begin() : gpu_clock_->end();
  };
#else
  auto gpu_clock = [](bool) {};
#endif
  auto buffer_for = [&](const pp::PpAction& a) -> Tensor& {
    const Key k{a.microbatch, a.chunk};
    switch (a.kind) {
      case pp::PpAction::SendAct:
        return y_out.at(k);
      case pp::PpAction::SendGrad:
        return dx_out.at(k);
      case pp::PpAction::RecvAct:
        return x_in[k] = act_buffer(local_tokens(mbs[a.microbatch]));
      default:
        return dy_in[k] = act_buffer(local_tokens(mbs[a.microbatch]));
    }
  };
  auto record = [&](const pp::PpAction& a, double start) {
    if (trace)
      trace->push_back({pp_.world_ranks()[rank_], pp::to_string(a), start - t0_us, now_us() - start});
  };

  std::map<int, size_t> last_backward;  // chunk -> index of its last backward action (grads final after it)
  for (size_t i = 0; i < actions.size(); ++i)
    if (actions[i].kind == pp::PpAction::Backward) last_backward[actions[i].chunk] = i;

  for (size_t i = 0; i < actions.size();) {
    const pp::PpAction& a = actions[i];
    const double start = now_us();
    if (a.is_compute()) {
      gpu_clock(true);
      const Key k{a.microbatch, a.chunk};
      Transformer& model = *chunks_[static_cast<size_t>(a.chunk)];
      const Microbatch& mb = mbs[static_cast<size_t>(a.microbatch)];
      if (a.kind == pp::PpAction::Forward) {
        Tensor in = stage_of(a.chunk) == 0 ? Tensor() : x_in.at(k);
        acts[k].loss_in_backward = is_last(a.chunk) && !token_loss;
        y_out[k] = model.forward(mb, in, acts[k]);
        if (is_last(a.chunk) && !acts[k].loss_in_backward) {
          if (token_loss) {
            const Tensor lp = ops::to_host_f32(acts[k].logprob);
            std::vector<float> logprob(lp.f32(), lp.f32() + lp.numel()), dloss(logprob.size(), 0.0f);
            loss += token_loss->seed(mb, logprob, dloss);
            seeds[k] = Tensor::from_vector(dloss, {static_cast<int64_t>(dloss.size())});
          } else {
            model.add_loss_sum(loss_acc_, mb, acts[k]);
          }
        }
        x_in.erase(k);
      } else {
        Tensor dy = is_last(a.chunk) ? Tensor() : dy_in.at(k);
        const bool last = grads_ready_ && last_backward[a.chunk] == i;
        const StageSpec& sp = model.stage();
        // Every microbatch's table gradient goes through the gathering hook; a tied table's (the head's
        // part) is reduced after the last microbatch's head backward, an untied one needs no reduction.
        const bool gathered = embedding_grad_ && sp.has_embedding;
        const bool tied_here = cfg_.model.tied() && sp.has_head;
        if (last)
          model.set_layer_done_hook([this](int64_t l) {
            const auto [b, e] = layer_range(l);
            if (e > b) grads_ready_(b, e, false);
          });
        if (last && sp.has_head)
          model.set_head_done_hook([this, gathered, tied_here] {
            report_ready({"final_norm.weight", "final_norm.bias", "lm_head.weight"}, false);
            if (gathered && tied_here) report_ready({"embed.tokens.weight"}, false);
          });
        if (gathered) model.set_embedding_grad_hook(embedding_grad_);
        auto seed = seeds.find(k);
        dx_out[k] =
            model.backward(mb, dy, loss_scale, acts.at(k), seed == seeds.end() ? nullptr : &seed->second);
        if (seed != seeds.end()) seeds.erase(seed);
        if (acts.at(k).loss_in_backward) model.add_loss_sum(loss_acc_, mb, acts.at(k));
        model.set_embedding_grad_hook(nullptr);
        if (last) {
          model.set_layer_done_hook(nullptr);
          model.set_head_done_hook(nullptr);
          if (gathered) {
            embedding_grad_->finish();
            if (!tied_here) report_ready({"embed.tokens.weight"}, true);
          }
        }
        acts.erase(k);  // activations die with their backward (1F1B's memory bound)
        y_out.erase(k);
        dy_in.erase(k);
      }
      gpu_clock(false);
      compute_s_ += (now_us() - start) * 1e-6;
      record(a, start);
      ++i;
      continue;
    }
    // Communication: one action, or a run of actions sharing a batch id, posted together.
    size_t j = i + 1;
    if (a.batch_id >= 0)
      while (j < actions.size() && !actions[j].is_compute() && actions[j].batch_id == a.batch_id) ++j;
    std::vector<P2POp> ops;
    std::vector<Key> sent_grads;
    for (size_t q = i; q < j; ++q) {
      const pp::PpAction& c = actions[q];
      Tensor& buf = buffer_for(c);
      const bool act = c.kind == pp::PpAction::SendAct || c.kind == pp::PpAction::RecvAct;
      ops.push_back({c.is_send() ? P2POp::Send : P2POp::Recv, buf.data_ptr(), buf.numel(), buf.dtype(),
                     c.peer, act ? kTagAct : kTagGrad});
      if (c.kind == pp::PpAction::SendGrad) sent_grads.push_back({c.microbatch, c.chunk});
    }
    pp_.batch_p2p(ops);
    for (const Key& k : sent_grads) dx_out.erase(k);
    for (size_t q = i; q < j; ++q) record(actions[q], start);
    i = j;
  }
#ifdef NDT_HAVE_CUDA
  if (gpu_timed) {
    const cuda::IntervalClock::Times t = gpu_clock_->collect();
    compute_s_ = t.busy_s;
    span_s_ = t.span_s;
  }
#endif
  (void)gpu_timed;
  return loss;
}

double PipelineEngine::take_loss() {
  // (No host flag of train()'s: a step replayed from a CUDA graph runs none of train()'s host code.)
  return loss_acc_.defined() ? loss_acc_.to_vector<double>()[0] : 0.0;
}

void PipelineEngine::sync_tied_grads() {
  if (!tied_) return;
  Param& w = store_.get("embed.tokens.weight");
  tied_->all_reduce(w.grad.data_ptr(), w.numel(), DType::F32, ReduceOp::Sum);
}

bool PipelineEngine::forward_only(const Microbatch& mb, Activations& last_acts, int* last_chunk) {
  connect_peers();
  const int S = p_ * v_;
  Tensor x;
  bool have_last = false;
  for (int s = 0; s < S; ++s) {
    const int owner = s % p_, c = s / p_;
    if (owner != rank_) continue;
    if (s > 0 && (s - 1) % p_ != rank_) {
      x = act_buffer(local_tokens(mb));
      pp_.recv(x.data_ptr(), x.numel(), x.dtype(), (s - 1) % p_, kTagAct);
    }
    Activations acts;
    x = chunks_[static_cast<size_t>(c)]->forward(mb, x, acts);
    if (s == S - 1) {
      last_acts = std::move(acts);
      *last_chunk = c;
      have_last = true;
    } else if ((s + 1) % p_ != rank_) {
      pp_.send(x.data_ptr(), x.numel(), x.dtype(), (s + 1) % p_, kTagAct);
    }
  }
  return have_last;
}

double PipelineEngine::loss_sum(const Microbatch& full) {
  const Microbatch mb = shard(full);
  Activations acts;
  int c = 0;
  double loss = forward_only(mb, acts, &c) ? chunks_[static_cast<size_t>(c)]->loss_sum(mb, acts) : 0.0;
  pp_.broadcast(&loss, 1, DType::F64, p_ - 1);
  if (cp_) cp_->all_reduce(&loss, 1, DType::F64, ReduceOp::Sum);
  return loss;
}

std::vector<int32_t> PipelineEngine::argmax(const Microbatch& full, const std::vector<int64_t>& rows) {
  const Microbatch mb = shard(full);
  // Under CP each rank answers the rows it holds (-1 elsewhere) and a max over CP combines them.
  std::vector<int64_t> local_rows;
  std::vector<size_t> which;
  if (cp_) {
    const std::vector<int64_t> mine = cp_rows(full, cp_->size(), cp_->rank());
    std::map<int64_t, int64_t> local_of;
    for (size_t i = 0; i < mine.size(); ++i) local_of[mine[i]] = static_cast<int64_t>(i);
    for (size_t i = 0; i < rows.size(); ++i)
      if (auto it = local_of.find(rows[i]); it != local_of.end()) {
        local_rows.push_back(it->second);
        which.push_back(i);
      }
  } else {
    local_rows = rows;
    for (size_t i = 0; i < rows.size(); ++i) which.push_back(i);
  }
  Activations acts;
  int c = 0;
  std::vector<int32_t> out(rows.size(), -1);
  if (forward_only(mb, acts, &c)) {
    const std::vector<int32_t> got = chunks_[static_cast<size_t>(c)]->argmax_rows(acts, local_rows);
    for (size_t i = 0; i < which.size(); ++i) out[which[i]] = got[i];
  }
  pp_.broadcast(out.data(), static_cast<int64_t>(out.size()), DType::I32, p_ - 1);
  if (cp_) cp_->all_reduce(out.data(), static_cast<int64_t>(out.size()), DType::I32, ReduceOp::Max);
  return out;
}

PipelineEngine::Scores PipelineEngine::scores(const Microbatch& full, int64_t k) {
  const Microbatch mb = shard(full);
  const int64_t T = full.num_tokens(), Tl = mb.num_tokens();
  std::vector<int64_t> rows(static_cast<size_t>(Tl));
  if (cp_)
    rows = cp_rows(full, cp_->size(), cp_->rank());
  else
    for (int64_t t = 0; t < Tl; ++t) rows[static_cast<size_t>(t)] = t;
  // Each rank writes its rows into zeroed full-size buffers; a sum over CP then assembles them.
  Scores sc;
  sc.logprob.assign(static_cast<size_t>(T), 0.0f);
  sc.topk_value.assign(static_cast<size_t>(T * k), 0.0f);
  std::vector<float> ids(static_cast<size_t>(T * k), 0.0f);  // ids < 2^24 travel exactly as floats
  Activations acts;
  int c = 0;
  if (forward_only(mb, acts, &c)) {
    std::vector<float> val;
    std::vector<int32_t> id;
    chunks_[static_cast<size_t>(c)]->topk_rows(acts, k, val, id);
    const Tensor logprob = ops::to_host_f32(acts.logprob);
    for (int64_t t = 0; t < Tl; ++t) {
      const auto g = static_cast<size_t>(rows[static_cast<size_t>(t)]);
      sc.logprob[g] = logprob.f32()[t];
      for (int64_t j = 0; j < k; ++j) {
        sc.topk_value[g * k + j] = val[static_cast<size_t>(t * k + j)];
        ids[g * k + j] = static_cast<float>(id[static_cast<size_t>(t * k + j)]);
      }
    }
  }
  for (std::vector<float>* buf : {&sc.logprob, &sc.topk_value, &ids}) {
    pp_.broadcast(buf->data(), static_cast<int64_t>(buf->size()), DType::F32, p_ - 1);
    if (cp_) cp_->all_reduce(buf->data(), static_cast<int64_t>(buf->size()), DType::F32, ReduceOp::Sum);
  }
  sc.topk_id.resize(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) sc.topk_id[i] = static_cast<int32_t>(ids[i]);
  return sc;
}

}  // namespace ndt
