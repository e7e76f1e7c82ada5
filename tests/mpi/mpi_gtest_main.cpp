// main() for multi-rank GoogleTest binaries: one MPI job, every rank runs every test. Rank 0 prints
// the usual output; other ranks print only their failures (prefixed with the rank), and the exit code
// is non-zero on every rank if any rank failed.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "dist/communicator.h"

namespace {

class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  // The name is kept here: UnitTest::current_test_info() inside OnTestPartResult deadlocks (gtest
  // holds its mutex while reporting a part result).
  void OnTestStart(const ::testing::TestInfo& t) override {
    test_ = std::string(t.test_suite_name()) + "." + t.name();
  }
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[rank %d] %s: %s:%d: Failure\n%s\n", rank_, test_.c_str(),
                 r.file_name() ? r.file_name() : "?", r.line_number(), r.message());
    std::fflush(stderr);
  }

 private:
  int rank_;
  std::string test_;
};

}  // namespace

int main(int argc, char** argv) {
  ndt::MpiSession mpi(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  int failed = 0;
  {
    std::unique_ptr<ndt::Communicator> world = ndt::make_mpi_world();
    if (world->rank() != 0) {
      auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
      delete listeners.Release(listeners.default_result_printer());
      listeners.Append(new FailurePrinter(world->rank()));
    }
    failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
    world->all_reduce(&failed, 1, ndt::DType::I32, ndt::ReduceOp::Max);
    if (world->rank() == 0 && failed) std::fprintf(stderr, "at least one rank failed (see [rank N] lines)\n");
  }
  return failed;
}
