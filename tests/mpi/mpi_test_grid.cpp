// Grid tests on 8 ranks: coordinates, every axis subset's group (members, order, reductions), axis
// order, and two grids over the same ranks used interleaved.
#include <gtest/gtest.h>

#include <map>

#include "dist/grid.h"

namespace ndt {
namespace {

const std::vector<std::string> kOrderAll = {"tp", "cp", "ep", "dp", "pp"};

std::unique_ptr<Grid> make_grid(Communicator& world, std::map<std::string, int64_t> sizes,
                                std::string order = "tp-cp-ep-dp-pp") {
  GridSpec spec;
  spec.sizes = std::move(sizes);
  spec.order = std::move(order);
  auto g = Grid::create(world, spec);
  if (!g) ADD_FAILURE() << g.status().message();
  return std::move(g).value();
}

std::vector<std::string> split_order(const std::string& order) {
  std::vector<std::string> out;
  size_t start = 0;
  for (size_t i = 0; i <= order.size(); ++i)
    if (i == order.size() || order[i] == '-') out.push_back(order.substr(start, i - start)), start = i + 1;
  return out;
}

// Coordinates of world rank r (innermost axis first), computed independently of Grid.
std::map<std::string, int64_t> coords_of(int r, const std::vector<std::string>& order,
                                         const std::map<std::string, int64_t>& sizes) {
  std::map<std::string, int64_t> c;
  for (const std::string& a : order) {
    const int64_t s = sizes.count(a) ? sizes.at(a) : 1;
    c[a] = r % s;
    r /= static_cast<int>(s);
  }
  return c;
}

// Checks comm(axes) for every non-empty subset: members are the ranks equal to us off the axes,
// ordered by their mixed-radix index along the axes (grid order), and sums reach exactly them.
void check_all_groups(Grid& g, const std::string& order, const std::map<std::string, int64_t>& sizes) {
  const std::vector<std::string> ord = split_order(order);
  const int me = g.world_rank();
  const auto mine = coords_of(me, ord, sizes);
  for (int mask = 1; mask < 32; ++mask) {
    std::vector<std::string> axes;
    for (int i = 0; i < 5; ++i)
      if (mask & (1 << i)) axes.push_back(kOrderAll[i]);  // canonical order, not grid order
    std::map<int64_t, int> expect;                        // index along axes -> world rank
    for (int r = 0; r < g.world_size(); ++r) {
      const auto c = coords_of(r, ord, sizes);
      bool same = true;
      int64_t idx = 0, stride = 1;
      for (const std::string& a : ord) {
        const bool in = std::find(axes.begin(), axes.end(), a) != axes.end();
        if (in)
          idx += c.at(a) * stride, stride *= sizes.count(a) ? sizes.at(a) : 1;
        else
          same &= c.at(a) == mine.at(a);
      }
      if (same) expect[idx] = r;
    }
    std::vector<int> members;
    for (auto& [idx, r] : expect) members.push_back(r);
    Communicator& c = g.comm(axes);
    std::string name;
    for (auto& a : axes) name += a + " ";
    EXPECT_EQ(c.world_ranks(), members) << "axes " << name;
    EXPECT_EQ(c.world_ranks()[static_cast<size_t>(c.rank())], me) << "axes " << name;
    int64_t sum = me;
    c.all_reduce(&sum, 1, DType::I64, ReduceOp::Sum);
    int64_t esum = 0;
    for (int r : members) esum += r;
    EXPECT_EQ(sum, esum) << "axes " << name;
  }
}

TEST(GridMpi, Tp2Dp2Pp2Coords) {
  auto world = make_mpi_world();
  ASSERT_EQ(world->size(), 8);
  auto g = make_grid(*world, {{"tp", 2}, {"dp", 2}, {"pp", 2}});
  const int r = world->rank();
  EXPECT_EQ(g->coord("tp"), r % 2);
  EXPECT_EQ(g->coord("dp"), (r / 2) % 2);
  EXPECT_EQ(g->coord("pp"), r / 4);
  EXPECT_EQ(g->coord("cp"), 0);
  EXPECT_EQ(g->coord("ep"), 0);
  EXPECT_EQ(g->size("tp"), 2);
  EXPECT_EQ(g->size("cp"), 1);
  EXPECT_EQ(g->describe(), "tp=2 cp=1 ep=1 dp=2 pp=2");
  EXPECT_EQ(g->world_size(), 8);

  // tp groups are {0,1}, {2,3}, ...: the sum of world ranks is 4 * (r / 2) + 1.
  int32_t s = r;
  g->comm({"tp"}).all_reduce(&s, 1, DType::I32, ReduceOp::Sum);
  EXPECT_EQ(s, 4 * (r / 2) + 1);
  // dp groups are {0,2}, {1,3}, {4,6}, {5,7}.
  EXPECT_EQ(g->comm({"dp"}).world_ranks(),
            (std::vector<int>{r - 2 * ((r / 2) % 2), r - 2 * ((r / 2) % 2) + 2}));
  // Axes in any order name the same cached communicator.
  EXPECT_EQ(&g->comm({"pp", "tp"}), &g->comm({"tp", "pp"}));
  EXPECT_THROW(g->comm({"xx"}), Error);
  EXPECT_THROW(g->comm({"tp", "tp"}), Error);
  check_all_groups(*g, "tp-cp-ep-dp-pp", {{"tp", 2}, {"dp", 2}, {"pp", 2}});
}

TEST(GridMpi, NonDefaultOrder) {
  auto world = make_mpi_world();
  const std::string order = "dp-pp-cp-tp-ep";
  const std::map<std::string, int64_t> sizes = {{"tp", 2}, {"dp", 2}, {"pp", 2}};
  auto g = make_grid(*world, sizes, order);
  const int r = world->rank();
  EXPECT_EQ(g->coord("dp"), r % 2);
  EXPECT_EQ(g->coord("pp"), (r / 2) % 2);
  EXPECT_EQ(g->coord("tp"), r / 4);
  // tp now strides by 4: groups {0,4}, {1,5}, ...
  EXPECT_EQ(g->comm({"tp"}).world_ranks(), (std::vector<int>{r % 4, r % 4 + 4}));
  check_all_groups(*g, order, sizes);
}

TEST(GridMpi, CpAndEpAxes) {
  auto world = make_mpi_world();
  const std::map<std::string, int64_t> sizes = {{"cp", 2}, {"ep", 2}, {"dp", 2}};
  auto g = make_grid(*world, sizes, "ep-tp-dp-cp-pp");
  check_all_groups(*g, "ep-tp-dp-cp-pp", sizes);
}

TEST(GridMpi, TwoLayoutsOverTheSameRanks) {
  // An encoder (tp2 dp4) and an LLM (tp4 dp2) on the same 8 ranks, used interleaved: each reduction
  // must reach exactly its own grid's group.
  auto world = make_mpi_world();
  auto enc = make_grid(*world, {{"tp", 2}, {"dp", 4}});
  auto llm = make_grid(*world, {{"tp", 4}, {"dp", 2}});
  const int r = world->rank();
  for (int step = 0; step < 3; ++step) {
    int64_t a = r + 100 * step, b = r + 1000 * step, c = r, d = r;
    enc->comm({"tp"}).all_reduce(&a, 1, DType::I64, ReduceOp::Sum);
    llm->comm({"tp"}).all_reduce(&b, 1, DType::I64, ReduceOp::Sum);
    llm->comm({"dp"}).all_reduce(&d, 1, DType::I64, ReduceOp::Max);
    enc->comm({"dp"}).all_reduce(&c, 1, DType::I64, ReduceOp::Max);
    EXPECT_EQ(a, 4 * (r / 2) + 1 + 200 * step);    // {2k, 2k+1}
    EXPECT_EQ(b, 16 * (r / 4) + 6 + 4000 * step);  // {4k..4k+3}
    EXPECT_EQ(c, r % 2 + 6);                       // {r%2, r%2+2, +4, +6}
    EXPECT_EQ(d, r % 4 + 4);                       // {r%4, r%4+4}
  }
}

TEST(GridMpi, CreateRejectsBadLayoutOnEveryRank) {
  auto world = make_mpi_world();
  GridSpec spec;
  spec.sizes = {{"tp", 3}, {"dp", 2}};
  auto g = Grid::create(*world, spec);
  ASSERT_FALSE(g.is_ok());
  EXPECT_EQ(g.status().message(), "layout tp=3 cp=1 ep=1 dp=2 pp=1 (product 6) does not match world size 8");
}

}  // namespace
}  // namespace ndt
