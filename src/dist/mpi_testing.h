#pragma once
// Test hook for the MPI backend. MPI-3 counts are `int`, so the backend cuts larger messages into
// chunks of at most INT_MAX elements; tests lower the limit to exercise those paths with tiny buffers.
#include <cstdint>

namespace ndt {

// Sets the largest element count passed to one MPI call (<= 0 restores INT_MAX). Process-wide; every
// rank must use the same value, and it must not change while a collective is in flight.
void set_mpi_max_chunk_for_testing(int64_t elements);

}  // namespace ndt
