// Tests of the CPU reference ops (ops/cpu_ops.h): finite-difference gradient checks for every
// backward (tolerance stated in gradcheck.h), plus forward references and the vocab-parallel pieces, and the
// CPU path of the tensor-level fused ops (bit-identical to the composite they replace).
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "core/check.h"
#include "gradcheck.h"
#include "ops/cpu_ops.h"
#include "ops/ops.h"

namespace {

using ndt::gradcheck::check_grad;
using ndt::gradcheck::minus;
using ndt::gradcheck::randint;
using ndt::gradcheck::randn;
using ndt::gradcheck::randu;
using ndt::gradcheck::weighted_sum;
namespace cpu = ndt::cpu;
using Vec = std::vector<float>;

// ---------------------------------------------------------------- gradient checks

TEST(OpsGradcheck, Embedding) {
  std::mt19937 rng(1);
  const int64_t T = 12, V = 7, C = 5, vocab_start = 3;
  auto ids = randint(T, rng, 0, 15);  // some ids fall outside this shard [3, 10)
  ids[0] = 3;
  ids[1] = 9;
  ids[2] = 9;  // repeated id: gradients must add up
  Vec table = randn(V * C, rng), R = randn(T * C, rng), out(T * C);
  auto loss = [&] {
    cpu::embedding_forward(out.data(), ids.data(), table.data(), T, V, C, vocab_start);
    return weighted_sum(out, R);
  };
  loss();
  Vec prior = randn(V * C, rng), dtable = prior;
  cpu::embedding_backward(dtable.data(), R.data(), ids.data(), T, V, C, vocab_start);
  check_grad("dtable", table, minus(dtable, prior), loss);
}

TEST(OpsGradcheck, PositionEmbedding) {
  std::mt19937 rng(2);
  const int64_t T = 9, P = 6, C = 5;
  auto pos = randint(T, rng, 0, P);
  Vec base = randn(T * C, rng), table = randn(P * C, rng), R = randn(T * C, rng);
  auto loss = [&] {
    Vec out = base;
    cpu::add_position_embedding_forward(out.data(), pos.data(), table.data(), T, P, C);
    return weighted_sum(out, R);
  };
  Vec prior = randn(P * C, rng), dtable = prior;
  cpu::add_position_embedding_backward(dtable.data(), R.data(), pos.data(), T, P, C);
  check_grad("dpos_table", table, minus(dtable, prior), loss);
}

TEST(OpsGradcheck, Linear) {
  std::mt19937 rng(3);
  const int64_t T = 6, IC = 5, OC = 4;
  Vec inp = randn(T * IC, rng), w = randn(OC * IC, rng), b = randn(OC, rng), R = randn(T * OC, rng),
      out(T * OC);
  auto loss = [&] {
    cpu::linear_forward(out.data(), inp.data(), w.data(), b.data(), T, IC, OC);
    return weighted_sum(out, R);
  };
  Vec pi = randn(T * IC, rng), pw = randn(OC * IC, rng), pb = randn(OC, rng);
  Vec dinp = pi, dw = pw, db = pb;
  cpu::linear_backward(dinp.data(), dw.data(), db.data(), R.data(), inp.data(), w.data(), T, IC, OC);
  check_grad("dinp", inp, minus(dinp, pi), loss);
  check_grad("dweight", w, minus(dw, pw), loss);
  check_grad("dbias", b, minus(db, pb), loss);
}

TEST(OpsGradcheck, LayerNorm) {
  std::mt19937 rng(4);
  const int64_t T = 5, C = 8;
  const float eps = 1e-5f;
  Vec inp = randn(T * C, rng), w = randu(C, rng, 0.5f, 1.5f), b = randn(C, rng), R = randn(T * C, rng);
  Vec out(T * C), mean(T), rstd(T);
  auto loss = [&] {
    cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(), T, C, eps);
    return weighted_sum(out, R);
  };
  loss();
  Vec pi = randn(T * C, rng), pw = randn(C, rng), pb = randn(C, rng);
  Vec dinp = pi, dw = pw, db = pb;
  cpu::layernorm_backward(dinp.data(), dw.data(), db.data(), R.data(), inp.data(), w.data(), mean.data(),
                          rstd.data(), T, C);
  check_grad("dinp", inp, minus(dinp, pi), loss);
  check_grad("dweight", w, minus(dw, pw), loss);
  check_grad("dbias", b, minus(db, pb), loss);
}

