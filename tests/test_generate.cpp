// The generation engine against the uncached model: cached greedy decoding returns the tokens of
// evaluate.h's greedy_generate (full forward per token), a decode step's logits equal the full forward's,
// and the sampler's rules (greedy ties, top-k, top-p, frequencies, counter-based keys).
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>

#include "core/check.h"
#include "generate/generator.h"
#include "generate/kv_cache.h"
#include "generate/sampler.h"
#include "model/transformer.h"
#include "ops/ops.h"
#include "tiny_model.h"
#include "train/evaluate.h"

namespace ndt {
namespace {

// style "qwen3": llama with q/k norms and a head width (6) that is not d_model / n_heads (16 / 4).
ModelConfig gen_model(const std::string& style) {
  ModelConfig m = testing::tiny_model(style == "qwen3" ? "llama" : style);
  if (style == "qwen3") {
    m.head_dim_override = 6;
    m.qk_norm = true;
  }
  return m;
}

Config gen_config(const std::string& style, int64_t experts = 0) {
  Config c;
  c.model = gen_model(style);
  c.model.moe.num_experts = experts;
  return c;
}

std::vector<std::pair<std::string, Tensor>> full_weights(Transformer& m) {
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& p : m.params().all()) out.emplace_back(p->name, p->value.clone());
  return out;
}

std::vector<std::vector<int32_t>> prompts_of(const std::vector<int>& lengths, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> tok(0, static_cast<int>(vocab) - 1);
  std::vector<std::vector<int32_t>> out;
  for (int len : lengths) {
    out.emplace_back();
    for (int i = 0; i < len; ++i) out.back().push_back(tok(rng));
  }
  return out;
}

std::vector<GenOutput> cached_generate(Generator& gen, const std::vector<std::vector<int32_t>>& prompts,
                                       int64_t max_new, int32_t stop, double temperature = 0) {
  std::vector<GenRequest> reqs;
  for (size_t i = 0; i < prompts.size(); ++i) reqs.push_back({prompts[i], i, 0});
  SamplingParams sp;
  sp.temperature = temperature;
  sp.max_new_tokens = max_new;
  if (stop >= 0) sp.stop_ids = {stop};
  return gen.generate(reqs, sp, 0);
}

// Cached greedy generation == greedy_generate without a cache, with a stop token that some prompt hits.
void same_as_uncached(const Config& cfg) {
  Transformer ref(cfg.model, StageSpec{}, nullptr);
  ref.params().init(5);
  auto self = make_self_communicator();
  Generator gen(cfg, *self, GenLayout{1});
  gen.load_full(full_weights(ref));
  const auto prompts = prompts_of({3, 7, 1, 5, 2}, cfg.model.vocab_size, 9);
  const int64_t max_new = 8;
  // A stop token that prompt 0 emits as its third token.
  const auto free_run = greedy_generate(argmax_fn(ref), prompts, max_new, /*eos=*/-1, /*pad=*/0);
  const int32_t stop = free_run[0][2];
  const auto want = greedy_generate(argmax_fn(ref), prompts, max_new, stop, 0);
  const auto got = cached_generate(gen, prompts, max_new, stop);
  ASSERT_EQ(got.size(), prompts.size());
  int stopped = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    std::vector<int32_t> body = got[i].tokens;
    if (got[i].stopped) {
      ASSERT_EQ(body.back(), stop);
      body.pop_back();
      ++stopped;
    } else {
      EXPECT_EQ(static_cast<int64_t>(got[i].tokens.size()), max_new) << "prompt " << i;
    }
    EXPECT_EQ(body, want[i]) << cfg.model.style << " prompt " << i;
    EXPECT_EQ(got[i].logprobs.size(), got[i].tokens.size());
    for (float lp : got[i].logprobs) EXPECT_LE(lp, 0.0f);
  }
  EXPECT_GE(stopped, 1);
}

TEST(Generate, CachedGreedyMatchesUncachedGpt2) { same_as_uncached(gen_config("gpt2")); }
TEST(Generate, CachedGreedyMatchesUncachedLlamaGqa) { same_as_uncached(gen_config("llama")); }
TEST(Generate, CachedGreedyMatchesUncachedMoe) { same_as_uncached(gen_config("llama", 4)); }
TEST(Generate, CachedGreedyMatchesUncachedQwen3HeadDim) { same_as_uncached(gen_config("qwen3")); }

