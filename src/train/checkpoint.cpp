#include "train/checkpoint.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <system_error>
#include <tuple>

#include "train/safetensors.h"

namespace fs = std::filesystem;

namespace ndt {
namespace {

constexpr const char* kFormat = "ndtrain-checkpoint";
constexpr int kVersion = 1;
constexpr int kSliceTag = 7301;

std::string strip_slash(std::string s) {
  while (s.size() > 1 && s.back() == '/') s.pop_back();
  return s;
}

std::string join(const std::string& a, const std::string& b) { return (fs::path(a) / b).string(); }

// Writes `text` to path + ".tmp" then renames onto path.
Status write_text_atomic(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) return Status::error(fmt::format("cannot create '{}'", tmp));
    f << text;
    f.flush();
    if (!f) return Status::error(fmt::format("write failed for '{}'", tmp));
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) return Status::error(fmt::format("cannot rename '{}' to '{}': {}", tmp, path, ec.message()));
  return Status::ok();
}

Result<std::string> read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return Status::error(fmt::format("cannot open '{}'", path));
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

nlohmann::json slice_to_json(const CheckpointSlice& s) {
  return nlohmann::json{{"name", s.name},  {"global_shape", s.global_shape}, {"dtype", s.dtype},
                        {"file", s.file},  {"shard_dim", s.shard_dim},       {"offset", s.offset},
                        {"shape", s.shape}};
}

// Validates one slice against its global shape; returns an empty string when fine. Every size is checked
// before it is used, so absurd values (negative or overflowing extents) from a file are refused here.
std::string slice_problem(const Shape& g, int sd, int64_t off, const Shape& shape) {
  if (shape.size() != g.size())
    return fmt::format("slice shape {} has a different rank than the global shape {}", shape_str(shape),
                       shape_str(g));
  if (g.size() > 64) return fmt::format("global shape has {} dims", g.size());
  int64_t numel = 1;
  for (int64_t d : g) {
    if (d < 0 || (d > 0 && numel > (int64_t{1} << 62) / d))
      return fmt::format("global shape {} is negative or absurdly large", shape_str(g));
    numel *= d;
  }
  if (sd < -1 || sd >= static_cast<int>(g.size()))
    return fmt::format("shard_dim {} out of range for global shape {}", sd, shape_str(g));
  for (size_t d = 0; d < g.size(); ++d) {
    if (static_cast<int>(d) == sd) continue;
    if (shape[d] != g[d])
      return fmt::format("slice shape {} differs from the global shape {} outside the shard dim {}",
                         shape_str(shape), shape_str(g), sd);
  }
  // (g[sd] - shape[sd] cannot overflow: both are in [0, 2^62] here.)
  if (sd >= 0 && (off < 0 || shape[sd] < 0 || shape[sd] > g[sd] || off > g[sd] - shape[sd]))
    return fmt::format("slice of {} at offset {} along dim {} is outside the global extent {}", shape[sd],
                       off, sd, g[sd]);
  if (sd < 0 && off != 0) return fmt::format("unsharded slice with offset {}", off);
  return "";
}

// Shard files are plain names inside the step directory: no separator, no "." or "..", nothing absolute.
bool plain_file_name(const std::string& f) {
  return !f.empty() && f != "." && f != ".." && f.find('/') == std::string::npos &&
         f.find('\\') == std::string::npos && f.find('\0') == std::string::npos;
}

// A slice that came from outside this process (index.json, another rank's list); "" when fine.
std::string slice_input_problem(const CheckpointSlice& s) {
  if (!plain_file_name(s.file))
    return fmt::format("bad shard file name '{}' (a plain file name in the step directory is expected)",
                       s.file);
  return slice_problem(s.global_shape, s.shard_dim, s.offset, s.shape);
}

