#pragma once
// Expert parallelism enters the MoE layer only through this interface (model/ never depends on dist/);
// parallel/ep implements it with all-to-all over the EP group. The default is one rank holding every
// expert: the plan keeps the counts and dispatch/combine are the identity.
//
// Rows travel grouped by expert. Before dispatch a rank holds its rows sorted by GLOBAL expert id
// (counts[e] rows for expert e, e = 0..E-1); EP rank r owns experts [r·El, (r+1)·El), El = E/ep.
// After dispatch a rank holds the rows of its own experts sorted by LOCAL expert, and inside one expert
// by source rank (then in the source's order): local_counts[e] rows for local expert e. combine() is the
// exact inverse (rows return to their source in their original order), so the backward of dispatch is
// combine and the backward of combine is dispatch.
#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace ndt {

struct EpPlan {
  std::vector<int64_t> send_rows;     // (ep) rows this rank sends to each EP rank in dispatch
  std::vector<int64_t> recv_rows;     // (ep) rows it receives from each EP rank
  std::vector<int64_t> recv_counts;   // (ep * El) rows from source r for local expert e at [r * El + e]
  std::vector<int64_t> local_counts;  // (El) rows per local expert after dispatch
};

class EpHooks {
 public:
  virtual ~EpHooks() = default;
  virtual int size() const { return 1; }
  virtual int rank() const { return 0; }
  // Collective over EP (exchanges the row counts). counts: (E) rows per global expert on this rank.
  virtual EpPlan plan(const std::vector<int64_t>& counts) {
    EpPlan p;
    const int64_t n = sum(counts);
    p.send_rows = {n};
    p.recv_rows = {n};
    p.recv_counts = counts;
    p.local_counts = counts;
    return p;
  }
  // Collective over EP. x (rows, C) grouped by global expert -> (local rows, C) grouped by local expert.
  virtual Tensor dispatch(const Tensor& x, const EpPlan& plan) { return x; }
  // Collective over EP. The inverse of dispatch.
  virtual Tensor combine(const Tensor& y, const EpPlan& plan) { return y; }

 protected:
  static int64_t sum(const std::vector<int64_t>& v) {
    int64_t n = 0;
    for (int64_t x : v) n += x;
    return n;
  }
};

}  // namespace ndt
