#pragma once
// Output of `ndtrain plan`: a table (layouts that fit, fastest first; then those rejected, with the
// reason) or JSON with every number per layout and per rank.
#include <nlohmann/json.hpp>
#include <string>

#include "plan/plan.h"

namespace ndt::plan {

// top > 0 shows only the first `top` fitting layouts (the rejected ones are always listed).
std::string format_report(const PlanResult& r, const PlanOptions& o, const Config& base, int top = 0);
nlohmann::json to_json(const PlanResult& r, const PlanOptions& o, const Config& base);

}  // namespace ndt::plan
