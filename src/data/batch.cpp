// make_microbatch and the data order (sample_index); contracts in data/dataset.h.
#include <algorithm>

#include "core/rng.h"
#include "data/dataset.h"

namespace ndt {

Microbatch make_microbatch(const std::vector<Sample>& samples, int64_t seq_len, int32_t pad_id) {
  NDT_CHECK(!samples.empty(), "make_microbatch: no samples");
  NDT_CHECK(seq_len >= 1, "make_microbatch: seq_len must be >= 1 (got {})", seq_len);
  const int64_t nseq = static_cast<int64_t>(samples.size());
  const int64_t T = nseq * seq_len;
  Microbatch mb;
  mb.tokens = Tensor::empty({T}, DType::I32);
  mb.targets = Tensor::empty({T}, DType::I32);
  mb.loss_mask = Tensor::zeros({T}, DType::F32);
  mb.positions = Tensor::empty({T}, DType::I32);
  mb.cu_seqlens = Tensor::empty({nseq + 1}, DType::I32);
  int32_t* tok = mb.tokens.i32();
  int32_t* tgt = mb.targets.i32();
  float* mask = mb.loss_mask.f32();
  int32_t* pos = mb.positions.i32();
  int32_t* cu = mb.cu_seqlens.i32();
  int64_t nloss = 0;
  cu[0] = 0;
  for (int64_t b = 0; b < nseq; ++b) {
    const Sample& s = samples[static_cast<size_t>(b)];
    NDT_CHECK(s.tokens.size() == s.loss_mask.size(), "sample {}: {} tokens but {} mask entries", b,
              s.tokens.size(), s.loss_mask.size());
    NDT_CHECK(s.tokens.size() >= 2, "sample {} has {} token(s); a sample needs at least 2", b,
              s.tokens.size());
    // n inputs predict n targets; the rest of the row is padding (mask 0, target pad_id).
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(s.tokens.size()), seq_len + 1) - 1;
    const int64_t off = b * seq_len;
    for (int64_t i = 0; i < seq_len; ++i) {
      pos[off + i] = static_cast<int32_t>(i);
      if (i < n && s.loss_mask[static_cast<size_t>(i + 1)]) {
        tok[off + i] = s.tokens[static_cast<size_t>(i)];
        tgt[off + i] = s.tokens[static_cast<size_t>(i + 1)];
        mask[off + i] = 1.0f;
        ++nloss;
      } else {
        tok[off + i] = i < n ? s.tokens[static_cast<size_t>(i)] : pad_id;
        tgt[off + i] = pad_id;
      }
    }
    cu[b + 1] = static_cast<int32_t>(off + seq_len);
    mb.seq_real.push_back(static_cast<int32_t>(n));
    mb.sample_ids.push_back(b);
  }
  mb.nseq = nseq;
  mb.max_seqlen = seq_len;
  mb.num_loss_tokens = nloss;
  return mb;
}

int64_t Microbatch::num_real_tokens() const {
  int64_t n = 0;
  for (int32_t r : seq_real) n += r;
  return n;
}

int64_t Microbatch::num_real_seqs() const {
  int64_t n = 0;
  for (int32_t r : seq_real) n += r > 0;
  return n;
}

namespace {

// A bijection of [0, 2^(2*half)) by a 6-round balanced Feistel network keyed by (seed, epoch).
uint64_t feistel(uint64_t x, int half, uint64_t seed, uint64_t epoch) {
  const uint64_t mask = (uint64_t{1} << half) - 1;
  uint64_t l = x >> half, r = x & mask;
  for (uint64_t round = 0; round < 6; ++round) {
    const uint64_t f = philox_u64(seed, epoch * 8 + round + 0x5851F42D4C957F2Dull, r) & mask;
    const uint64_t nl = r;
    r = l ^ f;
    l = nl;
  }
  return (l << half) | r;
}

}  // namespace

int64_t sample_index(int64_t data_seed, int64_t step, int64_t j, int64_t global_batch, int64_t dataset_size,
                     bool shuffle) {
  NDT_CHECK(step >= 0 && j >= 0 && j < global_batch, "sample_index: step {} j {} global_batch {}", step, j,
            global_batch);
  const int64_t g = step * global_batch + j;  // global sample counter of the run
  if (dataset_size < 0) return g;
  NDT_CHECK(dataset_size > 0, "sample_index: empty dataset");
  if (!shuffle) return g % dataset_size;
  const uint64_t n = static_cast<uint64_t>(dataset_size);
  const uint64_t epoch = static_cast<uint64_t>(g) / n;
  uint64_t x = static_cast<uint64_t>(g) % n;
  // Cycle walking: apply the bijection of the smallest even-bit power of two >= n until the value lands
  // in [0, n). This restricts a permutation of [0, 2^bits) to a permutation of [0, n), in O(1) expected
  // steps (2^bits < 4n) and O(1) memory, whatever the dataset size.
  int bits = 2;
  while ((uint64_t{1} << bits) < n) bits += 2;
  do {
    x = feistel(x, bits / 2, static_cast<uint64_t>(data_seed), epoch);
  } while (x >= n);
  return static_cast<int64_t>(x);
}

}  // namespace ndt
