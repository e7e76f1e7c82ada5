#pragma once
// A replay of the device allocator's bookkeeping: allocations and frees in program order, the live total
// and its high-water mark (what cuda::memory_stats().peak_allocated_gib reports), with a label of where
// the peak happened. Sizes are rounded like Tensor::empty rounds CUDA allocations.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace ndt::plan {

class AllocTrace {
 public:
  using Id = int64_t;
  static constexpr Id kNone = -1;  // "no allocation": the tensor aliases another one

  // granule: the allocation rounding (256 on CUDA; 1 to count exact tensor bytes).
  explicit AllocTrace(int64_t granule = 256) : granule_(granule) {}

  Id alloc(int64_t bytes) {
    const int64_t b = (std::max<int64_t>(bytes, 1) + granule_ - 1) / granule_ * granule_;
    sizes_.push_back(b);
    live_ += b;
    if (live_ > peak_) {
      peak_ = live_;
      peak_at_ = where_;
    }
    return static_cast<Id>(sizes_.size()) - 1;
  }
  void free(Id id) {
    if (id == kNone) return;
    int64_t& b = sizes_.at(static_cast<size_t>(id));
    live_ -= b;
    b = 0;  // freeing twice is harmless; a tensor's storage is released once
  }
  void free(const std::vector<Id>& ids) {
    for (Id i : ids) free(i);
  }
  // The phase that allocations from now on belong to (reported with the peak).
  void at(std::string where) { where_ = std::move(where); }
  // Starts a new window: peak() is then measured from the live total now.
  void reset_peak() {
    peak_ = live_;
    peak_at_ = where_;
  }
  int64_t live() const { return live_; }
  int64_t peak() const { return peak_; }
  const std::string& peak_at() const { return peak_at_; }

 private:
  int64_t granule_;
  std::vector<int64_t> sizes_;
  int64_t live_ = 0, peak_ = 0;
  std::string where_, peak_at_;
};

}  // namespace ndt::plan