// Refit straight from a whole training store gives the weights load_full gives (same tokens and logprobs);
// a store that lacks a parameter (another model) is refused, copying nothing.
TEST(Generate, RefitFromAWholeStoreEqualsLoadFull) {
  const Config cfg = gen_config("llama");
  Transformer ref(cfg.model, StageSpec{}, nullptr);
  ref.params().init(5);
  auto self = make_self_communicator();
  Generator a(cfg, *self, GenLayout{1}), b(cfg, *self, GenLayout{1});
  a.load_full(full_weights(ref));
  ref.params().flatten();
  ASSERT_TRUE(b.refit_from(ref.params()));
  const auto prompts = prompts_of({3, 7, 1}, cfg.model.vocab_size, 2);
  const auto ga = cached_generate(a, prompts, 6, -1, 1.0), gb = cached_generate(b, prompts, 6, -1, 1.0);
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(ga[i].tokens, gb[i].tokens);
    EXPECT_EQ(ga[i].logprobs, gb[i].logprobs);
  }
  Config other = cfg;
  other.model.n_layers = 1;  // lacks layers.1.*
  Transformer small(other.model, StageSpec{}, nullptr);
  small.params().init(5);
  EXPECT_FALSE(b.refit_from(small.params()));
  const auto gc = cached_generate(b, prompts, 6, -1, 1.0);
  EXPECT_EQ(gc[0].tokens, ga[0].tokens);  // unchanged
}

TEST(Generate, StopsAtContextLimit) {
  // max_seq_len 16: a 14-token prompt leaves room for 3 new tokens (a sequence holds at most 17 tokens,
  // the last one never fed back), like a training sample of seq_len + 1 tokens.
  const Config cfg = gen_config("gpt2");
  Transformer ref(cfg.model, StageSpec{}, nullptr);
  ref.params().init(5);
  auto self = make_self_communicator();
  Generator gen(cfg, *self, GenLayout{1});
  gen.load_full(full_weights(ref));
  const auto prompts = prompts_of({14, 4}, cfg.model.vocab_size, 3);
  const auto got = cached_generate(gen, prompts, 10, -1);
  EXPECT_EQ(got[0].tokens.size(), 3u);
  EXPECT_FALSE(got[0].stopped);
  EXPECT_EQ(got[1].tokens.size(), 10u);
  const auto want = greedy_generate(argmax_fn(ref), {prompts[0]}, 3, -1, 0);
  EXPECT_EQ(got[0].tokens, want[0]);
}

TEST(Generate, ErrorsNameTheRequest) {
  const Config cfg = gen_config("llama");
  auto self = make_self_communicator();
  Generator gen(cfg, *self, GenLayout{1});
  const auto prompts = prompts_of({3, 16}, cfg.model.vocab_size, 1);
  try {
    cached_generate(gen, prompts, 4, -1);
    FAIL() << "a 16-token prompt must be rejected (max_seq_len 16)";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("generation request 1"), std::string::npos) << e.what();
  }
  EXPECT_THROW({ Generator g(cfg, *self, GenLayout{3}); }, Error);  // 3 divides neither 1 rank nor 4 heads
}

