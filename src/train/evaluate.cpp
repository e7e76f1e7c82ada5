#include "train/evaluate.h"

#include <algorithm>

namespace ndt {

Microbatch pack_samples(const std::vector<Sample>& samples, int32_t pad_id, int64_t multiple) {
  std::vector<int32_t> tokens, targets, positions, cu{0};
  std::vector<float> mask;
  int64_t max_len = 0;
  auto push_seq = [&](const std::vector<int32_t>& ids, const std::vector<uint8_t>* m) {
    const int64_t n = static_cast<int64_t>(ids.size()) - 1;
    for (int64_t i = 0; i < n; ++i) {
      tokens.push_back(ids[static_cast<size_t>(i)]);
      targets.push_back(ids[static_cast<size_t>(i + 1)]);
      positions.push_back(static_cast<int32_t>(i));
      mask.push_back(m ? static_cast<float>((*m)[static_cast<size_t>(i + 1)]) : 0.0f);
    }
    cu.push_back(static_cast<int32_t>(tokens.size()));
    max_len = std::max(max_len, n);
  };
  for (const Sample& s : samples) {
    NDT_CHECK(s.tokens.size() >= 2 && s.loss_mask.size() == s.tokens.size(),
              "sample needs >= 2 tokens and a mask");
    push_seq(s.tokens, &s.loss_mask);
  }
  const int64_t rem = static_cast<int64_t>(tokens.size()) % multiple;
  if (rem != 0) push_seq(std::vector<int32_t>(static_cast<size_t>(multiple - rem + 1), pad_id), nullptr);

  Microbatch mb;
  const int64_t T = static_cast<int64_t>(tokens.size());
  mb.tokens = Tensor::from_vector(tokens, {T});
  mb.targets = Tensor::from_vector(targets, {T});
  mb.positions = Tensor::from_vector(positions, {T});
  mb.loss_mask = Tensor::from_vector(mask, {T});
  mb.cu_seqlens = Tensor::from_vector(cu, {static_cast<int64_t>(cu.size())});
  mb.nseq = static_cast<int64_t>(cu.size()) - 1;
  mb.max_seqlen = max_len;
  int64_t n = 0;
  for (float m : mask) n += m != 0.0f;
  mb.num_loss_tokens = n;
  return mb;
}

std::vector<std::vector<int32_t>> greedy_generate(const ArgmaxFn& model,
                                                  const std::vector<std::vector<int32_t>>& prompts,
                                                  int64_t max_new_tokens, int32_t eos_id, int32_t pad_id,
                                                  int64_t token_multiple) {
  const size_t n = prompts.size();
  std::vector<std::vector<int32_t>> out(n);
  std::vector<bool> done(n, false);
  for (int64_t step = 0; step < max_new_tokens; ++step) {
    // Every prompt stays in the batch (finished ones too) so that all TP ranks run identical shapes.
    std::vector<Sample> seqs(n);
    for (size_t i = 0; i < n; ++i) {
      seqs[i].tokens = prompts[i];
      seqs[i].tokens.insert(seqs[i].tokens.end(), out[i].begin(), out[i].end());
      seqs[i].tokens.push_back(pad_id);  // dummy target so the last real token is an input
      seqs[i].loss_mask.assign(seqs[i].tokens.size(), 0);
    }
    Microbatch mb = pack_samples(seqs, pad_id, token_multiple);
    std::vector<int64_t> rows(n);
    for (size_t i = 0; i < n; ++i) rows[i] = mb.cu_seqlens.i32()[i + 1] - 1;
    std::vector<int32_t> next = model(mb, rows);
    bool all_done = true;
    for (size_t i = 0; i < n; ++i) {
      if (done[i]) continue;
      if (next[i] == eos_id) {
        done[i] = true;
      } else {
        out[i].push_back(next[i]);
        all_done = false;
      }
    }
    if (all_done) break;
  }
  return out;
}

ArgmaxFn argmax_fn(Transformer& model) {
  return [&model](const Microbatch& mb, const std::vector<int64_t>& rows) {
    Activations acts;
    model.forward(mb, Tensor(), acts);
    return model.argmax_rows(acts, rows);
  };
}

LossFn loss_fn(Transformer& model) {
  return [&model](const Microbatch& mb) {
    Activations acts;
    model.forward(mb, Tensor(), acts);
    return model.loss_sum(mb, acts);
  };
}

namespace {
// This DP rank's contiguous block of [0, n).
std::pair<int64_t, int64_t> dp_block(int64_t n, Communicator& dp) {
  const int64_t per = (n + dp.size() - 1) / dp.size();
  const int64_t b = std::min(n, per * dp.rank());
  return {b, std::min(n, b + per)};
}
}  // namespace

double exact_match(const ArgmaxFn& model, const Tokenizer& tok, const std::vector<EvalProblem>& problems,
                   int64_t max_new_tokens, Communicator& dp, int64_t token_multiple) {
  auto [b, e] = dp_block(static_cast<int64_t>(problems.size()), dp);
  std::vector<std::vector<int32_t>> prompts;
  for (int64_t i = b; i < e; ++i) prompts.push_back(problems[static_cast<size_t>(i)].prompt);
  int64_t correct = 0;
  if (!prompts.empty()) {
    auto gen = greedy_generate(model, prompts, max_new_tokens, tok.eos_id(), tok.pad_id(), token_multiple);
    for (size_t i = 0; i < gen.size(); ++i)
      correct += tok.decode(gen[i]) == problems[static_cast<size_t>(b) + i].answer;
  }
  dp.all_reduce(&correct, 1, DType::I64, ReduceOp::Sum);
  return problems.empty() ? 0.0 : static_cast<double>(correct) / static_cast<double>(problems.size());
}

double validation_loss(const LossFn& model, const Dataset& data, int64_t n, int64_t seq_len, int32_t pad_id,
                       int64_t batch, Communicator& dp, int64_t token_multiple) {
  if (data.size() >= 0) n = std::min(n, data.size());
  auto [b, e] = dp_block(n, dp);
  double sums[2] = {0, 0};  // loss sum, token count
  for (int64_t i = b; i < e; i += batch) {
    std::vector<Sample> samples;
    for (int64_t j = i; j < std::min(e, i + batch); ++j) {
      Sample s = data.get(j);
      if (static_cast<int64_t>(s.tokens.size()) > seq_len + 1) {
        s.tokens.resize(static_cast<size_t>(seq_len + 1));
        s.loss_mask.resize(static_cast<size_t>(seq_len + 1));
      }
      samples.push_back(std::move(s));
    }
    Microbatch mb = pack_samples(samples, pad_id, token_multiple);
    sums[0] += model(mb);
    sums[1] += static_cast<double>(mb.num_loss_tokens);
  }
  dp.all_reduce(sums, 2, DType::F64, ReduceOp::Sum);
  return sums[1] > 0 ? sums[0] / sums[1] : 0.0;
}

}  // namespace ndt
