#include "train/step_graph.h"

#include <algorithm>

#include "core/check.h"

#ifdef NDT_HAVE_CUDA
#include "cuda/runtime.h"
#endif

namespace ndt {

std::vector<int64_t> step_signature(const std::vector<Microbatch>& mbs) {
  std::vector<int64_t> sig = {static_cast<int64_t>(mbs.size())};
  for (const Microbatch& mb : mbs) {
    const int64_t n_cu = mb.cu_seqlens.defined() ? mb.cu_seqlens.numel() : -1;
    sig.insert(sig.end(), {mb.num_tokens(), mb.nseq, mb.max_seqlen, n_cu,
                           (mb.targets.defined() ? 1 : 0) | (mb.loss_mask.defined() ? 2 : 0) |
                               (mb.positions.defined() ? 4 : 0) | (mb.loss_scale.defined() ? 8 : 0)});
    if (n_cu > 0) {
      const Tensor cu = mb.cu_seqlens.device() == Device::CPU ? mb.cu_seqlens : mb.cu_seqlens.to(Device::CPU);
      sig.insert(sig.end(), cu.i32(), cu.i32() + n_cu);
    }
  }
  return sig;
}

// One microbatch slot's device buffers (undefined where the microbatch has no such input).
struct StepGraph::Inputs {
  Tensor tokens, targets, loss_mask, positions, cu_seqlens;
};

#ifdef NDT_HAVE_CUDA

std::vector<Microbatch> StepGraph::upload(const std::vector<Microbatch>& mbs, float loss_scale) {
  bool moved = bufs_.size() != mbs.size();
  if (!scale_.defined()) scale_ = Tensor::empty({1}, DType::F32, Device::CUDA);
  scale_.copy_from(Tensor::full({1}, loss_scale));
  bufs_.resize(mbs.size());
  std::vector<Microbatch> dev;
  for (size_t i = 0; i < mbs.size(); ++i) {
    Microbatch d = mbs[i];
    // A buffer keeps its address while its size and dtype repeat; a new one invalidates the graph.
    auto put = [&](Tensor& buf, Tensor& field) {
      if (!field.defined()) return;
      if (!buf.defined() || buf.numel() != field.numel() || buf.dtype() != field.dtype()) {
        buf = Tensor::empty(field.shape(), field.dtype(), Device::CUDA);
        moved = true;
      }
      buf.view(field.shape()).copy_from(field);
      field = buf.view(field.shape());
    };
    Inputs& b = bufs_[i];
    put(b.tokens, d.tokens);
    put(b.targets, d.targets);
    put(b.loss_mask, d.loss_mask);
    put(b.positions, d.positions);
    if (!seqlens_on_host_) put(b.cu_seqlens, d.cu_seqlens);
    d.loss_scale = scale_;
    dev.push_back(std::move(d));
  }
  if (moved) graph_.reset();
  return dev;
}

bool StepGraph::run(const std::vector<Microbatch>& mbs, float loss_scale,
                    const std::function<void(const std::vector<Microbatch>&)>& work,
                    const std::vector<int64_t>& extra_signature) {
  std::vector<int64_t> sig = step_signature(mbs);
  sig.insert(sig.end(), extra_signature.begin(), extra_signature.end());
  const std::vector<Microbatch> dev = upload(mbs, loss_scale);
  just_captured_ = false;
  if (graph_ && sig != graph_sig_ && sig == prev_sig_) graph_.reset();  // a new shape that repeats
  if (!graph_ && sig == prev_sig_ && std::find(failed_.begin(), failed_.end(), sig) == failed_.end()) {
    std::string why;
    graph_ = cuda::Graph::capture([&] { work(dev); }, &why);
    if (graph_) {
      graph_sig_ = sig;
      ++captures_;
      just_captured_ = true;
      // The eager steps' activations stay cached in the stream pool; the graph has its own memory.
      cuda::release_cached_memory();
    } else {
      failure_ = why.empty() ? "the capture was invalidated" : why;
      failed_.push_back(sig);
    }
  }
  prev_sig_ = std::move(sig);
  if (graph_ && prev_sig_ == graph_sig_) {
    graph_->launch();
    ++replays_;
    return true;
  }
  work(dev);
  ++eager_;
  return false;
}

#else

namespace cuda {
class Graph {};  // (no graphs without the CUDA backend)
}  // namespace cuda

bool StepGraph::run(const std::vector<Microbatch>& mbs, float,
                    const std::function<void(const std::vector<Microbatch>&)>& work,
                    const std::vector<int64_t>&) {
  work(mbs);
  ++eager_;
  return false;
}

#endif

StepGraph::StepGraph(bool seqlens_on_host) : seqlens_on_host_(seqlens_on_host) {}
StepGraph::~StepGraph() = default;

}  // namespace ndt
