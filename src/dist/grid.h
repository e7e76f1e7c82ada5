#pragma once
// Grid: named parallel axes over the ranks of a communicator.
// Axes: tp, cp, ep, dp, pp with sizes and an order (innermost first, default "tp-cp-ep-dp-pp"): the
// rank is decomposed as rank = c0 + s0 * (c1 + s1 * (c2 + ...)) over the axes in that order.
// (EP folds onto data-parallel ranks in later work; here it is an ordinary axis whose size is 1
// unless set.) No global state: two Grids may cover the same ranks (an encoder and an LLM layout).
#include <array>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "dist/communicator.h"

namespace ndt {

struct GridSpec {
  std::map<std::string, int64_t> sizes;  // axis name -> degree (missing axes are 1)
  std::string order = "tp-cp-ep-dp-pp";  // innermost first; must name each of the five axes once
};

// What the degrees must divide; zero fields are not checked.
struct GridDivisibility {
  int64_t n_heads = 0, n_kv_heads = 0, vocab_size = 0, n_layers = 0, global_batch = 0, d_ff = 0;
  int64_t virtual_stages = 1;
};

class Grid {
 public:
  // Validates and builds the grid over `world` (collective over world: sub-communicators are created
  // here). Errors (product != world size, unknown axis, bad order, degree not dividing heads / KV
  // heads / vocab / layers / batch) list every degree, e.g.
  //   "layout tp=3 cp=1 ep=1 dp=2 pp=1 (product 6) does not match world size 4".
  static Result<std::unique_ptr<Grid>> create(Communicator& world, const GridSpec& spec,
                                              const GridDivisibility& div = {});
  // Pure validation without building communicators (used by tests and before any work starts).
  static Status validate(int world_size, const GridSpec& spec, const GridDivisibility& div = {});

  int64_t size(const std::string& axis) const;
  int64_t coord(const std::string& axis) const;  // this rank's coordinate along the axis
  int world_rank() const;
  int world_size() const;
  // The communicator over the ranks that differ from this one only along the given axes, e.g.
  // comm({"dp"}), comm({"dp", "cp"}) (group rank order follows the grid order). Cached.
  Communicator& comm(const std::vector<std::string>& axes);
  std::string describe() const;  // "tp=2 cp=1 ep=1 dp=2 pp=1"

 private:
  Grid() = default;
  Communicator* world_ = nullptr;
  std::vector<std::string> order_;
  std::map<std::string, int64_t> sizes_;
  std::map<std::string, int64_t> coords_;
  std::map<std::string, std::unique_ptr<Communicator>> comms_;
};

}  // namespace ndt
