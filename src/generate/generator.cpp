#include "generate/generator.h"

#include <algorithm>
#include <cmath>
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
#ifdef NDT_HAVE_NCCL
#include "dist/nccl_communicator.h"
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

  // Full-vocabulary logits (n, V) of the given rows of the last forward, on the host, identical on every
  // TP rank: each rank writes its vocab block into a zeroed (tp, n, Vl) buffer and the blocks are summed
  // over TP (adding zeros is exact).
  std::vector<float> full_rows(const Activations& acts, const std::vector<int64_t>& rows) {
    const int64_t n = static_cast<int64_t>(rows.size()), Vl = model->local_vocab(), V = Vl * tp;
    const Tensor mine = ops::gather_rows(acts.logits, rows);  // (n, Vl) on the model's device
    if (tp == 1) return ops::to_host_f32(mine).to_vector<float>();
    Tensor blocks = Tensor::zeros({tp, n, Vl}, DType::F32, mine.device());
    Tensor dst = blocks.view_at(hooks->rank() * n * Vl, {n, Vl});
    if (mine.dtype() == DType::F32)
      dst.copy_from(mine);
    else
      ops::cast_into(dst, mine);
    hooks->all_reduce_sum(blocks.f32(), blocks.numel());  // device buffer under NCCL, host under MPI
    const std::vector<float> b = blocks.to_vector<float>();
    std::vector<float> out(static_cast<size_t>(n * V));
    for (int64_t r = 0; r < tp; ++r)
      for (int64_t i = 0; i < n; ++i)
        std::copy_n(b.begin() + (r * n + i) * Vl, Vl, out.begin() + i * V + r * Vl);
    return out;
  }

  // Runs the cached forward of `mb` for the given cache slots and samples the next token of each
  // sequence from its last row; updates the requests.
  void step(KvCache& cache, const Microbatch& mb, const std::vector<int64_t>& slots, std::vector<Live>& live,
            const SamplingParams& sp, int64_t gstep) {
    cache.begin(mb, slots);
    Activations acts;
    model->forward(mb, Tensor(), acts);
    std::vector<int64_t> rows;
    for (int64_t s = 0; s < mb.nseq; ++s) rows.push_back(mb.cu_seqlens.i32()[s + 1] - 1);
    const std::vector<float> logits = full_rows(acts, rows);
    const int64_t V = cfg.model.vocab_size, ctx = cfg.model.max_seq_len;
    for (size_t s = 0; s < slots.size(); ++s) {
      Live& l = live[static_cast<size_t>(slots[s])];
      const GenRequest& q = *l.req;
      const int64_t i = static_cast<int64_t>(l.out.tokens.size());
      const TokenChoice tc =
          choose_token(logits.data() + s * static_cast<size_t>(V), V, sp.temperature, sp.top_k, sp.top_p,
                       sampling_uniform(sp.seed, gstep, q.prompt_key, q.sample_key, i));
      l.out.tokens.push_back(tc.token);
      l.out.logprobs.push_back(tc.logprob);
      l.out.stopped = std::find(sp.stop_ids.begin(), sp.stop_ids.end(), tc.token) != sp.stop_ids.end();
      // Context limit: the next input (this token) would sit at position max_seq_len. Like a training
      // sample, a sequence holds at most max_seq_len + 1 tokens.
      const int64_t total = static_cast<int64_t>(q.prompt.size()) + i + 1;
      l.done = l.out.stopped || i + 1 >= sp.max_new_tokens || total > ctx;
    }
  }

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
#ifndef NDT_HAVE_NCCL
  NDT_CHECK(!cuda || t == 1, "generation: gen_tp = {} on cuda needs NCCL, which this build lacks", t);
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
#ifdef NDT_HAVE_NCCL
    if (cuda) group = (im.tp_dev = make_nccl_communicator(*im.tp_host, device)).get();
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
