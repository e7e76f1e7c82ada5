#include "model/params.h"

#include <cstring>

#include "core/rng.h"
#include "ops/ops.h"

namespace ndt {

int64_t slice_to_global_index(const Shape& local, const Shape& global, int shard_dim, int64_t offset,
                              int64_t i) {
  if (shard_dim < 0) return i;
  // Decompose the local index over the local shape, shift the sharded coordinate, recompose globally.
  int64_t g = 0, rem = i, stride = shape_numel(local);
  for (size_t d = 0; d < local.size(); ++d) {
    stride /= local[d];
    int64_t c = rem / stride;
    rem %= stride;
    if (static_cast<int>(d) == shard_dim) c += offset;
    g = g * global[d] + c;
  }
  return g;
}

int64_t Param::global_index(int64_t i) const {
  return slice_to_global_index(value.shape(), global_shape, shard_dim, shard_offset, i);
}

void copy_global_slices(ParamStore& store, const std::map<std::string, const Tensor*>& full,
                        const std::string& what) {
  for (auto& p : store.all()) {
    auto it = full.find(p->name);
    if (it == full.end()) NDT_FAIL("{} have no tensor '{}'", what, p->name);
    const Tensor src = ops::to_host_f32(*it->second);
    if (src.shape() != p->global_shape)
      NDT_FAIL("{}: tensor '{}' has shape {}, the model expects {}", what, p->name, shape_str(src.shape()),
               shape_str(p->global_shape));
    NDT_CHECK(p->value.device() == Device::CPU, "copy_global_slices: '{}' is not on the host", p->name);
    // The slice is a block along shard_dim: `outer` runs of `run` contiguous elements.
    const Shape& l = p->value.shape();
    const int sd = p->shard_dim < 0 ? 0 : p->shard_dim;
    int64_t outer = 1, inner = 1;
    for (int d = 0; d < sd; ++d) outer *= l[static_cast<size_t>(d)];
    for (size_t d = static_cast<size_t>(sd) + 1; d < l.size(); ++d) inner *= l[d];
    const int64_t run = l.empty() ? 1 : l[static_cast<size_t>(sd)] * inner;
    const int64_t gdim = l.empty() ? 1 : p->global_shape[static_cast<size_t>(sd)];
    const int64_t off = p->shard_dim < 0 ? 0 : p->shard_offset;
    float* dst = p->value.f32();
    for (int64_t o = 0; o < outer; ++o)
      std::memcpy(dst + o * run, src.f32() + (o * gdim + off) * inner,
                  static_cast<size_t>(run) * sizeof(float));
  }
}

float init_value(uint64_t seed, const std::string& name, InitKind kind, float std, int64_t global_index) {
  switch (kind) {
    case InitKind::Ones:
      return 1.0f;
    case InitKind::Zeros:
      return 0.0f;
    case InitKind::Normal:
      return std * philox_normal(seed, stable_hash(name), static_cast<uint64_t>(global_index));
  }
  return 0.0f;
}

Param& ParamStore::add(const std::string& name, Shape global_shape, InitKind init, float init_std,
                       bool weight_decay, int shard_dim, int64_t shards, int64_t shard_rank) {
  NDT_CHECK(find(name) == nullptr, "duplicate parameter {}", name);
  auto p = std::make_unique<Param>();
  p->name = name;
  p->global_shape = global_shape;
  Shape local = global_shape;
  if (shard_dim >= 0 && shards > 1) {
    NDT_CHECK(global_shape[shard_dim] % shards == 0,
              "parameter {} dim {} of size {} not divisible into {} shards", name, shard_dim,
              global_shape[shard_dim], shards);
    local[shard_dim] = global_shape[shard_dim] / shards;
    p->shard_dim = shard_dim;
    p->shard_offset = local[shard_dim] * shard_rank;
    p->tp_replicated = false;
  }
  p->init = init;
  p->init_std = init_std;
  p->weight_decay = weight_decay;
  p->value = Tensor::zeros(local);
  p->grad = Tensor::zeros(local);
  params_.push_back(std::move(p));
  return *params_.back();
}

void ParamStore::init(uint64_t seed) {
  for (auto& p : params_) {
    float* v = p->value.f32();
    const int64_t n = p->numel();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i)
      v[i] = init_value(seed, p->name, p->init, p->init_std, p->global_index(i));
  }
}

void ParamStore::zero_grad() {
  if (flat_grads_.defined()) {
    flat_grads_.zero_();  // one memset (on the device: one launch instead of one per parameter)
    return;
  }
  for (auto& p : params_) p->grad.zero_();
}

Param* ParamStore::find(const std::string& name) {
  for (auto& p : params_)
    if (p->name == name) return p.get();
  return nullptr;
}

