#pragma once
// Run outputs a person reads: metrics.jsonl (one JSON object per line), an SVG loss curve, and
// human-friendly number formatting for log lines. All file functions are rank-0 business: callers decide
// who writes; nothing here is collective.
#include <cstdint>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "core/status.h"

namespace ndt {

// Appends one JSON object per line to `<out_dir>/metrics.jsonl`. Each line is flushed when written, so
// the file is complete up to the last finished record even if the run dies. Non-finite numbers (NaN,
// inf) are written as null (JSON has no NaN). Not thread-safe.
//
// With tensorboard = true every record with an integer "step" is also written to a TensorBoard event file
// in <out_dir>/tensorboard/ (train/tensorboard.h): each numeric leaf becomes a scalar tagged
// "<type>/<key>" (type = the record's "type", e.g. train or eval; nested objects and arrays add
// "/<key>" and "/<index>"), the same values as the JSON line.
class TensorBoardWriter;
class MetricsWriter {
 public:
  // Creates out_dir (and parents). append=false starts a fresh file (truncates an old one);
  // append=true continues it (resumed runs; TensorBoard gets a new event file, which it merges).
  static Result<MetricsWriter> open(const std::string& out_dir, bool append = false,
                                    bool tensorboard = false);
  MetricsWriter();
  MetricsWriter(MetricsWriter&&) noexcept;
  MetricsWriter& operator=(MetricsWriter&&) noexcept;
  ~MetricsWriter();

  // Writes `record` (must be a JSON object) as one line (and its scalars to TensorBoard).
  Status write(const nlohmann::json& record);
  const std::string& path() const { return path_; }
  // The TensorBoard event file ("" when off).
  std::string tensorboard_path() const;

 private:
  std::string path_;
  std::ofstream out_;
  std::unique_ptr<TensorBoardWriter> tb_;
};

// A resumed run's metrics.jsonl: keeps the records before `step` (and the ones without a step), drops the
// rest and a torn last line, so that steps repeated after the checkpoint are not recorded twice. Missing
// file: OK.
Status truncate_metrics_from(const std::string& out_dir, int64_t step);

// The TensorBoard scalars of one metrics record: (tag, value) for every numeric leaf but "step".
std::vector<std::pair<std::string, float>> tensorboard_scalars(const nlohmann::json& record);

// Reads a metrics.jsonl back (for plotting and tests). Fails naming the file and line on bad JSON.
Result<std::vector<nlohmann::json>> read_metrics_jsonl(const std::string& path);
// The (step, value) pairs of records that carry both `step` and a numeric `key`.
std::vector<std::pair<int64_t, double>> metric_series(const std::vector<nlohmann::json>& records,
                                                      const std::string& key);

// A self-contained SVG loss curve: axes with tick labels, a legend, the training loss as a line and
// the validation loss (usually sparse) as a line with markers. Either series may be empty; non-finite
// points are skipped. log_y plots the loss on a log10 axis (all values must be > 0, others skipped).
Status write_loss_svg(const std::vector<std::pair<int64_t, double>>& train_loss,
                      const std::vector<std::pair<int64_t, double>>& val_loss, const std::string& path,
                      const std::string& title, bool log_y = false,
                      const std::pair<std::string, std::string>& labels = {"train loss", "validation loss"});

// Expert load over a run, one heatmap per MoE layer: rows are experts, columns steps, the colour the
// expert's share of the layer's routed tokens relative to a uniform share (white = 1/E, blue = less,
// red = more, saturating at 0 and 2/E). loads[i][s] holds layer layers[i]'s per-expert counts at steps[s].
Status write_expert_load_svg(const std::vector<int64_t>& steps, const std::vector<int64_t>& layers,
                             const std::vector<std::vector<std::vector<double>>>& loads,
                             const std::string& path, const std::string& title);

// 0.42 -> "0.42s", 12.3 -> "12.3s", 83 -> "1m23s", 3725 -> "1h02m", 90000 -> "1d01h".
std::string format_duration(double seconds);
// Three significant digits with a k/M/G/T suffix: 999 -> "999", 12345 -> "12.3k", 1.5e9 -> "1.50G".
std::string format_count(double value);

}  // namespace ndt