TEST(OpsGradcheck, RMSNorm) {
  std::mt19937 rng(5);
  const int64_t T = 5, C = 8;
  const float eps = 1e-5f;
  Vec inp = randn(T * C, rng), w = randu(C, rng, 0.5f, 1.5f), R = randn(T * C, rng), out(T * C), rstd(T);
  auto loss = [&] {
    cpu::rmsnorm_forward(out.data(), rstd.data(), inp.data(), w.data(), T, C, eps);
    return weighted_sum(out, R);
  };
  loss();
  Vec pi = randn(T * C, rng), pw = randn(C, rng), dinp = pi, dw = pw;
  cpu::rmsnorm_backward(dinp.data(), dw.data(), R.data(), inp.data(), w.data(), rstd.data(), T, C);
  check_grad("dinp", inp, minus(dinp, pi), loss);
  check_grad("dweight", w, minus(dw, pw), loss);
}

TEST(OpsGradcheck, Rope) {
  std::mt19937 rng(6);
  const int64_t T = 6, H = 3, D = 8;
  const float theta = 10000.0f;
  auto pos = randint(T, rng, 0, 50);
  Vec inp = randn(T * H * D, rng), R = randn(T * H * D, rng), out(T * H * D);
  auto loss = [&] {
    cpu::rope_forward(out.data(), inp.data(), pos.data(), T, H, D, theta);
    return weighted_sum(out, R);
  };
  loss();
  // In place (inp == out) must give the same result.
  Vec inplace = inp;
  cpu::rope_forward(inplace.data(), inplace.data(), pos.data(), T, H, D, theta);
  EXPECT_EQ(inplace, out);
  Vec prior = randn(T * H * D, rng), dinp = prior;
  cpu::rope_backward(dinp.data(), R.data(), pos.data(), T, H, D, theta);
  check_grad("dinp", inp, minus(dinp, prior), loss);
}

// The fused q/k/v split with RoPE (ops::qkv_split_rope) and its backward (ops::qkv_merge_rope_backward),
// GQA with H = 3, KV = 2: finite differences of the split against the merge.
TEST(OpsGradcheck, QkvSplitRopeMergeBackward) {
  using ndt::Tensor;
  namespace ops = ndt::ops;
  std::mt19937 rng(16);
  const int64_t T = 5, H = 3, KV = 2, D = 8, W = (H + 2 * KV) * D;
  const float theta = 10000.0f;
  auto posv = randint(T, rng, 0, 50);
  const Tensor pos = Tensor::from_vector(posv, {T});
  Vec inp = randn(T * W, rng), Rq = randn(T * H * D, rng), Rk = randn(T * KV * D, rng),
      Rv = randn(T * KV * D, rng);
  Tensor q = Tensor::empty({T, H, D}), k = Tensor::empty({T, KV, D}), v = Tensor::empty({T, KV, D});
  auto loss = [&] {
    ops::qkv_split_rope(q, k, v, Tensor::from_vector(inp, {T, W}), pos, theta);
    return weighted_sum(q.to_vector<float>(), Rq) + weighted_sum(k.to_vector<float>(), Rk) +
           weighted_sum(v.to_vector<float>(), Rv);
  };
  loss();
  Tensor dqkv = Tensor::empty({T, W});
  ops::qkv_merge_rope_backward(dqkv, Tensor::from_vector(Rq, {T, H, D}), Tensor::from_vector(Rk, {T, KV, D}),
                               Tensor::from_vector(Rv, {T, KV, D}), pos, theta);
  check_grad("dqkv", inp, dqkv.to_vector<float>(), loss);
}

