#include "train/hf_common.h"

#include <fmt/format.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/check.h"
#include "ops/ops.h"

namespace fs = std::filesystem;

namespace ndt::hf_detail {

Result<HfWeights> HfWeights::open(const std::string& dir) {
  HfWeights w;
  const fs::path single = fs::path(dir) / "model.safetensors",
                 index = fs::path(dir) / "model.safetensors.index.json";
  if (fs::exists(single)) {
    auto f = open_safetensors(single.string());
    if (!f) return f.status();
    w.add(std::move(f.value()));
    return w;
  }
  if (!fs::exists(index))
    return Status::error(fmt::format("'{}' is missing (and no '{}')", single.string(), index.string()));
  std::ifstream in(index);
  nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
    return Status::error(fmt::format("'{}': invalid JSON or no \"weight_map\" object", index.string()));
  std::map<std::string, size_t> file_of;  // shard file -> index in files_
  for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
    if (!it.value().is_string())
      return Status::error(
          fmt::format("'{}': weight_map[\"{}\"] is not a file name", index.string(), it.key()));
    const std::string file = it.value().get<std::string>();
    // Shards are plain names in the directory: no separators, no "..", nothing absolute.
    if (file.empty() || file.find('/') != std::string::npos || file.find('\\') != std::string::npos ||
        file == "." || file == "..")
      return Status::error(fmt::format("'{}': shard \"{}\" of tensor {} is not a plain file name in '{}'",
                                       index.string(), file, it.key(), dir));
    if (!file_of.count(file)) {
      auto f = open_safetensors((fs::path(dir) / file).string());
      if (!f)
        return Status::error(
            fmt::format("'{}' names shard {}: {}", index.string(), file, f.status().message()));
      file_of[file] = w.files_.size();
      w.add(std::move(f.value()));
    }
    const SafetensorsFile& shard = w.files_[file_of[file]];
    if (!shard.contains(it.key()))
      return Status::error(
          fmt::format("'{}': tensor {} is not in its shard '{}'", index.string(), it.key(), shard.path()));
    w.where_[it.key()] = file_of[file];
  }
  return w;
}

void HfWeights::add(SafetensorsFile f) {
  const size_t i = files_.size();
  files_.push_back(std::move(f));
  for (const std::string& n : files_.back().names())
    if (!where_.count(n)) where_[n] = i;
}

std::string HfWeights::describe() const {
  return files_.size() == 1 ? files_[0].path() : fmt::format("{} shards", files_.size());
}

// Reads HF tensor `name` (F32, or BF16 widened exactly) into dst, an F32 CPU tensor (or view) of the same
// shape. Throws Error naming the file and the tensor.
void read_as_f32(const HfWeights& weights, const std::string& name, Tensor& dst) {
  const SafetensorsFile& file = weights.file_of(name);
  const SafetensorInfo& info = file.info(name);
  if (info.dtype == DType::F32) {
    file.read_into(name, dst).throw_if_error();
  } else if (info.dtype == DType::BF16) {
    Tensor raw = file.read(name);
    const uint16_t* src = raw.data<uint16_t>();
    float* out = dst.f32();
    for (int64_t i = 0; i < dst.numel(); ++i) {
      uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
      std::memcpy(&out[i], &bits, 4);
    }
  } else {
    throw Error(fmt::format("'{}': tensor {} has dtype {} (only F32 and BF16 are supported)", file.path(),
                            name, safetensors_dtype_name(info.dtype)));
  }
}

int64_t json_size(const nlohmann::json& v, const std::string& cpath, const char* key, int64_t max) {
  const bool integer =
      v.is_number_integer() && !(v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(max));
  if (!integer || v.get<int64_t>() < 1 || v.get<int64_t>() > max)
    throw Error(fmt::format("import_hf: '{}': \"{}\" must be an integer in [1, {}], got {}", cpath, key, max,
                            v.dump()));
  return v.get<int64_t>();
}

Result<nlohmann::json> read_config_json(const std::string& dir) {
  const std::string cpath = (fs::path(dir) / "config.json").string();
  std::ifstream cf(cpath);
  if (!cf) return Status::error(fmt::format("import_hf: cannot open '{}'", cpath));
  std::stringstream ss;
  ss << cf.rdbuf();
  nlohmann::json c = nlohmann::json::parse(ss.str(), nullptr, false);
  if (c.is_discarded() || !c.is_object())
    return Status::error(fmt::format("import_hf: '{}': invalid JSON", cpath));
  return c;
}

namespace {
Status write_json_file(const std::string& path, const nlohmann::ordered_json& j) {
  {
    std::ofstream f(path + ".tmp", std::ios::trunc);
    f << j.dump(2) << "\n";
    f.flush();
    if (!f) return Status::error(fmt::format("export_hf: cannot write '{}'", path));
  }
  std::error_code ec;
  fs::rename(path + ".tmp", path, ec);
  if (ec) return Status::error(fmt::format("export_hf: cannot write '{}': {}", path, ec.message()));
  return Status::ok();
}
}  // namespace

Status write_hf_dir(const std::string& out_dir, nlohmann::ordered_json c,
                    std::vector<std::pair<std::string, Tensor>> out, const HfExportOptions& opts) {
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) return Status::error(fmt::format("export_hf: cannot create '{}': {}", out_dir, ec.message()));
  c["torch_dtype"] = opts.bf16 ? "bfloat16" : "float32";
  Status cs = write_json_file((fs::path(out_dir) / "config.json").string(), c);
  if (!cs.is_ok()) return cs;
  if (opts.bf16)
    for (auto& [name, t] : out) {
      Tensor b = Tensor::empty(t.shape(), DType::BF16);
      ops::cast_into(b, t);  // round to nearest even
      t = b;
    }
  // Shards: consecutive tensors while they fit in shard_bytes (one file when everything does).
  std::vector<std::vector<std::pair<std::string, Tensor>>> shards(1);
  int64_t bytes = 0, total = 0;
  for (auto& nt : out) {
    const int64_t b = nt.second.numel() * static_cast<int64_t>(dtype_size(nt.second.dtype()));
    if (opts.shard_bytes > 0 && !shards.back().empty() && bytes + b > opts.shard_bytes) {
      shards.emplace_back();
      bytes = 0;
    }
    shards.back().push_back(std::move(nt));
    bytes += b;
    total += b;
  }
  // transformers requires metadata format=pt to load safetensors weights.
  if (shards.size() == 1)
    return save_safetensors((fs::path(out_dir) / "model.safetensors").string(), shards[0],
                            {{"format", "pt"}});
  nlohmann::ordered_json index;
  index["metadata"] = {{"total_size", total}};
  index["weight_map"] = nlohmann::ordered_json::object();
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string name = fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, shards.size());
    Status st = save_safetensors((fs::path(out_dir) / name).string(), shards[i], {{"format", "pt"}});
    if (!st.is_ok()) return st;
    for (const auto& nt : shards[i]) index["weight_map"][nt.first] = name;
  }
  return write_json_file((fs::path(out_dir) / "model.safetensors.index.json").string(), index);
}

}  // namespace ndt::hf_detail
