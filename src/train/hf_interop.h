#pragma once
// Hugging Face Llama / Mixtral / Qwen2 / Qwen3 / GPT-2 interop (docs/checkpoints.md): export a full
// (unsharded) model as a LlamaForCausalLM directory, an MoE model as a MixtralForCausalLM one, one with
// model.qkv_bias as Qwen2ForCausalLM, one with model.qk_norm as Qwen3ForCausalLM, a style gpt2 model as a
// GPT2LMHeadModel one (config.json + weights, train/hf_gpt2.cpp), and import any of them back under our
// names. Our RoPE is rotate-half, the same
// convention as HF's modeling_llama, so q/k weights map 1:1 with no permutation. Our stacked expert
// tensors (E, ...) are one HF tensor per expert.
#include <string>
#include <utility>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "train/config.h"

namespace ndt {

// Our name -> HF name for a llama model ("" if the name has no HF counterpart). A stacked expert tensor
// (layers.{l}.mlp.experts.w1.weight) maps to one HF tensor per expert: the name returned holds the
// placeholder "{e}" for the expert index (model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight).
std::string hf_name_for(const std::string& ours);

// Export options: shard_bytes > 0 splits the weights into model-0000i-of-0000n.safetensors files of at
// most that many bytes each (a larger tensor gets a file of its own) with model.safetensors.index.json,
// as transformers' save_pretrained(max_shard_size=...) does (one file when everything fits); bf16 stores
// the weights rounded to bfloat16 (nearest even; config.json's torch_dtype says so).
struct HfExportOptions {
  int64_t shard_bytes = 0;
  bool bf16 = false;
};

// Writes out_dir/config.json and out_dir/model.safetensors (F32; see HfExportOptions). full_params: every
// parameter of a style-llama model, full tensors under our global names. lm_head.weight is omitted when tied.
// An MoE model (cfg.moe.enabled()) is written as MixtralForCausalLM and must be one: softmax router,
// renormalize true, no shared experts, every layer MoE (first_dense 0, every 1), capacity_factor 0;
// otherwise the error names the config key.
Status export_hf(const std::string& out_dir, const ModelConfig& cfg,
                 const std::vector<std::pair<std::string, Tensor>>& full_params,
                 const HfExportOptions& opts = {});

// Reads dir/config.json + dir/model.safetensors, or the shards named by dir/model.safetensors.index.json
// (plain file names inside dir: a path elsewhere is refused), F32 or BF16 (converted to F32), of a llama,
// mixtral, qwen2, qwen3 or gpt2 model_type: returns the ModelConfig (cfg.moe filled for Mixtral) and full
// tensors under OUR names, in our registration order (per-expert tensors stacked). Errors name the file and
// the key/tensor.
Result<std::pair<ModelConfig, std::vector<std::pair<std::string, Tensor>>>> import_hf(const std::string& dir);

}  // namespace ndt
