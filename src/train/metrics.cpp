#include "train/metrics.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <sstream>

#include "train/tensorboard.h"

namespace ndt {

namespace fs = std::filesystem;
using nlohmann::json;

// ---------------------------------------------------------------------------------------------------
// metrics.jsonl
// ---------------------------------------------------------------------------------------------------

MetricsWriter::MetricsWriter() = default;
MetricsWriter::MetricsWriter(MetricsWriter&&) noexcept = default;
MetricsWriter& MetricsWriter::operator=(MetricsWriter&&) noexcept = default;
MetricsWriter::~MetricsWriter() = default;

std::string MetricsWriter::tensorboard_path() const { return tb_ ? tb_->path() : std::string(); }

namespace {
void add_leaves(const json& j, const std::string& tag, std::vector<std::pair<std::string, float>>& out) {
  if (j.is_number()) {
    out.emplace_back(tag, static_cast<float>(j.get<double>()));
  } else if (j.is_boolean()) {
    out.emplace_back(tag, j.get<bool>() ? 1.0f : 0.0f);
  } else if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it) add_leaves(it.value(), tag + "/" + it.key(), out);
  } else if (j.is_array()) {
    for (size_t i = 0; i < j.size(); ++i) add_leaves(j[i], tag + "/" + std::to_string(i), out);
  }
}
}  // namespace

std::vector<std::pair<std::string, float>> tensorboard_scalars(const json& record) {
  std::vector<std::pair<std::string, float>> out;
  const std::string type = record.contains("type") && record["type"].is_string()
                               ? record["type"].get<std::string>()
                               : std::string("metrics");
  // "time" (the step's Unix seconds) is no curve; the event carries a wall time of its own.
  for (auto it = record.begin(); it != record.end(); ++it)
    if (it.key() != "step" && it.key() != "type" && it.key() != "time")
      add_leaves(it.value(), type + "/" + it.key(), out);
  return out;
}

Result<MetricsWriter> MetricsWriter::open(const std::string& out_dir, bool append, bool tensorboard) {
  std::error_code ec;
  if (!out_dir.empty()) fs::create_directories(out_dir, ec);
  if (ec) return Status::error(fmt::format("cannot create output directory '{}': {}", out_dir, ec.message()));
  MetricsWriter w;
  w.path_ = (fs::path(out_dir.empty() ? "." : out_dir) / "metrics.jsonl").string();
  w.out_.open(w.path_, append ? std::ios::app : std::ios::trunc);
  if (!w.out_) return Status::error(fmt::format("cannot open '{}' for writing", w.path_));
  if (tensorboard) {
    auto tb = TensorBoardWriter::open((fs::path(out_dir.empty() ? "." : out_dir) / "tensorboard").string());
    if (!tb.is_ok()) return tb.status();
    w.tb_ = std::make_unique<TensorBoardWriter>(std::move(tb.value()));
  }
  return w;
}

namespace {
// JSON has no NaN/inf; nlohmann would write `null` anyway, but do it explicitly so nested values are
// handled the same way everywhere.
json sanitize(const json& j) {
  if (j.is_number_float() && !std::isfinite(j.get<double>())) return nullptr;
  if (j.is_object() || j.is_array()) {
    json out = j;
    for (auto& v : out) v = sanitize(v);
    return out;
  }
  return j;
}
}  // namespace

Status MetricsWriter::write(const json& record) {
  if (!record.is_object())
    return Status::error(fmt::format("metrics record for '{}' must be a JSON object", path_));
  out_ << sanitize(record).dump() << '\n';
  out_.flush();
  if (!out_) return Status::error(fmt::format("write to '{}' failed (disk full?)", path_));
  if (tb_ && record.contains("step") && record["step"].is_number_integer())
    return tb_->add(record["step"].get<int64_t>(), tensorboard_scalars(record));
  return Status::ok();
}

