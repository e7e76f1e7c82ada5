// Grid: named axes over a communicator's ranks. All sub-communicators are built in create() (one
// split per non-empty subset of axes, in a fixed order), so comm() is a lookup that never communicates
// and cannot be called by some ranks only.
#include "dist/grid.h"

#include <algorithm>
#include <set>
#include <sstream>

namespace ndt {
namespace {

const std::vector<std::string> kAxes = {"tp", "cp", "ep", "dp", "pp"};  // canonical (print) order

bool known_axis(const std::string& a) { return std::find(kAxes.begin(), kAxes.end(), a) != kAxes.end(); }

int64_t degree(const GridSpec& spec, const std::string& axis) {
  auto it = spec.sizes.find(axis);
  return it == spec.sizes.end() ? 1 : it->second;
}

std::string layout_of(const GridSpec& spec) {
  std::string s;
  for (const std::string& a : kAxes) s += fmt::format("{}{}={}", s.empty() ? "" : " ", a, degree(spec, a));
  return s;
}

std::vector<std::string> split_order(const std::string& order) {
  std::vector<std::string> out;
  std::stringstream ss(order);
  std::string tok;
  while (std::getline(ss, tok, '-')) out.push_back(tok);
  if (!order.empty() && order.back() == '-') out.push_back("");
  return out;
}

}  // namespace

Status Grid::validate(int world_size, const GridSpec& spec, const GridDivisibility& div) {
  const std::string layout = layout_of(spec);
  for (const auto& [axis, deg] : spec.sizes)
    if (!known_axis(axis))
      return Status::error(
          fmt::format("unknown parallel axis '{}' (axes are tp, cp, ep, dp, pp; layout {})", axis, layout));
  std::set<std::string> seen;
  for (const std::string& a : split_order(spec.order)) {
    if (!known_axis(a))
      return Status::error(fmt::format(
          "unknown axis '{}' in order '{}' (axes are tp, cp, ep, dp, pp; layout {})", a, spec.order, layout));
    if (!seen.insert(a).second)
      return Status::error(fmt::format(
          "axis '{}' appears twice in order '{}' (each of tp, cp, ep, dp, pp exactly once; layout {})", a,
          spec.order, layout));
  }
  for (const std::string& a : kAxes)
    if (!seen.count(a))
      return Status::error(fmt::format(
          "order '{}' does not name axis '{}' (each of tp, cp, ep, dp, pp exactly once; layout {})",
          spec.order, a, layout));
  for (const std::string& a : kAxes)
    if (degree(spec, a) < 1)
      return Status::error(
          fmt::format("degree {}={} must be at least 1 (layout {})", a, degree(spec, a), layout));
  int64_t product = 1;
  bool overflow = false;
  for (const std::string& a : kAxes) overflow |= __builtin_mul_overflow(product, degree(spec, a), &product);
  if (overflow || product != world_size)
    return Status::error(fmt::format("layout {} (product {}) does not match world size {}", layout,
                                     overflow ? std::string("overflows") : std::to_string(product),
                                     world_size));
  if (div.virtual_stages < 1)
    return Status::error(
        fmt::format("virtual_stages={} must be at least 1 (layout {})", div.virtual_stages, layout));

  // Report every violated divisibility rule at once: fixing one at a time is tedious.
  std::vector<std::string> errs;
  auto need = [&](const std::string& axis, int64_t value, const char* what) {
    const int64_t d = degree(spec, axis);
    if (value != 0 && value % d != 0)
      errs.push_back(fmt::format("{}={} does not divide {}={}", axis, d, what, value));
  };
  need("tp", div.n_heads, "n_heads");
  need("tp", div.n_kv_heads, "n_kv_heads");
  need("tp", div.vocab_size, "vocab_size");
  need("tp", div.d_ff, "d_ff");
  need("dp", div.global_batch, "global_batch");
  const int64_t pp = degree(spec, "pp");
  if (div.n_layers != 0 && div.n_layers % (pp * div.virtual_stages) != 0)
    errs.push_back(div.virtual_stages == 1
                       ? fmt::format("pp={} does not divide n_layers={}", pp, div.n_layers)
                       : fmt::format("pp={} x virtual_stages={} = {} does not divide n_layers={}", pp,
                                     div.virtual_stages, pp * div.virtual_stages, div.n_layers));
  if (errs.empty()) return Status::ok();
  std::string msg;
  for (const std::string& e : errs) msg += (msg.empty() ? "" : "; ") + e;
  return Status::error(fmt::format("{} (layout {})", msg, layout));
}

Result<std::unique_ptr<Grid>> Grid::create(Communicator& world, const GridSpec& spec,
                                           const GridDivisibility& div) {
  Status st = validate(world.size(), spec, div);
  if (!st) return st;
  std::unique_ptr<Grid> g(new Grid());
  g->world_ = &world;
  g->order_ = split_order(spec.order);
  for (const std::string& a : kAxes) g->sizes_[a] = degree(spec, a);
  int64_t r = world.rank();
  for (const std::string& a : g->order_) {
    g->coords_[a] = r % g->sizes_[a];
    r /= g->sizes_[a];
  }
  // One split per non-empty subset of axes (bit i = order_[i]), always in the same order on every rank.
  // Within a group the key is the mixed-radix index of the coords along the chosen axes (grid order);
  // the color is the same index along the other axes, which identifies the group.
  const int n = static_cast<int>(g->order_.size());
  for (int mask = 1; mask < (1 << n); ++mask) {
    int64_t color = 0, key = 0, cstride = 1, kstride = 1, group_size = 1;
    std::string name;
    for (int i = 0; i < n; ++i) {
      const std::string& a = g->order_[static_cast<size_t>(i)];
      if (mask & (1 << i)) {
        key += g->coords_[a] * kstride;
        kstride *= g->sizes_[a];
        group_size *= g->sizes_[a];
        name += (name.empty() ? "" : ",") + a;
      } else {
        color += g->coords_[a] * cstride;
        cstride *= g->sizes_[a];
      }
    }
    std::unique_ptr<Communicator> c = world.split(static_cast<int>(color), static_cast<int>(key));
    NDT_CHECK(c && c->size() == group_size && c->rank() == key, "grid {}: split for axes {} gave a bad group",
              g->describe(), name);
    g->comms_[name] = std::move(c);
  }
  return g;
}

int64_t Grid::size(const std::string& axis) const {
  auto it = sizes_.find(axis);
  NDT_CHECK(it != sizes_.end(), "unknown axis '{}' (axes are tp, cp, ep, dp, pp)", axis);
  return it->second;
}

int64_t Grid::coord(const std::string& axis) const {
  auto it = coords_.find(axis);
  NDT_CHECK(it != coords_.end(), "unknown axis '{}' (axes are tp, cp, ep, dp, pp)", axis);
  return it->second;
}

int Grid::world_rank() const { return world_->rank(); }
int Grid::world_size() const { return world_->size(); }

Communicator& Grid::comm(const std::vector<std::string>& axes) {
  NDT_CHECK(!axes.empty(), "Grid::comm needs at least one axis");
  std::set<std::string> want;
  for (const std::string& a : axes) {
    NDT_CHECK(known_axis(a), "unknown axis '{}' (axes are tp, cp, ep, dp, pp)", a);
    NDT_CHECK(want.insert(a).second, "axis '{}' given twice to Grid::comm", a);
  }
  std::string name;
  for (const std::string& a : order_)
    if (want.count(a)) name += (name.empty() ? "" : ",") + a;
  auto it = comms_.find(name);
  NDT_CHECK(it != comms_.end(), "no communicator for axes {}", name);
  return *it->second;
}

std::string Grid::describe() const {
  std::string s;
  for (const std::string& a : kAxes) s += fmt::format("{}{}={}", s.empty() ? "" : " ", a, sizes_.at(a));
  return s;
}

}  // namespace ndt
