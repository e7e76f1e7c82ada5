#include "train/token_loss.h"

#include "core/check.h"

namespace ndt {

std::vector<RowSource> row_sources(const Microbatch& mb) {
  NDT_CHECK(static_cast<int64_t>(mb.sample_ids.size()) == mb.nseq,
            "microbatch has {} sample ids for {} sequences (built without them?)", mb.sample_ids.size(),
            mb.nseq);
  const int64_t T = mb.num_tokens();
  std::vector<RowSource> out(static_cast<size_t>(T));
  const int32_t* cu = mb.cu_seqlens.i32();
  const int32_t* pos = mb.positions.i32();
  for (int64_t s = 0; s < mb.nseq; ++s)
    for (int64_t t = cu[s]; t < cu[s + 1]; ++t)
      out[static_cast<size_t>(t)] = {mb.sample_ids[static_cast<size_t>(s)], pos[t] + 1};
  return out;
}

}  // namespace ndt