// Several sequences of different lengths (one of length 1, two longer than the kernels' row blocks of
// 16 and 32), GQA with H = 4, KV = 2.
TEST(OpsGradcheck, Attention) {
  std::mt19937 rng(7);
  const std::vector<int32_t> cu = {0, 5, 40, 41, 58};
  const int64_t nseq = 4, T = 58, H = 4, KV = 2, D = 8;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  Vec q = randn(T * H * D, rng), k = randn(T * KV * D, rng), v = randn(T * KV * D, rng);
  Vec R = randn(T * H * D, rng), out(T * H * D), lse(T * H);
  auto loss = [&] {
    cpu::attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), cu.data(), nseq, T, H, KV, D,
                           scale);
    return weighted_sum(out, R);
  };
  loss();
  Vec pq = randn(q.size(), rng), pk = randn(k.size(), rng), pv = randn(v.size(), rng);
  Vec dq = pq, dk = pk, dv = pv;
  cpu::attention_backward(dq.data(), dk.data(), dv.data(), R.data(), q.data(), k.data(), v.data(), out.data(),
                          lse.data(), cu.data(), nseq, T, H, KV, D, scale);
  check_grad("dq", q, minus(dq, pq), loss);
  check_grad("dk", k, minus(dk, pk), loss);
  check_grad("dv", v, minus(dv, pv), loss);
}

TEST(OpsGradcheck, Gelu) {
  std::mt19937 rng(8);
  const int64_t N = 64;
  Vec x = randn(N, rng, 2.0f), R = randn(N, rng), out(N);
  auto loss = [&] {
    cpu::gelu_forward(out.data(), x.data(), N);
    return weighted_sum(out, R);
  };
  Vec prior = randn(N, rng), dx = prior;
  cpu::gelu_backward(dx.data(), R.data(), x.data(), N);
  check_grad("dinp", x, minus(dx, prior), loss);
}

TEST(OpsGradcheck, SwiGLU) {
  std::mt19937 rng(9);
  const int64_t N = 64;
  Vec gate = randn(N, rng, 2.0f), up = randn(N, rng), R = randn(N, rng), out(N);
  auto loss = [&] {
    cpu::swiglu_forward(out.data(), gate.data(), up.data(), N);
    return weighted_sum(out, R);
  };
  Vec pg = randn(N, rng), pu = randn(N, rng), dg = pg, du = pu;
  cpu::swiglu_backward(dg.data(), du.data(), R.data(), gate.data(), up.data(), N);
  check_grad("dgate", gate, minus(dg, pg), loss);
  check_grad("dup", up, minus(du, pu), loss);
}

// L = sum_t R[t] * loss[t] over unmasked rows; the pieces' backward gets dloss = R * mask.
TEST(OpsGradcheck, CrossEntropy) {
  std::mt19937 rng(10);
  const int64_t T = 6, V = 11;
  Vec logits = randn(T * V, rng, 3.0f), R = randn(T, rng), losses(T);
  auto targets = randint(T, rng, 0, V);
  Vec mask = {1, 1, 0, 1, 1, 1};
  auto loss = [&] {
    cpu::cross_entropy_forward(losses.data(), logits.data(), targets.data(), mask.data(), T, V);
    return weighted_sum(losses, R);
  };
  Vec rowmax(T), sumexp(T), dloss(T);
  cpu::xent_rowmax(rowmax.data(), logits.data(), T, V);
  cpu::xent_sumexp(sumexp.data(), logits.data(), rowmax.data(), T, V);
  for (int64_t t = 0; t < T; ++t) dloss[t] = R[t] * mask[t];
  Vec prior = randn(T * V, rng), dlogits = prior;
  cpu::xent_backward(dlogits.data(), logits.data(), rowmax.data(), sumexp.data(), targets.data(),
                     dloss.data(), T, V, 0);
  check_grad("dlogits", logits, minus(dlogits, prior), loss);
}

// ---------------------------------------------------------------- attention semantics

