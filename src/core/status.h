#pragma once
// Errors as values at boundaries (config parsing, file IO, checkpoint load, communicator init).
#include <optional>
#include <string>
#include <utility>
#include <variant>

#include "core/check.h"

namespace ndt {

class Status {
 public:
  Status() = default;
  static Status ok() { return Status(); }
  static Status error(std::string msg) {
    Status s;
    s.msg_ = std::move(msg);
    s.ok_ = false;
    return s;
  }
  bool is_ok() const { return ok_; }
  explicit operator bool() const { return ok_; }
  const std::string& message() const { return msg_; }
  // Turn an error into an exception (for callers that cannot continue).
  void throw_if_error() const {
    if (!ok_) throw Error(msg_);
  }

 private:
  bool ok_ = true;
  std::string msg_;
};

template <typename T>
class Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  Result(Status st) : v_(std::move(st)) {    // NOLINT(google-explicit-constructor)
    NDT_CHECK(!std::get<Status>(v_).is_ok(), "Result constructed from an OK status");
  }
  bool is_ok() const { return std::holds_alternative<T>(v_); }
  explicit operator bool() const { return is_ok(); }
  const Status& status() const {
    static const Status kOk;
    return is_ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & {
    if (!is_ok()) throw Error(std::get<Status>(v_).message());
    return std::get<T>(v_);
  }
  T&& value() && {
    if (!is_ok()) throw Error(std::get<Status>(v_).message());
    return std::move(std::get<T>(v_));
  }

 private:
  std::variant<T, Status> v_;
};

}  // namespace ndt
