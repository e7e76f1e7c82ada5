#pragma once
// The run configuration: YAML file + `--set key=value` overrides, validated into typed structs.
// Every key has a type and a range; unknown keys, wrong types and out-of-range values are errors that
// name the key (and the file). Keys are dotted paths: `model.n_layers`, `train.lr`, ...
#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"

namespace ndt {

// Mixture-of-Experts feed-forward layers (model/moe.h, docs/architecture.md: router and losses).
struct MoeConfig {
  int64_t num_experts = 0;     // routed experts E; 0 = a dense model
  int64_t top_k = 2;           // experts per token
  int64_t d_ff_expert = 0;     // hidden width of one expert; 0 = model.d_ff (style default)
  int64_t shared_experts = 0;  // always-on experts (one dense MLP of width shared_experts * d_ff_expert)
  int64_t first_dense = 0;     // the first k layers keep a dense MLP
  int64_t every = 1;  // after those, every n-th layer is MoE (layer l: (l - first_dense) % every == 0)
  std::string router =
      "softmax";            // "softmax" (Mixtral/Qwen) or "sigmoid" (DeepSeek-V3: scores + selection bias)
  bool renormalize = true;  // gate weights of the k chosen experts divided by their sum
  double aux_loss_coef = 0.01;     // Switch/GShard load-balancing loss, per sequence (0 = off)
  double z_loss_coef = 0.0;        // router z-loss (0 = off)
  double bias_update_rate = 1e-3;  // sigmoid router: expert-bias step per optimizer step (0 = frozen)
  double capacity_factor = 0;      // 0 = dropless; > 0 drops tokens over capacity (layout-dependent)
  bool enabled() const { return num_experts > 0; }
};

struct ModelConfig {
  std::string style = "llama";  // "gpt2" (LayerNorm, learned positions, GELU, tied embeddings, biases)
                                // or "llama" (RMSNorm, RoPE, GQA, SwiGLU, untied, no biases)
  int64_t vocab_size = 320;     // model vocabulary (>= tokenizer vocab; padded for TP divisibility)
  int64_t d_model = 128;        // C
  int64_t n_layers = 2;         // L
  int64_t n_heads = 4;          // H
  int64_t n_kv_heads = 0;       // KV; 0 means = n_heads
  // D, the width of one attention head (config key model.head_dim; read it through head_dim()). 0 means
  // d_model / n_heads; otherwise q/k/v project C -> H*D (or KV*D) and the output projection H*D -> C,
  // with H*D free to differ from C (Qwen3, Gemma).
  int64_t head_dim_override = 0;
  int64_t d_ff = 0;           // MLP hidden; 0 means 4*C (gpt2) or the Llama rule 8C/3 rounded up to 32
  int64_t max_seq_len = 256;  // learned-position table size (gpt2) and the longest sequence accepted
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;
  int tie_embeddings = -1;  // -1: style default (gpt2 tied, llama untied); 0/1 force
  bool qkv_bias = false;    // style llama: biases on the q, k and v projections (Qwen2)
  bool qk_norm = false;     // style llama: per-head RMSNorm of q and k over D before RoPE (Qwen3)
  double init_std = 0.02;
  MoeConfig moe;
  // Set in code by the vision encoder (not config keys): a prefix of every layer's parameter names
  // ("encoder." -> "encoder.layers.0.attn.wq.weight") and bidirectional attention within each sequence.
  std::string param_prefix;
  bool causal = true;
  // Derived, filled by finalize(): head_dim, effective kv heads / d_ff / tying.
  int64_t head_dim() const { return head_dim_override > 0 ? head_dim_override : d_model / n_heads; }
  int64_t kv_heads() const { return n_kv_heads > 0 ? n_kv_heads : n_heads; }
  int64_t ffn_dim() const;
  bool tied() const { return tie_embeddings < 0 ? style == "gpt2" : tie_embeddings != 0; }
  bool is_gpt2() const { return style == "gpt2"; }
  // MoE: whether layer l has routed experts, and one expert's hidden width.
  bool is_moe_layer(int64_t l) const {
    return moe.enabled() && l >= moe.first_dense && (l - moe.first_dense) % moe.every == 0;
  }
  int64_t expert_ffn_dim() const { return moe.d_ff_expert > 0 ? moe.d_ff_expert : ffn_dim(); }
};

struct DataConfig {
  std::string task = "addition";    // "addition" | "lm" (embedded synthetic), "shards", "sft"
  std::string path;                 // shards: file or directory of .bin shards; sft: a .jsonl file
  std::string val_path;             // optional held-out data for validation loss (shards/sft)
  std::string tokenizer = "byte";   // "byte" or a path to a SentencePiece .model file
  int64_t seq_len = 64;             // tokens per sample (after which samples are cut / padded)
  int64_t addition_digits = 3;      // addition task: operands have 1..addition_digits digits
  double addition_label_noise = 0;  // addition task: share of training answers with every carry dropped
  int64_t seed = 1234;              // data order / generation seed (independent of the init seed)
  // lm task: when > 0, sample lengths (tokens) are drawn log-uniformly from [min_seq_len, seq_len].
  int64_t min_seq_len = 0;
  // Sequence packing (THD): samples laid end to end with cu_seqlens instead of each padded to seq_len,
  // grouped into microbatches under a token budget (docs/data.md: the packing policy).
  bool packing = false;
  // Finite datasets: false = read samples in file order (sample j of step s is (s * global_batch + j) mod
  // size), e.g. to feed another framework the same batches; true = the epoch-wise permutation.
  bool shuffle = true;
  int64_t pack_tokens = 0;  // token budget per microbatch; 0 = micro_batch * seq_len
  // How SFT JSONL and post-training JSONL prompts become tokens (data/chat_template.h):
  // "simple" (default), "chatml" or "llama3".
  std::string chat_template = "simple";
  int64_t caption_digits = 2;  // image_caption task: digits drawn in each image (the caption lists them)
  double image_noise = 0.2;    // image_caption task: std of the Gaussian pixel noise
};

struct TrainConfig {
  int64_t seed = 42;  // parameter init seed
  int64_t steps = 1000;
  int64_t global_batch = 32;  // samples per optimizer step, over all DP ranks and microbatches
  int64_t micro_batch = 0;    // samples per microbatch per DP rank; 0 = global_batch / dp
  double lr = 1e-3;
  double min_lr = 1e-4;  // cosine floor
  int64_t warmup_steps = 50;
  double beta1 = 0.9, beta2 = 0.95, adam_eps = 1e-8;
  double weight_decay = 0.1;  // applied to matrices only (not norms, biases)
  double grad_clip = 1.0;     // global norm; 0 disables
  int64_t log_every = 10;
  int64_t eval_every = 0;                // 0: only at the end
  int64_t eval_samples = 200;            // held-out problems for exact-match / validation loss
  std::string out_dir = "runs/default";  // metrics.jsonl, loss.svg, model.safetensors
  int64_t max_seconds = 0;               // stop early after this wall time (0 = no limit)
  int64_t checkpoint_every = 0;          // save a checkpoint every N steps and at the end (0 = never)
  int64_t keep_last = 3;                 // checkpoints kept (0 = all)
  std::string checkpoint_dir;            // default: <out_dir>/checkpoints
  std::string device = "cpu";            // "cpu" | "cuda" (the GPU of local rank % device count)
  // How ranks exchange device buffers (dist/device_communicator.h): "nccl", or "mpi" (staged through host
  // memory: slow; lets several ranks share one GPU, for checking layouts and measuring memory).
  std::string device_comm = "nccl";
  std::string precision = "auto";  // "auto" (bf16 on cuda, fp32 on cpu) | "fp32" | "bf16"
  // Attention kernels on cuda (docs/gpu.md): "auto" (cuDNN's fused attention where it applies and loads,
  // else the built-in kernels), "cudnn" (the same, but a run without cuDNN is an error), "native" (the
  // built-in kernels only).
  std::string attention = "auto";
  bool recompute = false;    // recompute each layer's forward during backward (less memory)
  bool cuda_graphs = true;   // replay repeated training steps' forward + backward from a CUDA graph
  bool tensorboard = false;  // also write metrics as TensorBoard events (<out_dir>/tensorboard)
  // A step whose loss or reduced gradients hold NaN/Inf (docs/reliability.md): "stop" ends the run with an
  // error on every rank; "skip" leaves weights and optimizer state as they are and goes on, up to
  // max_consecutive_skips skipped steps in a row (then an error).
  std::string nonfinite = "stop";
  int64_t max_consecutive_skips = 5;
  // When the host waits for the device to learn a step's loss and gradient norm (train/deferred_steps.h):
  // "step" after every step (the clip and skip decisions on the host), "log" at log steps, checkpoints,
  // evaluations and the end (the decisions on the device, the steps' metrics read back then, the same
  // numbers), "auto" = log on cuda, step on cpu. Steps with post-training losses, a second module, MoE
  // layers, `ndtrain verify`'s gradient checks or tracing always wait every step.
  std::string host_sync = "auto";
  // A blocking communication call (or a wait for the GPU) that has not returned after this many seconds ends
  // the job with a message naming the call, the rank and the step, NCCL communicators aborted
  // (dist/watchdog.h); 0 = no watchdog. Multi-rank runs and every GPU run.
  double collective_timeout_s = 300;
  // precision with "auto" resolved.
  std::string effective_precision() const {
    return precision != "auto" ? precision : (device == "cuda" ? "bf16" : "fp32");
  }
};

struct ParallelConfig {
  int64_t tp = 1, cp = 1, ep = 1, dp = 1, pp = 1;
  std::string order = "tp-cp-ep-dp-pp";  // innermost first
  bool sequence_parallel = false;
  // TP communication beside the matmuls (parallel/tp/comm_tp_hooks.h); false: each collective, then its
  // matmul.
  bool tp_comm_overlap = true;
  bool zero1 = false;
  // The token-embedding table's gradient under DP: "gather" every replica's input-gradient rows and ids per
  // microbatch and add them on each (parallel/dp/gathered_embedding_grad.h), "all_reduce" the table with the
  // other gradients, or "auto": gather on GPUs for untied tables when that moves at most half the bytes.
  std::string dp_embedding_grad = "auto";
  // GPUs over NCCL: the flat gradients in NCCL memory registered as a symmetric window on the gradient
  // group, so that NCCL reduces them with its symmetric kernels (fewer SMs taken from the backward beside
  // it); false: ordinary device memory.
  bool dp_grad_window = true;
  // Plain DP on GPUs: "nccl" all-reduces the gradients with NCCL; "copy_engine" with the GPUs' copy engines
  // between the mapped buffers of one host's ranks, summed in rank order (dist/copy_engine_reduction.h).
  std::string dp_reduction = "nccl";
  int64_t virtual_stages = 1;
  std::string schedule = "1f1b";
  std::string cp_attention = "ring";  // context parallel attention: "ring" (P2P) or "allgather"
  // Layers per virtual stage in stage order, comma-separated ("3,5" for pp=2); empty = even split.
  std::string stage_layers;
};

// Post-training (docs/posttraining.md): algo "sft" is plain training on `data`; "dpo" and "grpo" run
// the post-training loop of src/posttrain on the prompts/pairs of `task`.
struct PosttrainConfig {
  std::string algo = "sft";       // "sft" | "dpo" | "grpo"
  std::string task = "addition";  // "addition" | "sort" (embedded, verifiable) | "jsonl" (data_path)
  std::string data_path;          // jsonl: {prompt, answer} (grpo) or {prompt, chosen, rejected} (dpo)
  // Reward rule: "exact_match" | "partial_match" (any task); "contains" | "numeric" (jsonl only).
  std::string reward = "exact_match";
  std::string init;            // weights to start from (a run dir's model.safetensors); empty = init
  int64_t eval_samples = 200;  // held-out prompts for exact match (greedy)
  // GRPO
  int64_t prompts_per_step = 8;
  int64_t samples_per_prompt = 8;  // G
  int64_t max_new_tokens = 16;
  double temperature = 1.0;
  double top_p = 1.0;
  int64_t top_k = 0;
  int64_t gen_tp = 1;             // generation layout: TP degree (world / gen_tp replicas)
  std::string baseline = "mean";  // advantage baseline: group "mean" or leave-one-out "loo"
  bool std_normalize = true;      // divide advantages by the group's std + adv_eps
  double adv_eps = 1e-6;
  double clip_low = 0.2, clip_high = 0.2;  // ratio clipped to [1 - clip_low, 1 + clip_high]
  double kl_coef = 0.0;                    // beta of the k3 KL penalty to the frozen reference (0 = off)
  std::string loss_agg = "token";  // "token": mean over all loss tokens of the global batch; "sequence"
  int64_t epochs = 1;              // optimizer steps per rollout batch
  bool dynamic_sampling = false;   // drop prompt groups whose rewards are all equal
  double tis_cap = 0;              // truncated importance sampling cap for generator mismatch (0 = off)
  // DPO
  double dpo_beta = 0.1;
  std::string dpo_logprob = "sum";  // "sum" | "mean" of a response's token logprobs
  double dpo_sft_coef = 0;          // weight of an SFT (NLL) term on the chosen responses
  int64_t pairs_per_step = 8;
};

// The image encoder of a vision-language model (docs/multimodal.md): a ViT over patch_size x patch_size
// patches of (channels, image_size, image_size) images, bidirectional attention, then a two-layer
// projector into model.d_model whose outputs replace the text's image placeholder tokens (LLaVA style).
// It has its own layout over the same ranks (colocated): tensor x data parallel, no pipeline or context
// parallelism. image_size = 0: no encoder (a text-only model).
struct EncoderConfig {
  int64_t image_size = 0;
  int64_t patch_size = 4;
  int64_t channels = 1;
  std::string style = "gpt2";  // blocks like model.style: gpt2 (LayerNorm, GELU) or llama (RMSNorm, SwiGLU)
  int64_t d_model = 64;
  int64_t n_layers = 2;
  int64_t n_heads = 4;
  int64_t d_ff = 0;              // 0: the style's default from d_model
  int64_t projector_hidden = 0;  // projector MLP width; 0 = model.d_model
  int64_t image_token = -1;      // placeholder token id; -1 = the tokenizer's vocabulary size (first free id)
  int64_t tp = 1, dp = 0, cp = 1, pp = 1;  // encoder.parallel.*; dp 0 = world / tp; cp and pp must stay 1
  bool enabled() const { return image_size > 0; }
  int64_t grid() const { return image_size / patch_size; }
  int64_t patches() const { return grid() * grid(); }  // image tokens per image
  int64_t patch_dim() const { return channels * patch_size * patch_size; }
};

// Debugging aids, off by default.
struct DebugConfig {
  // Fault injection (train/fault.h, docs/reliability.md), e.g. "nan_grad@step=3,rank=1"; empty = none (the
  // environment variable NDT_FAULT is read instead).
  std::string fault;
};

struct Config {
  ModelConfig model;
  DataConfig data;
  TrainConfig train;
  ParallelConfig parallel;
  PosttrainConfig posttrain;
  EncoderConfig encoder;
  DebugConfig debug;
  std::string source;  // where it came from (file path or "<defaults>"), for messages
};

// Parse a YAML file, then apply overrides of the form "a.b=value" (value parsed as YAML scalar).
// A config may say `preset: NAME` to start from configs/NAME.yaml (resolved next to the file, then in
// the repo's configs/ directory); its own keys override the preset's.
Result<Config> load_config(const std::string& path, const std::vector<std::string>& overrides);
Result<Config> parse_config_string(const std::string& yaml_text, const std::vector<std::string>& overrides,
                                   const std::string& source_name = "<string>");
// Cross-field checks (d_model % n_heads unless model.head_dim is set, n_heads % kv_heads, seq_len <=
// max_seq_len, batch divides, vocab >= tokenizer vocab is checked later by whoever knows the tokenizer).
// Called by the parsers.
Status validate_config(const Config& c);
// Round-trips the effective config (for logs and checkpoints).
std::string config_to_yaml(const Config& c);

}  // namespace ndt
