#pragma once
// Expert parallelism over an EP communicator (model/ep_hooks.h has the contract): row counts travel over
// a host communicator (MPI), rows over `data` (the same MPI group on CPU, NCCL on GPU) with one variable
// all-to-all each way. Blocking.
#include "dist/communicator.h"
#include "model/ep_hooks.h"

namespace ndt {

class CommEpHooks final : public EpHooks {
 public:
  // host and data span the same ranks in the same order; neither is owned.
  CommEpHooks(Communicator& host, Communicator& data) : host_(host), data_(data) {}
  int size() const override { return host_.size(); }
  int rank() const override { return host_.rank(); }
  EpPlan plan(const std::vector<int64_t>& counts) override;
  Tensor dispatch(const Tensor& x, const EpPlan& plan) override;
  Tensor combine(const Tensor& y, const EpPlan& plan) override;

 private:
  Communicator& host_;
  Communicator& data_;
};

}  // namespace ndt
