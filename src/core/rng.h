#pragma once
// Counter-based random numbers (Philox4x32-10). A value is a pure function of (seed, stream key,
// counter), so any process can generate exactly its slice of a global tensor: parameter init keys
// the stream by the global parameter name and the counter by the global element index. No state,
// no rank in the key: every layout draws identical numbers.
#include <array>
#include <cstdint>
#include <string_view>

namespace ndt {

// 64-bit FNV-1a: stable across platforms and runs (std::hash is not).
uint64_t stable_hash(std::string_view s);

// Four 32-bit random words for (key, counter).
std::array<uint32_t, 4> philox4x32(uint64_t key, uint64_t counter_hi, uint64_t counter_lo);

// Uniform in [0, 1) for element `index` of stream (seed, stream).
float philox_uniform(uint64_t seed, uint64_t stream, uint64_t index);
// Standard normal (Box-Muller on two uniforms of the same counter) for element `index`.
float philox_normal(uint64_t seed, uint64_t stream, uint64_t index);
// 64 random bits for element `index` (data order, sampling).
uint64_t philox_u64(uint64_t seed, uint64_t stream, uint64_t index);

// Convenience: a deterministic generator walking the counter of one stream (for data generation,
// where the draw order is itself a function of global indices).
class CounterRng {
 public:
  CounterRng(uint64_t seed, uint64_t stream) : seed_(seed), stream_(stream) {}
  uint64_t next_u64() { return philox_u64(seed_, stream_, counter_++); }
  // Uniform integer in [lo, hi] inclusive.
  int64_t uniform_int(int64_t lo, int64_t hi);
  float uniform() { return philox_uniform(seed_, stream_, counter_++); }

 private:
  uint64_t seed_, stream_, counter_ = 0;
};

}  // namespace ndt