Status truncate_metrics_from(const std::string& out_dir, int64_t step) {
  const fs::path path = fs::path(out_dir.empty() ? "." : out_dir) / "metrics.jsonl";
  std::ifstream in(path);
  if (!in) return Status::ok();
  std::string kept, line;
  while (std::getline(in, line)) {
    const json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) continue;  // a line torn by a kill
    if (j.contains("step") && j["step"].is_number_integer() && j["step"].get<int64_t>() >= step) continue;
    kept += line + "\n";
  }
  in.close();
  std::ofstream out(path.string() + ".tmp", std::ios::trunc);
  out << kept;
  out.flush();
  if (!out) return Status::error(fmt::format("cannot rewrite '{}'", path.string()));
  std::error_code ec;
  fs::rename(path.string() + ".tmp", path, ec);
  if (ec) return Status::error(fmt::format("cannot rewrite '{}': {}", path.string(), ec.message()));
  return Status::ok();
}

Result<std::vector<json>> read_metrics_jsonl(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::error(fmt::format("metrics file '{}' not found", path));
  std::vector<json> out;
  std::string line;
  for (int64_t lineno = 1; std::getline(in, line); ++lineno) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object())
      return Status::error(fmt::format("{}:{}: not a JSON object", path, lineno));
    out.push_back(std::move(j));
  }
  return out;
}

