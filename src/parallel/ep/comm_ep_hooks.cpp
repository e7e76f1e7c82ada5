#include "parallel/ep/comm_ep_hooks.h"

#include "ops/ops.h"

namespace ndt {
namespace {

std::vector<int64_t> offsets_of(const std::vector<int64_t>& counts) {
  std::vector<int64_t> off(counts.size(), 0);
  for (size_t i = 1; i < counts.size(); ++i) off[i] = off[i - 1] + counts[i - 1];
  return off;
}

std::vector<int64_t> times(std::vector<int64_t> v, int64_t f) {
  for (int64_t& x : v) x *= f;
  return v;
}

// Row order of the received (source-major) buffer that makes it expert-major, and its inverse.
std::vector<int64_t> expert_major_order(const EpPlan& p, int64_t ep, int64_t El) {
  std::vector<int64_t> src_off(static_cast<size_t>(ep * El), 0);
  for (int64_t i = 1; i < ep * El; ++i)
    src_off[static_cast<size_t>(i)] =
        src_off[static_cast<size_t>(i - 1)] + p.recv_counts[static_cast<size_t>(i - 1)];
  std::vector<int64_t> order;
  for (int64_t e = 0; e < El; ++e)
    for (int64_t r = 0; r < ep; ++r) {
      const size_t i = static_cast<size_t>(r * El + e);
      for (int64_t j = 0; j < p.recv_counts[i]; ++j) order.push_back(src_off[i] + j);
    }
  return order;
}

}  // namespace

EpPlan CommEpHooks::plan(const std::vector<int64_t>& counts) {
  const int64_t ep = size(), E = static_cast<int64_t>(counts.size());
  NDT_CHECK(E % ep == 0, "expert parallelism: {} experts do not divide over ep = {}", E, ep);
  const int64_t El = E / ep;
  EpPlan p;
  p.recv_counts.assign(static_cast<size_t>(ep * El), 0);
  // Rank r receives, from every source, the counts of r's experts: a block of El counts each way.
  const std::vector<int64_t> block(static_cast<size_t>(ep), El), off = offsets_of(block);
  host_.all_to_all_v(counts.data(), block, off, p.recv_counts.data(), block, off, DType::I64);
  p.send_rows.assign(static_cast<size_t>(ep), 0);
  p.recv_rows.assign(static_cast<size_t>(ep), 0);
  p.local_counts.assign(static_cast<size_t>(El), 0);
  for (int64_t r = 0; r < ep; ++r)
    for (int64_t e = 0; e < El; ++e) {
      p.send_rows[static_cast<size_t>(r)] += counts[static_cast<size_t>(r * El + e)];
      p.recv_rows[static_cast<size_t>(r)] += p.recv_counts[static_cast<size_t>(r * El + e)];
      p.local_counts[static_cast<size_t>(e)] += p.recv_counts[static_cast<size_t>(r * El + e)];
    }
  return p;
}

Tensor CommEpHooks::dispatch(const Tensor& x, const EpPlan& p) {
  const int64_t C = x.size(1), ep = size(), El = static_cast<int64_t>(p.local_counts.size());
  const int64_t n = sum(p.recv_rows);
  Tensor recv = Tensor::empty({n, C}, x.dtype(), x.device());
  data_.all_to_all_v(x.data_ptr(), times(p.send_rows, C), times(offsets_of(p.send_rows), C), recv.data_ptr(),
                     times(p.recv_rows, C), times(offsets_of(p.recv_rows), C), x.dtype());
  if (ep == 1 || n == 0) return recv;
  return ops::gather_rows(recv, expert_major_order(p, ep, El));
}

Tensor CommEpHooks::combine(const Tensor& y, const EpPlan& p) {
  const int64_t C = y.size(1), ep = size(), El = static_cast<int64_t>(p.local_counts.size());
  Tensor src_major = y;
  if (ep > 1 && y.size(0) > 0) {
    const std::vector<int64_t> order = expert_major_order(p, ep, El);
    std::vector<int64_t> inverse(order.size());
    for (size_t i = 0; i < order.size(); ++i)
      inverse[static_cast<size_t>(order[i])] = static_cast<int64_t>(i);
    src_major = ops::gather_rows(y, inverse);
  }
  const int64_t n = sum(p.send_rows);
  Tensor out = Tensor::empty({n, C}, y.dtype(), y.device());
  data_.all_to_all_v(src_major.data_ptr(), times(p.recv_rows, C), times(offsets_of(p.recv_rows), C),
                     out.data_ptr(), times(p.send_rows, C), times(offsets_of(p.send_rows), C), y.dtype());
  return out;
}

}  // namespace ndt
