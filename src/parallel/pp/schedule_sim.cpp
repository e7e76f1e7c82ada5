// Validator / simulator for pipeline schedules: runs every rank's action list in one process under the
// communication contract of schedule.h (rendezvous send/recv, batches post together, FIFO channels).
// Static checks first (fields, counts, send/recv pairing), then a timed run that finds dependency
// violations and deadlocks. The run is deterministic: pairs are fixed statically, so the order in which
// ranks are stepped changes nothing.
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

#include "parallel/pp/schedule.h"

namespace ndt::pp {
namespace {

struct Sim {
  const Schedule& s;
  int p, v, m, last;
  PpCost cost;
  // match[r][i] = (peer rank, peer action index) of comm action i on rank r.
  std::vector<std::vector<std::pair<int, size_t>>> match;

  int stage(int r, int c) const { return c * p + r; }
  size_t key(int mb, int c) const { return static_cast<size_t>(mb) * v + c; }
  Status at(int r, size_t i, const std::string& why) const {
    return Status::error(fmt::format("pipeline schedule (p={}, v={}, m={}): rank {} action {} ({}): {}", p, v,
                                     m, r, i, to_string(s[r][i]), why));
  }
  Status error(const std::string& why) const {
    return Status::error(fmt::format("pipeline schedule (p={}, v={}, m={}): {}", p, v, m, why));
  }

  // Peer a comm action must name, or -1 if that stage has no such neighbour.
  int expected_peer(int r, const PpAction& a) const {
    const int st = stage(r, a.chunk);
    const bool to_next = a.kind == PpAction::SendAct || a.kind == PpAction::RecvGrad;
    if (to_next) return st < last ? (st + 1) % p : -1;
    return st > 0 ? (st - 1) % p : -1;
  }

  Status check_fields() const {
    if (static_cast<int>(s.size()) != p)
      return error(fmt::format("{} rank lists, expected p={}", s.size(), p));
    for (int r = 0; r < p; ++r) {
      std::set<int> closed_batches;
      std::vector<int> computes(2 * m * v, 0);
      std::set<std::tuple<int, int, int>> comms;
      for (size_t i = 0; i < s[r].size(); ++i) {
        const PpAction& a = s[r][i];
        if (a.kind < PpAction::Forward || a.kind > PpAction::RecvGrad) {
          return error(fmt::format("rank {} action {}: invalid kind {}", r, i, static_cast<int>(a.kind)));
        }
        if (a.microbatch < 0 || a.microbatch >= m) return at(r, i, "microbatch out of range [0, m)");
        if (a.chunk < 0 || a.chunk >= v) return at(r, i, "chunk out of range [0, v)");
        if (a.is_compute()) {
          if (a.peer != -1 || a.batch_id != -1) return at(r, i, "compute action with a peer or batch_id");
          if (++computes[(a.kind == PpAction::Backward) * m * v + key(a.microbatch, a.chunk)] > 1) {
            return at(r, i, fmt::format("duplicate compute of stage {}", stage(r, a.chunk)));
          }
        } else {
          if (p == 1) return at(r, i, "send/recv with p=1 (all stages are local)");
          const int want = expected_peer(r, a);
          if (want < 0)
            return at(r, i, fmt::format("stage {} has no neighbour in that direction", stage(r, a.chunk)));
          if (a.peer != want) return at(r, i, fmt::format("peer should be rank {}", want));
          if (!comms.insert({a.kind, a.microbatch, a.chunk}).second) return at(r, i, "duplicate send/recv");
        }
        const bool continues = i > 0 && a.batch_id != -1 && s[r][i - 1].batch_id == a.batch_id;
        if (a.batch_id != -1 && !continues && closed_batches.count(a.batch_id)) {
          return at(r, i, fmt::format("batch {} is not contiguous", a.batch_id));
        }
        if (i > 0 && s[r][i - 1].batch_id != -1 && !continues) closed_batches.insert(s[r][i - 1].batch_id);
      }
      for (int b = 0; b < 2; ++b) {
        for (int mb = 0; mb < m; ++mb) {
          for (int c = 0; c < v; ++c) {
            if (computes[b * m * v + key(mb, c)] == 0) {
              return error(fmt::format("rank {} never runs {}{}.c{} (stage {})", r, b ? "B" : "F", mb, c,
                                       stage(r, c)));
            }
          }
        }
      }
    }
    return Status::ok();
  }

