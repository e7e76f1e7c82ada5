// Sequence packing and the context-parallel split: the packing policy, padding rules, packed ==
// unpacked on one process, the load-balanced CP chunks, and the positional attention op that CP uses.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "data/packing.h"
#include "gradcheck.h"
#include "model/transformer.h"
#include "ops/cpu_ops.h"
#include "parallel/cp/cp_shard.h"
#include "tiny_model.h"

namespace ndt {
namespace {

using gradcheck::check_grad;
using gradcheck::minus;
using gradcheck::randn;
using gradcheck::weighted_sum;
using Vec = std::vector<float>;

Sample make_sample(int64_t n_tokens, int32_t seed, int32_t vocab = 32) {
  Sample s;
  for (int64_t t = 0; t < n_tokens; ++t) {
    s.tokens.push_back(static_cast<int32_t>((seed * 7 + t * 5 + t * t) % vocab));
    s.loss_mask.push_back(t > 0 && (t + seed) % 5 != 0);  // some masked positions, as in SFT
  }
  return s;
}

TEST(Packing, PolicyRespectsBudgetAndPlacesEverySampleOnce) {
  const std::vector<int64_t> lengths = {30, 4, 17, 9, 25, 2, 31, 12, 8, 16, 3, 22};
  for (int64_t budget : {32, 48, 64, 100}) {
    for (int64_t mult : {1, 2, 4}) {
      auto bins = pack_into_microbatches(lengths, budget, mult);
      EXPECT_EQ(bins.size() % static_cast<size_t>(mult), 0u);
      std::vector<int64_t> seen;
      int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;
      for (const auto& b : bins) {
        ASSERT_FALSE(b.empty());
        EXPECT_TRUE(std::is_sorted(b.begin(), b.end()));
        int64_t load = 0;
        for (int64_t i : b) load += lengths[static_cast<size_t>(i)], seen.push_back(i);
        EXPECT_LE(load, budget);
        lo = std::min(lo, load), hi = std::max(hi, load);
      }
      std::sort(seen.begin(), seen.end());
      std::vector<int64_t> all(lengths.size());
      std::iota(all.begin(), all.end(), 0);
      EXPECT_EQ(seen, all) << "budget " << budget;
      // Minimal count: one fewer (multiple) would not hold the tokens or was tried and failed.
      const int64_t total = std::accumulate(lengths.begin(), lengths.end(), int64_t{0});
      EXPECT_GE(static_cast<int64_t>(bins.size()) * budget, total);
      EXPECT_EQ(bins, pack_into_microbatches(lengths, budget, mult)) << "deterministic";
    }
  }
}

TEST(Packing, PolicyRejectsSampleOverBudget) {
  try {
    pack_into_microbatches({10, 40, 5}, 32);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("exceeds the token budget"), std::string::npos) << e.what();
  }
}

TEST(Packing, PadsSequencesAndStreamWithoutLoss) {
  std::vector<Sample> samples = {make_sample(6, 1), make_sample(2, 2), make_sample(11, 3)};
  PackLayout layout = pack_layout(/*cp=*/2, /*tp=*/3, /*sp=*/true);
  EXPECT_EQ(layout.seq_multiple, 4);
  EXPECT_EQ(layout.stream_multiple, 12);
  Microbatch mb = pack_samples(samples, 99, layout);
  // 5 -> 8, 1 -> 4, 10 -> 12 inputs; 24 tokens is a multiple of 12: no tail sequence.
  ASSERT_EQ(mb.nseq, 3);
  EXPECT_EQ(std::vector<int32_t>(mb.cu_seqlens.i32(), mb.cu_seqlens.i32() + 4),
            (std::vector<int32_t>{0, 8, 12, 24}));
  EXPECT_EQ(mb.max_seqlen, 12);
  int64_t want_loss = 0;
  for (const Sample& s : samples)
    for (size_t t = 1; t < s.tokens.size(); ++t) want_loss += s.loss_mask[t];
  EXPECT_EQ(mb.num_loss_tokens, want_loss);
  for (int64_t t = 5; t < 8; ++t) {  // padding of the first sequence
    EXPECT_EQ(mb.tokens.i32()[t], 99);
    EXPECT_EQ(mb.loss_mask.f32()[t], 0.0f);
    EXPECT_EQ(mb.positions.i32()[t], t);
  }
  // Without sequence parallelism a tail sequence is not needed; with odd totals it is added.
  Microbatch mb2 = pack_samples({make_sample(6, 1)}, 99, pack_layout(1, 4, true));
  EXPECT_EQ(mb2.num_tokens(), 8);  // 5 real inputs + a 3-token pad-only sequence
  EXPECT_EQ(mb2.nseq, 2);
  EXPECT_EQ(mb2.num_loss_tokens, samples[0].loss_mask.size() - 1 - 1);
}

// The same samples, padded to seq_len one per row or packed end to end, give the same loss and
// gradients (fp32: loss 1e-6 relative, gradients 1e-5 of their max plus 1e-4 relative per element).
TEST(Packing, PackedEqualsUnpackedOnOneProcess) {
  for (const std::string style : {"llama", "gpt2"}) {
    ModelConfig mc = testing::tiny_model(style);
    std::vector<Sample> samples;
    for (int i = 0; i < 6; ++i) samples.push_back(make_sample(2 + (i * 5) % 15, i));
    auto run = [&](const Microbatch& mb, std::vector<std::vector<float>>& grads) {
      Transformer m(mc, StageSpec{}, nullptr);
      m.params().init(5);
      Activations a;
      m.forward(mb, Tensor(), a);
      const double loss = m.loss_sum(mb, a);
      m.backward(mb, Tensor(), 1.0f / static_cast<float>(mb.num_loss_tokens), a);
      for (auto& p : m.params().all()) grads.emplace_back(p->grad.f32(), p->grad.f32() + p->grad.numel());
      return loss;
    };
    std::vector<std::vector<float>> g_pad, g_pack;
    Microbatch padded = make_microbatch(samples, mc.max_seq_len, 0);
    Microbatch packed = pack_samples(samples, 0, PackLayout{1, 1, mc.max_seq_len});
    ASSERT_LT(packed.num_tokens(), padded.num_tokens());
    ASSERT_EQ(packed.num_loss_tokens, padded.num_loss_tokens);
    const double l_pad = run(padded, g_pad), l_pack = run(packed, g_pack);
    EXPECT_NEAR(l_pack, l_pad, 1e-6 * l_pad) << style;
    ASSERT_EQ(g_pad.size(), g_pack.size());
    for (size_t p = 0; p < g_pad.size(); ++p) {
      float gmax = 0;
      for (float x : g_pad[p]) gmax = std::max(gmax, std::fabs(x));
      for (size_t i = 0; i < g_pad[p].size(); ++i)
        ASSERT_NEAR(g_pack[p][i], g_pad[p][i], 1e-5 * gmax + 1e-4 * std::fabs(g_pad[p][i]))
            << style << " param " << p << " element " << i;
    }
  }
}

TEST(CpShard, LoadBalancedChunksCoverEveryRowOnce) {
  std::vector<Sample> samples = {make_sample(9, 1), make_sample(17, 2), make_sample(3, 3)};
  for (int64_t cp : {2, 3, 4}) {
    Microbatch full = pack_samples(samples, 0, pack_layout(cp, 1, false));
    std::vector<int64_t> all;
    int64_t loss_tokens = 0;
    for (int64_t r = 0; r < cp; ++r) {
      Microbatch mb = cp_shard(full, cp, r);
      const std::vector<int64_t> rows = cp_rows(full, cp, r);
      ASSERT_EQ(static_cast<int64_t>(rows.size()), mb.num_tokens());
      EXPECT_EQ(mb.num_tokens() * cp, full.num_tokens()) << "equal shares";
      const std::vector<int32_t> pos = cp_positions(mb.cu_seqlens, cp, r);
      for (size_t i = 0; i < rows.size(); ++i) {
        EXPECT_EQ(mb.tokens.i32()[i], full.tokens.i32()[rows[i]]);
        EXPECT_EQ(mb.targets.i32()[i], full.targets.i32()[rows[i]]);
        EXPECT_EQ(mb.positions.i32()[i], full.positions.i32()[rows[i]]) << "global positions";
        EXPECT_EQ(pos[i], mb.positions.i32()[i]) << "positions computable by every rank";
      }
      // Rank r holds chunks r and 2cp-1-r of sequence 0.
      const int64_t c = (full.cu_seqlens.i32()[1] - full.cu_seqlens.i32()[0]) / (2 * cp);
      EXPECT_EQ(rows[0], r * c);
      EXPECT_EQ(rows[static_cast<size_t>(c)], (2 * cp - 1 - r) * c);
      all.insert(all.end(), rows.begin(), rows.end());
      loss_tokens += mb.num_loss_tokens;
    }
    std::sort(all.begin(), all.end());
    std::vector<int64_t> want(static_cast<size_t>(full.num_tokens()));
    std::iota(want.begin(), want.end(), 0);
    EXPECT_EQ(all, want) << "cp " << cp;
    EXPECT_EQ(loss_tokens, full.num_loss_tokens);
  }
}

TEST(CpShard, RejectsSequencesNotDivisibleBy2Cp) {
  Microbatch mb = make_microbatch({make_sample(10, 1)}, 6, 0);  // one sequence of 6 tokens
  try {
    cp_shard(mb, 2, 0);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("multiple of 2*cp = 4"), std::string::npos) << e.what();
  }
}