// Dense reference in double for one sequence [s0, s1).
void naive_attention(std::vector<double>& out, const Vec& q, const Vec& k, const Vec& v, int64_t s0,
                     int64_t s1, int64_t H, int64_t KV, int64_t D, double scale) {
  for (int64_t h = 0; h < H; ++h) {
    const int64_t g = h / (H / KV);
    for (int64_t i = s0; i < s1; ++i) {
      std::vector<double> s;
      double m = -1e300;
      for (int64_t j = s0; j <= i; ++j) {
        double d = 0;
        for (int64_t c = 0; c < D; ++c) d += double(q[(i * H + h) * D + c]) * k[(j * KV + g) * D + c];
        s.push_back(d * scale);
        m = std::max(m, d * scale);
      }
      double z = 0;
      for (auto& x : s) z += (x = std::exp(x - m));
      for (int64_t c = 0; c < D; ++c) {
        double acc = 0;
        for (int64_t j = s0; j <= i; ++j) acc += s[j - s0] * v[(j * KV + g) * D + c];
        out[(i * H + h) * D + c] = acc / z;
      }
    }
  }
}

TEST(OpsAttention, MatchesNaiveReference) {
  std::mt19937 rng(11);
  const std::vector<int32_t> cu = {0, 37, 40, 75};  // crosses the 32-row block of the forward
  const int64_t nseq = 3, T = 75, H = 4, KV = 2, D = 16;
  const float scale = 0.25f;
  Vec q = randn(T * H * D, rng), k = randn(T * KV * D, rng), v = randn(T * KV * D, rng);
  Vec out(T * H * D), lse(T * H);
  cpu::attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), cu.data(), nseq, T, H, KV, D,
                         scale);
  std::vector<double> ref(out.size());
  for (int64_t s = 0; s < nseq; ++s) naive_attention(ref, q, k, v, cu[s], cu[s + 1], H, KV, D, scale);
  for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], ref[i], 1e-5 + 1e-5 * std::fabs(ref[i])) << i;
  // The first token of a sequence attends only to itself: out = v, lse = its own scaled score.
  for (int64_t h = 0; h < H; ++h)
    for (int64_t c = 0; c < D; ++c) EXPECT_FLOAT_EQ(out[(37 * H + h) * D + c], v[(37 * KV + h / 2) * D + c]);
}

// Changing the tokens of one sequence leaves every other sequence bitwise unchanged (forward and
// backward), and changing a later token leaves earlier tokens of the same sequence unchanged.
TEST(OpsAttention, NoCrossSequenceOrFutureLeak) {
  std::mt19937 rng(12);
  const std::vector<int32_t> cu = {0, 6, 15, 19};
  const int64_t nseq = 3, T = 19, H = 4, KV = 2, D = 8;
  const float scale = 0.35f;
  Vec q = randn(T * H * D, rng), k = randn(T * KV * D, rng), v = randn(T * KV * D, rng),
      dout = randn(T * H * D, rng);
  auto run = [&](const Vec& q_, const Vec& k_, const Vec& v_, Vec& out, Vec& dq, Vec& dk, Vec& dv) {
    Vec lse(T * H);
    out.assign(T * H * D, 0.f);
    dq.assign(q_.size(), 0.f);
    dk.assign(k_.size(), 0.f);
    dv.assign(v_.size(), 0.f);
    cpu::attention_forward(out.data(), lse.data(), q_.data(), k_.data(), v_.data(), cu.data(), nseq, T, H, KV,
                           D, scale);
    cpu::attention_backward(dq.data(), dk.data(), dv.data(), dout.data(), q_.data(), k_.data(), v_.data(),
                            out.data(), lse.data(), cu.data(), nseq, T, H, KV, D, scale);
  };
  Vec o0, dq0, dk0, dv0, o1, dq1, dk1, dv1;
  run(q, k, v, o0, dq0, dk0, dv0);
  // Perturb every token of sequence 1 (tokens 6..14).
  Vec q2 = q, k2 = k, v2 = v;
  for (int64_t t = 6; t < 15; ++t) {
    for (int64_t i = 0; i < H * D; ++i) q2[t * H * D + i] += 1.0f;
    for (int64_t i = 0; i < KV * D; ++i) k2[t * KV * D + i] -= 0.5f, v2[t * KV * D + i] *= 2.0f;
  }
  run(q2, k2, v2, o1, dq1, dk1, dv1);
  auto same_rows = [&](const Vec& a, const Vec& b, int64_t width, int64_t t0, int64_t t1) {
    for (int64_t i = t0 * width; i < t1 * width; ++i)
      if (a[i] != b[i]) return false;
    return true;
  };
  for (auto [t0, t1] : {std::pair<int64_t, int64_t>{0, 6}, {15, 19}}) {
    EXPECT_TRUE(same_rows(o0, o1, H * D, t0, t1)) << "out rows " << t0;
    EXPECT_TRUE(same_rows(dq0, dq1, H * D, t0, t1)) << "dq rows " << t0;
    EXPECT_TRUE(same_rows(dk0, dk1, KV * D, t0, t1)) << "dk rows " << t0;
    EXPECT_TRUE(same_rows(dv0, dv1, KV * D, t0, t1)) << "dv rows " << t0;
  }
  EXPECT_FALSE(same_rows(o0, o1, H * D, 6, 15));  // the perturbation did something
  // Causality: perturbing the last token of sequence 1 leaves its earlier tokens unchanged.
  Vec k3 = k, v3 = v;
  for (int64_t i = 0; i < KV * D; ++i) k3[14 * KV * D + i] += 1.0f, v3[14 * KV * D + i] += 1.0f;
  run(q, k3, v3, o1, dq1, dk1, dv1);
  EXPECT_TRUE(same_rows(o0, o1, H * D, 0, 14));
  EXPECT_FALSE(same_rows(o0, o1, H * D, 14, 15));
}