// JSON integers and shapes read strictly: get<int64_t>() of a float or of an unsigned above INT64_MAX is
// out-of-range (undefined) conversion; this throws ndt::Error naming the key instead.
int64_t json_int(const nlohmann::json& j, const char* key) {
  if (!j.is_number_integer() || (j.is_number_unsigned() && j.get<uint64_t>() > uint64_t{INT64_MAX}))
    throw Error(fmt::format("\"{}\" must be an integer, got {}", key, j.dump()));
  return j.get<int64_t>();
}
int json_int32(const nlohmann::json& j, const char* key) {
  const int64_t v = json_int(j, key);
  if (v < INT32_MIN || v > INT32_MAX) throw Error(fmt::format("\"{}\" is out of range: {}", key, v));
  return static_cast<int>(v);
}
Shape json_shape(const nlohmann::json& j, const char* key) {
  if (!j.is_array()) throw Error(fmt::format("\"{}\" must be an array of integers, got {}", key, j.dump()));
  Shape out;
  for (const nlohmann::json& d : j) out.push_back(json_int(d, key));
  return out;
}

// Whether the slices cover the whole tensor; returns an empty string when they do.
std::string coverage_problem(const Shape& g, const std::vector<const CheckpointSlice*>& slices) {
  if (slices.empty()) return "no slices";
  for (const CheckpointSlice* s : slices)
    if (s->shape == g) return "";  // one slice holds the whole tensor
  const int sd = slices.front()->shard_dim;
  for (const CheckpointSlice* s : slices)
    if (s->shard_dim != sd) return "slices are split along different dims";
  if (sd < 0) return "no slice holds the whole tensor";
  std::vector<std::pair<int64_t, int64_t>> iv;
  for (const CheckpointSlice* s : slices) iv.emplace_back(s->offset, s->offset + s->shape[sd]);
  std::sort(iv.begin(), iv.end());
  int64_t covered = 0;
  for (auto [b, e] : iv) {
    if (b > covered) break;
    covered = std::max(covered, e);
  }
  if (covered < g[sd])
    return fmt::format("slices along dim {} cover only [0, {}) of {} (gap at {})", sd, covered, g[sd],
                       covered);
  return "";
}

struct IndexEntry {
  Shape shape;
  std::string dtype;
  std::vector<CheckpointSlice> slices;
};

struct Index {
  std::string path;
  CheckpointMeta meta;
  bool has_moments = false;
  std::map<std::string, IndexEntry> tensors;
};

