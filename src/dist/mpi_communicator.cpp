// MPI backend of Communicator (CPU buffers). Every call is blocking. MPI errors are returned (not
// fatal) on every communicator we create and turned into ndt::Error with MPI's error string.
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <set>
#include <vector>

#include "dist/communicator.h"
#include "dist/mpi_testing.h"
#include "dist/watchdog.h"

namespace ndt {
namespace {

// Largest count handed to one MPI call (MPI-3 counts are int); lowered by tests only.
std::atomic<int64_t> g_max_chunk{INT_MAX};

bool we_initialized = false;  // MpiSession called MPI_Init_thread (so it must finalize)

void mpi_check(int rc, const char* call, const char* file, int line) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS)
    len = std::snprintf(msg, sizeof msg, "error code %d", rc);
  check_failed(file, line, call, fmt::format("MPI error: {}", std::string(msg, static_cast<size_t>(len))));
}
#define NDT_MPI(call) ::ndt::mpi_check((call), #call, __FILE__, __LINE__)

MPI_Datatype mpi_type(DType dt) {
  switch (dt) {
    case DType::F32:
      return MPI_FLOAT;
    case DType::BF16:
      return MPI_UINT16_T;  // raw 16-bit words: fine for moving data, not for reducing
    case DType::I32:
      return MPI_INT32_T;
    case DType::I64:
      return MPI_INT64_T;
    case DType::F64:
      return MPI_DOUBLE;
  }
  NDT_CHECK(false, "unknown dtype {}", static_cast<int>(dt));
  return MPI_DATATYPE_NULL;
}

MPI_Op mpi_op(ReduceOp op, DType dt) {
  NDT_CHECK(dt != DType::BF16, "MPI backend cannot reduce bf16 (words are sent as uint16): reduce in f32");
  switch (op) {
    case ReduceOp::Sum:
      return MPI_SUM;
    case ReduceOp::Max:
      return MPI_MAX;
    case ReduceOp::Min:
      return MPI_MIN;
  }
  NDT_CHECK(false, "unknown reduce op {}", static_cast<int>(op));
  return MPI_OP_NULL;
}

char* at(void* p, int64_t elems, DType dt) { return static_cast<char*>(p) + elems * dtype_size(dt); }
const char* at(const void* p, int64_t elems, DType dt) {
  return static_cast<const char*>(p) + elems * dtype_size(dt);
}

// Calls f(offset, n) over [0, count) in pieces of at most the chunk limit.
void for_chunks(int64_t count, const std::function<void(int64_t, int)>& f) {
  NDT_CHECK(count >= 0, "negative count {}", count);
  const int64_t chunk = g_max_chunk.load();
  for (int64_t off = 0; off < count; off += chunk) f(off, static_cast<int>(std::min(chunk, count - off)));
}

// A committed datatype of n contiguous elements whose extent is `stride` elements: block i of a
// collective then lands at i * stride, so a chunk of every rank's block moves in one call.
class StridedType {
 public:
  StridedType(DType dt, int n, int64_t stride) {
    MPI_Datatype contig;
    NDT_MPI(MPI_Type_contiguous(n, mpi_type(dt), &contig));
    const MPI_Aint extent = static_cast<MPI_Aint>(stride) * static_cast<MPI_Aint>(dtype_size(dt));
    int rc = MPI_Type_create_resized(contig, 0, extent, &type_);
    MPI_Type_free(&contig);
    NDT_MPI(rc);
    NDT_MPI(MPI_Type_commit(&type_));
  }
  ~StridedType() { MPI_Type_free(&type_); }
  StridedType(const StridedType&) = delete;
  StridedType& operator=(const StridedType&) = delete;
  MPI_Datatype get() const { return type_; }

 private:
  MPI_Datatype type_ = MPI_DATATYPE_NULL;
};

bool overlaps(const void* a, size_t an, const void* b, size_t bn) {
  auto pa = reinterpret_cast<uintptr_t>(a), pb = reinterpret_cast<uintptr_t>(b);
  return an && bn && pa < pb + bn && pb < pa + an;
}

