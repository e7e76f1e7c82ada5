#include "generate/generator.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <map>

#include "core/check.h"
#include "generate/kv_cache.h"
#include "generate/sampler.h"
#include "model/transformer.h"
#include "ops/ops.h"
#include "parallel/tp/comm_tp_hooks.h"

#ifdef NDT_HAVE_CUDA
#include "cuda/runtime.h"
#endif
#ifdef NDT_HAVE_CUDA
#include "dist/device_communicator.h"
#endif

namespace ndt {

namespace {
// Requests decoded together per replica, and the cache rows (slots x length) one batch may hold.
constexpr int64_t kMaxBatch = 64;
constexpr int64_t kMaxCacheRows = 64 * 2048;
// Prompt tokens per prefill forward (its logits are (tokens, V/tp)); a longer prompt goes alone.
constexpr int64_t kPrefillTokens = 8192;

// A forward over new tokens: sequence s holds tokens[s] at positions first[s], first[s] + 1, ...
Microbatch cached_batch(const std::vector<const std::vector<int32_t>*>& tokens,
                        const std::vector<int64_t>& first) {
  std::vector<int32_t> tok, pos, cu{0};
  Microbatch mb;
  for (size_t s = 0; s < tokens.size(); ++s) {
    for (size_t i = 0; i < tokens[s]->size(); ++i) {
      tok.push_back((*tokens[s])[i]);
      pos.push_back(static_cast<int32_t>(first[s] + static_cast<int64_t>(i)));
    }
    cu.push_back(static_cast<int32_t>(tok.size()));
    mb.seq_real.push_back(pos.back() + 1);  // every row is real (absolute positions)
    mb.sample_ids.push_back(static_cast<int64_t>(s));
    mb.max_seqlen = std::max<int64_t>(mb.max_seqlen, pos.back() + 1);
  }
  const int64_t T = static_cast<int64_t>(tok.size());
  mb.tokens = Tensor::from_vector(tok, {T});
  mb.targets = Tensor::zeros({T}, DType::I32);  // unused: the forward's logprob of token 0 is discarded
  mb.loss_mask = Tensor::zeros({T}, DType::F32);
  mb.positions = Tensor::from_vector(pos, {T});
  mb.cu_seqlens = Tensor::from_vector(cu, {static_cast<int64_t>(cu.size())});
  mb.nseq = static_cast<int64_t>(tokens.size());
  return mb;
}

// One request being decoded.
struct Live {
  const GenRequest* req = nullptr;
  GenOutput out;
  bool done = false;
};
}  // namespace

struct Generator::Impl {
  Config cfg;
  Communicator& world;
  int64_t tp = 1, replicas = 1, replica = 0;
  std::unique_ptr<Communicator> tp_host;  // MPI group of the gen_tp consecutive ranks
  std::unique_ptr<Communicator> tp_dev;   // NCCL over it when the model lives on a GPU
  std::unique_ptr<CommTpHooks> hooks;
  std::unique_ptr<Transformer> model;

  Impl(const Config& c, Communicator& w) : cfg(c), world(w) {}

  // Full-vocabulary logits (n, V) of the given rows of the last forward, on the model's device, identical
  // on every TP rank: each rank writes its vocab block into a zeroed (tp, n, Vl) f32 buffer, the blocks are
  // summed over TP (adding zeros is exact; NCCL on the device under CUDA) and laid side by side.
  Tensor full_logits(const Activations& acts, const std::vector<int64_t>& rows) {
    const int64_t n = static_cast<int64_t>(rows.size()), Vl = model->local_vocab(), V = Vl * tp;
    Tensor mine = ops::gather_rows(acts.logits, rows);  // (n, Vl) on the model's device
    if (tp == 1) return mine;
    Tensor blocks = Tensor::zeros({tp, n, Vl}, DType::F32, mine.device());
    Tensor dst = blocks.view_at(hooks->rank() * n * Vl, {n, Vl});
    if (mine.dtype() == DType::F32)
      dst.copy_from(mine);
    else
      ops::cast_into(dst, mine);
    hooks->all_reduce_sum(blocks.f32(), blocks.numel());  // device buffer under NCCL, host under MPI
    Tensor out = Tensor::empty({n, V}, DType::F32, mine.device());
    for (int64_t r = 0; r < tp; ++r) {
      const float* src = blocks.f32() + r * n * Vl;
      float* d = out.f32() + r * Vl;
#ifdef NDT_HAVE_CUDA
      if (out.device() == Device::CUDA) {
        const size_t row = static_cast<size_t>(Vl) * sizeof(float);
        cuda::copy_d2d_2d(d, static_cast<size_t>(V) * sizeof(float), src, row, row, static_cast<size_t>(n));
        continue;
      }
#endif
      for (int64_t i = 0; i < n; ++i) std::copy_n(src + i * Vl, Vl, d + i * V);
    }
    return out;
  }

