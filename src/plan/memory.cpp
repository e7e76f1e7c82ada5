#include "plan/memory.h"

#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "core/check.h"
#include "parallel/pp/pipeline.h"
#include "parallel/pp/schedule.h"
#include "plan/act_mirror.h"

namespace ndt::plan {

MicrobatchShape microbatch_shape(const Config& cfg) {
  const ParallelConfig& p = cfg.parallel;
  const int64_t per_rank = cfg.train.global_batch / p.dp;
  const int64_t mbs = cfg.train.micro_batch > 0 ? cfg.train.micro_batch : per_rank;
  MicrobatchShape s;
  if (!cfg.data.packing) {
    s.samples = mbs;
    s.count = per_rank / mbs;
  } else {
    const int64_t budget = cfg.data.pack_tokens > 0 ? cfg.data.pack_tokens : mbs * cfg.data.seq_len;
    s.samples = std::max<int64_t>(1, budget / cfg.data.seq_len);
    s.count = (per_rank + s.samples - 1) / s.samples;
    // Interleaved packing groups the microbatches into a multiple of pp (Trainer::pack_count_multiple).
    if (p.virtual_stages > 1) s.count = (s.count + p.pp - 1) / p.pp * p.pp;
  }
  int64_t tokens = s.samples * cfg.data.seq_len;
  // Packed streams are tail-padded to a multiple of tp * 2cp under sequence parallelism (data/packing.h).
  if (cfg.data.packing && p.sequence_parallel && p.tp > 1) {
    const int64_t q = p.tp * 2 * p.cp;
    tokens = (tokens + q - 1) / q * q;
  }
  s.tokens = tokens / p.cp;
  return s;
}

StageMemory stage_memory(const Config& cfg, int64_t pp_rank) {
  const ParallelConfig& par = cfg.parallel;
  StageMemory m;
  m.pp_rank = pp_rank;
  m.params = rank_params(cfg, pp_rank);
  m.flat = flat_sizes(cfg, m.params);
  // ZeRO-1 on GPUs over NCCL reduces and gathers in place (train/optimizer.cpp): no gradient shard, no copy
  // of the updated shard before the all-gather; staged through MPI it keeps both, as on the CPU.
  const bool zero1_buffers = cfg.train.device_comm != "nccl";
  m.persistent = persistent_bytes(m.flat, cfg.train.precision != "fp32", zero1_buffers);

  const MicrobatchShape mb = microbatch_shape(cfg);
  const ActDims d = act_dims(cfg, mb.tokens);
  const std::vector<int64_t> b = stage_boundaries(par, cfg.model.n_layers).value();
  const int p = static_cast<int>(par.pp), v = static_cast<int>(par.virtual_stages), S = p * v;
  std::vector<ChunkProfile> chunks;
  for (int c = 0; c < v; ++c) {
    const int s = c * p + static_cast<int>(pp_rank);
    chunks.push_back(chunk_profile(
        cfg, d, {b[static_cast<size_t>(s)], b[static_cast<size_t>(s) + 1], s == 0, s == S - 1}));
    m.act_per_microbatch = std::max(m.act_per_microbatch, chunks.back().retained + chunks.back().input);
  }

  // The rank's schedule exactly as the engine builds it (PipelineEngine::train).
  const std::string kind = v > 1 ? "interleaved" : (p == 1 ? "1f1b" : par.schedule);
  const pp::Schedule sched = pp::make_schedule(kind, p, v, static_cast<int>(mb.count)).value();
  const std::vector<pp::PpAction>& actions = sched[static_cast<size_t>(pp_rank)];
  int64_t live = m.persistent.total(), peak = live;
  std::string peak_at = "optimizer state";
  auto check = [&](int64_t value, const std::string& where) {
    if (value > peak) {
      peak = value;
      peak_at = where;
    }
  };
  int in_flight = 0;
  std::vector<std::pair<int, int>> sent;  // (mb, chunk) input gradients waiting for their batch to finish
  for (size_t i = 0; i < actions.size(); ++i) {
    const pp::PpAction& a = actions[i];
    const ChunkProfile& c = chunks[static_cast<size_t>(a.chunk)];
    const std::string who = fmt::format("microbatch {} chunk {}", a.microbatch, a.chunk);
    switch (a.kind) {
      case pp::PpAction::Forward:
        check(live + c.fwd_peak, fmt::format("forward of {}, {}", who, c.fwd_peak_at));
        live += c.retained;
        m.max_in_flight = std::max(m.max_in_flight, ++in_flight);
        break;
      case pp::PpAction::Backward:
        check(live + c.bwd_peak, fmt::format("backward of {}, {}", who, c.bwd_peak_at));
        live += c.bwd_delta;
        --in_flight;
        break;
      case pp::PpAction::RecvAct:
        live += c.input;
        check(live, fmt::format("receiving the input of {}", who));
        break;
      case pp::PpAction::RecvGrad:
        live += c.dy;
        check(live, fmt::format("receiving the output gradient of {}", who));
        break;
      case pp::PpAction::SendGrad:
        sent.emplace_back(a.microbatch, a.chunk);
        break;
      case pp::PpAction::SendAct:
        break;
    }
    // A batch's sent input gradients are released once the whole batch completed.
    const bool batch_ends = a.batch_id < 0 || i + 1 == actions.size() ||
                            actions[i + 1].batch_id != a.batch_id || actions[i + 1].is_compute();
    if (!a.is_compute() && batch_ends) {
      for (const auto& [mbi, ch] : sent) live -= chunks[static_cast<size_t>(ch)].dx_out;
      sent.clear();
    }
  }
  NDT_CHECK(live == m.persistent.total(), "plan: {} bytes still live after the step on pp rank {}",
            live - m.persistent.total(), pp_rank);
  // ZeRO-1 over MPI: each sharded region's updated shard is copied before the all-gather (Optimizer::step).
  check(live + device_bytes(4 * std::max(m.flat.shard_dense, m.flat.shard_expert)) *
                   (zero1_buffers && (m.flat.shard_dense > 0 || m.flat.shard_expert > 0)),
        "optimizer step (ZeRO-1 all-gather)");
  m.peak = peak;
  m.peak_at = peak_at;
  m.activation_peak = peak - m.persistent.total();
  return m;
}

}  // namespace ndt::plan
