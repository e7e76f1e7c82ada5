#pragma once
// Pipeline-parallel schedules as data (DESIGN.md section 3). A generator emits, per pipeline rank, an
// ordered list of actions; a validator simulates all ranks in one process; an executor (elsewhere) runs
// one rank's list and calls a stage's forward/backward. Nothing here communicates or knows the model.
//
// Stage mapping (Megatron interleaved): local chunk c on rank r holds the global virtual stage
// s = c * p + r. Stage 0 is the first (embedding), stage p * v - 1 the last (head). Activations travel
// s -> s + 1 (rank (s + 1) % p), gradients s + 1 -> s. With p == 1 every stage is local and no
// send/recv is emitted; with p > 1 neighbouring stages are always on different ranks.
//
// Communication contract (what the executor must do, and what the validator simulates):
//  - Send/Recv are rendezvous: an op completes only when the matching op on the peer is posted.
//  - Consecutive comm actions with the same batch_id != -1 form one batch: the executor posts all of
//    them together (non-blocking isend/irecv or one NCCL group) and waits for all. Batches never
//    contain compute. An action with batch_id == -1 is a single blocking op.
//  - Matching is FIFO per channel (src, dst, act|grad): the k-th send on a channel pairs with the
//    k-th recv. An executor on MPI keeps this with one tag per direction kind. NCCL has no tags: it
//    pairs the k-th send from src to dst with the k-th recv posted for src on dst, whatever it carries,
//    so the messages between two ranks must also keep one order across both kinds (checked too).
//  - The generator puts every comm op between two computes into one batch (Megatron's
//    send_forward_recv_backward & co.); a lone op stays blocking.
#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"

namespace ndt::pp {

struct PpAction {
  enum Kind { Forward, Backward, SendAct, RecvAct, SendGrad, RecvGrad };
  Kind kind;
  int microbatch;
  // Local chunk 0..v-1 of THIS rank. For Send/Recv it names the local stage the data belongs to:
  // SendAct = output of my stage, RecvAct = input of my stage, SendGrad = gradient of my stage's
  // input, RecvGrad = gradient of my stage's output.
  int chunk;
  int peer = -1;      // pipeline rank of the other side for Send/Recv, -1 for compute
  int batch_id = -1;  // comm batch (rank-local id), -1 = a single blocking op

  bool is_compute() const { return kind == Forward || kind == Backward; }
  bool is_send() const { return kind == SendAct || kind == SendGrad; }
};

using Schedule = std::vector<std::vector<PpAction>>;  // [pipeline rank][program order]

// "F3.c1", "B3.c1", "SA3.c1>2" (send act to rank 2), "RA3.c1<0", "SG..", "RG..".
std::string to_string(const PpAction& a);

// kind: "gpipe" | "1f1b" | "interleaved". gpipe and 1f1b need v == 1 and accept any m >= 1;
// interleaved needs v >= 2 and m % p == 0 (Megatron's interleaved schedule).
Result<Schedule> make_schedule(const std::string& kind, int p, int v, int m);

// Simulates all ranks with the communication contract above. Checks: shape and field ranges; every
// (mb, stage) has exactly one forward and one backward; send/recv peers are the neighbouring stage's
// rank; per-channel FIFO pairs carry the same microbatch and adjacent stages; forward only after its
// input arrived, backward only after its forward and its output gradient, send only after the data
// was computed; no deadlock. Errors name the rank, the action index and the reason.
Status validate_schedule(const Schedule& s, int p, int v, int m);

struct PpCost {
  int64_t forward = 1;   // ticks per forward of one chunk
  int64_t backward = 2;  // ticks per backward of one chunk; communication is free
};

struct ActionTiming {
  int64_t start = 0;  // ticks; for a comm action: when it was posted
  int64_t end = 0;    // ticks; for a comm action: when its batch completed
};

struct ScheduleStats {
  // Mean over ranks of idle / ticks, where idle = ticks - compute time of that rank (fraction of the
  // total time, not of the compute time).
  double bubble_fraction = 0;
  int64_t ticks = 0;  // makespan: end of the last action on any rank
  // Max over ranks and time of (microbatch, chunk) activations held: forward done, backward not yet.
  // With v == 1 this is microbatches; with v > 1 each one is 1/v of the rank's layers.
  int max_in_flight_microbatches = 0;
  std::vector<int> max_in_flight_per_rank;
  std::vector<double> bubble_per_rank;
  std::vector<std::vector<ActionTiming>> timing;  // [rank][action index]
};

// Same checks as validate_schedule, plus timing under the cost model.
Result<ScheduleStats> simulate_schedule(const Schedule& s, int p, int v, int m, PpCost cost = {});

// Ideal bubble as a fraction of total time under the "F + B per microbatch per rank" model:
// gpipe / 1f1b: (p - 1) / (m + p - 1); interleaved: (p - 1) / (v * m + p - 1) (the (p - 1) fill/drain
// term shrinks by v). Equivalently bubble/compute = (p - 1) / m and (p - 1) / (v * m) (DESIGN.md).
double theoretical_bubble(const std::string& kind, int p, int v, int m);

// Chrome trace (chrome://tracing, Perfetto): pid 0, tid = pipeline rank, "X" events.
struct TraceEvent {
  int rank;
  std::string name;
  double start_us, dur_us;
};
std::string chrome_trace_json(const std::vector<TraceEvent>& events);

// Compute actions as events named like "F3.c1"; comm batches that waited appear as "wait ..." events.
std::string schedule_to_chrome_trace(const Schedule& s, const ScheduleStats& stats,
                                     double us_per_tick = 1000.0);

}  // namespace ndt::pp