Result<Index> read_index(const std::string& step_dir) {
  Index idx;
  idx.path = join(step_dir, "index.json");
  if (!fs::exists(idx.path))
    return Status::error(
        fmt::format("checkpoint index '{}' is missing (not a checkpoint step directory?)", idx.path));
  auto text = read_text(idx.path);
  if (!text) return text.status();
  nlohmann::json j = nlohmann::json::parse(text.value(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Status::error(fmt::format("checkpoint index '{}': invalid JSON", idx.path));
  std::string current = "<header>";
  try {
    if (!j.is_object() || j.value("format", std::string()) != kFormat)
      return Status::error(fmt::format("checkpoint index '{}': \"format\" is not \"{}\"", idx.path, kFormat));
    if (json_int(j.at("version"), "version") != kVersion)
      return Status::error(fmt::format("checkpoint index '{}': unsupported version {} (expected {})",
                                       idx.path, j.at("version").dump(), kVersion));
    idx.meta.step = json_int(j.at("step"), "step");
    idx.meta.optimizer_steps = json_int(j.at("optimizer_steps"), "optimizer_steps");
    idx.meta.config_yaml = j.value("config", std::string());
    idx.meta.layout = j.value("layout", std::string());
    idx.has_moments = j.value("optimizer_state", false);
    const nlohmann::json& ts = j.at("tensors");
    if (!ts.is_object())
      return Status::error(fmt::format("checkpoint index '{}': \"tensors\" is not an object", idx.path));
    for (auto it = ts.begin(); it != ts.end(); ++it) {
      current = it.key();
      IndexEntry e;
      e.shape = json_shape(it.value().at("shape"), "shape");
      e.dtype = it.value().at("dtype").get<std::string>();
      const nlohmann::json& slices = it.value().at("slices");
      if (!slices.is_array())
        return Status::error(
            fmt::format("checkpoint index '{}': tensor {}: \"slices\" is not an array", idx.path, current));
      for (const nlohmann::json& sj : slices) {
        CheckpointSlice s;
        s.name = current;
        s.global_shape = e.shape;
        s.dtype = e.dtype;
        s.file = sj.at("file").get<std::string>();
        s.shard_dim = json_int32(sj.at("shard_dim"), "shard_dim");
        s.offset = json_int(sj.at("offset"), "offset");
        s.shape = json_shape(sj.at("shape"), "shape");
        std::string p = slice_input_problem(s);
        if (!p.empty())
          return Status::error(fmt::format("checkpoint index '{}': tensor {}: {}", idx.path, current, p));
        e.slices.push_back(std::move(s));
      }
      idx.tensors.emplace(current, std::move(e));
    }
  } catch (const nlohmann::json::exception& ex) {
    return Status::error(
        fmt::format("checkpoint index '{}': malformed entry (at {}): {}", idx.path, current, ex.what()));
  } catch (const Error& ex) {
    return Status::error(
        fmt::format("checkpoint index '{}': malformed entry (at {}): {}", idx.path, current, ex.what()));
  }
  return idx;
}

// Copies the intersection of a source slice box and a destination slice box (both in global coordinates).
void copy_overlap(const Shape& g, const uint8_t* src, const Shape& src_shape, int src_sd, int64_t src_off,
                  uint8_t* dst, const Shape& dst_shape, int dst_sd, int64_t dst_off, size_t esize) {
  const size_t n = g.size();
  if (n == 0) {
    std::memcpy(dst, src, esize);
    return;
  }
  std::vector<int64_t> slo(n, 0), dlo(n, 0), lo(n), hi(n);
  if (src_sd >= 0) slo[src_sd] = src_off;
  if (dst_sd >= 0) dlo[dst_sd] = dst_off;
  for (size_t d = 0; d < n; ++d) {
    lo[d] = std::max(slo[d], dlo[d]);
    hi[d] = std::min(slo[d] + src_shape[d], dlo[d] + dst_shape[d]);
    if (lo[d] >= hi[d]) return;  // no overlap
  }
  std::vector<int64_t> sstride(n, 1), dstride(n, 1);
  for (size_t d = n - 1; d > 0; --d) {
    sstride[d - 1] = sstride[d] * src_shape[d];
    dstride[d - 1] = dstride[d] * dst_shape[d];
  }
  const size_t run = static_cast<size_t>(hi[n - 1] - lo[n - 1]) * esize;
  std::vector<int64_t> c = lo;  // current coordinate (last dim fixed at lo)
  while (true) {
    int64_t si = 0, di = 0;
    for (size_t d = 0; d < n; ++d) {
      si += (c[d] - slo[d]) * sstride[d];
      di += (c[d] - dlo[d]) * dstride[d];
    }
    std::memcpy(dst + di * esize, src + si * esize, run);
    // Advance over dims 0..n-2.
    int d = static_cast<int>(n) - 2;
    for (; d >= 0; --d) {
      if (++c[d] < hi[d]) break;
      c[d] = lo[d];
    }
    if (d < 0) break;
  }
}

}  // namespace

std::string checkpoint_step_name(int64_t step) { return fmt::format("step-{:08d}", step); }

std::string checkpoint_slices_to_json(const std::vector<CheckpointSlice>& slices) {
  nlohmann::json a = nlohmann::json::array();
  for (const CheckpointSlice& s : slices) a.push_back(slice_to_json(s));
  return a.dump();
}

Result<std::vector<CheckpointSlice>> checkpoint_slices_from_json(const std::string& text) {
  nlohmann::json a = nlohmann::json::parse(text, nullptr, false);
  if (a.is_discarded() || !a.is_array()) return Status::error("checkpoint slice list: invalid JSON");
  std::vector<CheckpointSlice> out;
  try {
    for (const nlohmann::json& j : a) {
      CheckpointSlice s;
      s.name = j.at("name").get<std::string>();
      s.global_shape = json_shape(j.at("global_shape"), "global_shape");
      s.dtype = j.at("dtype").get<std::string>();
      s.file = j.at("file").get<std::string>();
      s.shard_dim = json_int32(j.at("shard_dim"), "shard_dim");
      s.offset = json_int(j.at("offset"), "offset");
      s.shape = json_shape(j.at("shape"), "shape");
      std::string p = slice_input_problem(s);
      if (!p.empty()) return Status::error(fmt::format("checkpoint slice list: tensor {}: {}", s.name, p));
      out.push_back(std::move(s));
    }
  } catch (const nlohmann::json::exception& ex) {
    return Status::error(fmt::format("checkpoint slice list: {}", ex.what()));
  } catch (const Error& ex) {
    return Status::error(fmt::format("checkpoint slice list: {}", ex.what()));
  }
  return out;
}

Result<std::vector<CheckpointSlice>> write_checkpoint_shard(const std::string& step_dir,
                                                            const std::string& file, const ParamStore& params,
                                                            const Tensor& full_m, const Tensor& full_v,
                                                            bool write_dense) {
  const std::string path = join(step_dir, file);
  if (full_m.defined() != full_v.defined())
    return Status::error(
        fmt::format("checkpoint shard '{}': exp_avg and exp_avg_sq must both be given or neither", path));
  const bool moments = full_m.defined();
  if (moments) {
    for (const Tensor* t : {&full_m, &full_v})
      if (t->dtype() != DType::F32 || t->device() != Device::CPU)
        return Status::error(
            fmt::format("checkpoint shard '{}': optimizer moments must be F32 CPU tensors", path));
  }
  std::vector<std::pair<std::string, Tensor>> tensors;
  std::vector<CheckpointSlice> slices;
  try {
    for (const auto& pp : params.all()) {
      const Param& p = *pp;
      if (!p.expert && !write_dense) continue;
      if (!p.value.defined())
        return Status::error(fmt::format("checkpoint shard '{}': parameter {} has no value", path, p.name));
      CheckpointSlice s;
      s.name = p.name;
      s.global_shape = p.global_shape;
      s.dtype = safetensors_dtype_name(p.value.dtype());
      s.file = file;
      s.shard_dim = p.shard_dim;
      s.offset = p.shard_dim >= 0 ? p.shard_offset : 0;
      s.shape = p.value.shape();
      std::string prob = slice_problem(s.global_shape, s.shard_dim, s.offset, s.shape);
      if (!prob.empty())
        return Status::error(fmt::format("checkpoint shard '{}': parameter {}: {}", path, p.name, prob));
      tensors.emplace_back(p.name, p.value);
      if (moments) {
        const int64_t off = params.offset_of(p);
        for (const Tensor* t : {&full_m, &full_v})
          if (off + p.numel() > t->numel())
            return Status::error(
                fmt::format("checkpoint shard '{}': moments hold {} elements, parameter {} needs [{}, {}) of "
                            "the flat buffer",
                            path, t->numel(), p.name, off, off + p.numel()));
        tensors.emplace_back(p.name + ":exp_avg", full_m.view_at(off, p.value.shape()));
        tensors.emplace_back(p.name + ":exp_avg_sq", full_v.view_at(off, p.value.shape()));
      }
      slices.push_back(std::move(s));
    }
  } catch (const Error& e) {
    return Status::error(fmt::format("checkpoint shard '{}': {}", path, e.what()));
  }
  Status st = save_safetensors(path, tensors, {{"format", kFormat}});
  if (!st) return st;
  return slices;
}

Status write_checkpoint_index(const std::string& step_dir, const std::vector<CheckpointSlice>& slices,
                              const CheckpointMeta& meta, bool has_moments) {
  const std::string path = join(step_dir, "index.json");
  // Group by tensor, in first-seen order; drop exact duplicates (replicated copies).
  std::vector<std::string> order;
  std::map<std::string, std::vector<const CheckpointSlice*>> by_name;
  for (const CheckpointSlice& s : slices) {
    if (std::string p = slice_input_problem(s); !p.empty())
      return Status::error(fmt::format("checkpoint index '{}': tensor {}: {}", path, s.name, p));
    auto& v = by_name[s.name];
    if (v.empty()) order.push_back(s.name);
    bool dup = false;
    for (const CheckpointSlice* o : v) {
      if (o->global_shape != s.global_shape || o->dtype != s.dtype)
        return Status::error(fmt::format(
            "checkpoint index '{}': tensor {} saved as {} {} in '{}' but {} {} in '{}'", path, s.name,
            o->dtype, shape_str(o->global_shape), o->file, s.dtype, shape_str(s.global_shape), s.file));
      if (o->shape == s.shape && o->offset == s.offset &&
          (o->shard_dim == s.shard_dim || o->shape == o->global_shape))
        dup = true;
    }
    if (!dup) v.push_back(&s);
  }
  nlohmann::ordered_json tensors = nlohmann::ordered_json::object();
  for (const std::string& name : order) {
    const auto& v = by_name[name];
    std::string prob = coverage_problem(v.front()->global_shape, v);
    if (!prob.empty())
      return Status::error(
          fmt::format("checkpoint index '{}': tensor {} is not fully saved: {}", path, name, prob));
    nlohmann::ordered_json sl = nlohmann::ordered_json::array();
    for (const CheckpointSlice* s : v)
      sl.push_back(
          {{"file", s->file}, {"shard_dim", s->shard_dim}, {"offset", s->offset}, {"shape", s->shape}});
    tensors[name] = {
        {"shape", v.front()->global_shape}, {"dtype", v.front()->dtype}, {"slices", std::move(sl)}};
  }
  nlohmann::ordered_json j;
  j["format"] = kFormat;
  j["version"] = kVersion;
  j["step"] = meta.step;
  j["optimizer_steps"] = meta.optimizer_steps;
  j["config"] = meta.config_yaml;
  j["layout"] = meta.layout;
  j["optimizer_state"] = has_moments;
  j["tensors"] = std::move(tensors);
  return write_text_atomic(path, j.dump(1) + "\n");
}

Status publish_checkpoint(const std::string& dir_in, const std::string& tmp_dir, int64_t step,
                          int keep_last) {
  const std::string dir = strip_slash(dir_in);
  const std::string name = checkpoint_step_name(step);
  const std::string final_dir = join(dir, name);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return Status::error(fmt::format("cannot create checkpoint directory '{}': {}", dir, ec.message()));
  // Re-saving an existing step: move the old one aside first (a directory cannot be renamed onto a
  // non-empty one), then drop it once the new one is in place.
  std::string old_dir;
  if (fs::exists(final_dir)) {
    old_dir = final_dir + ".old";
    fs::remove_all(old_dir, ec);
    fs::rename(final_dir, old_dir, ec);
    if (ec)
      return Status::error(
          fmt::format("cannot move existing checkpoint '{}' aside: {}", final_dir, ec.message()));
  }
  fs::rename(tmp_dir, final_dir, ec);
  if (ec)
    return Status::error(fmt::format("cannot rename '{}' to '{}': {}", tmp_dir, final_dir, ec.message()));
  if (!old_dir.empty()) fs::remove_all(old_dir, ec);
  Status st = write_text_atomic(join(dir, "latest"), name + "\n");
  if (!st) return st;
  if (keep_last > 0) {
    std::vector<std::pair<int64_t, fs::path>> steps;
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      const std::string fn = e.path().filename().string();
      if (!e.is_directory() || fn.size() < 13 || fn.rfind("step-", 0) != 0) continue;
      const std::string digits = fn.substr(5);
      // (At most 18 digits: std::stoll throws on a name like step-99999999999999999999.)
      if (digits.size() > 18 ||
          !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
        continue;
      steps.emplace_back(std::stoll(digits), e.path());
    }
    std::sort(steps.begin(), steps.end());
    // Keep the newest keep_last by step number, and always the one just written.
    const int64_t n = static_cast<int64_t>(steps.size());
    for (int64_t i = 0; i < n - keep_last; ++i) {
      if (steps[i].first == step) continue;
      fs::remove_all(steps[i].second, ec);
      if (ec)
        return Status::error(
            fmt::format("cannot delete old checkpoint '{}': {}", steps[i].second.string(), ec.message()));
    }
  }
  return Status::ok();
}

Status save_checkpoint(const std::string& dir_in, const ParamStore& params, const Tensor& full_m,
                       const Tensor& full_v, const CheckpointMeta& meta, bool writer, int keep_last,
                       Communicator& world, bool write_dense, CheckpointFault fault) {
  const std::string dir = strip_slash(dir_in);
  const std::string tmp = fmt::format("{}.tmp-{}", dir, meta.step);
  const int rank = world.rank();
  Status st;
  if (rank == 0) {
    // A stale tmp dir from an interrupted save of the same step is discarded.
    std::error_code ec;
    fs::remove_all(tmp, ec);
    if (!ec) fs::create_directories(tmp, ec);
    if (ec)
      st = Status::error(
          fmt::format("cannot create checkpoint staging directory '{}': {}", tmp, ec.message()));
  }
  st = agree(st, world);
  if (!st) return st;

  std::vector<CheckpointSlice> mine;
  Status local;
  if (writer) {
    const std::string file = fmt::format("shard-{}.safetensors", rank);
    auto r = write_checkpoint_shard(tmp, file, params, full_m, full_v, write_dense);
    if (r)
      mine = std::move(r.value());
    else
      local = r.status();
    std::error_code ec;
    const fs::path path = fs::path(tmp) / file;
    if (local && fault == CheckpointFault::WriteError) {
      fs::remove(path, ec);
      local = Status::error(fmt::format(
          "writing {}: No space left on device (injected fault ckpt_write_error)", path.string()));
    }
    if (local && fault == CheckpointFault::ShortWrite) fs::resize_file(path, fs::file_size(path, ec) / 2, ec);
  }
  // Writers must agree on whether moments are saved.
  int32_t counts[2] = {writer ? 1 : 0, (writer && full_m.defined()) ? 1 : 0};
  world.all_reduce(counts, 2, DType::I32, ReduceOp::Sum);
  if (local && counts[1] != 0 && counts[1] != counts[0])
    local = Status::error(fmt::format(
        "checkpoint '{}': {} of {} writers gave optimizer moments (all or none)", tmp, counts[1], counts[0]));
  if (local && counts[0] == 0)
    local = Status::error(fmt::format("checkpoint '{}': no rank is a writer", tmp));
  st = agree(local, world);
  if (!st) {
    world.barrier();  // every writer is done with the staging directory before it goes
    if (rank == 0) {
      std::error_code ec;
      fs::remove_all(tmp, ec);
    }
    return st;
  }

  if (rank == 0) {
    const char* crash = std::getenv("NDT_CHECKPOINT_CRASH_AFTER_SHARDS");
    if (crash && std::string(crash) == "1") std::_Exit(3);
  }

  Status result;
  if (rank == 0) {
    std::vector<CheckpointSlice> all = std::move(mine);
    for (int r = 1; r < world.size(); ++r) {
      std::string text = world.recv_string(r, kSliceTag);
      auto got = checkpoint_slices_from_json(text);
      if (!got) {
        if (result) result = Status::error(fmt::format("from rank {}: {}", r, got.status().message()));
        continue;
      }
      all.insert(all.end(), got.value().begin(), got.value().end());
    }
    if (result) result = write_checkpoint_index(tmp, all, meta, counts[1] > 0);
    if (result) result = publish_checkpoint(dir, tmp, meta.step, keep_last);
  } else {
    world.send_string(checkpoint_slices_to_json(mine), 0, kSliceTag);
  }
  return agree(result, world);
}

Result<std::string> resolve_checkpoint(const std::string& dir_in) {
  const std::string dir = strip_slash(dir_in);
  if (fs::exists(join(dir, "index.json"))) return dir;
  const std::string latest = join(dir, "latest");
  if (fs::exists(latest)) {
    auto text = read_text(latest);
    if (!text) return text.status();
    std::string name = text.value();
    while (!name.empty() && (name.back() == '\n' || name.back() == '\r' || name.back() == ' '))
      name.pop_back();
    // A plain name inside dir: "..", "." or a path would point outside the checkpoint directory.
    if (!plain_file_name(name))
      return Status::error(fmt::format("checkpoint pointer '{}' does not name a step directory", latest));
    const std::string step_dir = join(dir, name);
    if (!fs::exists(join(step_dir, "index.json")))
      return Status::error(
          fmt::format("checkpoint pointer '{}' names '{}', which has no index.json", latest, step_dir));
    return step_dir;
  }
  if (!fs::exists(dir)) return Status::error(fmt::format("checkpoint '{}' does not exist", dir));
  return Status::error(
      fmt::format("'{}' is not a checkpoint: it has neither index.json nor a `latest` file", dir));
}

Result<CheckpointMeta> read_checkpoint_meta(const std::string& step_dir) {
  auto idx = read_index(strip_slash(step_dir));
  if (!idx) return idx.status();
  return idx.value().meta;
}

Status load_checkpoint(const std::string& step_dir_in, ParamStore& params, Tensor* full_m, Tensor* full_v) {
  const std::string step_dir = strip_slash(step_dir_in);
  auto idx_r = read_index(step_dir);
  if (!idx_r) return idx_r.status();
  const Index& idx = idx_r.value();
  if ((full_m != nullptr) != (full_v != nullptr))
    return Status::error("load_checkpoint: exp_avg and exp_avg_sq must both be requested or neither");
  const bool moments = full_m != nullptr;
  if (moments) {
    for (Tensor* t : {full_m, full_v})
      if (!t->defined() || t->dtype() != DType::F32 || t->device() != Device::CPU)
        return Status::error("load_checkpoint: moment buffers must be defined F32 CPU tensors");
  }
  std::map<std::string, SafetensorsFile> files;
  try {
    for (auto& pp : params.all()) {
      Param& p = *pp;
      auto it = idx.tensors.find(p.name);
      if (it == idx.tensors.end())
        return Status::error(fmt::format("checkpoint '{}': tensor {} is missing", idx.path, p.name));
      const IndexEntry& e = it->second;
      if (e.shape != p.global_shape)
        return Status::error(
            fmt::format("checkpoint '{}': tensor {} has global shape {} in the checkpoint but {} in "
                        "this model",
                        idx.path, p.name, shape_str(e.shape), shape_str(p.global_shape)));
      DType dt;
      if (!safetensors_dtype_from_name(e.dtype, &dt) || dt != p.value.dtype())
        return Status::error(fmt::format("checkpoint '{}': tensor {} has dtype {}, this model holds {}",
                                         idx.path, p.name, e.dtype, dtype_name(p.value.dtype())));
      std::vector<const CheckpointSlice*> refs;
      for (const CheckpointSlice& s : e.slices) refs.push_back(&s);
      std::string prob = coverage_problem(e.shape, refs);
      if (!prob.empty())
        return Status::error(
            fmt::format("checkpoint '{}': slices of tensor {} do not cover it: {}", idx.path, p.name, prob));
      if (moments && !idx.has_moments)
        return Status::error(
            fmt::format("checkpoint '{}' has no optimizer state (exp_avg/exp_avg_sq requested for tensor {})",
                        idx.path, p.name));

      Tensor dst_m, dst_v;
      if (moments) {
        const int64_t off = params.offset_of(p);
        for (Tensor* t : {full_m, full_v})
          if (off + p.numel() > t->numel())
            return Status::error(
                fmt::format("load_checkpoint: moment buffer holds {} elements, tensor {} needs [{}, {})",
                            t->numel(), p.name, off, off + p.numel()));
        dst_m = full_m->view_at(off, p.value.shape());
        dst_v = full_v->view_at(off, p.value.shape());
      }
      const Shape& lshape = p.value.shape();
      const int lsd = p.shard_dim;
      const int64_t loff = lsd >= 0 ? p.shard_offset : 0;
      // Local box along the shard dim (full elsewhere).
      for (const CheckpointSlice& s : e.slices) {
        // Skip slices that do not overlap this rank's slice.
        bool overlap = true;
        for (size_t d = 0; d < lshape.size(); ++d) {
          int64_t a0 = (static_cast<int>(d) == lsd) ? loff : 0, a1 = a0 + lshape[d];
          int64_t b0 = (static_cast<int>(d) == s.shard_dim) ? s.offset : 0, b1 = b0 + s.shape[d];
          if (std::max(a0, b0) >= std::min(a1, b1)) overlap = false;
        }
        if (!overlap) continue;
        const std::string fpath = join(step_dir, s.file);
        auto fit = files.find(s.file);
        if (fit == files.end()) {
          if (!fs::exists(fpath))
            return Status::error(fmt::format(
                "checkpoint '{}': shard file '{}' (holding tensor {}) is missing", idx.path, fpath, p.name));
          auto f = open_safetensors(fpath);
          if (!f)
            return Status::error(
                fmt::format("checkpoint shard '{}' (tensor {}): {}", fpath, p.name, f.status().message()));
          fit = files.emplace(s.file, std::move(f.value())).first;
        }
        const SafetensorsFile& f = fit->second;
        auto copy_one = [&](const std::string& key, Tensor& dst) -> Status {
          if (!f.contains(key))
            return Status::error(fmt::format("checkpoint shard '{}': tensor {} is missing", fpath, key));
          const SafetensorInfo& info = f.info(key);
          if (info.shape != s.shape || info.dtype != dst.dtype())
            return Status::error(
                fmt::format("checkpoint shard '{}': tensor {} is {} {}, the index says {} {}", fpath, key,
                            safetensors_dtype_name(info.dtype), shape_str(info.shape),
                            safetensors_dtype_name(dst.dtype()), shape_str(s.shape)));
          Tensor src = f.read(key);
          copy_overlap(e.shape, static_cast<const uint8_t*>(src.data_ptr()), s.shape, s.shard_dim, s.offset,
                       static_cast<uint8_t*>(dst.data_ptr()), lshape, lsd, loff, dtype_size(dst.dtype()));
          return Status::ok();
        };
        Status st = copy_one(p.name, p.value);
        if (st && moments) st = copy_one(p.name + ":exp_avg", dst_m);
        if (st && moments) st = copy_one(p.name + ":exp_avg_sq", dst_v);
        if (!st) return st;
      }
    }
  } catch (const Error& e) {
    return Status::error(fmt::format("checkpoint '{}': {}", step_dir, e.what()));
  }
  return Status::ok();
}

}  // namespace ndt