// The positional form with keys = queries and positions = offsets is exactly the plain causal op.
TEST(OpsGeneralAttention, MatchesPlainCausal) {
  std::mt19937 rng(21);
  const std::vector<int32_t> cu = {0, 5, 40, 41, 58};
  const int64_t nseq = 4, T = 58, H = 4, KV = 2, D = 8;
  const float scale = 0.3f;
  std::vector<int32_t> pos(T);
  for (int64_t s = 0; s < nseq; ++s)
    for (int32_t t = cu[s]; t < cu[s + 1]; ++t) pos[t] = t - cu[s];
  Vec q = randn(T * H * D, rng), k = randn(T * KV * D, rng), v = randn(T * KV * D, rng),
      dout = randn(T * H * D, rng);
  Vec o1(T * H * D), l1(T * H), o2(T * H * D), l2(T * H);
  cpu::attention_forward(o1.data(), l1.data(), q.data(), k.data(), v.data(), cu.data(), nseq, T, H, KV, D,
                         scale);
  cpu::attention_forward(o2.data(), l2.data(), q.data(), k.data(), v.data(), cu.data(), cu.data(), pos.data(),
                         pos.data(), nseq, T, T, H, KV, D, scale);
  for (size_t i = 0; i < o1.size(); ++i) ASSERT_NEAR(o1[i], o2[i], 1e-6) << i;
  for (size_t i = 0; i < l1.size(); ++i) ASSERT_NEAR(l1[i], l2[i], 1e-5) << i;
  Vec dq1(q.size()), dk1(k.size()), dv1(v.size()), dq2(q.size()), dk2(k.size()), dv2(v.size());
  cpu::attention_backward(dq1.data(), dk1.data(), dv1.data(), dout.data(), q.data(), k.data(), v.data(),
                          o1.data(), l1.data(), cu.data(), nseq, T, H, KV, D, scale);
  cpu::attention_backward(dq2.data(), dk2.data(), dv2.data(), dout.data(), q.data(), k.data(), v.data(),
                          o1.data(), l1.data(), cu.data(), cu.data(), pos.data(), pos.data(), nseq, T, T, H,
                          KV, D, scale);
  for (size_t i = 0; i < dq1.size(); ++i) ASSERT_NEAR(dq1[i], dq2[i], 1e-5) << i;
  for (size_t i = 0; i < dk1.size(); ++i) ASSERT_NEAR(dk1[i], dk2[i], 1e-5) << i;
  for (size_t i = 0; i < dv1.size(); ++i) ASSERT_NEAR(dv1[i], dv2[i], 1e-5) << i;
}