  // Runs the cached forward of `mb` for the given cache slots and samples the next token of each
  // sequence from its last row; updates the requests.
  void step(KvCache& cache, const Microbatch& mb, const std::vector<int64_t>& slots, std::vector<Live>& live,
            const SamplingParams& sp, int64_t gstep) {
    cache.begin(mb, slots);
    std::vector<int64_t> rows;
    for (int64_t s = 0; s < mb.nseq; ++s) rows.push_back(mb.cu_seqlens.i32()[s + 1] - 1);
    Activations acts;
    if (model->params().device() == Device::CPU) {
      model->forward(mb, Tensor(), acts);
    } else {
      // The forward's per-token metadata goes to the device once, now, while the device is idle (it waited
      // for the last step's tokens): an upload from pageable memory waits for the stream, so the ops'
      // own per-layer uploads would stall the host behind every layer and leave the GPU waiting for
      // launches.
      Microbatch dev = mb;
      dev.tokens = mb.tokens.to(model->params().device());
      dev.positions = mb.positions.to(model->params().device());
      dev.targets = mb.targets.to(model->params().device());
      model->forward(dev, Tensor(), acts);
    }
    // Sampled where the logits are (the device under CUDA: only n choices come back).
    const std::vector<double> u = uniforms(slots, live, sp, gstep);
    record(choose_tokens(full_logits(acts, rows), sp.temperature, sp.top_k, sp.top_p, u), slots, live, sp);
  }

  // The uniforms of the next token of each listed request (`ahead`: of the token after the one in flight).
  static std::vector<double> uniforms(const std::vector<int64_t>& slots, const std::vector<Live>& live,
                                      const SamplingParams& sp, int64_t gstep, int64_t ahead = 0) {
    std::vector<double> u(slots.size());
    for (size_t s = 0; s < slots.size(); ++s) {
      const Live& l = live[static_cast<size_t>(slots[s])];
      u[s] = sampling_uniform(sp.seed, gstep, l.req->prompt_key, l.req->sample_key,
                              static_cast<int64_t>(l.out.tokens.size()) + ahead);
    }
    return u;
  }

  // Appends the chosen token of each listed request and decides whether it is done.
  void record(const std::vector<TokenChoice>& choice, const std::vector<int64_t>& slots,
              std::vector<Live>& live, const SamplingParams& sp) const {
    const int64_t ctx = cfg.model.max_seq_len;
    for (size_t s = 0; s < slots.size(); ++s) {
      Live& l = live[static_cast<size_t>(slots[s])];
      const GenRequest& q = *l.req;
      const int64_t i = static_cast<int64_t>(l.out.tokens.size());
      const TokenChoice& tc = choice[s];
      l.out.tokens.push_back(tc.token);
      l.out.logprobs.push_back(tc.logprob);
      l.out.stopped = std::find(sp.stop_ids.begin(), sp.stop_ids.end(), tc.token) != sp.stop_ids.end();
      // Context limit: the next input (this token) would sit at position max_seq_len. Like a training
      // sample, a sequence holds at most max_seq_len + 1 tokens.
      const int64_t total = static_cast<int64_t>(q.prompt.size()) + i + 1;
      l.done = l.out.stopped || i + 1 >= sp.max_new_tokens || total > ctx;
    }
  }

#ifdef NDT_HAVE_CUDA
  // Device decode state of one batch: inputs and outputs at fixed addresses, and CUDA graphs of the decode
  // step by number of sequences (a graph replays one step with a single launch instead of ~15 launches per
  // layer, which is what a decode step of small matrices is otherwise bound by).
  struct DeviceDecode {
    explicit DeviceDecode(int64_t B) {
      const Device cu = Device::CUDA;
      tok = Tensor::empty({B}, DType::I32, cu);
      pos = Tensor::empty({B}, DType::I32, cu);
      tgt = Tensor::zeros({B}, DType::I32, cu);
      u = Tensor::empty({B}, DType::F64, cu);
      out_tok = Tensor::empty({B}, DType::I32, cu);
      out_lp = Tensor::empty({B}, DType::F32, cu);
      for (int i = 0; i < 2; ++i) {
        h_u[i] = std::make_unique<cuda::PinnedBuffer>(static_cast<size_t>(B) * sizeof(double));
        h_tok[i] = std::make_unique<cuda::PinnedBuffer>(static_cast<size_t>(B) * sizeof(int32_t));
        h_lp[i] = std::make_unique<cuda::PinnedBuffer>(static_cast<size_t>(B) * sizeof(float));
      }
    }
    Tensor tok, pos, tgt, u, out_tok, out_lp;  // (B) each
    std::map<int64_t, std::unique_ptr<cuda::Graph>> graphs;
    int64_t last_n = -1;
    // Host staging of two steps in flight: step t's uniforms go up and its choices come back through
    // buffer t % 2 while the host reads step t - 1's from the other.
    std::unique_ptr<cuda::PinnedBuffer> h_u[2], h_tok[2], h_lp[2];
    cuda::StreamEvent done[2];
  };

