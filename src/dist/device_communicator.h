#pragma once
// The communicator for DEVICE buffers of a group of ranks, by train.device_comm:
//   "nccl"  NCCL (dist/nccl_communicator.h): one GPU per rank, the production path.
//   "mpi"   MPI with every device buffer staged through host memory: the compute stream is synchronised,
//           buffers are copied to the host, the MPI call runs, results are copied back. Slow, but any
//           number of ranks may share one GPU (NCCL refuses two ranks on one device), so that multi-rank
//           layouts of the GPU kernels can be checked, and their per-rank memory measured, on one GPU.
// Host buffers go over MPI in both, as with the NCCL communicator.
#include <initializer_list>
#include <memory>
#include <string>

#include "dist/communicator.h"

namespace ndt {

// Collective over `mpi_group` (an MPI-backed communicator, or a device communicator made here: its MPI
// side is used). `device`: this rank's CUDA device. Splits of the result are of the same kind.
std::unique_ptr<Communicator> make_device_communicator(Communicator& mpi_group, int device,
                                                       const std::string& kind);

// How a call with these buffers is routed by a device communicator: true when every non-null one is device
// (or managed) memory, false when every one is host memory; a mix is an error naming the call `what`.
bool device_buffers(std::initializer_list<const void*> ptrs, const char* what);

}  // namespace ndt
