// Fuzz target: token shards (data/shards.h). The input is a whole .bin shard: TokenShard::open validates
// the header and every id, read_token_shard reads it, and ShardDataset windows it (seq_len 3).
#include "data/shards.h"
#include "fuzz_common.h"

using namespace ndt;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string in = fuzz::write_file("in.bin", fuzz::as_text(data, size));
  try {
    ShardHeader h;
    auto tokens = read_token_shard(in, &h);
    if (!tokens) return 0;
    for (int32_t t : tokens.value())
      if (t < 0 || static_cast<uint64_t>(t) >= h.vocab_size)
        fuzz::property_failed("token id", "outside [0, vocab_size)");
    auto d = ShardDataset::open(in, 3);
    if (!d) return 0;
    for (int64_t i = 0; i < std::min<int64_t>(d.value()->size(), 16); ++i) {
      const Sample s = d.value()->get(i);
      if (s.tokens.size() != 4) fuzz::property_failed("window", "not seq_len + 1 tokens");
    }
  } catch (const Error&) {
  }
  return 0;
}
