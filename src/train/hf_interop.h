#pragma once
// Hugging Face Llama interop (docs/checkpoints.md): export a full (unsharded) model as a
// LlamaForCausalLM directory (config.json + model.safetensors) and import one back under our names.
// Our RoPE is rotate-half, the same convention as HF's modeling_llama, so q/k weights map 1:1 with no
// permutation.
#include <string>
#include <utility>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "train/config.h"

namespace ndt {

// Our name -> HF name for a llama model ("" if the name has no HF counterpart).
std::string hf_name_for(const std::string& ours);

// Writes out_dir/config.json and out_dir/model.safetensors (F32). full_params: every parameter of a
// style-llama model, full tensors under our global names. lm_head.weight is omitted when tied.
Status export_hf(const std::string& out_dir, const ModelConfig& cfg,
                 const std::vector<std::pair<std::string, Tensor>>& full_params);

// Reads dir/config.json + dir/model.safetensors (F32 or BF16, converted to F32): returns the ModelConfig
// and full tensors under OUR names, in our registration order. Errors name the file and the key/tensor.
Result<std::pair<ModelConfig, std::vector<std::pair<std::string, Tensor>>>> import_hf(const std::string& dir);

}  // namespace ndt
