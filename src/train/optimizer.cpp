#include "train/optimizer.h"

#include <algorithm>
#include <cmath>

#include "ops/cpu_ops.h"

#ifdef NDT_HAVE_NCCL
#include "dist/nccl_communicator.h"
#endif
#ifdef NDT_HAVE_CUDA
#include "cuda/cuda_ops.h"
#include "cuda/runtime.h"
#endif

namespace ndt {
namespace {

constexpr int64_t kBucketElems = int64_t{1} << 22;  // 16 MiB of fp32 per all-reduce

bool active(const Communicator* c) { return c != nullptr && c->size() > 1; }

}  // namespace

Optimizer::Optimizer(ParamStore& params, const TrainConfig& cfg, OptimizerComms comms)
    : params_(params), cfg_(cfg), c_(comms) {
  const int64_t n = params_.flat_grads().numel();
  NDT_CHECK(n > 0, "optimizer needs a flattened parameter store");
  if (c_.zero1 && active(c_.dp)) {
    const int64_t dp = c_.dp->size();
    NDT_CHECK(n % dp == 0, "flat buffer of {} elements not aligned to dp={}", n, dp);
    own_begin_ = n / dp * c_.dp->rank();
    own_end_ = own_begin_ + n / dp;
    shard_grad_ = Tensor::zeros({n / dp}, DType::F32, params_.device());
  } else {
    own_begin_ = 0;
    own_end_ = n;
  }
  m_ = Tensor::zeros({own_end_ - own_begin_}, DType::F32, params_.device());
  v_ = Tensor::zeros({own_end_ - own_begin_}, DType::F32, params_.device());
}

bool Optimizer::overlaps_reduction() const {
#ifdef NDT_HAVE_NCCL
  return params_.device() == Device::CUDA && active(c_.dp) && !c_.zero1 && as_nccl(c_.dp) != nullptr;
#else
  return false;
#endif
}

void Optimizer::reduce_early(int64_t begin, int64_t end) {
  NDT_CHECK(overlaps_reduction() && begin >= 0 && begin < end && end <= params_.flat_grads().numel(),
            "reduce_early [{}, {}): needs plain DP over NCCL and a range of the flat buffer", begin, end);
#ifdef NDT_HAVE_NCCL
  std::shared_ptr<CommHandle> h = as_nccl(c_.dp)->all_reduce_async(params_.flat_grads().f32() + begin,
                                                                   end - begin, DType::F32, ReduceOp::Sum);
  early_ranges_.emplace_back(begin, end);
  early_waits_.push_back([h] { h->wait(); });
#endif
}

double Optimizer::reduce_and_clip(double clip) {
  Tensor& flat = params_.flat_grads();
  const int64_t n = flat.numel();
  const bool tp_active = active(c_.tp);
  for (auto& wait : early_waits_) wait();  // DP reductions started under backward (reduce_early)
  if (c_.sequence_parallel && tp_active) {
    for (auto& p : params_.all())
      if (p->tp_replicated) c_.tp->all_reduce(p->grad.data_ptr(), p->numel(), DType::F32, ReduceOp::Sum);
  }
  // The range whose reduced gradient this rank holds after DP reduction.
  float* g = flat.f32() + own_begin_;
  if (active(c_.dp)) {
    if (c_.zero1) {
      c_.dp->reduce_scatter(flat.f32(), shard_grad_.f32(), n / c_.dp->size(), DType::F32, ReduceOp::Sum);
      g = shard_grad_.f32();
    } else {
      std::sort(early_ranges_.begin(), early_ranges_.end());
      auto reduce = [&](int64_t b, int64_t e) {
        for (; b < e; b += kBucketElems)
          c_.dp->all_reduce(flat.f32() + b, std::min(kBucketElems, e - b), DType::F32, ReduceOp::Sum);
      };
      int64_t done = 0;  // the ranges between the early ones (embeddings, final norm, head, padding)
      for (const auto& [b, e] : early_ranges_) {
        reduce(done, b);
        done = e;
      }
      reduce(done, n);
    }
    early_ranges_.clear();
    early_waits_.clear();
  }
  // Sum of squares: elements of TP-replicated params count on TP rank 0 only.
  double ss = 0;
  std::vector<std::pair<int64_t, int64_t>> runs;  // counted ranges, adjacent ones merged (device path)
  for (auto& p : params_.all()) {
    if (!p->count_in_norm || (p->tp_replicated && tp_active && c_.tp->rank() != 0)) continue;
    const int64_t b = std::max(params_.offset_of(*p), own_begin_);
    const int64_t e = std::min(params_.offset_of(*p) + p->numel(), own_end_);
    if (b >= e) continue;
    if (params_.device() == Device::CPU) {
      ss += cpu::sum_squares(g + (b - own_begin_), e - b);
    } else if (!runs.empty() && runs.back().second == b) {
      runs.back().second = e;
    } else {
      runs.emplace_back(b, e);
    }
  }
#ifdef NDT_HAVE_CUDA
  if (params_.device() == Device::CUDA) {
    // Accumulated on the device, read once (the step's only wait for the GPU besides the loss).
    Tensor acc = Tensor::zeros({1}, DType::F64, Device::CUDA);
    for (auto [b, e] : runs)
      cuda::sum_squares_device(acc.data<double>(), g + (b - own_begin_), e - b, /*accumulate=*/true,
                               cuda::stream());
    ss = acc.to_vector<double>()[0];
  }
#endif
  if (c_.zero1 && active(c_.dp)) c_.dp->all_reduce(&ss, 1, DType::F64, ReduceOp::Sum);
  if (tp_active) c_.tp->all_reduce(&ss, 1, DType::F64, ReduceOp::Sum);
  if (active(c_.norm_extra)) c_.norm_extra->all_reduce(&ss, 1, DType::F64, ReduceOp::Sum);
  const double norm = std::sqrt(ss);
  grad_scale_ = 1.0f;
  if (clip > 0 && norm > clip) {
    if (params_.device() == Device::CPU)
      cpu::scale_inplace(g, static_cast<float>(clip / (norm + 1e-6)), own_end_ - own_begin_);
    else
      grad_scale_ = static_cast<float>(clip / (norm + 1e-6));  // applied inside the AdamW kernel
  }
  return norm;
}

void Optimizer::step(double lr) {
  ++step_;
  float* g = (c_.zero1 && active(c_.dp)) ? shard_grad_.f32() : params_.flat_grads().f32() + own_begin_;
  float* w = params_.flat_values().f32();
#ifdef NDT_HAVE_CUDA
  if (params_.device() == Device::CUDA) {
    step_device(lr, g, w);
    return;
  }
#endif
  for (auto& p : params_.all()) {
    const int64_t off = params_.offset_of(*p);
    const int64_t b = std::max(off, own_begin_), e = std::min(off + p->numel(), own_end_);
    if (b >= e) continue;
    const int64_t s = b - own_begin_;
    cpu::adamw_update(w + b, g + s, m_.f32() + s, v_.f32() + s, e - b, static_cast<float>(lr),
                      static_cast<float>(cfg_.beta1), static_cast<float>(cfg_.beta2),
                      static_cast<float>(cfg_.adam_eps),
                      p->weight_decay ? static_cast<float>(cfg_.weight_decay) : 0.f, step_);
  }
  if (c_.zero1 && active(c_.dp)) {
    // All-gather the updated shards into every rank's full parameter buffer.
    const int64_t shard = own_end_ - own_begin_;
    Tensor mine = params_.flat_values().view_at(own_begin_, {shard}).clone();
    c_.dp->all_gather(mine.f32(), w, shard, DType::F32);
  }
}

#ifdef NDT_HAVE_CUDA
void Optimizer::step_device(double lr, float* g, float* w) {
  // One fused launch per run of adjacent parameters with the same weight decay; it applies the clip
  // factor and writes the bf16 compute copy in the same pass.
  Tensor& compute = params_.flat_compute();
  auto* wc = compute.defined() ? static_cast<__nv_bfloat16*>(compute.data_ptr()) : nullptr;
  int64_t run_b = -1, run_e = -1;
  bool run_decay = false;
  auto flush = [&] {
    if (run_b < 0) return;
    const int64_t s = run_b - own_begin_;
    cuda::adamw_update(w + run_b, g + s, m_.f32() + s, v_.f32() + s, run_e - run_b, static_cast<float>(lr),
                       static_cast<float>(cfg_.beta1), static_cast<float>(cfg_.beta2),
                       static_cast<float>(cfg_.adam_eps),
                       run_decay ? static_cast<float>(cfg_.weight_decay) : 0.f, step_,
                       wc ? wc + run_b : nullptr, grad_scale_, cuda::stream());
    run_b = -1;
  };
  for (auto& p : params_.all()) {
    const int64_t off = params_.offset_of(*p);
    const int64_t b = std::max(off, own_begin_), e = std::min(off + p->numel(), own_end_);
    if (b >= e) continue;
    if (run_b >= 0 && run_e == b && run_decay == p->weight_decay) {
      run_e = e;
      continue;
    }
    flush();
    run_b = b;
    run_e = e;
    run_decay = p->weight_decay;
  }
  flush();
  grad_scale_ = 1.0f;
  if (c_.zero1 && active(c_.dp)) {
    const int64_t shard = own_end_ - own_begin_;
    Tensor mine = params_.flat_values().view_at(own_begin_, {shard}).clone();
    c_.dp->all_gather(mine.f32(), w, shard, DType::F32);
    params_.refresh_compute();  // the gathered shards' compute copies
  }
}
#endif

void Optimizer::gather_moments(Tensor& full_m, Tensor& full_v) {
  const int64_t n = params_.flat_values().numel();
  full_m = Tensor::empty({n});
  full_v = Tensor::empty({n});
  if (c_.zero1 && active(c_.dp)) {
    const Tensor m = m_.to(Device::CPU), v = v_.to(Device::CPU);
    c_.dp->all_gather(m.data_ptr(), full_m.data_ptr(), m.numel(), DType::F32);
    c_.dp->all_gather(v.data_ptr(), full_v.data_ptr(), v.numel(), DType::F32);
  } else {
    full_m.copy_from(m_);
    full_v.copy_from(v_);
  }
}

void Optimizer::scatter_moments(const Tensor& full_m, const Tensor& full_v) {
  const int64_t n = own_end_ - own_begin_;
  m_.copy_from(full_m.view_at(own_begin_, {n}));
  v_.copy_from(full_v.view_at(own_begin_, {n}));
}

}  // namespace ndt
