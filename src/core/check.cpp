#include "core/check.h"

namespace ndt {

void check_failed(const char* file, int line, const char* cond, const std::string& msg) {
  throw Error(fmt::format("{}:{}: check failed: {}{}{}", file, line, cond, msg.empty() ? "" : ": ", msg));
}

}  // namespace ndt