// Large enough to take the threaded path: every (sequence, head) task computes the same numbers
// whichever thread runs it, so 1 and 4 threads agree bitwise.
TEST(OpsAttention, ThreadedMatchesSerial) {
  std::mt19937 rng(16);
  const std::vector<int32_t> cu = {0, 128, 228};
  const int64_t nseq = 2, T = 228, H = 4, KV = 2, D = 32;
  Vec q = randn(T * H * D, rng), k = randn(T * KV * D, rng), v = randn(T * KV * D, rng),
      dout = randn(T * H * D, rng);
  auto run = [&](int threads, Vec& out, Vec& dq, Vec& dk, Vec& dv) {
    const int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    Vec lse(T * H);
    out.assign(T * H * D, 0.f);
    dq.assign(q.size(), 0.f);
    dk.assign(k.size(), 0.f);
    dv.assign(v.size(), 0.f);
    cpu::attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), cu.data(), nseq, T, H, KV, D,
                           0.2f);
    cpu::attention_backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(), v.data(),
                            out.data(), lse.data(), cu.data(), nseq, T, H, KV, D, 0.2f);
    omp_set_num_threads(saved);
  };
  Vec o1, dq1, dk1, dv1, o4, dq4, dk4, dv4;
  run(1, o1, dq1, dk1, dv1);
  run(4, o4, dq4, dk4, dv4);
  EXPECT_EQ(o1, o4);
  EXPECT_EQ(dq1, dq4);
  EXPECT_EQ(dk1, dk4);
  EXPECT_EQ(dv1, dv4);
}

// ---------------------------------------------------------------- cross-entropy pieces

TEST(OpsXent, PiecesComposeToCrossEntropy) {
  std::mt19937 rng(13);
  const int64_t T = 7, V = 50;
  Vec logits = randn(T * V, rng, 4.0f);
  logits[3] = 80.0f;  // large logit: the max shift keeps exp finite
  auto targets = randint(T, rng, 0, V);
  Vec losses(T), rowmax(T), sumexp(T), tl(T), lp(T);
  const double total =
      cpu::cross_entropy_forward(losses.data(), logits.data(), targets.data(), nullptr, T, V);
  cpu::xent_rowmax(rowmax.data(), logits.data(), T, V);
  cpu::xent_sumexp(sumexp.data(), logits.data(), rowmax.data(), T, V);
  cpu::xent_target_logit(tl.data(), logits.data(), targets.data(), T, V, 0);
  cpu::xent_logprob(lp.data(), tl.data(), rowmax.data(), sumexp.data(), T);
  double sum = 0;
  for (int64_t t = 0; t < T; ++t) {
    // Reference in double: log-sum-exp minus the target logit.
    double m = -1e300, z = 0;
    for (int64_t j = 0; j < V; ++j) m = std::max(m, double(logits[t * V + j]));
    for (int64_t j = 0; j < V; ++j) z += std::exp(double(logits[t * V + j]) - m);
    const double ref = m + std::log(z) - logits[t * V + targets[t]];
    EXPECT_NEAR(losses[t], ref, 1e-5 * (1 + std::fabs(ref)));
    EXPECT_FLOAT_EQ(losses[t], -lp[t]);
    EXPECT_TRUE(std::isfinite(losses[t]));
    sum += losses[t];
  }
  EXPECT_NEAR(total, sum, 1e-9);
  // Mask: masked rows get loss 0 and do not count; their target may be an ignore index.
  Vec mask(T, 1.0f);
  mask[2] = 0.0f;
  targets[2] = -100;
  Vec masked(T);
  const double mtotal =
      cpu::cross_entropy_forward(masked.data(), logits.data(), targets.data(), mask.data(), T, V);
  EXPECT_EQ(masked[2], 0.0f);
  EXPECT_NEAR(mtotal, sum - losses[2], 1e-5);
}

