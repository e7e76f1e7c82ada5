// Schedule generators (gpipe, Megatron 1F1B, Megatron interleaved 1F1B) and trace output.
// The generators first decide each rank's compute order, then insert the send/recv actions that order
// implies; all comm ops between two computes become one batch (see schedule.h for the contract).
#include "parallel/pp/schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>

namespace ndt::pp {
namespace {

struct Compute {
  bool forward;
  int mb;
  int chunk;
};
// A step is one compute, or (interleaved steady phase) an F/B pair with no comm in between.
using Steps = std::vector<std::vector<Compute>>;

std::vector<Compute> gpipe_order(int m) {
  std::vector<Compute> out;
  for (int i = 0; i < m; ++i) out.push_back({true, i, 0});
  for (int i = 0; i < m; ++i) out.push_back({false, i, 0});
  return out;
}

// Megatron non-interleaved: (p - r - 1) warmup forwards, steady F/B pairs, cooldown backwards.
std::vector<Compute> one_f_one_b_order(int p, int r, int m) {
  const int warmup = std::min(p - r - 1, m);
  std::vector<Compute> out;
  for (int i = 0; i < warmup; ++i) out.push_back({true, i, 0});
  for (int i = 0; i < m - warmup; ++i) {
    out.push_back({true, warmup + i, 0});
    out.push_back({false, i, 0});
  }
  for (int i = m - warmup; i < m; ++i) out.push_back({false, i, 0});
  return out;
}

// Megatron interleaved (schedules.py, m % p == 0): virtual microbatch k runs microbatch
// (k / (p v)) * p + k % p on chunk (k % (p v)) / p; backwards visit chunks in reverse.
Steps interleaved_steps(int p, int v, int r, int m) {
  const int total = m * v;
  auto mb_of = [&](int k) { return (k / (p * v)) * p + k % p; };
  auto chunk_of = [&](int k, bool fwd) {
    const int c = (k % (p * v)) / p;
    return fwd ? c : v - 1 - c;
  };
  // m == p: Megatron runs all forwards first (the steady phase would need data not yet produced).
  int warmup = (m == p) ? total : std::min((p - r - 1) * 2 + (v - 1) * p, total);
  Steps out;
  for (int k = 0; k < warmup; ++k) out.push_back({{true, mb_of(k), chunk_of(k, true)}});
  for (int k = 0; k < total - warmup; ++k) {  // steady: one step = F then B, comm only around it
    const int kf = k + warmup;
    out.push_back({{true, mb_of(kf), chunk_of(kf, true)}, {false, mb_of(k), chunk_of(k, false)}});
  }
  for (int k = total - warmup; k < total; ++k) out.push_back({{false, mb_of(k), chunk_of(k, false)}});
  return out;
}

Steps single_steps(const std::vector<Compute>& order) {
  Steps out;
  for (const Compute& c : order) out.push_back({c});
  return out;
}

// Turns one rank's steps into actions with explicit communication. All comm between two steps (the
// sends of the previous step, the recvs of the next one) is one batch; a lone op stays blocking.
// This is Megatron's pairing: send_forward_recv_backward (1F1B) and, with steps of F/B pairs,
// send_forward_backward_recv_forward_backward (interleaved steady phase). Per-compute batches deadlock
// for interleaving: its stage ring p-1 -> 0 lets every rank block in a send whose recv comes later.
std::vector<PpAction> with_comm(const Steps& steps, int p, int v, int r) {
  const int last = p * v - 1;
  std::vector<PpAction> out;
  std::vector<PpAction> gap;  // comm ops between the previous step and the next one
  int next_batch = 0;
  auto flush = [&] {
    const int id = gap.size() > 1 ? next_batch++ : -1;
    for (PpAction a : gap) {
      a.batch_id = id;
      out.push_back(a);
    }
    gap.clear();
  };
  for (const std::vector<Compute>& step : steps) {
    for (const Compute& c : step) {  // this step's inputs (sends of the previous step are in `gap`)
      const int s = c.chunk * p + r;
      if (p > 1 && c.forward && s > 0) gap.push_back({PpAction::RecvAct, c.mb, c.chunk, (s - 1) % p});
      if (p > 1 && !c.forward && s < last) gap.push_back({PpAction::RecvGrad, c.mb, c.chunk, (s + 1) % p});
    }
    flush();
    for (const Compute& c : step) {
      out.push_back({c.forward ? PpAction::Forward : PpAction::Backward, c.mb, c.chunk, -1});
    }
    for (const Compute& c : step) {
      const int s = c.chunk * p + r;
      if (p > 1 && c.forward && s < last) gap.push_back({PpAction::SendAct, c.mb, c.chunk, (s + 1) % p});
      if (p > 1 && !c.forward && s > 0) gap.push_back({PpAction::SendGrad, c.mb, c.chunk, (s - 1) % p});
    }
  }
  flush();
  return out;
}

}  // namespace

std::string to_string(const PpAction& a) {
  static const char* kNames[] = {"F", "B", "SA", "RA", "SG", "RG"};
  std::string s = fmt::format("{}{}.c{}", kNames[a.kind], a.microbatch, a.chunk);
  if (!a.is_compute()) s += fmt::format("{}{}", a.is_send() ? '>' : '<', a.peer);
  return s;
}

Result<Schedule> make_schedule(const std::string& kind, int p, int v, int m) {
  const std::string what = fmt::format("pipeline schedule '{}' (p={}, v={}, m={})", kind, p, v, m);
  if (p < 1 || v < 1 || m < 1) {
    return Status::error(fmt::format("{}: p, v and m must all be >= 1", what));
  }
  if (kind != "gpipe" && kind != "1f1b" && kind != "interleaved") {
    return Status::error(fmt::format("{}: unknown kind (expected gpipe, 1f1b or interleaved)", what));
  }
  if (kind != "interleaved" && v != 1) {
    return Status::error(fmt::format("{}: only 'interleaved' supports virtual chunks (v > 1)", what));
  }
  if (kind == "interleaved" && v < 2) {
    return Status::error(fmt::format("{}: interleaved needs v >= 2 (use 1f1b for v=1)", what));
  }
  if (kind == "interleaved" && m % p != 0) {
    return Status::error(fmt::format(
        "{}: interleaved 1F1B needs the number of microbatches m={} to be a multiple of p={} (v={})", what, m,
        p, v));
  }
  Schedule out(p);
  for (int r = 0; r < p; ++r) {
    Steps steps = kind == "gpipe"  ? single_steps(gpipe_order(m))
                  : kind == "1f1b" ? single_steps(one_f_one_b_order(p, r, m))
                                   : interleaved_steps(p, v, r, m);
    out[r] = with_comm(steps, p, v, r);
  }
  return out;
}

double theoretical_bubble(const std::string& kind, int p, int v, int m) {
  const double fill = p - 1;
  if (kind == "interleaved") return fill / (static_cast<double>(v) * m + fill);
  return fill / (m + fill);
}

std::string chrome_trace_json(const std::vector<TraceEvent>& events) {
  nlohmann::json trace = nlohmann::json::array();
  std::map<int, bool> ranks;
  for (const TraceEvent& e : events) {
    ranks[e.rank] = true;
    trace.push_back(
        {{"name", e.name}, {"ph", "X"}, {"pid", 0}, {"tid", e.rank}, {"ts", e.start_us}, {"dur", e.dur_us}});
  }
  trace.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", 0}, {"args", {{"name", "pipeline"}}}});
  for (const auto& [rank, unused] : ranks) {
    trace.push_back({{"name", "thread_name"},
                     {"ph", "M"},
                     {"pid", 0},
                     {"tid", rank},
                     {"args", {{"name", fmt::format("pp rank {}", rank)}}}});
    // Keep ranks in numeric order in the viewer.
    trace.push_back({{"name", "thread_sort_index"},
                     {"ph", "M"},
                     {"pid", 0},
                     {"tid", rank},
                     {"args", {{"sort_index", rank}}}});
  }
  nlohmann::json doc = {{"traceEvents", trace}, {"displayTimeUnit", "ms"}};
  return doc.dump();
}

std::string schedule_to_chrome_trace(const Schedule& s, const ScheduleStats& stats, double us_per_tick) {
  NDT_CHECK(stats.timing.size() == s.size(), "stats are for a schedule with {} ranks, not {}",
            stats.timing.size(), s.size());
  std::vector<TraceEvent> events;
  for (size_t r = 0; r < s.size(); ++r) {
    NDT_CHECK(stats.timing[r].size() == s[r].size(), "stats do not match rank {}'s actions", r);
    for (size_t i = 0; i < s[r].size(); ++i) {
      const ActionTiming& t = stats.timing[r][i];
      const bool is_compute = s[r][i].is_compute();
      std::string name = to_string(s[r][i]);
      if (!is_compute) {
        // One "wait" event per comm batch, shown only if the rank waited (communication is free).
        const int b = s[r][i].batch_id;
        if (b != -1 && i > 0 && s[r][i - 1].batch_id == b) continue;
        if (t.end == t.start) continue;
        name = "wait " + name;
        for (size_t j = i + 1; b != -1 && j < s[r].size() && s[r][j].batch_id == b; ++j) {
          name += "," + to_string(s[r][j]);
        }
      }
      events.push_back({static_cast<int>(r), name, t.start * us_per_tick, (t.end - t.start) * us_per_tick});
    }
  }
  return chrome_trace_json(events);
}

}  // namespace ndt::pp
