#pragma once
// Parameters with stable global names and explicit placement (DESIGN.md §1.3): each local tensor knows
// the global tensor it is a slice of. Initialization is a pure function of (seed, global name, global
// element index), so every layout starts from identical weights with no communication.
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace ndt {

enum class InitKind { Normal, Ones, Zeros };

struct Param {
  std::string name;          // global, e.g. "layers.7.attn.wq.weight"
  Shape global_shape;        // shape of the whole tensor
  int shard_dim = -1;        // dim split over TP ranks (-1: this rank holds the whole tensor)
  int64_t shard_offset = 0;  // first global index along shard_dim held here
  // Same values on every TP rank (norm weights, row-parallel biases, position table). Their gradients
  // are partial sums under sequence parallelism and are reduced over TP; the grad norm counts them once.
  bool tp_replicated = true;
  // Replicated over TP, but each TP rank's gradient covers only its own attention heads (Qwen3's q/k norm
  // weights, shared by all heads): a partial sum over TP with or without sequence parallelism, reduced
  // over TP by the optimizer (transformers' tp_plan calls this "replicated_with_grad_allreduce").
  bool tp_partial_grad = false;
  bool weight_decay = false;  // matrices decay; norms and biases do not
  // False for a second copy of a parameter held elsewhere too (the tied embedding on the last pipeline
  // stage): the global grad norm counts each parameter once.
  bool count_in_norm = true;
  // A routed-expert weight (E, ...): dim 0 sharded over the EP group (shard_dim 0 when ep > 1), replicated
  // over TP, its gradient reduced over the expert-data-parallel group instead of DP x CP.
  bool expert = false;
  // The forward reads the fp32 value itself, not the compute copy (the MoE router and its bias): ZeRO-1 then
  // gathers values at the end of the optimizer step instead of deferring it (ParamStore::settle_values).
  bool forward_reads_value = false;
  InitKind init = InitKind::Normal;
  float init_std = 0.02f;
  Tensor value;  // local slice (fp32 master weights)
  Tensor grad;   // same shape as value, fp32; accumulated by backward (+=)
  // Mixed precision: the bf16 copy of value that kernels read (a view into the store's compute buffer,
  // refreshed by the optimizer). Undefined when the compute dtype is fp32: kernels read value itself.
  Tensor compute;

  int64_t numel() const { return value.numel(); }
  const Tensor& compute_value() const { return compute.defined() ? compute : value; }
  // Global flat index of local element i.
  int64_t global_index(int64_t i) const;
};

class ParamStore {
 public:
  // Registers a parameter; local shape = global shape with shard_dim divided into `shards` slices of
  // which this rank holds slice `shard_rank`.
  Param& add(const std::string& name, Shape global_shape, InitKind init, float init_std, bool weight_decay,
             int shard_dim = -1, int64_t shards = 1, int64_t shard_rank = 0);
  // Fills every value from (seed, name, global index).
  void init(uint64_t seed);
  void zero_grad();
  Param& get(const std::string& name);
  const Param& get(const std::string& name) const;
  Param* find(const std::string& name);
  std::vector<std::unique_ptr<Param>>& all() { return params_; }
  const std::vector<std::unique_ptr<Param>>& all() const { return params_; }
  int64_t local_numel() const;
  // Elements of the full (global) tensors this store holds shards of, each parameter once (tied copies that
  // do not count in the norm left out).
  int64_t global_numel() const;
  // Moves every value and grad into one flat buffer each (params become views, in registration order,
  // each starting at Param offset), padded to a multiple of `align` elements. Flat buffers make
  // bucketed gradient reduction and ZeRO-1 sharding plain slicing. Expert params (Param::expert) go
  // after all others, from expert_begin() (a multiple of `align`), padded to a multiple of
  // `expert_align`: the two regions are reduced and ZeRO-sharded over different groups.
  void flatten(int64_t align = 1, int64_t expert_align = 1);
  int64_t expert_begin() const { return expert_begin_; }
  Tensor& flat_values() { return flat_values_; }
  Tensor& flat_grads() { return flat_grads_; }
  // The bf16 compute copy of flat_values (undefined when compute_dtype() is F32).
  Tensor& flat_compute() { return flat_compute_; }
  int64_t offset_of(const Param& p) const;

  // Where the parameters live and the dtype kernels compute in (activations and weight copies). Values,
  // grads (and the optimizer state) stay fp32. Moves the flattened store's buffers to `dev` (values are
  // copied, grads zeroed) and, for compute = BF16, creates the compute copy. Initialize (init / load) on
  // the CPU first: initialization is layout- and device-independent. Moving back to the CPU gives fp32.
  // `grads`, when given, becomes the flat gradient buffer instead of a new one (zeroed, flat_grads' shape,
  // f32 on `dev`): DP hands in NCCL memory it registers for its reductions.
  void to_device(Device dev, DType compute, Tensor grads = Tensor());
  Device device() const { return device_; }
  DType compute_dtype() const { return compute_dtype_; }
  // Re-derives the compute copy from the values (after they were written other than by the optimizer).
  void refresh_compute();
  // ZeRO-1 on GPUs gathers the other ranks' updated fp32 values beside the next step (the forward reads the
  // compute copy, gathered at once): until then those values are being written. Whatever reads Param::value
  // or flat_values() outside the optimizer calls settle_values() first, which makes the current stream (and
  // so the host's later copies) wait for the gather; with_host_values and refresh_compute do it themselves.
  // The optimizer sets the hook (nullptr clears it); settling runs it once.
  void set_values_pending(std::function<void()> settle) { values_pending_ = std::move(settle); }
  void settle_values();
  bool values_pending() const { return static_cast<bool>(values_pending_); }
  // Runs fn with every Param::value a host f32 tensor: itself on the CPU; on CUDA views of one host copy
  // of the flat values (checkpoints, weight import/export read and write values on the host). With
  // write_back the host values are copied to the device afterwards (and the compute copy refreshed).
  void with_host_values(const std::function<void()>& fn, bool write_back);

 private:
  std::vector<std::unique_ptr<Param>> params_;
  std::vector<int64_t> offsets_;
  int64_t expert_begin_ = 0;
  Tensor flat_values_, flat_grads_, flat_compute_;
  std::function<void()> values_pending_;
  Device device_ = Device::CPU;
  DType compute_dtype_ = DType::F32;
};

// Global flat index of element i of a slice with `local` shape taken at `offset` along shard_dim.
int64_t slice_to_global_index(const Shape& local, const Shape& global, int shard_dim, int64_t offset,
                              int64_t i);

// Fills every parameter's local slice (Param::value, host f32: on a device store run it inside
// with_host_values) from the full tensor of the same name. Errors name `what` (e.g. "initial weights") and
// the tensor when one is missing or its shape is not the parameter's global shape.
void copy_global_slices(ParamStore& store, const std::map<std::string, const Tensor*>& full,
                        const std::string& what);

// The init value of element `global_index` of parameter `name`.
float init_value(uint64_t seed, const std::string& name, InitKind kind, float std, int64_t global_index);

}  // namespace ndt
