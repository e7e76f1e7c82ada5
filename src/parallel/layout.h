#pragma once
// Builds a run's parallel layout from the config: the Grid over the world communicator, the TP hooks
// and the RunComms the trainer uses. Validation happens here, before any work starts, and names every
// degree when something does not divide.
#include <initializer_list>
#include <map>
#include <memory>
#include <string>

#include "dist/grid.h"
#include "parallel/ep/comm_ep_hooks.h"
#include "parallel/tp/comm_tp_hooks.h"
#include "train/config.h"
#include "train/trainer.h"

namespace ndt {

class Layout {
 public:
  // Collective over world. The world communicator must outlive the layout.
  static Result<std::unique_ptr<Layout>> create(const Config& cfg, Communicator& world);
  RunComms comms();
  Grid& grid() { return *grid_; }
  Communicator& world() { return *world_; }
  bool is_logger() const { return world_->rank() == 0; }
  std::string describe() const;  // "tp=2 cp=1 ep=2 dp=2 pp=1"
  // The ranks of one LLM replica whose gradients of an input row are partial sums (cp x pp, with tp under
  // sequence parallelism): the multimodal bridge sums the injected rows' gradients over them.
  Communicator& bridge_group();
  static std::vector<std::string> replica_axes(const Config& cfg);

 private:
  Communicator* world_ = nullptr;
  std::unique_ptr<Grid> grid_;
  std::vector<std::string> replica_axes_;
  std::unique_ptr<CommTpHooks> tp_hooks_;
  // Expert parallelism: EP and expert-data-parallel groups cut out of DP x CP (host/MPI communicators).
  std::unique_ptr<Communicator> ep_, edp_;
  std::unique_ptr<CommEpHooks> ep_hooks_;
  void make_expert_groups(int64_t ep);
  Communicator& expert_group(const std::string& name);  // the device communicator when there is one
  // train.device cuda: NCCL communicators over the grid's groups (host buffers still go over MPI).
  std::map<std::string, std::unique_ptr<Communicator>> device_comms_;
  Communicator& group(const std::string& name, std::initializer_list<std::string> dims);
};

// Checks the layout against the config without communicating (same messages as create()).
Status validate_layout(const Config& cfg, int world_size);

}  // namespace ndt
