// Packing: contracts in data/packing.h.
#include "data/packing.h"

#include <algorithm>
#include <numeric>

#include "core/check.h"

namespace ndt {

namespace {
int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
}  // namespace

PackLayout pack_layout(int64_t cp, int64_t tp, bool sequence_parallel, int64_t max_len) {
  PackLayout l;
  l.seq_multiple = cp > 1 ? 2 * cp : 1;
  l.stream_multiple = l.seq_multiple * (sequence_parallel ? tp : 1);
  l.max_len = max_len;
  return l;
}

int64_t packed_length(const Sample& s, const PackLayout& layout) {
  int64_t n = static_cast<int64_t>(s.tokens.size()) - 1;
  if (layout.max_len >= 0) n = std::min(n, layout.max_len);
  return round_up(n, layout.seq_multiple);
}

Microbatch pack_samples(const std::vector<Sample>& samples, int32_t pad_id, const PackLayout& layout) {
  NDT_CHECK(layout.seq_multiple >= 1 && layout.stream_multiple % layout.seq_multiple == 0,
            "pack layout: stream multiple {} must be a multiple of the sequence multiple {}",
            layout.stream_multiple, layout.seq_multiple);
  std::vector<int32_t> tokens, targets, positions, cu{0}, seq_real;
  std::vector<int64_t> sample_ids;
  std::vector<float> mask;
  int64_t max_len = 0, nloss = 0;
  // n inputs of `ids` (predicting ids[1..n]) then padding up to `padded` rows.
  auto push_seq = [&](const std::vector<int32_t>& ids, const std::vector<uint8_t>* m, int64_t n,
                      int64_t padded) {
    for (int64_t i = 0; i < padded; ++i) {
      const bool real = i < n;
      const bool loss = real && m && (*m)[static_cast<size_t>(i + 1)];
      tokens.push_back(real ? ids[static_cast<size_t>(i)] : pad_id);
      targets.push_back(loss ? ids[static_cast<size_t>(i + 1)] : pad_id);
      positions.push_back(static_cast<int32_t>(i));
      mask.push_back(loss ? 1.0f : 0.0f);
      nloss += loss;
    }
    cu.push_back(static_cast<int32_t>(tokens.size()));
    seq_real.push_back(static_cast<int32_t>(n));
    max_len = std::max(max_len, padded);
  };
  for (size_t b = 0; b < samples.size(); ++b) {
    const Sample& s = samples[b];
    NDT_CHECK(s.tokens.size() >= 2 && s.loss_mask.size() == s.tokens.size(),
              "sample {}: needs >= 2 tokens and one mask entry per token (has {} and {})", b, s.tokens.size(),
              s.loss_mask.size());
    int64_t n = static_cast<int64_t>(s.tokens.size()) - 1;
    if (layout.max_len >= 0) n = std::min(n, layout.max_len);
    push_seq(s.tokens, &s.loss_mask, n, packed_length(s, layout));
    sample_ids.push_back(static_cast<int64_t>(b));
  }
  const int64_t rem = static_cast<int64_t>(tokens.size()) % layout.stream_multiple;
  if (rem != 0 || tokens.empty()) {
    const int64_t pad = tokens.empty() ? layout.stream_multiple : layout.stream_multiple - rem;
    push_seq({}, nullptr, 0, pad);
    sample_ids.push_back(-1);
  }

  Microbatch mb;
  const int64_t T = static_cast<int64_t>(tokens.size());
  mb.tokens = Tensor::from_vector(tokens, {T});
  mb.targets = Tensor::from_vector(targets, {T});
  mb.positions = Tensor::from_vector(positions, {T});
  mb.loss_mask = Tensor::from_vector(mask, {T});
  mb.cu_seqlens = Tensor::from_vector(cu, {static_cast<int64_t>(cu.size())});
  mb.nseq = static_cast<int64_t>(cu.size()) - 1;
  mb.max_seqlen = max_len;
  mb.num_loss_tokens = nloss;
  mb.seq_real = std::move(seq_real);
  mb.sample_ids = std::move(sample_ids);
  return mb;
}

std::vector<std::vector<int64_t>> pack_into_microbatches(const std::vector<int64_t>& lengths, int64_t budget,
                                                         int64_t count_multiple, int64_t min_count) {
  const int64_t n = static_cast<int64_t>(lengths.size());
  NDT_CHECK(n > 0, "packing: no samples");
  NDT_CHECK(count_multiple >= 1, "packing: microbatch count multiple must be >= 1");
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (lengths[static_cast<size_t>(i)] > budget)
      NDT_FAIL(
          "packing: a sample of {} tokens (after padding) exceeds the token budget data.pack_tokens = {}",
          lengths[static_cast<size_t>(i)], budget);
    total += lengths[static_cast<size_t>(i)];
  }
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return lengths[static_cast<size_t>(a)] > lengths[static_cast<size_t>(b)];
  });
  NDT_CHECK(min_count <= n, "packing: {} microbatches asked for {} samples", min_count, n);
  for (int64_t m = round_up(std::max<int64_t>({1, (total + budget - 1) / budget, min_count}), count_multiple);
       m <= n; m += count_multiple) {
    std::vector<std::vector<int64_t>> bins(static_cast<size_t>(m));
    std::vector<int64_t> load(static_cast<size_t>(m), 0);
    bool fits = true;
    for (int64_t i : order) {
      const size_t lightest = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
      load[lightest] += lengths[static_cast<size_t>(i)];
      if (load[lightest] > budget) {
        fits = false;
        break;
      }
      bins[lightest].push_back(i);
    }
    if (!fits) continue;
    for (auto& b : bins) std::sort(b.begin(), b.end());
    std::sort(bins.begin(), bins.end(), [](const auto& a, const auto& b) { return a.front() < b.front(); });
    return bins;
  }
  NDT_FAIL(
      "packing: {} samples ({} tokens) cannot be packed into a multiple of {} microbatches of at most {} "
      "tokens "
      "(raise data.pack_tokens or the samples per microbatch)",
      n, total, count_multiple, budget);
}

}  // namespace ndt