  // Whether decode steps may be replayed from CUDA graphs: one GPU per replica (no TP collectives inside
  // the step) and no MoE layer (routing is decided on the host). NDT_GEN_CUDA_GRAPHS=0 turns them off.
  bool graphs_allowed() const {
    const char* env = std::getenv("NDT_GEN_CUDA_GRAPHS");
    return tp == 1 && !cfg.model.moe.enabled() && !(env && std::string(env) == "0");
  }

  // Enqueues a decode step on the GPU from host inputs: like step(), but every device input lives in dd's
  // fixed buffers, the tokens are sampled on the device into dd's outputs and the step ends by advancing
  // its inputs and the cache metadata to the next step's (KvCache::advance), so the whole step can be
  // captured once and replayed; the second consecutive step with the same number of sequences captures it.
  // Its choices come back into buffer `buf` (collect_device).
  void launch_device(KvCache& cache, const Microbatch& mb, const std::vector<int64_t>& slots,
                     const std::vector<Live>& live, const SamplingParams& sp, int64_t gstep, DeviceDecode& dd,
                     int buf) {
    const int64_t n = mb.nseq;
    cache.begin(mb, slots);
    const std::vector<double> u = uniforms(slots, live, sp, gstep, 0);
    Microbatch dev = mb;
    (dev.tokens = dd.tok.view_at(0, {n})).copy_from(mb.tokens);
    (dev.positions = dd.pos.view_at(0, {n})).copy_from(mb.positions);
    dev.targets = dd.tgt.view_at(0, {n});
    dd.u.view_at(0, {n}).copy_from(Tensor::from_vector(u, {n}));
    Tensor out_tok = dd.out_tok.view_at(0, {n}), out_lp = dd.out_lp.view_at(0, {n});
    const Tensor ud = dd.u.view_at(0, {n});
    auto work = [&] {
      Activations acts;  // allocated and freed inside the work (graph-owned memory under capture)
      model->forward(dev, Tensor(), acts);
      choose_tokens_on_device(out_tok, out_lp, acts.logits, sp.temperature, sp.top_k, sp.top_p, ud);
      cache.advance(dev.tokens, dev.positions, out_tok);
    };
    std::unique_ptr<cuda::Graph>* g = nullptr;
    if (graphs_allowed() && n == dd.last_n) {
      g = &dd.graphs[n];
      if (!*g) *g = cuda::Graph::capture(work);
    }
    if (g && *g)
      (*g)->launch();
    else
      work();
    dd.last_n = n;
    fetch_device(dd, n, buf);
  }

  // The next decode step of the same sequences, enqueued before the current one's tokens are known: its
  // inputs are on the device already (KvCache::advance); only the uniforms go up.
  void launch_device_ahead(KvCache& cache, const std::vector<int64_t>& slots, const std::vector<Live>& live,
                           const SamplingParams& sp, int64_t gstep, DeviceDecode& dd, int buf) {
    const int64_t n = static_cast<int64_t>(slots.size());
    cache.begin_ahead(slots);
    const std::vector<double> u = uniforms(slots, live, sp, gstep, 1);
    std::copy(u.begin(), u.end(), dd.h_u[buf]->as<double>());
    cuda::copy_h2d_async(dd.u.data<double>(), *dd.h_u[buf], static_cast<size_t>(n) * sizeof(double));
    dd.graphs.at(n)->launch();
    fetch_device(dd, n, buf);
  }