Param& ParamStore::get(const std::string& name) {
  Param* p = find(name);
  NDT_CHECK(p != nullptr, "no parameter named {}", name);
  return *p;
}

const Param& ParamStore::get(const std::string& name) const {
  return const_cast<ParamStore*>(this)->get(name);
}

int64_t ParamStore::local_numel() const {
  int64_t n = 0;
  for (const auto& p : params_) n += p->numel();
  return n;
}

int64_t ParamStore::global_numel() const {
  int64_t n = 0;
  for (const auto& p : params_)
    if (p->count_in_norm) n += shape_numel(p->global_shape);
  return n;
}

void ParamStore::flatten(int64_t align, int64_t expert_align) {
  offsets_.assign(params_.size(), 0);
  int64_t n = 0;
  for (size_t i = 0; i < params_.size(); ++i)
    if (!params_[i]->expert) {
      offsets_[i] = n;
      n += params_[i]->numel();
    }
  n = (n + align - 1) / align * align;
  expert_begin_ = n;
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i]->expert) {
      offsets_[i] = n;
      n += params_[i]->numel();
    }
  if (n > expert_begin_)
    n = expert_begin_ + (n - expert_begin_ + expert_align - 1) / expert_align * expert_align;
  Tensor values = Tensor::zeros({n}), grads = Tensor::zeros({n});
  for (size_t i = 0; i < params_.size(); ++i) {
    Param& p = *params_[i];
    Tensor v = values.view_at(offsets_[i], p.value.shape());
    v.copy_from(p.value);
    p.value = v;
    p.grad = grads.view_at(offsets_[i], p.value.shape());
  }
  flat_values_ = values;
  flat_grads_ = grads;
}

void ParamStore::to_device(Device dev, DType compute, Tensor grads) {
  settle_values();
  NDT_CHECK(flat_values_.defined(), "ParamStore::to_device needs a flattened store");
  NDT_CHECK(compute == DType::F32 || compute == DType::BF16, "compute dtype must be f32 or bf16, got {}",
            dtype_name(compute));
  NDT_CHECK(dev == Device::CUDA || compute == DType::F32, "bf16 compute needs a CUDA device");
  if (grads.defined()) {
    NDT_CHECK(grads.shape() == flat_grads_.shape() && grads.dtype() == DType::F32 && grads.device() == dev,
              "to_device: grads {} {} on {} for a store of {} f32 grads on {}", shape_str(grads.shape()),
              dtype_name(grads.dtype()), device_name(grads.device()), shape_str(flat_grads_.shape()),
              device_name(dev));
  } else {
    grads = Tensor::zeros(flat_grads_.shape(), DType::F32, dev);
  }
  Tensor values = flat_values_.to(dev);
  flat_compute_ = Tensor();
  if (compute == DType::BF16) flat_compute_ = Tensor::empty(values.shape(), DType::BF16, dev);
  for (size_t i = 0; i < params_.size(); ++i) {
    Param& p = *params_[i];
    const Shape shape = p.value.shape();
    p.value = values.view_at(offsets_[i], shape);
    p.grad = grads.view_at(offsets_[i], shape);
    p.compute = flat_compute_.defined() ? flat_compute_.view_at(offsets_[i], shape) : Tensor();
  }
  flat_values_ = values;
  flat_grads_ = grads;
  device_ = dev;
  compute_dtype_ = compute;
  refresh_compute();
}

void ParamStore::settle_values() {
  if (!values_pending_) return;
  std::function<void()> settle = std::move(values_pending_);
  values_pending_ = nullptr;
  settle();
}

void ParamStore::refresh_compute() {
  settle_values();
  if (flat_compute_.defined()) ops::cast_into(flat_compute_, flat_values_);
}

void ParamStore::with_host_values(const std::function<void()>& fn, bool write_back) {
  if (device_ == Device::CPU) {
    fn();
    return;
  }
  settle_values();
  const Tensor host = flat_values_.to(Device::CPU);
  std::vector<Tensor> device_views;
  for (size_t i = 0; i < params_.size(); ++i) {
    device_views.push_back(params_[i]->value);
    params_[i]->value = host.view_at(offsets_[i], params_[i]->value.shape());
  }
  auto restore = [&] {
    for (size_t i = 0; i < params_.size(); ++i) params_[i]->value = device_views[i];
  };
  try {
    fn();
  } catch (...) {
    restore();
    throw;
  }
  restore();
  if (write_back) {
    flat_values_.copy_from(host);
    refresh_compute();
  }
}

int64_t ParamStore::offset_of(const Param& p) const {
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].get() == &p) return offsets_.at(i);
  NDT_FAIL("parameter {} is not in this store", p.name);
}

}  // namespace ndt
