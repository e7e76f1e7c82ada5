// A one-rank communicator: collectives are identities or copies, so single-process code runs the
// same paths as parallel code. Point-to-point to oneself only exists inside batch_p2p (a degenerate
// pipeline with one stage exchanges with itself); a blocking send to self would deadlock in MPI too.
#include <cstring>
#include <deque>
#include <map>

#include "dist/communicator.h"

namespace ndt {
namespace {

class SelfCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  const std::vector<int>& world_ranks() const override { return world_ranks_; }

  void all_reduce(void*, int64_t count, DType dt, ReduceOp) override {
    NDT_CHECK(count >= 0, "negative count {}", count);
    NDT_CHECK(dt != DType::BF16, "reductions on bf16 are not supported: reduce in f32");
  }
  void all_gather(const void* send, void* recv, int64_t count, DType dt) override {
    copy(recv, send, count, dt);
  }
  void reduce_scatter(const void* send, void* recv, int64_t count, DType dt, ReduceOp) override {
    NDT_CHECK(dt != DType::BF16, "reductions on bf16 are not supported: reduce in f32");
    copy(recv, send, count, dt);
  }
  void broadcast(void*, int64_t count, DType, int root) override {
    NDT_CHECK(root == 0, "broadcast root {} out of range (communicator size 1)", root);
    NDT_CHECK(count >= 0, "negative count {}", count);
  }
  void send(const void*, int64_t, DType, int peer, int) override {
    NDT_CHECK(false, "blocking send to peer {} on a one-rank communicator (use batch_p2p for self exchange)",
              peer);
  }
  void recv(void*, int64_t, DType, int peer, int) override {
    NDT_CHECK(false,
              "blocking recv from peer {} on a one-rank communicator (use batch_p2p for self exchange)",
              peer);
  }
  void batch_p2p(const std::vector<P2POp>& ops) override {
    // Pair sends and receives by tag, in posting order (MPI's non-overtaking rule), then copy.
    std::map<int, std::deque<const P2POp*>> sends, recvs;
    for (const P2POp& op : ops) {
      NDT_CHECK(op.peer == 0, "batch_p2p peer {} out of range (communicator size 1)", op.peer);
      (op.kind == P2POp::Send ? sends : recvs)[op.tag].push_back(&op);
    }
    for (auto& [tag, rq] : recvs) {
      auto& sq = sends[tag];
      NDT_CHECK(sq.size() == rq.size(), "batch_p2p on one rank: {} sends but {} recvs with tag {}", sq.size(),
                rq.size(), tag);
      for (size_t i = 0; i < rq.size(); ++i) {
        NDT_CHECK(sq[i]->count == rq[i]->count && sq[i]->dtype == rq[i]->dtype,
                  "batch_p2p on one rank: send of {} {} matched with recv of {} {} (tag {})", sq[i]->count,
                  dtype_name(sq[i]->dtype), rq[i]->count, dtype_name(rq[i]->dtype), tag);
        copy(rq[i]->buf, sq[i]->buf, sq[i]->count, sq[i]->dtype);
      }
    }
    for (auto& [tag, sq] : sends)
      NDT_CHECK(sq.empty() || recvs.count(tag), "batch_p2p on one rank: {} sends with tag {} have no recv",
                sq.size(), tag);
  }
  void all_to_all_v(const void* send, const std::vector<int64_t>& send_counts,
                    const std::vector<int64_t>& send_offsets, void* recv,
                    const std::vector<int64_t>& recv_counts, const std::vector<int64_t>& recv_offsets,
                    DType dt) override {
    NDT_CHECK(send_counts.size() == 1 && send_offsets.size() == 1 && recv_counts.size() == 1 &&
                  recv_offsets.size() == 1,
              "all_to_all_v: counts/offsets must have one entry per rank (1)");
    NDT_CHECK(send_counts[0] == recv_counts[0], "all_to_all_v: sends {} to itself but expects {}",
              send_counts[0], recv_counts[0]);
    copy(static_cast<char*>(recv) + recv_offsets[0] * dtype_size(dt),
         static_cast<const char*>(send) + send_offsets[0] * dtype_size(dt), send_counts[0], dt);
  }
  void barrier() override {}
  std::unique_ptr<Communicator> subgroup(const std::vector<int>& members) override {
    NDT_CHECK(members.size() <= 1 && (members.empty() || members[0] == 0),
              "subgroup of a one-rank communicator may only contain rank 0");
    if (members.empty()) return nullptr;
    return std::make_unique<SelfCommunicator>();
  }
  std::unique_ptr<Communicator> split(int color, int) override {
    return color >= 0 ? std::make_unique<SelfCommunicator>() : nullptr;
  }

 private:
  static void copy(void* dst, const void* src, int64_t count, DType dt) {
    NDT_CHECK(count >= 0, "negative count {}", count);
    if (dst != src && count > 0) std::memmove(dst, src, static_cast<size_t>(count) * dtype_size(dt));
  }
  std::vector<int> world_ranks_ = {0};
};

}  // namespace

std::unique_ptr<Communicator> make_self_communicator() { return std::make_unique<SelfCommunicator>(); }

}  // namespace ndt