std::vector<std::pair<int64_t, double>> metric_series(const std::vector<json>& records,
                                                      const std::string& key) {
  std::vector<std::pair<int64_t, double>> out;
  for (const auto& r : records) {
    auto s = r.find("step");
    auto v = r.find(key);
    if (s == r.end() || v == r.end() || !s->is_number() || !v->is_number()) continue;
    out.emplace_back(s->get<int64_t>(), v->get<double>());
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------
// SVG loss curve
// ---------------------------------------------------------------------------------------------------

namespace {

std::string xml_escape(const std::string& s) {
  std::string o;
  for (char ch : s) {
    switch (ch) {
      case '&':
        o += "&amp;";
        break;
      case '<':
        o += "&lt;";
        break;
      case '>':
        o += "&gt;";
        break;
      case '"':
        o += "&quot;";
        break;
      default:
        o += ch;
    }
  }
  return o;
}

// A "nice" tick step (1, 2 or 5 times a power of ten) giving about `target` intervals over `span`.
double nice_step(double span, int target) {
  const double raw = span / target;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double f = raw / mag;
  return (f < 1.5 ? 1 : f < 3.5 ? 2 : f < 7.5 ? 5 : 10) * mag;
}

std::vector<double> linear_ticks(double lo, double hi, int target) {
  const double step = nice_step(hi - lo, target);
  std::vector<double> t;
  for (double v = std::ceil(lo / step - 1e-9) * step; v <= hi + step * 1e-9; v += step)
    t.push_back(std::fabs(v) < step * 1e-9 ? 0.0 : v);
  return t;
}

std::string tick_label(double v, double step) {
  const int decimals = std::max(0, static_cast<int>(-std::floor(std::log10(step) + 1e-9)));
  if (std::fabs(v) >= 1e5 && std::fmod(v, 1000.0) == 0) return format_count(v);
  return fmt::format("{:.{}f}", v, decimals);
}

struct Axis {
  double lo, hi;  // data range (log10 values when log)
  double p0, p1;  // pixel range
  double map(double v) const { return p0 + (v - lo) / (hi - lo) * (p1 - p0); }
};

void pad_range(double& lo, double& hi, double rel) {
  if (hi <= lo) {
    const double d = lo == 0 ? 1.0 : std::fabs(lo) * 0.1;
    lo -= d;
    hi += d;
  } else {
    const double d = (hi - lo) * rel;
    lo -= d;
    hi += d;
  }
}

}  // namespace

Status write_loss_svg(const std::vector<std::pair<int64_t, double>>& train_loss,
                      const std::vector<std::pair<int64_t, double>>& val_loss, const std::string& path,
                      const std::string& title, bool log_y,
                      const std::pair<std::string, std::string>& labels) {
  // Keep the plottable points (finite, and > 0 on a log axis); y in axis units.
  auto clean = [&](const std::vector<std::pair<int64_t, double>>& s) {
    std::vector<std::pair<double, double>> out;
    for (const auto& [x, y] : s) {
      if (!std::isfinite(y) || (log_y && y <= 0)) continue;
      out.emplace_back(static_cast<double>(x), log_y ? std::log10(y) : y);
    }
    return out;
  };
  const auto tr = clean(train_loss), va = clean(val_loss);

  constexpr double W = 800, H = 480, ML = 72, MR = 24, MT = 44, MB = 56;
  double xlo = std::numeric_limits<double>::infinity(), xhi = -xlo, ylo = xlo, yhi = -xlo;
  for (const auto* s : {&tr, &va})
    for (const auto& [x, y] : *s) {
      xlo = std::min(xlo, x), xhi = std::max(xhi, x);
      ylo = std::min(ylo, y), yhi = std::max(yhi, y);
    }
  const bool empty = tr.empty() && va.empty();
  if (empty) xlo = 0, xhi = 1, ylo = 0, yhi = 1;
  pad_range(xlo, xhi, 0.01);  // keeps end markers off the frame
  pad_range(ylo, yhi, 0.05);
  Axis ax{xlo, xhi, ML, W - MR}, ay{ylo, yhi, H - MB, MT};

  std::ostringstream o;
  o << fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n",
      W, H);
  o << fmt::format("<rect x=\"0\" y=\"0\" width=\"{}\" height=\"{}\" fill=\"white\"/>\n", W, H);
  o << fmt::format("<text x=\"{}\" y=\"24\" text-anchor=\"middle\" font-size=\"16\">{}</text>\n", W / 2,
                   xml_escape(title));

  // Grid lines and tick labels.
  const auto xt = linear_ticks(xlo, xhi, 8);
  const double xstep = xt.size() > 1 ? xt[1] - xt[0] : 1;
  for (double v : xt) {
    const double px = ax.map(v);
    o << fmt::format("<line x1=\"{0:.1f}\" y1=\"{1}\" x2=\"{0:.1f}\" y2=\"{2}\" stroke=\"#e5e5e5\"/>\n", px,
                     MT, H - MB);
    o << fmt::format("<text x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n", px, H - MB + 18,
                     tick_label(v, std::max(1.0, xstep)));
  }
  std::vector<std::pair<double, std::string>> yt;  // (axis value, label)
  if (log_y && yhi - ylo >= 0.3) {
    // Decades, plus 2x and 5x when the range spans few decades.
    const bool fine = yhi - ylo < 2.5;
    for (int e = static_cast<int>(std::floor(ylo)); e <= static_cast<int>(std::ceil(yhi)); ++e)
      for (double m : fine ? std::vector<double>{1, 2, 5} : std::vector<double>{1}) {
        const double v = std::log10(m) + e;
        if (v >= ylo && v <= yhi) yt.emplace_back(v, fmt::format("{:g}", m * std::pow(10.0, e)));
      }
  } else {
    // Linear ticks in axis units (on a narrow log axis the labels show the loss value itself).
    const auto t = linear_ticks(ylo, yhi, 6);
    const double step = t.size() > 1 ? t[1] - t[0] : 1;
    for (double v : t)
      yt.emplace_back(v, log_y ? fmt::format("{:.3g}", std::pow(10.0, v)) : tick_label(v, step));
  }
  for (const auto& [v, label] : yt) {
    const double py = ay.map(v);
    o << fmt::format("<line x1=\"{1}\" y1=\"{0:.1f}\" x2=\"{2}\" y2=\"{0:.1f}\" stroke=\"#e5e5e5\"/>\n", py,
                     ML, W - MR);
    o << fmt::format("<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{}</text>\n", ML - 6, py + 4, label);
  }
  // Axes and their labels.
  o << fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#333\"/>\n", ML,
                   MT, W - ML - MR, H - MT - MB);
  o << fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">step</text>\n", (ML + W - MR) / 2, H - 14);
  o << fmt::format(
      "<text x=\"16\" y=\"{0}\" text-anchor=\"middle\" transform=\"rotate(-90 16 {0})\">{1}</text>\n",
      (MT + H - MB) / 2,
      labels.first != "train loss" ? "value"
      : log_y                      ? "loss (log scale)"
                                   : "loss");
  if (empty)
    o << fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" fill=\"#888\">no data</text>\n", W / 2,
                     H / 2);

  // Series, clipped to the plot area.
  o << fmt::format("<clipPath id=\"plot\"><rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\"/></clipPath>\n",
                   ML, MT, W - ML - MR, H - MT - MB);
  auto polyline = [&](const std::vector<std::pair<double, double>>& s, const char* id, const char* color,
                      bool markers) {
    if (s.empty()) return;
    o << fmt::format(
        "<g id=\"{}\" clip-path=\"url(#plot)\">\n<polyline fill=\"none\" stroke=\"{}\" "
        "stroke-width=\"1.5\" points=\"",
        id, color);
    for (const auto& [x, y] : s) o << fmt::format("{:.1f},{:.1f} ", ax.map(x), ay.map(y));
    o << "\"/>\n";
    if (markers || s.size() == 1)
      for (const auto& [x, y] : s)
        o << fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3\" fill=\"{}\"/>\n", ax.map(x), ay.map(y),
                         color);
    o << "</g>\n";
  };
  polyline(tr, "train_loss", "#1f77b4", false);
  polyline(va, "val_loss", "#d62728", true);

  // Legend (top right inside the plot).
  const double lx = W - MR - 150, ly = MT + 10;
  o << fmt::format("<rect x=\"{}\" y=\"{}\" width=\"140\" height=\"46\" fill=\"white\" stroke=\"#999\"/>\n",
                   lx, ly);
  o << fmt::format(
      "<line x1=\"{0}\" y1=\"{1}\" x2=\"{2}\" y2=\"{1}\" stroke=\"#1f77b4\" stroke-width=\"2\"/>\n", lx + 10,
      ly + 15, lx + 34);
  o << fmt::format("<text x=\"{}\" y=\"{}\">{}</text>\n", lx + 42, ly + 19, xml_escape(labels.first));
  o << fmt::format(
      "<line x1=\"{0}\" y1=\"{1}\" x2=\"{2}\" y2=\"{1}\" stroke=\"#d62728\" stroke-width=\"2\"/>\n", lx + 10,
      ly + 33, lx + 34);
  o << fmt::format("<circle cx=\"{}\" cy=\"{}\" r=\"3\" fill=\"#d62728\"/>\n", lx + 22, ly + 33);
  o << fmt::format("<text x=\"{}\" y=\"{}\">{}</text>\n", lx + 42, ly + 37, xml_escape(labels.second));
  o << "</svg>\n";

  std::error_code ec;
  const fs::path p(path);
  if (p.has_parent_path()) fs::create_directories(p.parent_path(), ec);
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    if (!f) return Status::error(fmt::format("cannot write loss curve '{}'", path));
    f << o.str();
    if (!f.flush()) return Status::error(fmt::format("cannot write loss curve '{}'", path));
  }
  fs::rename(tmp, path, ec);
  if (ec) return Status::error(fmt::format("cannot write loss curve '{}': {}", path, ec.message()));
  return Status::ok();
}