  // Pairs the k-th send with the k-th recv of each (src, dst, act|grad) channel and checks contents.
  // NCCL has no tags: it pairs the messages between two ranks in posting order across both kinds, so
  // the pairs found per channel must also be the n-th send and the n-th recv of their rank pair.
  Status pair_channels() {
    using Lists = std::pair<std::vector<size_t>, std::vector<size_t>>;  // sends on src, recvs on dst
    std::map<std::tuple<int, int, bool>, Lists> ch;
    std::map<std::pair<int, int>, Lists> pairs;
    match.assign(p, {});
    for (int r = 0; r < p; ++r) {
      match[r].assign(s[r].size(), {-1, 0});
      for (size_t i = 0; i < s[r].size(); ++i) {
        const PpAction& a = s[r][i];
        if (a.is_compute()) continue;
        const bool grad = a.kind == PpAction::SendGrad || a.kind == PpAction::RecvGrad;
        if (a.is_send()) {
          ch[{r, a.peer, grad}].first.push_back(i);
          pairs[{r, a.peer}].first.push_back(i);
        } else {
          ch[{a.peer, r, grad}].second.push_back(i);
          pairs[{a.peer, r}].second.push_back(i);
        }
      }
    }
    for (const auto& [k, lists] : ch) {
      const auto [src, dst, grad] = k;
      const auto& [sends, recvs] = lists;
      for (size_t n = 0; n < std::max(sends.size(), recvs.size()); ++n) {
        if (n >= recvs.size()) return at(src, sends[n], fmt::format("no matching recv on rank {}", dst));
        if (n >= sends.size()) return at(dst, recvs[n], fmt::format("no matching send on rank {}", src));
        const PpAction& a = s[src][sends[n]];
        const PpAction& b = s[dst][recvs[n]];
        const int want = stage(src, a.chunk) + (grad ? -1 : 1);
        if (a.microbatch != b.microbatch || stage(dst, b.chunk) != want) {
          return at(dst, recvs[n],
                    fmt::format("receives mb {} stage {}, but the matching send (rank {} action {}, "
                                "{}) carries mb {} for stage {} (FIFO order per channel)",
                                b.microbatch, stage(dst, b.chunk), src, sends[n], to_string(a), a.microbatch,
                                want));
        }
        match[src][sends[n]] = {dst, recvs[n]};
        match[dst][recvs[n]] = {src, sends[n]};
      }
    }
    for (const auto& [k, lists] : pairs) {  // (the channels above matched every send and recv)
      const auto [src, dst] = k;
      const auto& [sends, recvs] = lists;
      for (size_t n = 0; n < sends.size(); ++n)
        if (match[src][sends[n]].second != recvs[n])
          return at(
              src, sends[n],
              fmt::format("is message {} from rank {} to rank {}, but rank {} posts its receive as message "
                          "{} from rank {}: NCCL pairs them in order, without tags",
                          n, src, dst, dst,
                          std::find(recvs.begin(), recvs.end(), match[src][sends[n]].second) - recvs.begin(),
                          src));
    }
    return Status::ok();
  }

