// Pipeline schedules as data: every generated schedule is checked by the one-process simulator (no
// communication), its bubble is compared with theory, and hand-corrupted schedules must be rejected
// with a message that names the rank and the action.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <set>

#include "parallel/pp/schedule.h"

namespace ndt::pp {
namespace {

struct Layout {
  std::string kind;
  int p, v, m;
};

std::string name(const Layout& l) { return fmt::format("{} p={} v={} m={}", l.kind, l.p, l.v, l.m); }

// Every layout the generators accept in the test grid.
std::vector<Layout> all_layouts() {
  std::vector<Layout> out;
  for (int p : {1, 2, 3, 4, 8}) {
    for (int m : {1, 2, 3, 4, 5, 7, 8, 16}) {
      out.push_back({"gpipe", p, 1, m});
      out.push_back({"1f1b", p, 1, m});
      for (int v : {2, 3, 4}) {
        if (m % p == 0) out.push_back({"interleaved", p, v, m});
      }
    }
  }
  return out;
}

Schedule make(const std::string& kind, int p, int v, int m) {
  Result<Schedule> s = make_schedule(kind, p, v, m);
  EXPECT_TRUE(s.is_ok()) << s.status().message();
  return std::move(s).value();
}

void expect_error(const Status& st, std::initializer_list<std::string> parts) {
  ASSERT_FALSE(st.is_ok());
  for (const std::string& part : parts) EXPECT_NE(st.message().find(part), std::string::npos) << st.message();
}

// Index of the first action on `rank` matching `pred`.
template <typename Pred>
size_t find(const std::vector<PpAction>& acts, Pred pred) {
  for (size_t i = 0; i < acts.size(); ++i) {
    if (pred(acts[i])) return i;
  }
  ADD_FAILURE() << "action not found";
  return 0;
}

TEST(PpScheduleGen, AllLayoutsValidate) {
  for (const Layout& l : all_layouts()) {
    Schedule s = make(l.kind, l.p, l.v, l.m);
    ASSERT_EQ(static_cast<int>(s.size()), l.p) << name(l);
    Status st = validate_schedule(s, l.p, l.v, l.m);
    EXPECT_TRUE(st.is_ok()) << name(l) << ": " << st.message();
    for (const auto& rank : s) {
      // 2 computes per (mb, chunk); with p > 1 at most 2 sends and 2 recvs per (mb, chunk) as well.
      EXPECT_GE(rank.size(), static_cast<size_t>(2 * l.m * l.v)) << name(l);
      if (l.p == 1) EXPECT_EQ(rank.size(), static_cast<size_t>(2 * l.m * l.v)) << name(l);
    }
  }
}

TEST(PpScheduleGen, RejectsBadArguments) {
  expect_error(make_schedule("interleaved", 4, 2, 6).status(), {"multiple of p=4", "m=6", "v=2"});
  expect_error(make_schedule("interleaved", 3, 2, 2).status(), {"p=3", "m=2"});
  expect_error(make_schedule("interleaved", 2, 1, 4).status(), {"v >= 2", "v=1"});
  expect_error(make_schedule("1f1b", 2, 2, 4).status(), {"v > 1", "'1f1b'", "v=2"});
  expect_error(make_schedule("gpipe", 2, 3, 4).status(), {"'gpipe'", "v=3"});
  expect_error(make_schedule("zigzag", 2, 1, 4).status(), {"unknown kind", "'zigzag'"});
  expect_error(make_schedule("1f1b", 0, 1, 4).status(), {"p=0"});
  expect_error(make_schedule("1f1b", 2, 0, 4).status(), {"v=0"});
  expect_error(make_schedule("1f1b", 2, 1, 0).status(), {"m=0"});
  EXPECT_TRUE(make_schedule("1f1b", 8, 1, 3).is_ok());  // m < p is fine without interleaving
  EXPECT_TRUE(make_schedule("gpipe", 8, 1, 1).is_ok());
}

// Under the unit-cost model (F = 1, B = 2, free communication) gpipe and 1F1B reach the textbook
// bubble exactly: makespan = (m + p - 1) * 3, so idle / total = (p - 1) / (m + p - 1).
TEST(PpScheduleBubble, GpipeAnd1f1bMatchTheory) {
  for (const Layout& l : all_layouts()) {
    if (l.kind == "interleaved") continue;
    Result<ScheduleStats> st = simulate_schedule(make(l.kind, l.p, l.v, l.m), l.p, l.v, l.m);
    ASSERT_TRUE(st.is_ok()) << st.status().message();
    EXPECT_NEAR(st.value().bubble_fraction, theoretical_bubble(l.kind, l.p, l.v, l.m), 1e-12) << name(l);
    EXPECT_EQ(st.value().ticks, 3 * (l.m + l.p - 1)) << name(l);
  }
}

// Interleaving shrinks the fill/drain term by v. Under the unit-cost model Megatron's interleaved
// schedule reaches the ideal (p - 1) / (v m + p - 1) exactly (F/B cost per chunk), also for m == p;
// for m >= p (always true here, m % p == 0) that is below 1F1B's bubble.
TEST(PpScheduleBubble, InterleavedMatchesTheoryAndBeats1f1b) {
  for (const Layout& l : all_layouts()) {
    if (l.kind != "interleaved") continue;
    auto st = simulate_schedule(make(l.kind, l.p, l.v, l.m), l.p, l.v, l.m).value();
    const double base = simulate_schedule(make("1f1b", l.p, 1, l.m), l.p, 1, l.m).value().bubble_fraction;
    EXPECT_NEAR(st.bubble_fraction, theoretical_bubble(l.kind, l.p, l.v, l.m), 1e-12) << name(l);
    EXPECT_EQ(st.ticks, 3 * (l.v * l.m + l.p - 1)) << name(l);
    if (l.p > 1) EXPECT_LT(st.bubble_fraction, base) << name(l);
    // Activation memory of rank 0, in chunks: Megatron's warmup (p - 1) * 2 + (v - 1) * p, plus one.
    const int warm = l.m == l.p ? l.m * l.v : std::min((l.p - 1) * 2 + (l.v - 1) * l.p + 1, l.m * l.v);
    EXPECT_EQ(st.max_in_flight_per_rank[0], warm) << name(l);
  }
}

// 1F1B bounds activation memory by p microbatches on rank 0 (min(p, m) in fact); GPipe holds all m.
TEST(PpScheduleMemory, InFlightMicrobatches) {
  for (int p : {1, 2, 4, 8}) {
    for (int m : {1, 3, 8, 16}) {
      auto s1 = simulate_schedule(make("1f1b", p, 1, m), p, 1, m).value();
      auto sg = simulate_schedule(make("gpipe", p, 1, m), p, 1, m).value();
      EXPECT_EQ(s1.max_in_flight_per_rank[0], std::min(p, m)) << "p=" << p << " m=" << m;
      EXPECT_LE(s1.max_in_flight_per_rank[0], p);
      EXPECT_EQ(sg.max_in_flight_per_rank[0], m);
      for (int r = 0; r < p; ++r) EXPECT_EQ(s1.max_in_flight_per_rank[r], std::min(p - r, m));
    }
  }
}

TEST(PpScheduleValidator, RejectsSwappedActions) {
  Schedule s = make("1f1b", 4, 1, 8);
  // Rank 1: move its first forward before the recv of its input.
  std::swap(s[1][0], s[1][1]);
  ASSERT_EQ(s[1][0].kind, PpAction::Forward);
  expect_error(validate_schedule(s, 4, 1, 8), {"rank 1 action 0 (F0.c0)", "input activation arrived"});
}

TEST(PpScheduleValidator, RejectsDroppedRecv) {
  Schedule s = make("1f1b", 4, 1, 8);
  // The last gradient recv: earlier pairs still match, the extra send on rank 3 has no partner.
  const size_t i =
      find(s[2], [](const PpAction& a) { return a.kind == PpAction::RecvGrad && a.microbatch == 7; });
  s[2].erase(s[2].begin() + static_cast<std::ptrdiff_t>(i));
  expect_error(validate_schedule(s, 4, 1, 8), {"rank 3 action", "SG", "no matching recv on rank 2"});
}

TEST(PpScheduleValidator, RejectsMismatchedMicrobatch) {
  Schedule s = make("interleaved", 2, 2, 4);
  // Swap the microbatches of two activation recvs: no duplicates, but FIFO pairing breaks.
  auto recv = [](int mb) {
    return
        [mb](const PpAction& a) { return a.kind == PpAction::RecvAct && a.microbatch == mb && a.chunk == 0; };
  };
  std::swap(s[1][find(s[1], recv(1))].microbatch, s[1][find(s[1], recv(3))].microbatch);
  expect_error(validate_schedule(s, 2, 2, 4), {"rank 1 action", "receives mb 3", "carries mb 1"});
}

TEST(PpScheduleValidator, RejectsPerPeerOrderNcclCannotMatch) {
  // Interleaved with p = 2: rank 0 sends rank 1 activations and gradients. Swapping two receives of
  // different kinds inside one batch keeps every channel FIFO (tags would still match them, as MPI does),
  // but NCCL pairs the messages between two ranks in posting order, without tags.
  Schedule s = make("interleaved", 2, 2, 4);
  ASSERT_TRUE(validate_schedule(s, 2, 2, 4).is_ok());
  bool swapped = false;
  for (size_t i = 0; i + 1 < s[1].size() && !swapped; ++i) {
    PpAction &a = s[1][i], &b = s[1][i + 1];
    const auto recv = [](const PpAction& x) { return !x.is_compute() && !x.is_send(); };
    if (a.batch_id >= 0 && a.batch_id == b.batch_id && recv(a) && recv(b) && a.kind != b.kind &&
        a.peer == b.peer) {
      std::swap(a, b);
      swapped = true;
    }
  }
  ASSERT_TRUE(swapped) << "no batch on rank 1 receives both kinds from one peer";
  expect_error(validate_schedule(s, 2, 2, 4), {"from rank 0 to rank 1", "NCCL pairs them in order"});
}

TEST(PpScheduleValidator, RejectsUnbatchedDeadlock) {
  // Without batching, 1F1B's steady state has rank 0 sending an activation while rank 1 sends a
  // gradient: both block (this is why Megatron pairs send_forward_recv_backward).
  Schedule s = make("1f1b", 2, 1, 4);
  for (auto& rank : s) {
    for (PpAction& a : rank) a.batch_id = -1;
  }
  expect_error(validate_schedule(s, 2, 1, 4), {"deadlock", "rank 0 action", "rank 1 action"});
}

TEST(PpScheduleValidator, RejectsBadFields) {
  Schedule s = make("1f1b", 2, 1, 2);
  Schedule dup = s;
  dup[0].push_back({PpAction::Forward, 0, 0});
  expect_error(validate_schedule(dup, 2, 1, 2), {"rank 0 action", "duplicate compute"});
  Schedule peer = s;
  peer[0][find(peer[0], [](const PpAction& a) { return a.kind == PpAction::SendAct; })].peer = 0;
  expect_error(validate_schedule(peer, 2, 1, 2), {"rank 0 action", "peer should be rank 1"});
  Schedule missing = s;
  ASSERT_EQ(missing[0].back().kind, PpAction::Backward);  // stage 0 sends no gradient after it
  missing[0].pop_back();
  expect_error(validate_schedule(missing, 2, 1, 2), {"rank 0 never runs B1.c0"});
  expect_error(validate_schedule(s, 3, 1, 2), {"expected p=3"});
  Schedule local = make("1f1b", 1, 1, 2);
  local[0].insert(local[0].begin() + 1, {PpAction::SendAct, 0, 0, 0});
  expect_error(validate_schedule(local, 1, 1, 2), {"rank 0 action 1", "p=1"});
}

TEST(PpScheduleTrace, SimulatedTraceHasOneTrackPerRank) {
  const int p = 4, v = 2, m = 8;
  Schedule s = make("interleaved", p, v, m);
  ScheduleStats st = simulate_schedule(s, p, v, m).value();
  nlohmann::json j = nlohmann::json::parse(schedule_to_chrome_trace(s, st));
  std::set<int> tids, named;
  int computes = 0;
  for (const auto& e : j.at("traceEvents")) {
    EXPECT_EQ(e.at("pid"), 0);
    if (e.at("ph") == "X") {
      tids.insert(e.at("tid").get<int>());
      const std::string n = e.at("name");
      if (n[0] == 'F' || n[0] == 'B') ++computes;
      EXPECT_GE(e.at("dur").get<double>(), 0.0);
    } else if (e.at("name") == "thread_name") {
      named.insert(e.at("tid").get<int>());
    }
  }
  EXPECT_EQ(tids, (std::set<int>{0, 1, 2, 3}));
  EXPECT_EQ(named, tids);
  EXPECT_EQ(computes, 2 * p * v * m);
}

TEST(PpScheduleTrace, MeasuredEvents) {
  std::vector<TraceEvent> ev = {{0, "F0.c0", 0.0, 10.5}, {1, "F0.c0", 11.0, 9.0}, {0, "B0.c0", 30.0, 20.0}};
  nlohmann::json j = nlohmann::json::parse(chrome_trace_json(ev));
  int x = 0, names = 0;
  for (const auto& e : j.at("traceEvents")) {
    if (e.at("ph") == "X") ++x;
    if (e.at("name") == "thread_name") ++names;
  }
  EXPECT_EQ(x, 3);
  EXPECT_EQ(names, 2);
  EXPECT_EQ(j.at("traceEvents")[0].at("ts"), 0.0);
  EXPECT_EQ(j.at("traceEvents")[0].at("dur"), 10.5);
}

}  // namespace
}  // namespace ndt::pp