// ---------------------------------------------------------------------------------------------------
// Formatting
// ---------------------------------------------------------------------------------------------------

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds)) return "?";
  if (seconds < 0) return "-" + format_duration(-seconds);
  if (seconds < 10) return fmt::format("{:.2f}s", seconds);
  if (seconds < 60) return fmt::format("{:.1f}s", seconds);
  const int64_t s = static_cast<int64_t>(std::llround(seconds));
  if (s < 3600) return fmt::format("{}m{:02}s", s / 60, s % 60);
  if (s < 86400) return fmt::format("{}h{:02}m", s / 3600, (s % 3600) / 60);
  return fmt::format("{}d{:02}h", s / 86400, (s % 86400) / 3600);
}

std::string format_count(double value) {
  if (!std::isfinite(value)) return "?";
  if (value < 0) return "-" + format_count(-value);
  static const char* kUnits[] = {"", "k", "M", "G", "T", "P"};
  int u = 0;
  double v = value;
  while (v >= 999.5 && u < 5) v /= 1000, ++u;  // 999.5 would print as "1000" otherwise
  if (u == 0) {
    if (v == std::floor(v)) return fmt::format("{}", static_cast<int64_t>(v));
    return fmt::format("{:.3g}", v);
  }
  const int decimals = v < 9.995 ? 2 : v < 99.95 ? 1 : 0;
  return fmt::format("{:.{}f}{}", v, decimals, kUnits[u]);
}

