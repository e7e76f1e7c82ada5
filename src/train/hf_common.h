#pragma once
// Pieces shared by the Hugging Face families (hf_interop.cpp: Llama / Mixtral / Qwen2 / Qwen3; hf_gpt2.cpp:
// GPT-2): reading a directory's weights (one model.safetensors or an index and its shards) and writing
// config.json plus the weights (bf16 and sharding options). Internal to train/.
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "train/hf_interop.h"
#include "train/safetensors.h"

namespace ndt::hf_detail {

// The tensors of a Hugging Face directory: one model.safetensors, or the shards its index names.
class HfWeights {
 public:
  static Result<HfWeights> open(const std::string& dir);
  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  const SafetensorsFile& file_of(const std::string& name) const { return files_.at(where_.at(name)); }
  const SafetensorInfo& info(const std::string& name) const { return file_of(name).info(name); }
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& [n, i] : where_) out.push_back(n);
    return out;
  }
  std::string describe() const;  // the file, or "n shards"

 private:
  void add(SafetensorsFile f);  // the index's weight_map, where there is one, decides duplicates
  std::vector<SafetensorsFile> files_;
  std::map<std::string, size_t> where_;
};

// Reads HF tensor `name` (F32, or BF16 widened exactly) into dst, an F32 CPU tensor (or view) of the same
// shape. Throws Error naming the file and the tensor.
void read_as_f32(const HfWeights& weights, const std::string& name, Tensor& dst);

// A size from config.json: an integer in [1, max], else throws ndt::Error naming the file and the key
// (a float, a string or an out-of-range value never reaches a conversion or a shape).
int64_t json_size(const nlohmann::json& v, const std::string& cpath, const char* key, int64_t max);

// Reads dir/config.json (an object); errors name the file.
Result<nlohmann::json> read_config_json(const std::string& dir);

// Writes out_dir (created)/config.json and the tensors (HF names, F32) as model.safetensors or shards with
// an index, cast to bf16 first when opts.bf16 (config's torch_dtype is set here). Errors name the file.
Status write_hf_dir(const std::string& out_dir, nlohmann::ordered_json config,
                    std::vector<std::pair<std::string, Tensor>> tensors, const HfExportOptions& opts);

}  // namespace ndt::hf_detail

namespace ndt {
// GPT-2 (hf_gpt2.cpp), reached through export_hf / import_hf.
Status export_hf_gpt2(const std::string& out_dir, const ModelConfig& cfg,
                      const std::vector<std::pair<std::string, Tensor>>& full_params,
                      const HfExportOptions& opts);
Result<std::pair<ModelConfig, std::vector<std::pair<std::string, Tensor>>>> import_hf_gpt2(
    const std::string& dir, const nlohmann::json& config);
}  // namespace ndt
