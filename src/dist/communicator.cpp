// Backend-independent parts of Communicator: the generic split() and error agreement.
#include "dist/communicator.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <numeric>

namespace ndt {

std::unique_ptr<Communicator> Communicator::split(int color, int key) {
  // Generic version for backends without a native split: one subgroup() call per color, in ascending
  // color order so that every rank makes the same sequence of collective calls.
  const int n = size();
  std::vector<int32_t> mine = {color < 0 ? -1 : color, key};
  std::vector<int32_t> all(static_cast<size_t>(2 * n));
  all_gather(mine.data(), all.data(), 2, DType::I32);
  std::map<int, std::vector<int>> groups;  // color -> members
  for (int r = 0; r < n; ++r)
    if (all[static_cast<size_t>(2 * r)] >= 0) groups[all[static_cast<size_t>(2 * r)]].push_back(r);
  std::unique_ptr<Communicator> out;
  for (auto& [c, members] : groups) {
    std::stable_sort(members.begin(), members.end(), [&](int a, int b) {
      return all[static_cast<size_t>(2 * a + 1)] < all[static_cast<size_t>(2 * b + 1)];
    });
    std::unique_ptr<Communicator> g = subgroup(members);
    if (g) out = std::move(g);
  }
  return out;
}

namespace {
class CompletedHandle final : public CommHandle {
 public:
  void wait() override {}
  void synchronize() override {}
  bool done() override { return true; }
};
}  // namespace

std::unique_ptr<CommHandle> Communicator::all_reduce_async(void* buf, int64_t count, DType dt, ReduceOp op) {
  all_reduce(buf, count, dt, op);
  return std::make_unique<CompletedHandle>();
}

std::unique_ptr<CommHandle> Communicator::all_gather_async(const void* send, void* recv, int64_t count,
                                                           DType dt) {
  all_gather(send, recv, count, dt);
  return std::make_unique<CompletedHandle>();
}

std::unique_ptr<CommHandle> Communicator::reduce_scatter_async(const void* send, void* recv, int64_t count,
                                                               DType dt, ReduceOp op) {
  reduce_scatter(send, recv, count, dt, op);
  return std::make_unique<CompletedHandle>();
}

std::unique_ptr<CommHandle> Communicator::batch_p2p_async(const std::vector<P2POp>& ops) {
  batch_p2p(ops);
  return std::make_unique<CompletedHandle>();
}

void Communicator::send_string(const std::string& s, int peer, int tag) {
  int64_t n = static_cast<int64_t>(s.size());
  send(&n, 1, DType::I64, peer, tag);
  std::vector<int32_t> chars(s.begin(), s.end());
  send(chars.data(), n, DType::I32, peer, tag);
}

std::string Communicator::recv_string(int peer, int tag) {
  int64_t n = 0;
  recv(&n, 1, DType::I64, peer, tag);
  std::vector<int32_t> chars(static_cast<size_t>(n));
  recv(chars.data(), n, DType::I32, peer, tag);
  return std::string(chars.begin(), chars.end());
}

Status agree(const Status& local, Communicator& comm) {
  if (comm.size() == 1) return local;
  // 1) the lowest failing rank (size() when every rank is fine); 2) that rank broadcasts its message.
  int32_t failing = local.is_ok() ? comm.size() : comm.rank();
  comm.all_reduce(&failing, 1, DType::I32, ReduceOp::Min);
  if (failing == comm.size()) return Status::ok();
  int64_t len = static_cast<int64_t>(local.message().size());
  comm.broadcast(&len, 1, DType::I64, failing);
  // The message travels as i32 words (there is no byte dtype); pad to a whole word.
  std::vector<int32_t> words(static_cast<size_t>((len + 3) / 4), 0);
  if (comm.rank() == failing && len > 0)
    std::memcpy(words.data(), local.message().data(), static_cast<size_t>(len));
  comm.broadcast(words.data(), static_cast<int64_t>(words.size()), DType::I32, failing);
  std::string msg(reinterpret_cast<const char*>(words.data()), static_cast<size_t>(len));
  return Status::error(fmt::format("rank {}: {}", comm.world_ranks()[static_cast<size_t>(failing)], msg));
}

}  // namespace ndt