// Two vocab shards with manual max / sum-exp / target-logit combination == the unsplit result, for the
// forward and the backward.
TEST(OpsXent, VocabParallelTwoShards) {
  std::mt19937 rng(14);
  const int64_t T = 9, V = 30, V0 = 13, V1 = V - V0;  // uneven shards
  Vec logits = randn(T * V, rng, 3.0f);
  auto targets = randint(T, rng, 0, V);
  targets[0] = 0, targets[1] = V0 - 1, targets[2] = V0, targets[3] = V - 1;  // shard edges
  Vec dloss = randn(T, rng);
  dloss[4] = 0.0f;  // skipped row
  // Unsplit.
  Vec rm(T), se(T), tl(T), lp(T), dl(T * V, 0.0f);
  cpu::xent_rowmax(rm.data(), logits.data(), T, V);
  cpu::xent_sumexp(se.data(), logits.data(), rm.data(), T, V);
  cpu::xent_target_logit(tl.data(), logits.data(), targets.data(), T, V, 0);
  cpu::xent_logprob(lp.data(), tl.data(), rm.data(), se.data(), T);
  cpu::xent_backward(dl.data(), logits.data(), rm.data(), se.data(), targets.data(), dloss.data(), T, V, 0);
  // Shards: columns [0, V0) and [V0, V).
  Vec s0(T * V0), s1(T * V1);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < V; ++j) (j < V0 ? s0[t * V0 + j] : s1[t * V1 + j - V0]) = logits[t * V + j];
  Vec m0(T), m1(T), m(T), e0(T), e1(T), e(T), t0(T), t1(T), tsum(T), lps(T);
  cpu::xent_rowmax(m0.data(), s0.data(), T, V0);
  cpu::xent_rowmax(m1.data(), s1.data(), T, V1);
  for (int64_t t = 0; t < T; ++t) m[t] = std::max(m0[t], m1[t]);  // all-reduce max
  cpu::xent_sumexp(e0.data(), s0.data(), m.data(), T, V0);
  cpu::xent_sumexp(e1.data(), s1.data(), m.data(), T, V1);
  for (int64_t t = 0; t < T; ++t) e[t] = e0[t] + e1[t];  // all-reduce sum
  cpu::xent_target_logit(t0.data(), s0.data(), targets.data(), T, V0, 0);
  cpu::xent_target_logit(t1.data(), s1.data(), targets.data(), T, V1, V0);
  for (int64_t t = 0; t < T; ++t) tsum[t] = t0[t] + t1[t];  // all-reduce sum
  cpu::xent_logprob(lps.data(), tsum.data(), m.data(), e.data(), T);
  for (int64_t t = 0; t < T; ++t) {
    EXPECT_EQ(m[t], rm[t]);
    EXPECT_EQ(tsum[t], tl[t]);
    EXPECT_NEAR(lps[t], lp[t], 1e-5 * (1 + std::fabs(lp[t])));
  }
  Vec d0(T * V0, 0.0f), d1(T * V1, 0.0f);
  cpu::xent_backward(d0.data(), s0.data(), m.data(), e.data(), targets.data(), dloss.data(), T, V0, 0);
  cpu::xent_backward(d1.data(), s1.data(), m.data(), e.data(), targets.data(), dloss.data(), T, V1, V0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < V; ++j) {
      const float d = j < V0 ? d0[t * V0 + j] : d1[t * V1 + j - V0];
      EXPECT_NEAR(d, dl[t * V + j], 1e-6) << t << "," << j;
    }
  for (int64_t j = 0; j < V; ++j) EXPECT_EQ(dl[4 * V + j], 0.0f);
}

