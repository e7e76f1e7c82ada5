#include "train/fault.h"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <limits>
#include <thread>
#include <utility>

#include "core/check.h"
#ifdef NDT_HAVE_CUDA
#include "cuda/runtime.h"
#include "cuda/train_kernels.h"
#endif

namespace ndt {
namespace {

// Every kind by its spec name, in Fault::Kind order: the parser, the syntax message and the log line read it.
constexpr std::pair<const char*, Fault::Kind> kKinds[] = {{"nan_grad", Fault::Kind::NanGrad},
                                                          {"inf_grad", Fault::Kind::InfGrad},
                                                          {"nan_loss", Fault::Kind::NanLoss},
                                                          {"inf_loss", Fault::Kind::InfLoss},
                                                          {"kill", Fault::Kind::Kill},
                                                          {"abort", Fault::Kind::Abort},
                                                          {"hang", Fault::Kind::Hang},
                                                          {"slow", Fault::Kind::Slow},
                                                          {"gpu_hang", Fault::Kind::GpuHang},
                                                          {"ckpt_write_error", Fault::Kind::CkptWriteError},
                                                          {"ckpt_short_write", Fault::Kind::CkptShortWrite}};

const char* kind_name(Fault::Kind k) {
  for (const auto& [name, kind] : kKinds)
    if (kind == k) return name;
  return "?";
}

const std::string& syntax() {
  static const std::string s = [] {
    std::string names;
    for (const auto& [name, kind] : kKinds) names += (names.empty() ? "" : ", ") + std::string(name);
    return "expected KIND@step=S[,rank=R] or KIND@steps=A-B[,rank=R] (slow also ms=M), faults separated by "
           "';', KIND one of " +
           names;
  }();
  return s;
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  const auto e = s.find_last_not_of(" \t");
  return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    const auto p = s.find(sep, start);
    out.push_back(trim(s.substr(start, p == std::string::npos ? std::string::npos : p - start)));
    if (p == std::string::npos) return out;
    start = p + 1;
  }
}

std::optional<int64_t> non_negative(const std::string& s) {
  int64_t v = 0;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || ptr != s.data() + s.size() || v < 0) return std::nullopt;
  return v;
}

Result<Fault> parse_one(const std::string& text) {
  const auto at = text.find('@');
  if (at == std::string::npos)
    return Status::error(fmt::format("fault '{}' has no '@step=...' ({})", text, syntax()));
  Fault f;
  const std::string kind = trim(text.substr(0, at));
  const auto known =
      std::find_if(std::begin(kKinds), std::end(kKinds), [&](const auto& k) { return kind == k.first; });
  if (known == std::end(kKinds))
    return Status::error(fmt::format("unknown fault kind '{}' in '{}' ({})", kind, text, syntax()));
  f.kind = known->second;
  bool have_step = false, have_rank = false, have_ms = false;
  for (const std::string& arg : split(text.substr(at + 1), ',')) {
    const auto eq = arg.find('=');
    const std::string key = trim(arg.substr(0, eq)),
                      val = eq == std::string::npos ? "" : trim(arg.substr(eq + 1));
    if (eq == std::string::npos ||
        (key != "step" && key != "steps" && key != "rank" && !(key == "ms" && f.kind == Fault::Kind::Slow)))
      return Status::error(fmt::format("unknown fault argument '{}' in '{}' ({})", arg, text, syntax()));
    if (key == "ms") {
      const auto m = non_negative(val);
      if (!m || have_ms)
        return Status::error(
            fmt::format("fault '{}': ms must be given once, an integer >= 0, got '{}'", text, val));
      f.ms = *m;
      have_ms = true;
      continue;
    }
    if ((key == "rank" && have_rank) || (key != "rank" && have_step))
      return Status::error(fmt::format("fault '{}' gives '{}' twice", text, key == "rank" ? "rank" : "step"));
    if (key == "rank") {
      const auto r = non_negative(val);
      if (!r)
        return Status::error(fmt::format("fault '{}': rank must be an integer >= 0, got '{}'", text, val));
      f.rank = *r;
      have_rank = true;
    } else if (key == "step") {
      const auto s = non_negative(val);
      if (!s)
        return Status::error(fmt::format("fault '{}': step must be an integer >= 0, got '{}'", text, val));
      f.first_step = f.last_step = *s;
      have_step = true;
    } else {
      const auto dash = val.find('-');
      const auto a = dash == std::string::npos ? std::nullopt : non_negative(trim(val.substr(0, dash)));
      const auto b = dash == std::string::npos ? std::nullopt : non_negative(trim(val.substr(dash + 1)));
      if (!a || !b || *a > *b)
        return Status::error(
            fmt::format("fault '{}': steps must be A-B with integers 0 <= A <= B, got '{}'", text, val));
      f.first_step = *a;
      f.last_step = *b;
      have_step = true;
    }
  }
  if (!have_step)
    return Status::error(fmt::format("fault '{}' needs step=S or steps=A-B ({})", text, syntax()));
  return f;
}

}  // namespace

float Fault::value() const {
  return (kind == Kind::NanGrad || kind == Kind::NanLoss) ? std::numeric_limits<float>::quiet_NaN()
                                                          : std::numeric_limits<float>::infinity();
}

Result<std::vector<Fault>> parse_fault_spec(const std::string& spec) {
  std::vector<Fault> out;
  if (trim(spec).empty()) return out;
  for (const std::string& part : split(spec, ';')) {
    if (part.empty()) return Status::error(fmt::format("empty fault in '{}' ({})", spec, syntax()));
    auto f = parse_one(part);
    if (!f) return f.status();
    out.push_back(f.value());
  }
  return out;
}

std::optional<float> fault_value(const std::vector<Fault>& faults, bool grad, int64_t step,
                                 int64_t world_rank) {
  for (const Fault& f : faults)
    if (f.is_value() && f.on_grad() == grad && f.fires(step, world_rank)) return f.value();
  return std::nullopt;
}

void apply_process_faults(const std::vector<Fault>& faults, int64_t step, int64_t world_rank, bool on_gpu) {
  for (const Fault& f : faults) {
    if (!f.on_process() || !f.fires(step, world_rank)) continue;
    std::fprintf(stderr, "ndtrain [rank %lld]: injected fault %s at step %lld\n",
                 static_cast<long long>(world_rank), kind_name(f.kind), static_cast<long long>(step));
    std::fflush(stderr);
    switch (f.kind) {
      case Fault::Kind::Kill:
        std::raise(SIGKILL);
        break;
      case Fault::Kind::Abort:
        std::abort();
      case Fault::Kind::Hang:
        for (;;) std::this_thread::sleep_for(std::chrono::seconds(60));
      case Fault::Kind::Slow:
        std::this_thread::sleep_for(std::chrono::milliseconds(f.ms));
        break;
      case Fault::Kind::GpuHang:
        NDT_CHECK(on_gpu, "debug.fault gpu_hang needs train.device cuda");
#ifdef NDT_HAVE_CUDA
        cuda::hang_stream(cuda::stream());
#endif
        break;
      default:
        break;
    }
  }
}

std::optional<Fault::Kind> checkpoint_fault(const std::vector<Fault>& faults, int64_t step,
                                            int64_t world_rank) {
  for (const Fault& f : faults)
    if (f.on_checkpoint() && f.fires(step, world_rank)) return f.kind;
  return std::nullopt;
}

}  // namespace ndt
