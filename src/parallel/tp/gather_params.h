#pragma once
// Reassemble full (global) parameter tensors from TP shards (and expert shards over EP): for saving
// weights and for parity checks against the single-process run. Collective over the TP group (and the
// EP group when given); every rank gets the result.
#include <string>
#include <utility>
#include <vector>

#include "dist/communicator.h"
#include "model/params.h"

namespace ndt {

std::vector<std::pair<std::string, Tensor>> gather_full_params(const ParamStore& params, Communicator& tp,
                                                               Communicator* ep = nullptr);
// The same for another buffer laid out like the store's flat values (e.g. the reduced gradients): each
// parameter's slice is taken from `flat` (host f32) at its offset.
std::vector<std::pair<std::string, Tensor>> gather_full_tensors(const ParamStore& params, const Tensor& flat,
                                                                Communicator& tp, Communicator* ep = nullptr);

}  // namespace ndt