// The logits of decode steps equal those of the full forward over the whole sequence at that position.
// Three sequences in slots 0, 1 and 3 (slot 2 stays empty); at some steps the middle one sits out, so the
// key segment of slot 0 spans the rows of slots 1 and 2, which must stay invisible.
void decode_logits_match(const std::string& style) {
  const ModelConfig mc = gen_model(style);
  Transformer m(mc, StageSpec{}, nullptr);
  m.params().init(7);
  const auto seqs = prompts_of({10, 12, 9}, mc.vocab_size, 4);
  const std::vector<int64_t> slot_of = {0, 1, 3}, prefill = {4, 6, 3};
  std::vector<Tensor> want;
  for (const auto& ids : seqs) {
    Sample s;
    s.tokens = ids;
    s.tokens.push_back(0);
    s.loss_mask.assign(s.tokens.size(), 0);
    Activations a;
    m.forward(pack_samples({s}, 0), Tensor(), a);
    want.push_back(ops::to_host_f32(a.logits));
  }
  KvCache cache(mc.n_layers, 4, mc.max_seq_len, mc.kv_heads(), mc.head_dim(), DType::F32, Device::CPU);
  m.set_kv_cache(&cache);
  const int64_t V = mc.vocab_size;
  std::vector<int64_t> fed(3, 0);
  double worst = 0;
  int64_t compared = 0;
  // One cached forward: sequences `which` (ascending), each with its next `count` tokens.
  auto run = [&](const std::vector<int64_t>& which, const std::vector<int64_t>& count) {
    Microbatch mb;
    std::vector<int32_t> tok, pos, cu{0}, seq_of_row;
    std::vector<int64_t> slots;
    for (size_t i = 0; i < which.size(); ++i) {
      const auto s = static_cast<size_t>(which[i]);
      for (int64_t t = fed[s]; t < fed[s] + count[i]; ++t) {
        tok.push_back(seqs[s][static_cast<size_t>(t)]);
        pos.push_back(static_cast<int32_t>(t));
        seq_of_row.push_back(static_cast<int32_t>(s));
      }
      fed[s] += count[i];
      cu.push_back(static_cast<int32_t>(tok.size()));
      mb.seq_real.push_back(static_cast<int32_t>(fed[s]));
      mb.max_seqlen = std::max(mb.max_seqlen, fed[s]);
      slots.push_back(slot_of[s]);
    }
    const int64_t T = static_cast<int64_t>(tok.size());
    mb.tokens = Tensor::from_vector(tok, {T});
    mb.targets = Tensor::zeros({T}, DType::I32);
    mb.loss_mask = Tensor::zeros({T});
    mb.positions = Tensor::from_vector(pos, {T});
    mb.cu_seqlens = Tensor::from_vector(cu, {static_cast<int64_t>(cu.size())});
    mb.nseq = static_cast<int64_t>(which.size());
    cache.begin(mb, slots);
    Activations a;
    m.forward(mb, Tensor(), a);
    const Tensor got = ops::to_host_f32(a.logits);
    for (int64_t r = 0; r < T; ++r)
      for (int64_t j = 0; j < V; ++j, ++compared) {
        const Tensor& w = want[static_cast<size_t>(seq_of_row[static_cast<size_t>(r)])];
        worst =
            std::max(worst, static_cast<double>(std::abs(got.f32()[r * V + j] - w.f32()[pos[r] * V + j])));
      }
  };
  run({0, 1, 2}, prefill);
  for (int step = 0; step < 6; ++step) {
    if (step % 3 == 1)
      run({0, 2}, {1, 1});  // the middle sequence sits out
    else
      run({0, 1, 2}, {1, 1, 1});
  }
  m.set_kv_cache(nullptr);
  EXPECT_GT(compared, 0);
  EXPECT_LE(worst, 1e-5) << style;
  EXPECT_EQ(cache.length(0), prefill[0] + 6);
  EXPECT_EQ(cache.length(1), prefill[1] + 4);
  EXPECT_EQ(cache.length(2), 0);
  EXPECT_EQ(cache.length(3), prefill[2] + 6);
}

TEST(Generate, DecodeLogitsMatchFullForwardGpt2) { decode_logits_match("gpt2"); }
TEST(Generate, DecodeLogitsMatchFullForwardLlama) { decode_logits_match("llama"); }
TEST(Generate, DecodeLogitsMatchFullForwardQwen3HeadDim) { decode_logits_match("qwen3"); }

TEST(KvCache, RejectsOutOfOrderPositions) {
  KvCache cache(1, 2, 8, 1, 4, DType::F32, Device::CPU);
  Microbatch mb;
  mb.tokens = Tensor::from_vector(std::vector<int32_t>{1, 2}, {2});
  mb.positions = Tensor::from_vector(std::vector<int32_t>{1, 2}, {2});  // slot 0 is empty: must start at 0
  mb.cu_seqlens = Tensor::from_vector(std::vector<int32_t>{0, 2}, {2});
  mb.nseq = 1;
  EXPECT_THROW(cache.begin(mb, {0}), Error);
}

