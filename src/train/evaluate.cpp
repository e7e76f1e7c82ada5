#include "train/evaluate.h"

#include <algorithm>

namespace ndt {

std::vector<std::vector<int32_t>> greedy_generate(const ArgmaxFn& model,
                                                  const std::vector<std::vector<int32_t>>& prompts,
                                                  int64_t max_new_tokens, int32_t eos_id, int32_t pad_id,
                                                  const PackLayout& layout, Communicator* lockstep) {
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
    Microbatch mb = pack_samples(seqs, pad_id, layout);
    std::vector<int64_t> rows(n);
    // The last real input of each sequence (sequences may carry padding after it).
    for (size_t i = 0; i < n; ++i)
      rows[i] = mb.cu_seqlens.i32()[i] + static_cast<int64_t>(seqs[i].tokens.size()) - 2;
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
    int32_t stop = all_done;
    if (lockstep) lockstep->all_reduce(&stop, 1, DType::I32, ReduceOp::Min);
    if (stop) break;
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

int64_t lockstep_count(int64_t mine, Communicator& dp, bool lockstep) {
  if (lockstep && dp.size() > 1) dp.all_reduce(&mine, 1, DType::I64, ReduceOp::Max);
  return mine;
}

double exact_match(const ArgmaxFn& model, const Tokenizer& tok, const std::vector<EvalProblem>& problems,
                   int64_t max_new_tokens, Communicator& dp, const PackLayout& layout, bool lockstep) {
  auto [b, e] = dp_block(static_cast<int64_t>(problems.size()), dp);
  std::vector<std::vector<int32_t>> prompts;
  for (int64_t i = b; i < e; ++i) prompts.push_back(problems[static_cast<size_t>(i)].prompt);
  int64_t correct = 0;
  if (!prompts.empty() || lockstep) {
    auto gen = greedy_generate(model, prompts, max_new_tokens, tok.eos_id(), tok.pad_id(), layout,
                               lockstep ? &dp : nullptr);
    for (size_t i = 0; i < gen.size(); ++i)
      correct += tok.decode(gen[i]) == problems[static_cast<size_t>(b) + i].answer;
  }
  dp.all_reduce(&correct, 1, DType::I64, ReduceOp::Sum);
  return problems.empty() ? 0.0 : static_cast<double>(correct) / static_cast<double>(problems.size());
}

double validation_loss(const LossFn& model, const Dataset& data, int64_t n, int64_t seq_len, int32_t pad_id,
                       int64_t batch, Communicator& dp, const PackLayout& layout, bool lockstep) {
  if (data.size() >= 0) n = std::min(n, data.size());
  auto [b, e] = dp_block(n, dp);
  double sums[2] = {0, 0};  // loss sum, token count
  const int64_t calls = lockstep_count((e - b + batch - 1) / batch, dp, lockstep);
  for (int64_t c = 0, i = b; c < calls; ++c, i += batch) {
    std::vector<Sample> samples;  // empty past this rank's share: a pad-only microbatch (lockstep)
    for (int64_t j = i; j < std::min(e, i + batch); ++j) {
      Sample s = data.get(j);
      if (static_cast<int64_t>(s.tokens.size()) > seq_len + 1) {
        s.tokens.resize(static_cast<size_t>(seq_len + 1));
        s.loss_mask.resize(static_cast<size_t>(seq_len + 1));
      }
      samples.push_back(std::move(s));
    }
    Microbatch mb = pack_samples(samples, pad_id, layout);
    sums[0] += model(mb);
    sums[1] += static_cast<double>(mb.num_loss_tokens);
  }
  dp.all_reduce(sums, 2, DType::F64, ReduceOp::Sum);
  return sums[1] > 0 ? sums[0] / sums[1] : 0.0;
}

}  // namespace ndt