class MpiCommunicator final : public Communicator {
 public:
  // Takes ownership of `comm` (freed in the destructor) unless it is MPI_COMM_WORLD.
  explicit MpiCommunicator(MPI_Comm comm) : comm_(comm) {
    NDT_MPI(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    NDT_MPI(MPI_Comm_rank(comm_, &rank_));
    NDT_MPI(MPI_Comm_size(comm_, &size_));
    MPI_Group group, world_group;
    NDT_MPI(MPI_Comm_group(comm_, &group));
    NDT_MPI(MPI_Comm_group(MPI_COMM_WORLD, &world_group));
    std::vector<int> mine(static_cast<size_t>(size_));
    for (int i = 0; i < size_; ++i) mine[static_cast<size_t>(i)] = i;
    world_ranks_.resize(mine.size());
    int rc = MPI_Group_translate_ranks(group, size_, mine.data(), world_group, world_ranks_.data());
    MPI_Group_free(&group);
    MPI_Group_free(&world_group);
    NDT_MPI(rc);
  }
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (comm_ != MPI_COMM_WORLD && !finalized) MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::vector<int>& world_ranks() const override { return world_ranks_; }
  void set_watchdog(Watchdog* w) override { watch_ = w; }

  void all_reduce(void* buf, int64_t count, DType dt, ReduceOp op) override {
    Watchdog::Scope watch(watch_, "all_reduce", size_);
    const MPI_Op mop = mpi_op(op, dt);
    for_chunks(count, [&](int64_t off, int n) {
      NDT_MPI(MPI_Allreduce(MPI_IN_PLACE, at(buf, off, dt), n, mpi_type(dt), mop, comm_));
    });
  }

  void all_gather(const void* send, void* recv, int64_t count, DType dt) override {
    Watchdog::Scope watch(watch_, "all_gather", size_);
    // MPI forbids aliased buffers; the usual aliasing (send is our own block of recv) is MPI_IN_PLACE.
    const bool in_place = send == at(recv, rank_ * count, dt);
    if (count <= g_max_chunk.load()) {  // common case: plain datatype, MPI picks its best algorithm
      NDT_MPI(MPI_Allgather(in_place ? MPI_IN_PLACE : send, static_cast<int>(count), mpi_type(dt), recv,
                            static_cast<int>(count), mpi_type(dt), comm_));
      return;
    }
    for_chunks(count, [&](int64_t off, int n) {
      StridedType block(dt, n, count);
      NDT_MPI(MPI_Allgather(in_place ? MPI_IN_PLACE : at(send, off, dt), in_place ? 0 : n, mpi_type(dt),
                            at(recv, off, dt), 1, block.get(), comm_));
    });
  }

  void reduce_scatter(const void* send, void* recv, int64_t count, DType dt, ReduceOp op) override {
    Watchdog::Scope watch(watch_, "reduce_scatter", size_);
    const MPI_Op mop = mpi_op(op, dt);
    const size_t bytes = dtype_size(dt);
    std::vector<char> copy;
    if (overlaps(send, static_cast<size_t>(size_ * count) * bytes, recv,
                 static_cast<size_t>(count) * bytes)) {
      copy.assign(static_cast<const char*>(send), at(send, size_ * count, dt));
      send = copy.data();
    }
    if (count <= g_max_chunk.load()) {
      NDT_MPI(MPI_Reduce_scatter_block(send, recv, static_cast<int>(count), mpi_type(dt), mop, comm_));
      return;
    }
    // Too large for one call. MPI's predefined ops reject strided derived types, so reduce each
    // destination block to its owner, chunk by chunk.
    for (int owner = 0; owner < size_; ++owner)
      for_chunks(count, [&](int64_t off, int n) {
        NDT_MPI(MPI_Reduce(at(send, owner * count + off, dt), owner == rank_ ? at(recv, off, dt) : nullptr, n,
                           mpi_type(dt), mop, owner, comm_));
      });
  }

  void broadcast(void* buf, int64_t count, DType dt, int root) override {
    Watchdog::Scope watch(watch_, "broadcast", size_);
    check_peer(root, "broadcast root");
    for_chunks(count, [&](int64_t off, int n) {
      NDT_MPI(MPI_Bcast(at(buf, off, dt), n, mpi_type(dt), root, comm_));
    });
  }

  void send(const void* buf, int64_t count, DType dt, int peer, int tag) override {
    Watchdog::Scope watch(watch_, "send", size_);
    check_peer(peer, "send peer");
    for_chunks(count, [&](int64_t off, int n) {
      NDT_MPI(MPI_Send(at(buf, off, dt), n, mpi_type(dt), peer, tag, comm_));
    });
  }

  void recv(void* buf, int64_t count, DType dt, int peer, int tag) override {
    Watchdog::Scope watch(watch_, "recv", size_);
    check_peer(peer, "recv peer");
    for_chunks(count, [&](int64_t off, int n) {
      NDT_MPI(MPI_Recv(at(buf, off, dt), n, mpi_type(dt), peer, tag, comm_, MPI_STATUS_IGNORE));
    });
  }

  void batch_p2p(const std::vector<P2POp>& ops) override {
    Watchdog::Scope watch(watch_, "batch_p2p", size_);
    std::vector<MPI_Request> reqs;
    try {
      for (const P2POp& op : ops) {
        check_peer(op.peer, "batch_p2p peer");
        // Chunks of one entry keep their order: MPI messages between a pair with one tag don't overtake.
        for_chunks(op.count, [&](int64_t off, int n) {
          MPI_Request r;
          if (op.kind == P2POp::Send)
            NDT_MPI(MPI_Isend(at(op.buf, off, op.dtype), n, mpi_type(op.dtype), op.peer, op.tag, comm_, &r));
          else
            NDT_MPI(MPI_Irecv(at(op.buf, off, op.dtype), n, mpi_type(op.dtype), op.peer, op.tag, comm_, &r));
          reqs.push_back(r);
        });
      }
    } catch (...) {
      // Don't leave posted requests writing into buffers the caller is about to free.
      for (MPI_Request& r : reqs) MPI_Cancel(&r);
      MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE);
      throw;
    }
    NDT_MPI(MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE));
  }

  void all_to_all_v(const void* send, const std::vector<int64_t>& send_counts,
                    const std::vector<int64_t>& send_offsets, void* recv,
                    const std::vector<int64_t>& recv_counts, const std::vector<int64_t>& recv_offsets,
                    DType dt) override {
    Watchdog::Scope watch(watch_, "all_to_all_v", size_);
    const auto n = static_cast<size_t>(size_);
    NDT_CHECK(send_counts.size() == n && send_offsets.size() == n && recv_counts.size() == n &&
                  recv_offsets.size() == n,
              "all_to_all_v: counts/offsets must have one entry per rank ({})", size_);
    // MPI-3 Alltoallv takes int counts and displacements. Beyond that we fail loudly: a message of
    // 2^31 elements per peer is far outside what this CPU path is for, and the check is local, so the
    // caller's fatal-error path (MpiSession::abort) must end the job.
    for (size_t i = 0; i < n; ++i)
      for (int64_t v : {send_counts[i], send_offsets[i], recv_counts[i], recv_offsets[i]})
        NDT_CHECK(v >= 0 && v <= INT_MAX,
                  "all_to_all_v: count/offset {} for rank {} is negative or exceeds the MPI int limit", v, i);
    auto to_int = [](const std::vector<int64_t>& v) { return std::vector<int>(v.begin(), v.end()); };
    std::vector<int> sc = to_int(send_counts), so = to_int(send_offsets), rc = to_int(recv_counts),
                     ro = to_int(recv_offsets);
    NDT_MPI(MPI_Alltoallv(send, sc.data(), so.data(), mpi_type(dt), recv, rc.data(), ro.data(), mpi_type(dt),
                          comm_));
  }

  void barrier() override {
    Watchdog::Scope watch(watch_, "barrier", size_);
    NDT_MPI(MPI_Barrier(comm_));
  }

  std::unique_ptr<Communicator> subgroup(const std::vector<int>& members) override {
    std::set<int> seen;
    int position = -1;
    for (size_t i = 0; i < members.size(); ++i) {
      check_peer(members[i], "subgroup member");
      NDT_CHECK(seen.insert(members[i]).second, "subgroup: rank {} listed twice", members[i]);
      if (members[i] == rank_) position = static_cast<int>(i);
    }
    return split(position >= 0 ? 0 : -1, std::max(position, 0));
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    MPI_Comm out = MPI_COMM_NULL;
    {
      Watchdog::Scope watch(watch_, "communicator split", size_);
      NDT_MPI(MPI_Comm_split(comm_, color >= 0 ? color : MPI_UNDEFINED, key, &out));
    }
    if (out == MPI_COMM_NULL) return nullptr;
    auto c = std::make_unique<MpiCommunicator>(out);
    c->set_watchdog(watch_);
    return c;
  }

 private:
  void check_peer(int peer, const char* what) const {
    NDT_CHECK(peer >= 0 && peer < size_, "{} {} out of range (communicator size {})", what, peer, size_);
  }

  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
  std::vector<int> world_ranks_;
  Watchdog* watch_ = nullptr;
};

}  // namespace

