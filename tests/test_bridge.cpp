// The multimodal bridge's routing, as pure functions of the two layouts (no communication): every rank
// receives exactly its shard, each sample once, from a rank that holds it; equal layouts stay local.
#include <gtest/gtest.h>

#include <set>

#include "parallel/bridge/bridge.h"

namespace ndt {
namespace {

// Encoder tp x dp and LLM dp over `world` ranks; coordinates from mixed-radix orders (innermost first).
BridgeMap make_map(int world, int64_t batch, int64_t etp, int64_t edp, int64_t ldp, bool enc_tp_inner,
                   int64_t llm_inner) {
  BridgeMap m;
  m.batch = batch;
  m.enc_tp = etp;
  m.enc_dp = edp;
  m.llm_dp = ldp;
  for (int r = 0; r < world; ++r) {
    m.enc_tp_of.push_back(enc_tp_inner ? r % etp : r / edp);
    m.enc_dp_of.push_back(enc_tp_inner ? r / etp : r % edp);
    m.llm_dp_of.push_back((r / llm_inner) % ldp);  // llm_inner: product of the LLM axes inside dp
  }
  return m;
}

void check_routes(const BridgeMap& m) {
  ASSERT_TRUE(m.validate()) << m.validate().message();
  for (bool fwd : {true, false}) {
    std::vector<BridgeRoute> routes;
    for (int r = 0; r < m.world(); ++r) routes.push_back(fwd ? route_forward(m, r) : route_backward(m, r));
    for (int q = 0; q < m.world(); ++q) {
      const auto [first, count] = fwd ? m.llm_block(q) : m.enc_block(q);
      std::multiset<int64_t> got;
      for (int p = 0; p < m.world(); ++p) {
        // What q expects from p is exactly what p sends to q.
        EXPECT_EQ(routes[q].recv[p], routes[p].send[q]) << "fwd " << fwd << " " << p << "->" << q;
        for (int64_t j : routes[q].recv[p]) {
          got.insert(j);
          // The sender holds the sample.
          const auto [sf, sc] = fwd ? m.enc_block(p) : m.llm_block(p);
          EXPECT_TRUE(j >= sf && j < sf + sc) << "rank " << p << " sends sample " << j << " it does not hold";
        }
      }
      std::multiset<int64_t> want;
      for (int64_t j = first; j < first + count; ++j) want.insert(j);
      EXPECT_EQ(got, want) << "rank " << q << " (forward " << fwd << ")";
    }
  }
}

TEST(Bridge, RoutesCoverEveryShardOnce) {
  // 4 ranks: equal, fan-in, fan-out, encoder TP, both axis orders.
  check_routes(make_map(4, 8, 1, 4, 4, true, 1));   // encoder dp4 -> LLM dp4
  check_routes(make_map(4, 8, 1, 4, 2, true, 2));   // dp4 -> tp2 dp2 (fan-in)
  check_routes(make_map(4, 8, 2, 2, 4, true, 1));   // tp2 dp2 -> dp4 (fan-out)
  check_routes(make_map(4, 8, 2, 2, 4, false, 1));  // the other encoder axis order
  check_routes(make_map(4, 8, 4, 1, 4, true, 1));   // tp4 -> dp4
  check_routes(make_map(4, 8, 1, 4, 1, true, 4));   // dp4 -> pp2 cp2 (one replica)
  // 8 ranks: fan-in and fan-out with CP inside the LLM replica.
  check_routes(make_map(8, 16, 2, 4, 2, true, 4));  // tp2 dp4 -> tp2 cp2 dp2
  check_routes(make_map(8, 16, 4, 2, 4, true, 2));  // tp4 dp2 -> cp2 dp4
  check_routes(make_map(8, 16, 1, 8, 2, true, 2));  // dp8 -> cp2 dp2 pp2 (rank = cp + 2 (dp + 2 pp))
}

TEST(Bridge, EqualLayoutsNeedNoCommunication) {
  EXPECT_TRUE(route_is_local(make_map(4, 8, 1, 4, 4, true, 1), true));
  EXPECT_TRUE(route_is_local(make_map(4, 8, 1, 4, 4, true, 1), false));
  EXPECT_TRUE(route_is_local(make_map(1, 3, 1, 1, 1, true, 1), true));
  // Same degrees but mismatched coordinates (LLM dp outermost vs encoder dp innermost) must move data.
  EXPECT_FALSE(route_is_local(make_map(4, 8, 2, 2, 2, true, 1), true));
  EXPECT_FALSE(route_is_local(make_map(4, 8, 1, 4, 2, true, 2), true));  // fan-in gathers
}

TEST(Bridge, RejectsLayoutsThatDoNotDivide) {
  BridgeMap m = make_map(6, 12, 1, 6, 2, true, 3);
  m.enc_dp = 6;
  m.llm_dp = 4;  // 6 and 4 do not divide one another
  m.llm_dp_of = {0, 1, 2, 3, 0, 1};
  const Status st = m.validate();
  ASSERT_FALSE(st);
  EXPECT_NE(st.message().find("must divide one another"), std::string::npos) << st.message();
  BridgeMap b = make_map(4, 6, 1, 4, 4, true, 1);  // 6 samples over dp 4
  EXPECT_FALSE(b.validate());
}

}  // namespace
}  // namespace ndt
