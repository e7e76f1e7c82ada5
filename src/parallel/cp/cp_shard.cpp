#include "parallel/cp/cp_shard.h"

#include "core/check.h"
#include "ops/ops.h"

namespace ndt {

std::vector<int64_t> cp_rows(const Microbatch& full, int64_t cp, int64_t r) {
  NDT_CHECK(cp >= 1 && r >= 0 && r < cp, "cp_shard: rank {} outside cp = {}", r, cp);
  const int32_t* cu = full.cu_seqlens.i32();
  NDT_CHECK(cu[full.nseq] == full.num_tokens(),
            "context parallelism needs every token inside a sequence (cu_seqlens ends at {}, {} tokens)",
            cu[full.nseq], full.num_tokens());
  std::vector<int64_t> rows;
  rows.reserve(static_cast<size_t>(full.num_tokens() / cp));
  for (int64_t s = 0; s < full.nseq; ++s) {
    const int64_t len = cu[s + 1] - cu[s];
    if (len % (2 * cp) != 0)
      NDT_FAIL(
          "context parallelism: sequence {} has {} tokens, not a multiple of 2*cp = {} (pad sequences to "
          "2*cp: data.seq_len must be a multiple of it)",
          s, len, 2 * cp);
    const int64_t c = len / (2 * cp);
    for (int64_t chunk : {r, 2 * cp - 1 - r})
      for (int64_t i = 0; i < c; ++i) rows.push_back(cu[s] + chunk * c + i);
  }
  return rows;
}

Microbatch cp_shard(const Microbatch& full, int64_t cp, int64_t r) {
  const std::vector<int64_t> rows = cp_rows(full, cp, r);
  const int32_t* cu = full.cu_seqlens.i32();
  const int32_t* pos = full.positions.i32();
  for (int64_t s = 0; s < full.nseq; ++s)
    for (int64_t t = cu[s]; t < cu[s + 1]; ++t)
      NDT_CHECK(pos[t] == t - cu[s], "context parallelism: positions must count 0.. inside each sequence");
  Microbatch mb;
  mb.tokens = ops::gather_rows(full.tokens, rows);
  mb.targets = ops::gather_rows(full.targets, rows);
  mb.loss_mask = ops::gather_rows(full.loss_mask, rows);
  mb.positions = ops::gather_rows(full.positions, rows);
  mb.cu_seqlens = Tensor::empty({full.nseq + 1}, DType::I32);
  for (int64_t s = 0; s <= full.nseq; ++s) mb.cu_seqlens.i32()[s] = static_cast<int32_t>(cu[s] / cp);
  mb.nseq = full.nseq;
  mb.max_seqlen = full.max_seqlen;
  mb.seq_real = full.seq_real;  // per sequence, global: positions stay global too
  mb.sample_ids = full.sample_ids;
  int64_t n = 0;
  for (int64_t t = 0; t < mb.num_tokens(); ++t) n += mb.loss_mask.f32()[t] != 0.0f;
  mb.num_loss_tokens = n;
  return mb;
}

std::vector<int32_t> cp_positions(const Tensor& local_cu, int64_t cp, int64_t owner) {
  const int32_t* cu = local_cu.i32();
  const int64_t nseq = local_cu.numel() - 1;
  std::vector<int32_t> pos;
  pos.reserve(static_cast<size_t>(cu[nseq]));
  for (int64_t s = 0; s < nseq; ++s) {
    const int64_t c = (cu[s + 1] - cu[s]) / 2;
    for (int64_t chunk : {owner, 2 * cp - 1 - owner})
      for (int64_t i = 0; i < c; ++i) pos.push_back(static_cast<int32_t>(chunk * c + i));
  }
  return pos;
}

}  // namespace ndt
