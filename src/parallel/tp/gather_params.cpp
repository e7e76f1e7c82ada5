#include "parallel/tp/gather_params.h"

namespace ndt {

namespace {

// src(p): the local slice of parameter p to assemble (its value, or a view of another flat buffer).
template <typename Src>
std::vector<std::pair<std::string, Tensor>> gather(const ParamStore& params, Communicator& tp,
                                                   Communicator* ep, Src&& src) {
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& param : params.all()) {
    const Param& p = *param;
    const Tensor v = src(p);             // this rank's slice
    if (p.expert && p.shard_dim == 0) {  // EP rank r holds experts [r * El, (r + 1) * El): blocks in order
      NDT_CHECK(ep != nullptr && ep->size() * v.size(0) == p.global_shape[0],
                "gathering expert tensor {} needs the EP group", p.name);
      Tensor full = Tensor::empty(p.global_shape);
      ep->all_gather(v.data_ptr(), full.data_ptr(), v.numel(), DType::F32);
      out.emplace_back(p.name, full);
      continue;
    }
    if (p.shard_dim < 0 || tp.size() == 1) {
      out.emplace_back(p.name, v.clone());
      continue;
    }
    const int64_t n = v.numel();
    Tensor all = Tensor::empty({tp.size() * n});
    tp.all_gather(v.data_ptr(), all.data_ptr(), n, DType::F32);
    Tensor full = Tensor::empty(p.global_shape);
    const int64_t width = v.size(p.shard_dim);
    for (int r = 0; r < tp.size(); ++r) {
      const float* from = all.f32() + r * n;
      for (int64_t i = 0; i < n; ++i)
        full.f32()[slice_to_global_index(v.shape(), p.global_shape, p.shard_dim, width * r, i)] = from[i];
    }
    out.emplace_back(p.name, full);
  }
  return out;
}

}  // namespace

std::vector<std::pair<std::string, Tensor>> gather_full_params(const ParamStore& params, Communicator& tp,
                                                               Communicator* ep) {
  return gather(params, tp, ep, [](const Param& p) { return p.value; });
}

std::vector<std::pair<std::string, Tensor>> gather_full_tensors(const ParamStore& params, const Tensor& flat,
                                                                Communicator& tp, Communicator* ep) {
  return gather(params, tp, ep,
                [&](const Param& p) { return flat.view_at(params.offset_of(p), p.value.shape()); });
}

}  // namespace ndt
