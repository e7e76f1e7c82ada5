// Fuzz target: the run configuration (train/config.h): YAML text and `--set key=value` overrides through
// parse_config_string (flattening, presets, scalar conversion, ranges, validate_config, debug.fault specs).
// Input: YAML; the lines after a line "#overrides" (a YAML comment) are overrides, one per line. A config
// that parses is written back with config_to_yaml, which must parse again to the same text.
#include <sstream>

#include "fuzz_common.h"
#include "train/config.h"

using namespace ndt;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(fuzz::as_text(data, size));
  std::string yaml = text;
  std::vector<std::string> overrides;
  const std::string marker = "#overrides\n";
  size_t at = std::string::npos, rest = 0;
  if (text.rfind(marker, 0) == 0) {
    at = 0;
    rest = marker.size();
  } else if (const size_t p = text.find("\n" + marker); p != std::string::npos) {
    at = p + 1;
    rest = at + marker.size();
  }
  if (at != std::string::npos) {
    yaml = text.substr(0, at);
    std::istringstream lines(text.substr(rest));
    for (std::string line; std::getline(lines, line);) overrides.push_back(line);
  }
  try {
    auto c = parse_config_string(yaml, overrides, "<fuzz>");
    if (!c) return 0;
    const std::string once = config_to_yaml(c.value());
    auto again = parse_config_string(once, {}, "<fuzz>");
    if (!again) fuzz::property_failed("config_to_yaml output does not parse", again.status().message());
    if (config_to_yaml(again.value()) != once) fuzz::property_failed("config round trip", once);
  } catch (const Error&) {
  }
  return 0;
}