  Status run(ScheduleStats* out) {
    const size_t kv = static_cast<size_t>(m) * v;
    std::vector<size_t> pc(p, 0);
    std::vector<int64_t> clock(p, 0), busy(p, 0);
    std::vector<std::vector<int64_t>> posted(p);
    std::vector<std::vector<char>> fwd(p, std::vector<char>(kv)), bwd = fwd, act_in = fwd, grad_in = fwd;
    std::vector<int> live(p, 0);
    out->timing.assign(p, {});
    out->max_in_flight_per_rank.assign(p, 0);
    for (int r = 0; r < p; ++r) {
      posted[r].assign(s[r].size(), -1);
      out->timing[r].assign(s[r].size(), {});
    }
    auto unit_end = [&](int r, size_t i) {
      size_t j = i + 1;
      while (s[r][i].batch_id != -1 && j < s[r].size() && s[r][j].batch_id == s[r][i].batch_id) ++j;
      return j;
    };
    for (bool progress = true; progress;) {
      progress = false;
      for (int r = 0; r < p; ++r) {
        while (pc[r] < s[r].size()) {
          const size_t i = pc[r];
          const PpAction& a = s[r][i];
          const size_t k = key(a.microbatch, a.chunk);
          const int st = stage(r, a.chunk);
          if (a.kind == PpAction::Forward) {
            if (st > 0 && p == 1 && !fwd[r][key(a.microbatch, a.chunk - 1)]) {
              return at(r, i, "forward before the previous stage's forward on this rank");
            }
            if (st > 0 && p > 1 && !act_in[r][k])
              return at(r, i, "forward before its input activation arrived");
            fwd[r][k] = 1;
            out->max_in_flight_per_rank[r] = std::max(out->max_in_flight_per_rank[r], ++live[r]);
          } else if (a.kind == PpAction::Backward) {
            if (!fwd[r][k]) return at(r, i, "backward before its forward");
            if (st < last && p == 1 && !bwd[r][key(a.microbatch, a.chunk + 1)]) {
              return at(r, i, "backward before the next stage's backward on this rank");
            }
            if (st < last && p > 1 && !grad_in[r][k])
              return at(r, i, "backward before its output gradient arrived");
            bwd[r][k] = 1;
            --live[r];
          }
          if (a.is_compute()) {
            const int64_t d = a.kind == PpAction::Forward ? cost.forward : cost.backward;
            out->timing[r][i] = {clock[r], clock[r] + d};
            clock[r] += d;
            busy[r] += d;
            ++pc[r];
            progress = true;
            continue;
          }
          const size_t end = unit_end(r, i);
          if (posted[r][i] < 0) {  // post the whole batch
            for (size_t j = i; j < end; ++j) {
              const PpAction& b = s[r][j];
              const size_t kb = key(b.microbatch, b.chunk);
              if (b.kind == PpAction::SendAct && !fwd[r][kb])
                return at(r, j, "sends an activation not computed yet");
              if (b.kind == PpAction::SendGrad && !bwd[r][kb])
                return at(r, j, "sends a gradient not computed yet");
              posted[r][j] = clock[r];
            }
            progress = true;
          }
          int64_t done = clock[r];
          bool complete = true;
          for (size_t j = i; j < end && complete; ++j) {
            const auto [q, qj] = match[r][j];
            complete = posted[q][qj] >= 0;
            done = std::max(done, posted[q][qj]);
          }
          if (!complete) break;
          for (size_t j = i; j < end; ++j) {
            const PpAction& b = s[r][j];
            if (b.kind == PpAction::RecvAct) act_in[r][key(b.microbatch, b.chunk)] = 1;
            if (b.kind == PpAction::RecvGrad) grad_in[r][key(b.microbatch, b.chunk)] = 1;
            out->timing[r][j] = {posted[r][j], done};
          }
          clock[r] = done;
          pc[r] = end;
          progress = true;
        }
      }
    }
    std::string stuck;
    for (int r = 0; r < p; ++r) {
      if (pc[r] == s[r].size()) continue;
      for (size_t j = pc[r]; j < unit_end(r, pc[r]); ++j) {
        const auto [q, qj] = match[r][j];
        if (posted[q][qj] >= 0) continue;
        stuck += fmt::format(
            "{}rank {} action {} ({}) waits for rank {} action {} ({}), but rank {} is at action {} ({})",
            stuck.empty() ? "" : "; ", r, j, to_string(s[r][j]), q, qj, to_string(s[q][qj]), q, pc[q],
            to_string(s[q][pc[q]]));
        break;
      }
    }
    if (!stuck.empty()) return error("deadlock: " + stuck);

    out->ticks = *std::max_element(clock.begin(), clock.end());
    out->bubble_per_rank.assign(p, 0);
    out->bubble_fraction = 0;
    for (int r = 0; r < p; ++r) {
      out->bubble_per_rank[r] = static_cast<double>(out->ticks - busy[r]) / static_cast<double>(out->ticks);
      out->bubble_fraction += out->bubble_per_rank[r] / p;
    }
    out->max_in_flight_microbatches =
        *std::max_element(out->max_in_flight_per_rank.begin(), out->max_in_flight_per_rank.end());
    return Status::ok();
  }
};

}  // namespace

Result<ScheduleStats> simulate_schedule(const Schedule& s, int p, int v, int m, PpCost cost) {
  if (p < 1 || v < 1 || m < 1) {
    return Status::error(
        fmt::format("pipeline schedule (p={}, v={}, m={}): p, v and m must be >= 1", p, v, m));
  }
  Sim sim{s, p, v, m, p * v - 1, cost, {}};
  if (Status st = sim.check_fields(); !st) return st;
  if (Status st = sim.pair_channels(); !st) return st;
  ScheduleStats stats;
  if (Status st = sim.run(&stats); !st) return st;
  return stats;
}

Status validate_schedule(const Schedule& s, int p, int v, int m) {
  return simulate_schedule(s, p, v, m).status();
}

}  // namespace ndt::pp
