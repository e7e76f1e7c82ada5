#include "train/step_graph.h"

#include <algorithm>
#include <cstring>

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

// Slots of page-locked memory used in turn, one per step: a slot is written again only once the device has
// copied the step that used it before (its event), so the host is at most kSlots steps ahead of the uploads.
struct StepGraph::Staging {
  static constexpr int kSlots = 3;
  static size_t padded(size_t bytes) { return (bytes + 255) / 256 * 256; }  // each copy's source aligned
  struct Slot {
    std::unique_ptr<cuda::PinnedBuffer> buf;
    size_t capacity = 0;
    cuda::StreamEvent copied;
    bool in_use = false;
  };
  Slot slots[kSlots];
  int next = 0;
  Slot* slot = nullptr;  // the step's, between begin() and end()
  size_t used = 0;

  void begin(size_t bytes) {
    slot = &slots[next];
    next = (next + 1) % kSlots;
    if (slot->in_use) slot->copied.wait();
    if (slot->capacity < bytes) {
      slot->buf = std::make_unique<cuda::PinnedBuffer>(bytes);
      slot->capacity = bytes;
    }
    used = 0;
  }
  void copy(void* dst, const void* src, size_t bytes) {
    uint8_t* at = slot->buf->as<uint8_t>() + used;
    std::memcpy(at, src, bytes);
    cuda::copy_h2d_pinned(dst, at, bytes);
    used += padded(bytes);
  }
  void end() {
    slot->copied.record();
    slot->in_use = true;
  }
};

std::vector<Microbatch> StepGraph::upload(const std::vector<Microbatch>& mbs, float loss_scale) {
  bool moved = bufs_.size() != mbs.size();
  if (!scale_.defined()) scale_ = Tensor::empty({1}, DType::F32, Device::CUDA);
  if (!staging_) staging_ = std::make_unique<Staging>();
  const auto staged = [](const Tensor& t) { return t.defined() ? Staging::padded(t.nbytes()) : 0; };
  size_t bytes = Staging::padded(sizeof(float));  // (the loss scale)
  for (const Microbatch& mb : mbs)
    bytes += staged(mb.tokens) + staged(mb.targets) + staged(mb.loss_mask) + staged(mb.positions) +
             (seqlens_on_host_ ? 0 : staged(mb.cu_seqlens));
  staging_->begin(bytes);
  staging_->copy(scale_.data_ptr(), &loss_scale, sizeof(float));
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
      if (field.device() == Device::CPU)
        staging_->copy(buf.data_ptr(), field.data_ptr(), field.nbytes());
      else
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
  staging_->end();
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
struct StepGraph::Staging {};

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