  static void fetch_device(DeviceDecode& dd, int64_t n, int buf) {
    cuda::copy_d2h_async(*dd.h_tok[buf], dd.out_tok.i32(), static_cast<size_t>(n) * sizeof(int32_t));
    cuda::copy_d2h_async(*dd.h_lp[buf], dd.out_lp.f32(), static_cast<size_t>(n) * sizeof(float));
    dd.done[buf].record();
  }

  // Waits for the step whose choices come back in `buf` and records them, except for the sequences that
  // finished before it (a step enqueued ahead may hold a sequence whose previous token was a stop: that
  // row's work is discarded).
  void collect_device(DeviceDecode& dd, int buf, const std::vector<int64_t>& slots, std::vector<Live>& live,
                      const SamplingParams& sp) const {
    dd.done[buf].wait();
    std::vector<TokenChoice> choice;
    std::vector<int64_t> kept;
    for (size_t s = 0; s < slots.size(); ++s) {
      if (live[static_cast<size_t>(slots[s])].done) continue;
      kept.push_back(slots[s]);
      choice.push_back({dd.h_tok[buf]->as<int32_t>()[s], dd.h_lp[buf]->as<float>()[s]});
    }
    record(choice, kept, live, sp);
  }

  // The decode steps of one batch on the GPU. With graphs, step t + 1 is enqueued before step t's tokens
  // are read back (the GPU never waits for the host between steps), for the sequences that step t does
  // not finish by length; a stop token found in step t's tokens discards that sequence's row of step t + 1.
  // A change in the set of sequences, or no graph yet, waits for the step in flight and starts from host
  // inputs. The tokens are those of the synchronous loop (same inputs, same kernels, same uniforms).
  void decode_device(KvCache& cache, std::vector<Live>& live, const SamplingParams& sp, int64_t gstep,
                     DeviceDecode& dd) {
    const int64_t ctx = cfg.model.max_seq_len;
    const char* env = std::getenv("NDT_GEN_PIPELINE");  // 0: wait for every step's tokens (measurements)
    const bool pipelined = graphs_allowed() && !(env && std::string(env) == "0");
    std::vector<int64_t> flying;  // slots of the step in flight, its choices in buffer `buf`
    int buf = 0;
    for (;;) {
      std::vector<int64_t> next;
      for (int64_t s = 0; s < static_cast<int64_t>(live.size()); ++s) {
        const Live& l = live[static_cast<size_t>(s)];
        if (l.done) continue;
        const int64_t i = static_cast<int64_t>(l.out.tokens.size());  // index of the token in flight
        if (!flying.empty() &&
            (i + 1 >= sp.max_new_tokens || static_cast<int64_t>(l.req->prompt.size()) + i + 1 > ctx))
          continue;  // the step in flight gives its last token
        next.push_back(s);
      }
      const int64_t n = static_cast<int64_t>(next.size());
      const auto g = dd.graphs.find(n);
      if (pipelined && !flying.empty() && next == flying && g != dd.graphs.end() && g->second) {
        launch_device_ahead(cache, next, live, sp, gstep, dd, buf ^ 1);
        collect_device(dd, buf, flying, live, sp);
        buf ^= 1;
        continue;
      }
      if (!flying.empty()) {
        collect_device(dd, buf, flying, live, sp);
        flying.clear();
        continue;
      }
      if (next.empty()) break;
      std::vector<int64_t> first;
      std::vector<std::vector<int32_t>> last;
      for (int64_t s : next) {
        first.push_back(cache.length(s));
        last.push_back({live[static_cast<size_t>(s)].out.tokens.back()});
      }
      std::vector<const std::vector<int32_t>*> toks;
      for (const auto& t : last) toks.push_back(&t);
      buf ^= 1;
      launch_device(cache, cached_batch(toks, first), next, live, sp, gstep, dd, buf);
      flying = next;
    }
  }
#endif

