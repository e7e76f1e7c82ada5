#include "parallel/tp/gather_params.h"

namespace ndt {

std::vector<std::pair<std::string, Tensor>> gather_full_params(const ParamStore& params, Communicator& tp,
                                                               Communicator* ep) {
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& p : params.all()) {
    if (p->expert && p->shard_dim == 0) {  // EP rank r holds experts [r * El, (r + 1) * El): blocks in order
      NDT_CHECK(ep != nullptr && ep->size() * p->value.size(0) == p->global_shape[0],
                "gathering expert tensor {} needs the EP group", p->name);
      Tensor full = Tensor::empty(p->global_shape);
      ep->all_gather(p->value.data_ptr(), full.data_ptr(), p->numel(), DType::F32);
      out.emplace_back(p->name, full);
      continue;
    }
    if (p->shard_dim < 0 || tp.size() == 1) {
      out.emplace_back(p->name, p->value.clone());
      continue;
    }
    const int64_t n = p->numel();
    Tensor all = Tensor::empty({tp.size() * n});
    tp.all_gather(p->value.data_ptr(), all.data_ptr(), n, DType::F32);
    Tensor full = Tensor::empty(p->global_shape);
    const int64_t width = p->value.size(p->shard_dim);
    for (int r = 0; r < tp.size(); ++r) {
      const float* src = all.f32() + r * n;
      for (int64_t i = 0; i < n; ++i)
        full.f32()[slice_to_global_index(p->value.shape(), p->global_shape, p->shard_dim, width * r, i)] =
            src[i];
    }
    out.emplace_back(p->name, full);
  }
  return out;
}

}  // namespace ndt
