#include "parallel/bridge/bridge.h"

#include <algorithm>
#include <cstring>

#include "core/check.h"
#include "ops/ops.h"

namespace ndt {

std::pair<int64_t, int64_t> BridgeMap::enc_block(int r) const {
  const int64_t per = batch / enc_dp;
  return {enc_dp_of[static_cast<size_t>(r)] * per, per};
}

std::pair<int64_t, int64_t> BridgeMap::llm_block(int r) const {
  const int64_t per = batch / llm_dp;
  return {llm_dp_of[static_cast<size_t>(r)] * per, per};
}

Status BridgeMap::validate() const {
  const size_t w = enc_dp_of.size();
  if (enc_tp_of.size() != w || llm_dp_of.size() != w)
    return Status::error("bridge: the per-rank coordinate lists differ in length");
  if (enc_dp < 1 || llm_dp < 1 || enc_tp < 1 || batch % enc_dp != 0 || batch % llm_dp != 0)
    return Status::error(fmt::format(
        "bridge: a batch of {} samples must divide into encoder dp={} and LLM dp={}", batch, enc_dp, llm_dp));
  if (enc_dp % llm_dp != 0 && llm_dp % enc_dp != 0)
    return Status::error(fmt::format(
        "bridge: encoder dp={} and LLM dp={} must divide one another (fan-in or fan-out)", enc_dp, llm_dp));
  if (static_cast<int64_t>(w) != enc_dp * enc_tp)
    return Status::error(
        fmt::format("bridge: the encoder layout dp={} tp={} does not cover the {} ranks", enc_dp, enc_tp, w));
  std::vector<int> enc_seen(static_cast<size_t>(enc_dp * enc_tp), 0),
      llm_seen(static_cast<size_t>(llm_dp), 0);
  for (size_t r = 0; r < w; ++r) {
    const int64_t e = enc_dp_of[r], t = enc_tp_of[r], d = llm_dp_of[r];
    if (e < 0 || e >= enc_dp || t < 0 || t >= enc_tp || d < 0 || d >= llm_dp)
      return Status::error(fmt::format("bridge: rank {} has coordinates outside the layouts", r));
    ++enc_seen[static_cast<size_t>(e * enc_tp + t)];
    ++llm_seen[static_cast<size_t>(d)];
  }
  for (int c : enc_seen)
    if (c != 1)
      return Status::error("bridge: every encoder (dp, tp) coordinate must belong to exactly one rank");
  for (int c : llm_seen)
    if (c == 0) return Status::error("bridge: an LLM data-parallel rank has no world rank");
  return Status::ok();
}

namespace {

// The source of sample j for destination rank `dst`: itself when it holds the sample, else one of the
// holders (ascending world ranks), chosen by the destination so that the load spreads over them.
struct Holders {
  std::vector<std::vector<int>> enc, llm;  // by encoder DP / LLM DP coordinate
  explicit Holders(const BridgeMap& m)
      : enc(static_cast<size_t>(m.enc_dp)), llm(static_cast<size_t>(m.llm_dp)) {
    for (int r = 0; r < m.world(); ++r) {
      enc[static_cast<size_t>(m.enc_dp_of[static_cast<size_t>(r)])].push_back(r);
      llm[static_cast<size_t>(m.llm_dp_of[static_cast<size_t>(r)])].push_back(r);
    }
  }
};

int pick(const std::vector<int>& holders, int dst) {
  if (std::find(holders.begin(), holders.end(), dst) != holders.end()) return dst;
  return holders[static_cast<size_t>(dst) % holders.size()];
}

// Forward: sample j is needed by the LLM replica of its LLM block and held by its encoder DP shard.
int source_forward(const BridgeMap& m, const Holders& h, int dst, int64_t j) {
  return pick(h.enc[static_cast<size_t>(j / (m.batch / m.enc_dp))], dst);
}
int source_backward(const BridgeMap& m, const Holders& h, int dst, int64_t j) {
  return pick(h.llm[static_cast<size_t>(j / (m.batch / m.llm_dp))], dst);
}

BridgeRoute route(const BridgeMap& m, int rank, bool forward) {
  const Holders h(m);
  BridgeRoute r;
  r.send.resize(static_cast<size_t>(m.world()));
  r.recv.resize(static_cast<size_t>(m.world()));
  auto need = [&](int q) { return forward ? m.llm_block(q) : m.enc_block(q); };
  auto source = [&](int dst, int64_t j) {
    return forward ? source_forward(m, h, dst, j) : source_backward(m, h, dst, j);
  };
  for (int q = 0; q < m.world(); ++q) {
    const auto [first, count] = need(q);
    for (int64_t j = first; j < first + count; ++j) {
      const int src = source(q, j);
      if (src == rank) r.send[static_cast<size_t>(q)].push_back(j);
      if (q == rank) r.recv[static_cast<size_t>(src)].push_back(j);
    }
  }
  return r;
}

}  // namespace

BridgeRoute route_forward(const BridgeMap& m, int rank) { return route(m, rank, true); }
BridgeRoute route_backward(const BridgeMap& m, int rank) { return route(m, rank, false); }

bool route_is_local(const BridgeMap& m, bool forward) {
  for (int q = 0; q < m.world(); ++q) {
    const BridgeRoute r = route(m, q, forward);
    for (int p = 0; p < m.world(); ++p)
      if (p != q && !r.send[static_cast<size_t>(p)].empty()) return false;
  }
  return true;
}

Bridge::Bridge(BridgeMap map, Communicator& world, Communicator* replica)
    : map_(std::move(map)), world_(world), replica_(replica) {
  map_.validate().throw_if_error();
  NDT_CHECK(map_.world() == world_.size(), "bridge map covers {} ranks, the world {}", map_.world(),
            world_.size());
  fwd_ = route_forward(map_, world_.rank());
  bwd_ = route_backward(map_, world_.rank());
  fwd_local_ = route_is_local(map_, true);
  bwd_local_ = route_is_local(map_, false);
}

Tensor Bridge::exchange(const BridgeRoute& r, const Tensor& src, int64_t src_first, int64_t dst_first,
                        int64_t dst_count, int64_t rows, bool local) const {
  const int64_t C = src.size(1);
  if (local) {  // every sample this rank needs is its own
    std::vector<int64_t> idx;
    for (int64_t j = dst_first; j < dst_first + dst_count; ++j)
      for (int64_t i = 0; i < rows; ++i) idx.push_back((j - src_first) * rows + i);
    return ops::gather_rows(src, idx);
  }
  // Host staging: the world communicator moves host buffers (GPU runs copy in and out once).
  const Tensor host = src.device() == Device::CPU ? src : src.to(Device::CPU);
  const size_t esz = dtype_size(src.dtype()), row_bytes = static_cast<size_t>(rows * C) * esz;
  const int W = world_.size();
  std::vector<int64_t> sc(static_cast<size_t>(W)), so(static_cast<size_t>(W)), rc(static_cast<size_t>(W)),
      ro(static_cast<size_t>(W));
  int64_t ns = 0, nr = 0;
  for (int p = 0; p < W; ++p) {
    so[static_cast<size_t>(p)] = ns * rows * C;
    ro[static_cast<size_t>(p)] = nr * rows * C;
    ns += static_cast<int64_t>(r.send[static_cast<size_t>(p)].size());
    nr += static_cast<int64_t>(r.recv[static_cast<size_t>(p)].size());
    sc[static_cast<size_t>(p)] = static_cast<int64_t>(r.send[static_cast<size_t>(p)].size()) * rows * C;
    rc[static_cast<size_t>(p)] = static_cast<int64_t>(r.recv[static_cast<size_t>(p)].size()) * rows * C;
  }
  NDT_CHECK(nr == dst_count, "bridge: receiving {} samples, expected {}", nr, dst_count);
  std::vector<char> sbuf(static_cast<size_t>(ns) * row_bytes), rbuf(static_cast<size_t>(nr) * row_bytes);
  const char* in = static_cast<const char*>(host.data_ptr());
  size_t at = 0;
  for (int p = 0; p < W; ++p)
    for (int64_t j : r.send[static_cast<size_t>(p)]) {
      std::memcpy(sbuf.data() + at, in + static_cast<size_t>(j - src_first) * row_bytes, row_bytes);
      at += row_bytes;
    }
  world_.all_to_all_v(sbuf.data(), sc, so, rbuf.data(), rc, ro, src.dtype());
  Tensor out = Tensor::empty({dst_count * rows, C}, src.dtype());
  char* o = static_cast<char*>(out.data_ptr());
  at = 0;
  for (int p = 0; p < W; ++p)
    for (int64_t j : r.recv[static_cast<size_t>(p)]) {
      std::memcpy(o + static_cast<size_t>(j - dst_first) * row_bytes, rbuf.data() + at, row_bytes);
      at += row_bytes;
    }
  return src.device() == Device::CPU ? out : out.to(src.device());
}

Tensor Bridge::forward(const Tensor& enc, int64_t rows) const {
  const int me = world_.rank();
  const auto [ef, ec] = map_.enc_block(me);
  const auto [lf, lc] = map_.llm_block(me);
  NDT_CHECK(enc.dim() == 2 && enc.size(0) == ec * rows, "bridge forward: expected ({} x {}, C) rows, got {}",
            ec, rows, shape_str(enc.shape()));
  return exchange(fwd_, enc, ef, lf, lc, rows, fwd_local_);
}

Tensor Bridge::backward_unreduced(const Tensor& dllm, int64_t rows) const {
  const int me = world_.rank();
  const auto [ef, ec] = map_.enc_block(me);
  const auto [lf, lc] = map_.llm_block(me);
  NDT_CHECK(dllm.dim() == 2 && dllm.size(0) == lc * rows,
            "bridge backward: expected ({} x {}, C) rows, got {}", lc, rows, shape_str(dllm.shape()));
  return exchange(bwd_, dllm, lf, ef, ec, rows, bwd_local_);
}

Tensor Bridge::backward(Tensor& dllm, int64_t rows) const {
  if (replica_ && replica_->size() > 1) replica_->all_reduce(dllm);  // partial sums -> complete gradient
  return backward_unreduced(dllm, rows);
}

}  // namespace ndt