// ---------------------------------------------------------------- forward references

TEST(OpsEmbedding, VocabStartOffset) {
  const int64_t T = 5, V = 3, C = 2, vocab_start = 4;
  const Vec table = {1, 2, 3, 4, 5, 6};  // rows for ids 4, 5, 6
  const std::vector<int32_t> ids = {4, 6, 3, 7, 5};
  Vec out(T * C, -1.0f);
  cpu::embedding_forward(out.data(), ids.data(), table.data(), T, V, C, vocab_start);
  EXPECT_EQ(out, (Vec{1, 2, 5, 6, 0, 0, 0, 0, 3, 4}));
  Vec dtable(V * C, 1.0f);
  const Vec dout = {1, 1, 2, 2, 9, 9, 9, 9, 3, 3};
  cpu::embedding_backward(dtable.data(), dout.data(), ids.data(), T, V, C, vocab_start);
  EXPECT_EQ(dtable, (Vec{2, 2, 4, 4, 3, 3}));  // accumulated onto 1; out-of-shard rows dropped
}

TEST(OpsEmbedding, PositionOutOfRangeThrows) {
  const std::vector<int32_t> pos = {0, 4};
  Vec out(4, 0.0f), table(8, 1.0f);
  EXPECT_THROW(cpu::add_position_embedding_forward(out.data(), pos.data(), table.data(), 2, 4, 2),
               ndt::Error);
}

TEST(OpsLinear, MatchesNaiveTripleLoop) {
  std::mt19937 rng(15);
  const int64_t T = 7, IC = 13, OC = 9;
  Vec inp = randn(T * IC, rng), w = randn(OC * IC, rng), b = randn(OC, rng);
  Vec out(T * OC), out_nb(T * OC);
  cpu::linear_forward(out.data(), inp.data(), w.data(), b.data(), T, IC, OC);
  cpu::linear_forward(out_nb.data(), inp.data(), w.data(), nullptr, T, IC, OC);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t o = 0; o < OC; ++o) {
      double acc = 0;
      for (int64_t i = 0; i < IC; ++i) acc += double(inp[t * IC + i]) * w[o * IC + i];
      EXPECT_NEAR(out_nb[t * OC + o], acc, 1e-5 * (1 + std::fabs(acc)));
      EXPECT_NEAR(out[t * OC + o], acc + b[o], 1e-5 * (1 + std::fabs(acc + b[o])));
    }
}

// AdamW against the formulas evaluated by hand in double for two steps.
TEST(OpsAdamW, TwoStepReference) {
  const float lr = 0.1f, b1 = 0.9f, b2 = 0.99f, eps = 1e-8f, wd = 0.05f;
  Vec p = {1.0f, -2.0f, 0.5f, 0.0f}, m(4, 0.0f), v(4, 0.0f);
  const Vec g1 = {0.5f, 0.1f, -1.0f, 0.0f}, g2 = {-0.2f, 0.3f, -0.5f, 2.0f};
  std::vector<double> P(p.begin(), p.end()), M(4, 0.0), S(4, 0.0);
  for (int step = 1; step <= 2; ++step) {
    const Vec& g = step == 1 ? g1 : g2;
    cpu::adamw_update(p.data(), g.data(), m.data(), v.data(), 4, lr, b1, b2, eps, wd, step);
    for (int i = 0; i < 4; ++i) {
      P[i] -= double(lr) * wd * P[i];
      M[i] = b1 * M[i] + (1 - double(b1)) * g[i];
      S[i] = b2 * S[i] + (1 - double(b2)) * double(g[i]) * g[i];
      const double mhat = M[i] / (1 - std::pow(double(b1), step));
      const double vhat = S[i] / (1 - std::pow(double(b2), step));
      P[i] -= lr * mhat / (std::sqrt(vhat) + eps);
    }
    for (int i = 0; i < 4; ++i) {
      EXPECT_NEAR(p[i], P[i], 1e-6) << "step " << step << " param " << i;
      EXPECT_NEAR(m[i], M[i], 1e-7);
      EXPECT_NEAR(v[i], S[i], 1e-7);
    }
  }
  // Step 1 with the hand values for element 0: p = 1 - 0.1*0.05*1 = 0.995; mhat = 0.5, vhat = 0.25,
  // update = 0.1 * 0.5 / 0.5 = 0.1 -> 0.895 (then step 2 follows from the loop above).
  Vec q = {1.0f}, mq = {0.0f}, vq = {0.0f};
  const Vec gq = {0.5f};
  cpu::adamw_update(q.data(), gq.data(), mq.data(), vq.data(), 1, lr, b1, b2, eps, wd, 1);
  EXPECT_NEAR(q[0], 0.895f, 1e-6);
}