  // Generates requests [b, e) of `reqs` on this replica.
  std::vector<GenOutput> run(const std::vector<GenRequest>& reqs, int64_t b, int64_t e,
                             const SamplingParams& sp, int64_t gstep) {
    std::vector<GenOutput> outs;
    const int64_t ctx = cfg.model.max_seq_len;
    for (int64_t c0 = b; c0 < e;) {
      // Cache rows per slot: the longest input this batch can feed (prompt + all but the last new token).
      int64_t B = 0, rows = 1;
      while (c0 + B < e && B < kMaxBatch) {
        const int64_t need =
            std::min<int64_t>(ctx, static_cast<int64_t>(reqs[static_cast<size_t>(c0 + B)].prompt.size()) +
                                       sp.max_new_tokens - 1);
        if (B > 0 && (B + 1) * std::max(rows, need) > kMaxCacheRows) break;
        rows = std::max(rows, need);
        ++B;
      }
      std::vector<Live> live(static_cast<size_t>(B));
      for (int64_t s = 0; s < B; ++s) {
        live[static_cast<size_t>(s)].req = &reqs[static_cast<size_t>(c0 + s)];
        live[static_cast<size_t>(s)].done = sp.max_new_tokens <= 0;
      }
      const ModelConfig& m = cfg.model;
      KvCache cache(m.n_layers, B, rows, m.kv_heads() / tp, m.head_dim(), model->params().compute_dtype(),
                    model->params().device());
      model->set_kv_cache(&cache);
#ifdef NDT_HAVE_CUDA
      std::unique_ptr<DeviceDecode> dd;
      if (model->params().device() == Device::CUDA && tp == 1) dd = std::make_unique<DeviceDecode>(B);
#endif
      try {
        // Prefill: whole prompts, several per forward up to the token budget.
        for (int64_t s0 = 0; s0 < B && sp.max_new_tokens > 0;) {
          std::vector<int64_t> slots;
          std::vector<const std::vector<int32_t>*> toks;
          int64_t tokens = 0;
          for (int64_t s = s0; s < B; ++s) {
            const auto& p = live[static_cast<size_t>(s)].req->prompt;
            if (!slots.empty() && tokens + static_cast<int64_t>(p.size()) > kPrefillTokens) break;
            slots.push_back(s);
            toks.push_back(&p);
            tokens += static_cast<int64_t>(p.size());
          }
          step(cache, cached_batch(toks, std::vector<int64_t>(slots.size(), 0)), slots, live, sp, gstep);
          s0 += static_cast<int64_t>(slots.size());
        }
        // Decode: the last token of every unfinished request, one forward per new token.
#ifdef NDT_HAVE_CUDA
        if (dd && sp.max_new_tokens > 0) decode_device(cache, live, sp, gstep, *dd);
#endif
        for (;;) {
          std::vector<int64_t> slots, first;
          std::vector<std::vector<int32_t>> last;
          for (int64_t s = 0; s < B; ++s) {
            const Live& l = live[static_cast<size_t>(s)];
            if (l.done) continue;
            slots.push_back(s);
            first.push_back(cache.length(s));
            last.push_back({l.out.tokens.back()});
          }
          if (slots.empty()) break;
          std::vector<const std::vector<int32_t>*> toks;
          for (const auto& t : last) toks.push_back(&t);
          step(cache, cached_batch(toks, first), slots, live, sp, gstep);
        }
      } catch (...) {
        model->set_kv_cache(nullptr);
        throw;
      }
      model->set_kv_cache(nullptr);
      for (Live& l : live) outs.push_back(std::move(l.out));
      c0 += B;
    }
    return outs;
  }
};

Generator::Generator(const Config& cfg, Communicator& world, GenLayout layout)
    : impl_(std::make_unique<Impl>(cfg, world)), layout_(layout) {
  Impl& im = *impl_;
  const ModelConfig& m = cfg.model;
  const int64_t t = layout.tp;
  // Every rank checks the same things before the first collective, so all of them fail together.
  NDT_CHECK(t >= 1 && world.size() % t == 0, "generation: gen_tp = {} does not divide the {} ranks", t,
            world.size());
  const int64_t shared = m.moe.enabled() ? m.moe.shared_experts * m.expert_ffn_dim() : 0;
  NDT_CHECK(
      m.n_heads % t == 0 && m.kv_heads() % t == 0 && m.vocab_size % t == 0 && m.ffn_dim() % t == 0 &&
          shared % t == 0,
      "generation: gen_tp = {} must divide model.n_heads ({}), the kv heads ({}), model.vocab_size ({}), "
      "the MLP width ({}) and the shared experts' width ({})",
      t, m.n_heads, m.kv_heads(), m.vocab_size, m.ffn_dim(), shared);
  const bool cuda = cfg.train.device == "cuda";
#ifndef NDT_HAVE_CUDA
  NDT_CHECK(!cuda, "train.device is cuda but this ndtrain was built without the CUDA backend");
#endif
  im.tp = t;
  im.replicas = world.size() / t;
  im.replica = world.rank() / t;
  int device = 0;
#ifdef NDT_HAVE_CUDA
  if (cuda) device = cuda::select_device(world.rank());
#endif
  (void)device;
  TpHooks* hooks = nullptr;
  if (t > 1) {
    im.tp_host = world.split(static_cast<int>(im.replica), world.rank());
    Communicator* group = im.tp_host.get();
#ifdef NDT_HAVE_CUDA
    if (cuda)
      group = (im.tp_dev = make_device_communicator(*im.tp_host, device, cfg.train.device_comm)).get();
#endif
    im.hooks = std::make_unique<CommTpHooks>(*group, /*sequence_parallel=*/false);
    hooks = im.hooks.get();
  }
  // The whole model (no PP) with every expert (no EP); weights arrive by load_full.
  im.model = std::make_unique<Transformer>(m, StageSpec{}, hooks);
  ParamStore& ps = im.model->params();
  ps.flatten();
  if (cuda) ps.to_device(Device::CUDA, cfg.train.effective_precision() == "bf16" ? DType::BF16 : DType::F32);
  // Inference never runs backward: drop the gradient buffers.
  ps.flat_grads() = Tensor();
  for (auto& p : ps.all()) p->grad = Tensor();
}

Generator::~Generator() = default;

void Generator::load_full(const std::vector<std::pair<std::string, Tensor>>& full) {
  std::map<std::string, const Tensor*> by_name;
  for (const auto& [name, t] : full) by_name[name] = &t;
  ParamStore& ps = impl_->model->params();
  ps.with_host_values([&] { copy_global_slices(ps, by_name, "refit weights"); }, /*write_back=*/true);
}

namespace {

// dst = the block of the whole tensor `whole` (global shape of p) that p holds along its shard dimension:
// one strided 2-D copy (outer rows of L * inner contiguous elements), on the tensors' device.
void copy_shard_of(Param& p, const Tensor& whole) {
  const Shape& g = p.global_shape;
  const auto d = static_cast<size_t>(p.shard_dim);
  int64_t outer = 1, inner = 1;
  for (size_t i = 0; i < d; ++i) outer *= g[i];
  for (size_t i = d + 1; i < g.size(); ++i) inner *= g[i];
  const int64_t len = p.value.shape()[d] * inner, full = g[d] * inner;
  const float* src = whole.f32() + p.shard_offset * inner;
  float* dst = p.value.f32();
#ifdef NDT_HAVE_CUDA
  if (p.value.device() == Device::CUDA) {
    const size_t f = sizeof(float);
    cuda::copy_d2d_2d(dst, static_cast<size_t>(len) * f, src, static_cast<size_t>(full) * f,
                      static_cast<size_t>(len) * f, static_cast<size_t>(outer));
    return;
  }
#endif
  for (int64_t o = 0; o < outer; ++o) std::copy_n(src + o * full, len, dst + o * len);
}

}  // namespace

bool Generator::refit_copy(const std::function<RefitSource(const std::string&)>& find, bool same_device) {
  Impl& im = *impl_;
  ParamStore& dst = im.model->params();
  bool ok = same_device;
  for (size_t i = 0; ok && i < dst.all().size(); ++i) {  // this rank's slice of every parameter is here
    const Param& p = *dst.all()[i];
    const RefitSource s = find(p.name);
    const bool whole = s.value && s.value->numel() == shape_numel(p.global_shape);
    ok = s.value && s.global_shape == p.global_shape &&
         (whole || (p.shard_dim >= 0 && s.shard_dim == p.shard_dim && s.shard_offset == p.shard_offset &&
                    s.value->numel() == p.value.numel()));
  }
  if (im.world.size() > 1) {  // one path for all ranks: load_full's caller gathers collectively
    double v = ok ? 1.0 : 0.0;
    im.world.all_reduce(&v, 1, DType::F64, ReduceOp::Min);
    ok = v > 0;
  }
  if (!ok) return false;
  for (auto& p : dst.all()) {  // fp32 master values: the same slice, or this rank's block of a whole tensor
    const Tensor& src = *find(p->name).value;
    if (src.numel() == p->value.numel())
      p->value.copy_from(src);
    else
      copy_shard_of(*p, src);
  }
  dst.refresh_compute();
  return true;
}

bool Generator::refit_from(ParamStore& train) {
  train.settle_values();  // ZeRO-1's values gathered beside the training step
  return refit_copy(
      [&](const std::string& name) {
        const Param* s = train.find(name);
        return s ? RefitSource{&s->value, s->global_shape, s->shard_dim, s->shard_offset} : RefitSource{};
      },
      train.device() == impl_->model->params().device());
}

bool Generator::refit_from_full(const std::vector<std::pair<std::string, Tensor>>& full) {
  std::map<std::string, const Tensor*> by_name;
  bool same_device = true;
  for (const auto& [name, t] : full) {
    by_name[name] = &t;
    same_device = same_device && t.device() == impl_->model->params().device();
  }
  return refit_copy(
      [&](const std::string& name) {
        auto it = by_name.find(name);
        return it == by_name.end() ? RefitSource{} : RefitSource{it->second, it->second->shape(), -1, 0};
      },
      same_device);
}

std::vector<GenOutput> Generator::generate(const std::vector<GenRequest>& reqs, const SamplingParams& sp,
                                           int64_t step) {
  Impl& im = *impl_;
  const ModelConfig& m = im.cfg.model;
  const int64_t n = static_cast<int64_t>(reqs.size());
  // Every rank checks every request before any collective.
  NDT_CHECK(std::isfinite(sp.temperature) && sp.temperature >= 0, "generation: temperature {} must be >= 0",
            sp.temperature);
  NDT_CHECK(sp.top_p > 0 && sp.top_p <= 1, "generation: top_p {} must be in (0, 1]", sp.top_p);
  NDT_CHECK(sp.top_k >= 0, "generation: top_k {} must be >= 0", sp.top_k);
  NDT_CHECK(sp.max_new_tokens >= 0, "generation: max_new_tokens {} must be >= 0", sp.max_new_tokens);
  for (int64_t i = 0; i < n; ++i) {
    const auto& p = reqs[static_cast<size_t>(i)].prompt;
    const auto len = static_cast<int64_t>(p.size());
    NDT_CHECK(len >= 1 && len <= m.max_seq_len - 1,
              "generation request {}: its prompt has {} tokens; it must have 1 to model.max_seq_len - 1 = {}",
              i, len, m.max_seq_len - 1);
    for (int32_t id : p)
      NDT_CHECK(id >= 0 && id < m.vocab_size,
                "generation request {}: token id {} outside the vocabulary [0, {})", i, id, m.vocab_size);
  }
  // Replica r generates the contiguous block [r n / R, (r + 1) n / R).
  const int64_t b = im.replica * n / im.replicas, e = (im.replica + 1) * n / im.replicas;
  const std::vector<GenOutput> mine = im.run(reqs, b, e, sp, step);
  // Every rank gets every output: per request [length, stopped, tokens..., logprobs...] (fixed stride),
  // written by TP rank 0 of its replica and summed over the world (one writer per entry: exact).
  const int64_t M = std::max<int64_t>(sp.max_new_tokens, 0), stride = 2 + 2 * M;
  std::vector<double> buf(static_cast<size_t>(n * stride), 0.0);
  if (im.world.rank() % im.tp == 0)
    for (int64_t i = b; i < e; ++i) {
      const GenOutput& g = mine[static_cast<size_t>(i - b)];
      double* row = buf.data() + i * stride;
      row[0] = static_cast<double>(g.tokens.size());
      row[1] = g.stopped ? 1.0 : 0.0;
      for (size_t j = 0; j < g.tokens.size(); ++j) {
        row[2 + j] = g.tokens[j];
        row[2 + M + static_cast<int64_t>(j)] = g.logprobs[j];
      }
    }
  if (im.world.size() > 1 && !buf.empty())
    im.world.all_reduce(buf.data(), static_cast<int64_t>(buf.size()), DType::F64, ReduceOp::Sum);
  std::vector<GenOutput> res(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const double* row = buf.data() + i * stride;
    GenOutput& g = res[static_cast<size_t>(i)];
    const auto len = static_cast<int64_t>(row[0]);
    g.stopped = row[1] != 0.0;
    for (int64_t j = 0; j < len; ++j) {
      g.tokens.push_back(static_cast<int32_t>(row[2 + j]));
      g.logprobs.push_back(static_cast<float>(row[2 + M + j]));
    }
  }
  return res;
}

}  // namespace ndt
