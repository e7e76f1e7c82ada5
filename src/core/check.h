#pragma once
// Invariant checks and the project's exception type.
// NDT_CHECK is for invariants inside the engine (a failure is a bug or a bad input that slipped past
// validation); boundaries (config, files, communicator init) return Status/Result instead.
#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace ndt {

// Thrown on a violated invariant or an unrecoverable user error. Carries a user-readable message.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// An error every rank of the job already knows about (agreed through a collective): each rank can
// stop on its own, with no need to abort the others.
class AgreedError : public Error {
 public:
  using Error::Error;
};

[[noreturn]] void check_failed(const char* file, int line, const char* cond, const std::string& msg);

}  // namespace ndt

#define NDT_CHECK(cond, ...)                                                                    \
  do {                                                                                          \
    if (!(cond)) ::ndt::check_failed(__FILE__, __LINE__, #cond, ::fmt::format("" __VA_ARGS__)); \
  } while (0)

// Raise a user-facing error (no file:line, the message must say everything).
#define NDT_FAIL(...) throw ::ndt::Error(::fmt::format(__VA_ARGS__))