TEST(OpsOptim, Reductions) {
  Vec x(40000);
  double ref = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = 0.001f * float(i % 97) - 0.03f;
    ref += double(x[i]) * x[i];
  }
  EXPECT_NEAR(cpu::sum_squares(x.data(), int64_t(x.size())), ref, 1e-9 * ref);
  Vec y = {1, 2, 3};
  cpu::scale_inplace(y.data(), 0.5f, 3);
  EXPECT_EQ(y, (Vec{0.5f, 1.0f, 1.5f}));
  const Vec z = {1, 1, 1};
  cpu::add_inplace(y.data(), z.data(), 3);
  EXPECT_EQ(y, (Vec{1.5f, 2.0f, 2.5f}));
}

// ---------------------------------------------------------------- tensor-level fused ops

// The fused MLP ops (ops::linear_gelu_forward / linear_dgelu_backward) are, on the CPU, the very composite
// they replace in Transformer::mlp_*: bit-identical results, so CPU training runs are unchanged.
TEST(OpsFused, LinearGeluIsTheCompositeOnCpu) {
  std::mt19937 rng(21);
  const int64_t T = 5, C = 6, F = 12;
  auto tensor = [&](ndt::Shape s) {
    ndt::Tensor t = ndt::Tensor::empty(std::move(s));
    const Vec v = randn(static_cast<size_t>(t.numel()), rng);
    std::copy(v.begin(), v.end(), t.f32());
    return t;
  };
  auto vec = [](const ndt::Tensor& t) { return Vec(t.f32(), t.f32() + t.numel()); };
  const ndt::Tensor x = tensor({T, C}), w1 = tensor({F, C}), b1 = tensor({F}), w2 = tensor({C, F}),
                    dout = tensor({T, C}), dw0 = tensor({C, F});
  for (const ndt::Tensor* bias : {&b1, static_cast<const ndt::Tensor*>(nullptr)}) {
    ndt::Tensor pre = ndt::Tensor::empty({T, F}), act = ndt::Tensor::empty({T, F});
    ndt::Tensor pre_ref = ndt::Tensor::empty({T, F}), act_ref = ndt::Tensor::empty({T, F});
    ndt::ops::linear_gelu_forward(act, pre, x, w1, bias);
    ndt::ops::linear_forward(pre_ref, x, w1, bias);
    ndt::ops::gelu_forward(act_ref, pre_ref);
    EXPECT_EQ(vec(pre), vec(pre_ref));
    EXPECT_EQ(vec(act), vec(act_ref));

    ndt::Tensor dpre = ndt::Tensor::full({T, F}, NAN), dw = dw0.clone();  // dpre is overwritten
    ndt::Tensor dact = ndt::Tensor::empty({T, F}), dpre_ref = ndt::Tensor::empty({T, F}),
                dw_ref = dw0.clone();
    ndt::ops::linear_dgelu_backward(dpre, dw, dout, act, w2, pre);
    ndt::ops::linear_backward(&dact, dw_ref, nullptr, dout, act, w2, /*accumulate_dinp=*/false);
    ndt::ops::gelu_backward(dpre_ref, dact, pre, /*accumulate=*/false);
    EXPECT_EQ(vec(dpre), vec(dpre_ref));
    EXPECT_EQ(vec(dw), vec(dw_ref));
  }
}

}  // namespace