// Decode steps advanced in place (KvCache::advance + begin_ahead, what the GPU decode loop replays without
// the host) attend exactly as decode steps prepared by begin() from host inputs: two caches, the same K/V/q
// each step, outputs bit-equal; the advanced step inputs are the sampled tokens at the next positions.
TEST(KvCache, AdvanceAheadEqualsBegin) {
  const int64_t layers = 1, kv = 2, H = 4, D = 8, max_len = 12;
  KvCache by_host(layers, 3, max_len, kv, D, DType::F32, Device::CPU);
  KvCache ahead(layers, 3, max_len, kv, D, DType::F32, Device::CPU);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> val(-1.0f, 1.0f);
  auto rand_t = [&](Shape sh) {
    Tensor t = Tensor::empty(std::move(sh));
    for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = val(rng);
    return t;
  };
  // Slots 0 and 2 (slot 1 idle): prompts of 3 and 5 tokens, then 4 decode steps.
  const std::vector<int64_t> slots = {0, 2};
  std::vector<int64_t> len = {3, 5};
  auto batch = [&](const std::vector<int64_t>& first, const std::vector<int64_t>& count) {
    std::vector<int32_t> tok, pos, cu{0};
    for (size_t s = 0; s < first.size(); ++s) {
      for (int64_t t = 0; t < count[s]; ++t) {
        tok.push_back(static_cast<int32_t>(10 + t));
        pos.push_back(static_cast<int32_t>(first[s] + t));
      }
      cu.push_back(static_cast<int32_t>(tok.size()));
    }
    Microbatch mb;
    const auto T = static_cast<int64_t>(tok.size());
    mb.tokens = Tensor::from_vector(tok, {T});
    mb.positions = Tensor::from_vector(pos, {T});
    mb.cu_seqlens = Tensor::from_vector(cu, {static_cast<int64_t>(cu.size())});
    mb.nseq = static_cast<int64_t>(first.size());
    return mb;
  };
  auto attend = [&](KvCache& c, const Microbatch& mb, const Tensor& q, const Tensor& k, const Tensor& v) {
    const int64_t T = mb.tokens.numel();
    Tensor out = Tensor::empty({T, H, D}), lse = Tensor::empty({T, H});
    c.attention_forward(0, mb, q, k, v, out, lse, 0.35f);
    return out;
  };
  const Microbatch pre = batch({0, 0}, len);
  const Tensor pq = rand_t({8, H, D}), pk = rand_t({8, kv, D}), pv = rand_t({8, kv, D});
  by_host.begin(pre, slots);
  ahead.begin(pre, slots);
  attend(by_host, pre, pq, pk, pv);
  attend(ahead, pre, pq, pk, pv);
  Tensor tokens, positions;
  for (int step = 0; step < 4; ++step) {
    const Microbatch mb = batch(len, {1, 1});
    by_host.begin(mb, slots);
    if (step == 0) {
      ahead.begin(mb, slots);
      tokens = mb.tokens.clone();
      positions = mb.positions.clone();
    } else {
      ahead.begin_ahead(slots);
      EXPECT_EQ(positions.to_vector<int32_t>(), mb.positions.to_vector<int32_t>()) << step;
    }
    const Tensor q = rand_t({2, H, D}), k = rand_t({2, kv, D}), v = rand_t({2, kv, D});
    const Tensor a = attend(by_host, mb, q, k, v), b = attend(ahead, mb, q, k, v);
    for (int64_t i = 0; i < a.numel(); ++i) ASSERT_EQ(a.f32()[i], b.f32()[i]) << "step " << step << " " << i;
    const Tensor sampled = Tensor::from_vector(std::vector<int32_t>{100 + step, 200 + step}, {2});
    ahead.advance(tokens, positions, sampled);
    EXPECT_EQ(tokens.to_vector<int32_t>(), sampled.to_vector<int32_t>());
    for (auto& l : len) ++l;
  }
  EXPECT_EQ(ahead.length(0), by_host.length(0));
  EXPECT_EQ(ahead.length(2), by_host.length(2));
  EXPECT_THROW(ahead.begin_ahead({0}), Error);  // another set of slots needs begin()
}

// ---- sampler ----

TEST(Sampler, GreedyTiesToSmallerId) {
  const std::vector<float> lg = {1.0f, 3.0f, 2.0f, 3.0f};
  const TokenChoice c = choose_token(lg.data(), 4, 0.0, 0, 1.0, 0.99);
  EXPECT_EQ(c.token, 1);
  double z = 0;
  for (float x : lg) z += std::exp(x);
  EXPECT_NEAR(c.logprob, 3.0 - std::log(z), 1e-6);
}

TEST(Sampler, TopKOneIsGreedy) {
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> pick(0, 4);  // few distinct values: many ties
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<float> lg(37);
    for (float& x : lg) x = static_cast<float>(pick(rng));
    const double u = sampling_uniform(1, 0, static_cast<uint64_t>(trial), 0, 0);
    EXPECT_EQ(choose_token(lg.data(), 37, 1.3, 1, 1.0, u).token,
              choose_token(lg.data(), 37, 0.0, 0, 1.0, u).token);
  }
}