Status write_expert_load_svg(const std::vector<int64_t>& steps, const std::vector<int64_t>& layers,
                             const std::vector<std::vector<std::vector<double>>>& loads,
                             const std::string& path, const std::string& title) {
  if (layers.size() != loads.size()) return Status::error("expert load plot: one load series per layer");
  // At most kCols columns: consecutive steps are summed into bins (a long run stays a small file).
  constexpr size_t kCols = 200;
  const size_t bin = std::max<size_t>(1, (steps.size() + kCols - 1) / kCols);
  const size_t S = (steps.size() + bin - 1) / bin;
  const size_t E = loads.empty() || loads[0].empty() ? 0 : loads[0][0].size();
  constexpr double W = 800, ML = 72, MR = 24, MT = 44, band = 12, gap = 28;
  const double cell_w = S ? (W - ML - MR) / static_cast<double>(S) : 1.0;
  const double H = MT + static_cast<double>(layers.size()) * (static_cast<double>(E) * band + gap) + 40;
  std::ostringstream o;
  o << fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" "
      "font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<text x=\"{2}\" y=\"24\" font-size=\"14\" text-anchor=\"middle\">{3}</text>\n",
      W, H, W / 2, title);
  double y0 = MT;
  for (size_t i = 0; i < layers.size(); ++i) {
    o << fmt::format(
        "<text x=\"{}\" y=\"{}\">layer {} (rows: experts 0..{}; columns: steps, {} per column)</text>\n", ML,
        y0 - 4, layers[i], E > 0 ? E - 1 : 0, bin);
    for (size_t s = 0; s < S; ++s) {
      std::vector<double> l(E, 0.0);
      for (size_t j = s * bin; j < std::min((s + 1) * bin, loads[i].size()); ++j)
        for (size_t e = 0; e < E && e < loads[i][j].size(); ++e) l[e] += loads[i][j][e];
      double sum = 0;
      for (double v : l) sum += v;
      for (size_t e = 0; e < l.size(); ++e) {
        // share relative to uniform: 0 -> blue, 1 -> white, >= 2 -> red
        const double r = sum > 0 ? std::min(2.0, l[e] * static_cast<double>(l.size()) / sum) : 1.0;
        const int over = static_cast<int>(255 * std::max(0.0, r - 1.0)),
                  under = static_cast<int>(255 * std::max(0.0, 1.0 - r));
        o << fmt::format(
            "<rect x=\"{:.2f}\" y=\"{:.1f}\" width=\"{:.2f}\" height=\"{}\" fill=\"rgb({},{},{})\"/>\n",
            ML + static_cast<double>(s) * cell_w, y0 + static_cast<double>(e) * band, cell_w + 0.5, band,
            255 - under, 255 - over - under, 255 - over);
      }
    }
    for (size_t e = 0; e < E; e += std::max<size_t>(1, E / 8))
      o << fmt::format("<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{}</text>\n", ML - 4,
                       y0 + (static_cast<double>(e) + 0.8) * band, e);
    y0 += static_cast<double>(E) * band + gap;
  }
  if (S > 0)
    o << fmt::format(
        "<text x=\"{}\" y=\"{:.1f}\">step {}</text><text x=\"{}\" y=\"{:.1f}\" "
        "text-anchor=\"end\">step {}</text>\n",
        ML, y0, steps.front(), W - MR, y0, steps.back());
  o << "</svg>\n";
  std::ofstream f(path);
  if (!(f << o.str())) return Status::error("cannot write " + path);
  return Status::ok();
}

}  // namespace ndt
