// Fuzz target: checkpoint indexes (train/checkpoint.h). The input is a step directory's index.json, next to
// two valid shard files of a small 3-tensor model saved by two TP-like ranks (made at start-up):
//   - read_checkpoint_meta parses and validates it (format, version, slices, shard file names);
//   - load_checkpoint assembles an unsharded store (with Adam moments) and a differently sharded one
//     from whatever the index says, so slice boxes, coverage and shard lookups all run on fuzzed values;
//   - checkpoint_slices_from_json reads it as a slice list (what ranks send rank 0 during a save); a list
//     that parses must round-trip through checkpoint_slices_to_json, and write_checkpoint_index must
//     either refuse it or write an index that read_checkpoint_meta accepts.
// NDT_FUZZ_DUMP_SEED=DIR writes the valid index.json (the seed corpus's) to DIR/index.json.
#include <cstdlib>
#include <memory>

#include "fuzz_common.h"
#include "model/params.h"
#include "train/checkpoint.h"

using namespace ndt;

namespace {

// "a" (4, 6), "b" (5) always whole, "c" (3, 4, 2): "a" split along a_dim and "c" along dim 1 into
// a_shards / c_shards pieces, of which this store holds piece `rank` (1 piece: the whole tensor).
std::unique_ptr<ParamStore> make_store(int a_dim, int64_t a_shards, int64_t c_shards, int64_t rank) {
  auto s = std::make_unique<ParamStore>();
  s->add("a", {4, 6}, InitKind::Normal, 1.0f, true, a_dim, a_shards, rank);
  s->add("b", {5}, InitKind::Normal, 1.0f, false);
  s->add("c", {3, 4, 2}, InitKind::Normal, 1.0f, true, 1, c_shards, rank);
  s->flatten();
  return s;
}

Tensor filled(int64_t n, float base) {
  Tensor t = Tensor::empty({n});
  for (int64_t i = 0; i < n; ++i) t.f32()[i] = base + static_cast<float>(i);
  return t;
}

const std::string& step_dir() {
  static const std::string dir = [] {
    const std::string d = fuzz::path("ckpt/step-00000007");
    std::vector<CheckpointSlice> all;
    for (int64_t r = 0; r < 2; ++r) {
      auto s = make_store(0, 2, 2, r);  // as saved by 2 TP ranks
      s->init(1234);
      const int64_t n = s->flat_values().numel();
      auto sl = write_checkpoint_shard(d, fmt::format("shard-{}.safetensors", r), *s, filled(n, 0.5f),
                                       filled(n, 100.0f));
      if (!sl) fuzz::property_failed("setup", sl.status().message());
      all.insert(all.end(), sl.value().begin(), sl.value().end());
    }
    CheckpointMeta meta{7, 7, "model:\n  d_model: 8\n", "tp=2"};
    Status st = write_checkpoint_index(d, all, meta, true);
    if (!st) fuzz::property_failed("setup", st.message());
    if (const char* out = std::getenv("NDT_FUZZ_DUMP_SEED")) {
      std::filesystem::copy_file(d + "/index.json", std::string(out) + "/index.json",
                                 std::filesystem::copy_options::overwrite_existing);
      std::fprintf(stderr, "wrote %s/index.json and slices.json\n", out);
      std::ofstream(std::string(out) + "/slices.json") << checkpoint_slices_to_json(all);
    }
    return d;
  }();
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& dir = step_dir();
  const std::string text(fuzz::as_text(data, size));
  fuzz::write_file("ckpt/step-00000007/index.json", text);
  fuzz::guarded([&] {
    auto meta = read_checkpoint_meta(dir);
    if (!meta) return;
    auto full = make_store(0, 1, 1, 0);
    const int64_t n = full->flat_values().numel();
    Tensor m = Tensor::zeros({n}), v = Tensor::zeros({n});
    (void)load_checkpoint(dir, *full, &m, &v);
    auto part = make_store(1, 3, 4, 2);  // "a" in 3 along dim 1, "c" in 4: the third piece
    (void)load_checkpoint(dir, *part, nullptr, nullptr);
  });
  fuzz::guarded([&] {
    auto slices = checkpoint_slices_from_json(text);
    if (!slices) return;
    const std::string again = checkpoint_slices_to_json(slices.value());
    auto back = checkpoint_slices_from_json(again);
    if (!back || checkpoint_slices_to_json(back.value()) != again)
      fuzz::property_failed("slice list round trip", again);
    const std::string out = fuzz::path("ckpt2/step-00000001");
    std::filesystem::create_directories(out);
    if (write_checkpoint_index(out, slices.value(), CheckpointMeta{}, false)) {
      auto meta = read_checkpoint_meta(out);
      if (!meta) fuzz::property_failed("written index does not read back", meta.status().message());
    }
  });
  return 0;
}
