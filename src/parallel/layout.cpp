#include "parallel/layout.h"

#include "parallel/pp/pipeline.h"
#include "parallel/pp/schedule.h"

#ifdef NDT_HAVE_CUDA
#include "cuda/runtime.h"
#include "dist/device_communicator.h"
#endif

namespace ndt {
namespace {

GridSpec spec_of(const ParallelConfig& p) {
  GridSpec s;
  // EP folds onto the DP x CP ranks instead of multiplying the world size: the grid's ep axis stays 1 and
  // the EP groups are cut out of the DP x CP group (Layout::create).
  s.sizes = {{"tp", p.tp}, {"cp", p.cp}, {"ep", 1}, {"dp", p.dp}, {"pp", p.pp}};
  s.order = p.order;
  return s;
}

GridDivisibility div_of(const Config& c) {
  GridDivisibility d;
  d.n_heads = c.model.n_heads;
  d.n_kv_heads = c.model.kv_heads();
  d.vocab_size = c.model.vocab_size;
  d.n_layers = c.parallel.stage_layers.empty() ? c.model.n_layers : 0;  // uneven splits: checked below
  d.global_batch = c.train.global_batch;
  d.d_ff = c.model.ffn_dim();
  d.virtual_stages = c.parallel.virtual_stages;
  return d;
}

}  // namespace

namespace {
// Post-training batches are rollouts (prompts x samples) or pairs, split over DP in contiguous blocks.
Status validate_posttrain_layout(const Config& cfg, int world_size, int64_t mbs, const std::string& layout) {
  const PosttrainConfig& t = cfg.posttrain;
  if (t.algo == "sft") return Status::ok();
  if (world_size % t.gen_tp != 0)
    return Status::error(
        fmt::format("posttrain.gen_tp = {} does not divide the {} ranks", t.gen_tp, world_size));
  const int64_t dp = cfg.parallel.dp;
  if (t.algo == "dpo") {
    if (t.pairs_per_step % dp != 0)
      return Status::error(fmt::format("posttrain.pairs_per_step = {} is not divisible by dp = {} ({})",
                                       t.pairs_per_step, dp, layout));
    if (!cfg.data.packing && (2 * t.pairs_per_step / dp) % mbs != 0)
      return Status::error(fmt::format(
          "DPO: train.micro_batch = {} must divide the {} samples (chosen + rejected) per DP rank ({})", mbs,
          2 * t.pairs_per_step / dp, layout));
    if (!cfg.data.packing && mbs % 2 != 0)
      return Status::error(fmt::format(
          "DPO: train.micro_batch = {} must be even (a pair's chosen and rejected share a microbatch)", mbs));
    return Status::ok();
  }
  const int64_t n = t.prompts_per_step * t.samples_per_prompt;
  if (n < dp || (!cfg.data.packing && !t.dynamic_sampling && n % (dp * mbs) != 0))
    return Status::error(fmt::format(
        "GRPO: {} rollouts per step (posttrain.prompts_per_step x samples_per_prompt) must be a multiple of "
        "dp x train.micro_batch = {} x {} ({})",
        n, dp, mbs, layout));
  return Status::ok();
}
}  // namespace

Status validate_layout(const Config& cfg, int world_size) {
  const ParallelConfig& p = cfg.parallel;
  Status st = Grid::validate(world_size, spec_of(p), div_of(cfg));
  if (!st) return st;
  const std::string layout = fmt::format("tp={} cp={} ep={} dp={} pp={}", p.tp, p.cp, p.ep, p.dp, p.pp);
  if (p.ep > 1 && (p.dp * p.cp) % p.ep != 0)
    return Status::error(
        fmt::format("layout {}: parallel.ep = {} must divide dp * cp = {} (experts are sharded "
                    "over the data x context parallel ranks)",
                    layout, p.ep, p.dp * p.cp));
  if (p.ep > 1 && cfg.model.moe.num_experts % p.ep != 0)
    return Status::error(
        fmt::format("layout {}: model.moe.num_experts = {} is not divisible by parallel.ep = {}", layout,
                    cfg.model.moe.num_experts, p.ep));
  if (p.cp > 1 && cfg.data.seq_len % (2 * p.cp) != 0)
    return Status::error(
        fmt::format("context parallelism cuts each sequence into 2*cp = {} chunks: data.seq_len ({}) must be "
                    "a multiple of "
                    "{} ({})",
                    2 * p.cp, cfg.data.seq_len, 2 * p.cp, layout));
  if (p.virtual_stages > 1 && p.pp == 1)
    return Status::error(
        fmt::format("parallel.virtual_stages={} needs pp > 1 ({})", p.virtual_stages, layout));
  const int64_t per_rank = cfg.train.global_batch / p.dp;
  const int64_t mbs = cfg.train.micro_batch > 0 ? cfg.train.micro_batch : per_rank;
  if (Status pt = validate_posttrain_layout(cfg, world_size, mbs, layout); !pt) return pt;
  if (per_rank % mbs != 0)
    return Status::error(fmt::format("train.micro_batch={} does not divide the {} samples per DP rank ({})",
                                     mbs, per_rank, layout));
  if (auto b = stage_boundaries(p, cfg.model.n_layers); !b)
    return Status::error(b.status().message() + " (" + layout + ")");
  if (p.pp > 1) {
    const std::string kind = p.virtual_stages > 1 ? "interleaved" : p.schedule;
    auto sched = pp::make_schedule(kind, static_cast<int>(p.pp), static_cast<int>(p.virtual_stages),
                                   static_cast<int>(per_rank / mbs));
    if (!sched)
      return Status::error(sched.status().message() + " (microbatches per step = samples per DP rank / " +
                           "train.micro_batch; " + layout + ")");
  }
  // Packed microbatches get tail padding for SP (data/packing.h); padded ones must divide as they are.
  if (p.sequence_parallel && !cfg.data.packing && (mbs * cfg.data.seq_len / p.cp) % p.tp != 0)
    return Status::error(
        fmt::format("sequence parallel: micro_batch {} x seq_len {} tokens{} not divisible by tp={} (or use "
                    "data.packing)",
                    mbs, cfg.data.seq_len, p.cp > 1 ? fmt::format(" / cp={}", p.cp) : "", p.tp));
  return Status::ok();
}

Result<std::unique_ptr<Layout>> Layout::create(const Config& cfg, Communicator& world) {
  Status st = validate_layout(cfg, world.size());
  if (!st) return st;
  auto grid = Grid::create(world, spec_of(cfg.parallel), div_of(cfg));
  if (!grid) return grid.status();
  std::unique_ptr<Layout> l(new Layout());
  l->world_ = &world;
  l->grid_ = std::move(grid).value();
  l->replica_axes_ = replica_axes(cfg);
  if (cfg.train.device == "cuda") {
#ifdef NDT_HAVE_CUDA
    // One GPU per rank (or ranks sharing one with device_comm mpi); every group that moves device buffers
    // (activations, gradients, weights) gets a device communicator, bootstrapped over the group's MPI
    // communicator (collective, same order on all ranks).
    const int dev = cuda::select_device(world.rank());
    const std::vector<std::pair<std::string, std::vector<std::string>>> groups = {
        {"dp", {"dp"}}, {"cp", {"cp"}}, {"grad", {"dp", "cp"}}, {"tp", {"tp"}}, {"pp", {"pp"}}};
    std::vector<std::pair<std::string, std::vector<std::string>>> all = groups;
    if (cfg.encoder.enabled()) all.push_back({"bridge", replica_axes(cfg)});
    for (const auto& [name, dims] : all) {
      Communicator& mpi = l->grid_->comm(std::vector<std::string>(dims.begin(), dims.end()));
      l->device_comms_[name] = make_device_communicator(mpi, dev, cfg.train.device_comm);
    }
    l->make_expert_groups(cfg.parallel.ep);
    l->device_comms_["ep"] = make_device_communicator(*l->ep_, dev, cfg.train.device_comm);
    l->device_comms_["edp"] = make_device_communicator(*l->edp_, dev, cfg.train.device_comm);
#else
    return Status::error("train.device is cuda but this ndtrain was built without the CUDA backend");
#endif
  }
  if (!l->ep_) l->make_expert_groups(cfg.parallel.ep);
  if (cfg.parallel.ep > 1) l->ep_hooks_ = std::make_unique<CommEpHooks>(*l->ep_, l->expert_group("ep"));
  if (cfg.parallel.tp > 1)
    l->tp_hooks_ = std::make_unique<CommTpHooks>(l->group("tp", {"tp"}), cfg.parallel.sequence_parallel,
                                                 cfg.parallel.tp_comm_overlap);
  return l;
}

void Layout::make_expert_groups(int64_t ep) {
  // DP x CP group rank g (cp innermost, as the grid orders them): EP groups are blocks of ep consecutive
  // ranks, expert-data-parallel groups take every ep-th rank (Megatron's convention).
  Communicator& grad = grid_->comm({"dp", "cp"});
  const int g = grad.rank();
  ep_ = grad.split(static_cast<int>(g / ep), g);
  edp_ = grad.split(static_cast<int>(g % ep), g);
}

Communicator& Layout::expert_group(const std::string& name) {
  auto it = device_comms_.find(name);
  return it != device_comms_.end() ? *it->second : (name == "ep" ? *ep_ : *edp_);
}

std::string Layout::describe() const {
  std::string d = grid_->describe();
  const std::string one = "ep=1";
  if (auto at = d.find(one); at != std::string::npos)
    d.replace(at, one.size(), fmt::format("ep={}", ep_->size()));
  return d;
}

Communicator& Layout::group(const std::string& name, std::initializer_list<std::string> dims) {
  auto it = device_comms_.find(name);
  return it != device_comms_.end() ? *it->second : grid_->comm(std::vector<std::string>(dims));
}

std::vector<std::string> Layout::replica_axes(const Config& cfg) {
  if (cfg.parallel.sequence_parallel) return {"tp", "cp", "pp"};
  return {"cp", "pp"};
}

Communicator& Layout::bridge_group() {
  auto it = device_comms_.find("bridge");
  return it != device_comms_.end() ? *it->second : grid_->comm(replica_axes_);
}

RunComms Layout::comms() {
  RunComms c;
  c.world = world_;
  c.dp = &group("dp", {"dp"});
  c.cp = &group("cp", {"cp"});
  c.grad = &group("grad", {"dp", "cp"});
  c.tp = &group("tp", {"tp"});
  c.pp = &group("pp", {"pp"});
  c.tp_hooks = tp_hooks_.get();
  c.ep = &expert_group("ep");
  c.expert_dp = &expert_group("edp");
  c.ep_hooks = ep_hooks_.get();
  return c;
}

}  // namespace ndt