void set_mpi_max_chunk_for_testing(int64_t elements) { g_max_chunk = elements > 0 ? elements : INT_MAX; }

std::unique_ptr<Communicator> make_mpi_world() {
  NDT_CHECK(MpiSession::initialized(), "make_mpi_world: MPI is not initialized (create an MpiSession first)");
  return std::make_unique<MpiCommunicator>(MPI_COMM_WORLD);
}

MpiSession::MpiSession(int* argc, char*** argv) {
  int init = 0;
  MPI_Initialized(&init);
  if (init) return;  // someone else owns MPI's lifetime
  int provided = 0;
  // Without a launcher this is a one-rank singleton job. Open MPI would spawn an orted daemon for it
  // (hwloc's probe of the machine: ~0.25 s of every single-process command); ndtrain never spawns or
  // connects to other jobs, so it asks for the isolated singleton. Only the singleton component reads this
  // parameter, so a launched rank is unaffected; a value set by the user wins.
  setenv("OMPI_MCA_ess_singleton_isolated", "1", /*overwrite=*/0);
  // FUNNELED: OpenMP threads compute, only the main thread calls MPI.
  int rc = MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided);
  if (rc != MPI_SUCCESS) NDT_FAIL("MPI_Init_thread failed with error code {}", rc);
  we_initialized = true;
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
}

MpiSession::~MpiSession() {
  if (!we_initialized) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
  we_initialized = false;
}

bool MpiSession::initialized() {
  int init = 0, finalized = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&finalized);
  return init && !finalized;
}

void MpiSession::abort(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  if (initialized()) MPI_Abort(MPI_COMM_WORLD, code);
  std::exit(code);
}

}  // namespace ndt