TEST(Sampler, TopPKeepsTheSmallestNucleus) {
  // Probabilities 0.5, 0.3, 0.15, 0.05 (ids shuffled); top_p 0.75 keeps {0.5, 0.3}, renormalized.
  const std::vector<double> p = {0.15, 0.5, 0.05, 0.3};
  std::vector<float> lg;
  for (double x : p) lg.push_back(static_cast<float>(std::log(x)));
  std::map<int32_t, int> count;
  const int N = 10000;
  for (int i = 0; i < N; ++i) ++count[choose_token(lg.data(), 4, 1.0, 0, 0.75, (i + 0.5) / N).token];
  EXPECT_EQ(count.size(), 2u);
  EXPECT_NEAR(count[1] / double(N), 0.5 / 0.8, 1e-3);
  EXPECT_NEAR(count[3] / double(N), 0.3 / 0.8, 1e-3);
  // A nucleus of one: the most likely token whatever u is.
  for (double u : {0.0, 0.5, 0.999999}) EXPECT_EQ(choose_token(lg.data(), 4, 1.0, 0, 0.4, u).token, 1);
  // top-k before top-p: k = 3 drops 0.05; top_p 0.9 of the renormalized {0.5, 0.3, 0.15} keeps all three.
  count.clear();
  for (int i = 0; i < N; ++i) ++count[choose_token(lg.data(), 4, 1.0, 3, 0.9, (i + 0.5) / N).token];
  EXPECT_EQ(count.size(), 3u);
  EXPECT_NEAR(count[0] / double(N), 0.15 / 0.95, 1e-3);
  // The reported logprob is the temperature-1 full softmax whatever the filters.
  const TokenChoice c = choose_token(lg.data(), 4, 0.5, 2, 0.9, 0.3);
  EXPECT_NEAR(c.logprob, std::log(p[static_cast<size_t>(c.token)]), 1e-6);
}

TEST(Sampler, FrequenciesMatchTemperedSoftmax) {
  // 200k draws with the engine's keyed uniforms; each frequency within 5 standard errors of
  // softmax(logits / T) (a false failure has probability ~1e-6 per token).
  const std::vector<float> lg = {0.3f, -1.2f, 2.0f, 0.0f, 1.1f, -0.4f};
  const double T = 0.7;
  const int N = 200000;
  std::vector<double> want(lg.size());
  double z = 0;
  for (size_t j = 0; j < lg.size(); ++j) z += want[j] = std::exp(lg[j] / T);
  std::vector<int> count(lg.size(), 0);
  for (int i = 0; i < N; ++i)
    ++count[static_cast<size_t>(
        choose_token(lg.data(), 6, T, 0, 1.0, sampling_uniform(42, 3, 7, 1, i)).token)];
  for (size_t j = 0; j < lg.size(); ++j) {
    const double p = want[j] / z, f = count[j] / double(N);
    EXPECT_NEAR(f, p, 5 * std::sqrt(p * (1 - p) / N)) << "token " << j;
  }
}

TEST(Sampler, UniformsAreKeyedAndDeterministic) {
  const double u = sampling_uniform(1, 2, 3, 4, 5);
  EXPECT_EQ(u, sampling_uniform(1, 2, 3, 4, 5));
  EXPECT_GE(u, 0.0);
  EXPECT_LT(u, 1.0);
  for (double other :
       {sampling_uniform(9, 2, 3, 4, 5), sampling_uniform(1, 9, 3, 4, 5), sampling_uniform(1, 2, 9, 4, 5),
        sampling_uniform(1, 2, 3, 9, 5), sampling_uniform(1, 2, 3, 4, 9), sampling_uniform(1, 2, 4, 3, 5)})
    EXPECT_NE(u, other);
}

TEST(Generate, SamplingIsReproducibleAndKeyed) {
  const Config cfg = gen_config("llama");
  Transformer ref(cfg.model, StageSpec{}, nullptr);
  ref.params().init(5);
  auto self = make_self_communicator();
  Generator gen(cfg, *self, GenLayout{1});
  gen.load_full(full_weights(ref));
  const auto prompts = prompts_of({3, 5}, cfg.model.vocab_size, 2);
  std::vector<GenRequest> reqs = {{prompts[0], 0, 0}, {prompts[1], 1, 0}, {prompts[0], 0, 1}};
  SamplingParams sp;
  sp.temperature = 1.0;
  sp.max_new_tokens = 8;
  const auto a = gen.generate(reqs, sp, 3);
  // The same request alone, or in another order, draws the same tokens.
  const auto b = gen.generate({reqs[2], reqs[0]}, sp, 3);
  EXPECT_EQ(a[2].tokens, b[0].tokens);
  EXPECT_EQ(a[0].tokens, b[1].tokens);
  EXPECT_NE(a[0].tokens, a[2].tokens);  // another sample key: other draws (8 tokens over 32 ids)
  const auto c = gen.generate(reqs, sp, 4);
  EXPECT_NE(a[0].tokens, c[0].tokens);  // another step
}

}  // namespace
}  // namespace ndt