// The CP case in one process: queries are chunks r and 2cp-1-r at global positions, keys a subset of
// the sequence (one ring block: another rank's two chunks). Rows that see no key get lse = -inf.
// Gradient check of all three inputs (tolerance in gradcheck.h) on the visible rows.
TEST(OpsGradcheck, GeneralAttentionRingBlock) {
  std::mt19937 rng(22);
  const int64_t cp = 2, c = 3, H = 2, KV = 1, D = 4;  // two sequences of 2*cp*c = 12 tokens
  const int64_t nseq = 2, Tq = nseq * 2 * c, Tk = nseq * 2 * c;
  std::vector<int32_t> cu = {0, 2 * c, 4 * c};
  std::vector<int32_t> pos_q, pos_k;
  for (int64_t s = 0; s < nseq; ++s) {
    for (int64_t chunk : {int64_t{0}, 2 * cp - 1})  // rank 0's chunks
      for (int64_t i = 0; i < c; ++i) pos_q.push_back(static_cast<int32_t>(chunk * c + i));
    for (int64_t chunk : {int64_t{1}, 2 * cp - 2})  // rank 1's chunks as keys
      for (int64_t i = 0; i < c; ++i) pos_k.push_back(static_cast<int32_t>(chunk * c + i));
  }
  Vec q = randn(Tq * H * D, rng), k = randn(Tk * KV * D, rng), v = randn(Tk * KV * D, rng);
  Vec R = randn(Tq * H * D, rng), out(Tq * H * D), lse(Tq * H);
  auto loss = [&] {
    cpu::attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), cu.data(), cu.data(),
                           pos_q.data(), pos_k.data(), nseq, Tq, Tk, H, KV, D, 0.5f);
    return weighted_sum(out, R);
  };
  loss();
  // Chunk 0 (positions 0..c-1) sees nothing of chunks 1 and 2: empty rows.
  EXPECT_EQ(lse[0], -std::numeric_limits<float>::infinity());
  EXPECT_EQ(out[0], 0.0f);
  EXPECT_TRUE(std::isfinite(lse[c * H])) << "chunk 3 sees chunks 1 and 2";
  Vec pq = randn(q.size(), rng), pk = randn(k.size(), rng), pv = randn(v.size(), rng);
  Vec dq = pq, dk = pk, dv = pv;
  cpu::attention_backward(dq.data(), dk.data(), dv.data(), R.data(), q.data(), k.data(), v.data(), out.data(),
                          lse.data(), cu.data(), cu.data(), pos_q.data(), pos_k.data(), nseq, Tq, Tk, H, KV,
                          D, 0.5f);
  check_grad("dq", q, minus(dq, pq), loss);
  check_grad("dk", k, minus(dk, pk), loss);
  check_grad("dv", v, minus(dv, pv), loss);
}

}  // namespace
}  // namespace ndt
