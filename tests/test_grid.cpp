// Grid::validate (pure, no communication) and Grid over a one-rank communicator. Every error message
// must name the violated rule and list all five degrees.
#include <gtest/gtest.h>

#include "dist/grid.h"

namespace ndt {
namespace {

GridSpec spec(std::map<std::string, int64_t> sizes, std::string order = "tp-cp-ep-dp-pp") {
  GridSpec s;
  s.sizes = std::move(sizes);
  s.order = std::move(order);
  return s;
}

void expect_error(const Status& st, const std::string& rule, const std::string& layout) {
  ASSERT_FALSE(st.is_ok()) << "expected an error mentioning: " << rule;
  EXPECT_NE(st.message().find(rule), std::string::npos) << st.message();
  EXPECT_NE(st.message().find(layout), std::string::npos) << st.message();
}

TEST(GridValidate, AcceptsGoodLayouts) {
  EXPECT_TRUE(Grid::validate(1, spec({})).is_ok());
  EXPECT_TRUE(Grid::validate(8, spec({{"tp", 2}, {"dp", 2}, {"pp", 2}})).is_ok());
  EXPECT_TRUE(Grid::validate(8, spec({{"tp", 2}, {"dp", 4}}, "dp-tp-pp-cp-ep")).is_ok());
  GridDivisibility d;
  d.n_heads = 8, d.n_kv_heads = 2, d.vocab_size = 256, d.d_ff = 64, d.n_layers = 8, d.global_batch = 4;
  d.virtual_stages = 2;
  EXPECT_TRUE(Grid::validate(8, spec({{"tp", 2}, {"dp", 2}, {"pp", 2}}), d).is_ok());
}

TEST(GridValidate, ProductMismatch) {
  Status st = Grid::validate(4, spec({{"tp", 3}, {"dp", 2}}));
  expect_error(st, "does not match world size 4", "tp=3 cp=1 ep=1 dp=2 pp=1");
  EXPECT_EQ(st.message(), "layout tp=3 cp=1 ep=1 dp=2 pp=1 (product 6) does not match world size 4");
}

TEST(GridValidate, UnknownAxisInSizes) {
  expect_error(Grid::validate(2, spec({{"tp", 1}, {"mp", 2}})), "unknown parallel axis 'mp'",
               "tp=1 cp=1 ep=1 dp=1 pp=1");
}

TEST(GridValidate, BadOrder) {
  const std::string layout = "tp=2 cp=1 ep=1 dp=1 pp=1";
  expect_error(Grid::validate(2, spec({{"tp", 2}}, "tp-cp-ep-dp-dp")), "axis 'dp' appears twice", layout);
  expect_error(Grid::validate(2, spec({{"tp", 2}}, "tp-cp-ep-dp")), "does not name axis 'pp'", layout);
  expect_error(Grid::validate(2, spec({{"tp", 2}}, "tp-cp-ep-dp-xx")), "unknown axis 'xx' in order", layout);
  expect_error(Grid::validate(2, spec({{"tp", 2}}, "tp,cp,ep,dp,pp")), "unknown axis", layout);
}

TEST(GridValidate, DegreeBelowOne) {
  expect_error(Grid::validate(2, spec({{"tp", 2}, {"dp", 0}})), "dp=0 must be at least 1",
               "tp=2 cp=1 ep=1 dp=0 pp=1");
}

TEST(GridValidate, TpMustDivideHeadsKvVocabFfn) {
  const std::string layout = "tp=3 cp=1 ep=1 dp=2 pp=1";
  GridDivisibility d;
  d.n_heads = 4;
  expect_error(Grid::validate(6, spec({{"tp", 3}, {"dp", 2}}), d), "tp=3 does not divide n_heads=4", layout);
  EXPECT_EQ(Grid::validate(6, spec({{"tp", 3}, {"dp", 2}}), d).message(),
            "tp=3 does not divide n_heads=4 (layout tp=3 cp=1 ep=1 dp=2 pp=1)");
  d = {};
  d.n_heads = 6, d.n_kv_heads = 2;
  expect_error(Grid::validate(6, spec({{"tp", 3}, {"dp", 2}}), d), "tp=3 does not divide n_kv_heads=2",
               layout);
  d = {};
  d.vocab_size = 100;
  expect_error(Grid::validate(6, spec({{"tp", 3}, {"dp", 2}}), d), "tp=3 does not divide vocab_size=100",
               layout);
  d = {};
  d.d_ff = 64;
  expect_error(Grid::validate(6, spec({{"tp", 3}, {"dp", 2}}), d), "tp=3 does not divide d_ff=64", layout);
}

TEST(GridValidate, LayersAndBatch) {
  const std::string layout = "tp=1 cp=1 ep=1 dp=2 pp=2";
  GridDivisibility d;
  d.n_layers = 3;
  expect_error(Grid::validate(4, spec({{"dp", 2}, {"pp", 2}}), d), "pp=2 does not divide n_layers=3", layout);
  d.n_layers = 6, d.virtual_stages = 2;
  expect_error(Grid::validate(4, spec({{"dp", 2}, {"pp", 2}}), d),
               "pp=2 x virtual_stages=2 = 4 does not divide n_layers=6", layout);
  d = {};
  d.global_batch = 5;
  expect_error(Grid::validate(4, spec({{"dp", 2}, {"pp", 2}}), d), "dp=2 does not divide global_batch=5",
               layout);
}

TEST(GridValidate, ReportsEveryViolatedRule) {
  GridDivisibility d;
  d.n_heads = 4, d.vocab_size = 10;
  Status st = Grid::validate(3, spec({{"tp", 3}}), d);
  expect_error(st, "tp=3 does not divide n_heads=4", "tp=3 cp=1 ep=1 dp=1 pp=1");
  expect_error(st, "tp=3 does not divide vocab_size=10", "tp=3 cp=1 ep=1 dp=1 pp=1");
}

TEST(GridSelf, CreateOverOneRank) {
  auto self = make_self_communicator();
  auto g = Grid::create(*self, spec({}));
  ASSERT_TRUE(g.is_ok()) << g.status().message();
  Grid& grid = *g.value();
  EXPECT_EQ(grid.describe(), "tp=1 cp=1 ep=1 dp=1 pp=1");
  EXPECT_EQ(grid.coord("dp"), 0);
  EXPECT_EQ(grid.comm({"dp", "tp"}).size(), 1);
  float x = 2;
  grid.comm({"tp"}).all_reduce(&x, 1, DType::F32, ReduceOp::Sum);
  EXPECT_EQ(x, 2);
  EXPECT_FALSE(Grid::create(*self, spec({{"tp", 2}})).is_ok());
}

}  // namespace
}  // namespace ndt
