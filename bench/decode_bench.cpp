// Decode benchmark (issue 14): the generation engine on one process, batched prompts, a fixed number of
// new tokens (no stop id), timed after a warm-up batch. Initial weights come from the seed (layout-free
// init) and can be exported as a Hugging Face Llama directory so that bench/hf_generate.py decodes from
// the same weights; the generated ids are written for comparison.
//
// Usage: ndtrain_decode_bench --config configs/llama-1b.yaml [--set key=value ...] [--batch 64]
//          [--prompt-len 32] [--new 256] [--temperature 0] [--top-k 0] [--top-p 1] [--repeats 3]
//          [--hf-out DIR] [--prompts-out FILE] [--tokens-out FILE] [--json FILE]
// Prints one JSON line: tokens/s (generated tokens over decode wall time), per-step ms, refit seconds.
#include <CLI/CLI.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>

#include "core/check.h"
#include "dist/communicator.h"
#include "generate/generator.h"
#include "model/transformer.h"
#include "train/config.h"
#include "train/hf_interop.h"

#ifdef NDT_HAVE_CUDA
#include "cuda/kernel_trace.h"
#include "cuda/runtime.h"
#endif

using namespace ndt;

namespace {
double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void sync_device([[maybe_unused]] const Config& cfg) {
#ifdef NDT_HAVE_CUDA
  if (cfg.train.device == "cuda") cuda::synchronize();
#endif
}
}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ndtrain decode benchmark"};
  std::string config_path, hf_out, prompts_out, tokens_out, json_out;
  std::vector<std::string> sets;
  int64_t batch = 64, prompt_len = 32, new_tokens = 256, top_k = 0, repeats = 3;
  double temperature = 0, top_p = 1;
  uint64_t seed = 1234;
  app.add_option("--config", config_path, "Model config (YAML)")->required();
  app.add_option("--set", sets, "key=value overrides");
  app.add_option("--batch", batch, "Prompts decoded together");
  app.add_option("--prompt-len", prompt_len, "Tokens per prompt (random ids, fixed seed)");
  app.add_option("--new", new_tokens, "New tokens per prompt (no stop id: always this many)");
  app.add_option("--temperature", temperature);
  app.add_option("--top-k", top_k);
  app.add_option("--top-p", top_p);
  app.add_option("--repeats", repeats, "Timed repeats (the best is reported; all are printed)");
  app.add_option("--seed", seed, "Init and prompt seed");
  app.add_option("--hf-out", hf_out, "Also export the weights as a Hugging Face Llama directory");
  app.add_option("--prompts-out", prompts_out, "Write the prompt ids (JSON) here");
  app.add_option("--tokens-out", tokens_out, "Write the generated ids of the last repeat (JSON) here");
  app.add_option("--json", json_out, "Append the result line to this file");
  std::string kernel_trace;
  app.add_option(
      "--kernel-trace", kernel_trace,
      "After the timed repeats, one more generate() traced (CUPTI): DIR/decode_kernels.{json,txt}");
  CLI11_PARSE(app, argc, argv);

  try {
    const Config cfg = load_config(config_path, sets).value();  // throws with the message
    auto world = make_self_communicator();

    // Initial weights on the CPU (fp32), as a 0-step training run would have them.
    double t0 = now_s();
    Transformer init_model(cfg.model, StageSpec{}, nullptr);
    init_model.params().init(cfg.train.seed);
    std::vector<std::pair<std::string, Tensor>> full;
    for (const auto& p : init_model.params().all()) full.emplace_back(p->name, p->value);
    const double init_s = now_s() - t0;
    if (!hf_out.empty()) {
      const Status s = export_hf(hf_out, cfg.model, full);
      NDT_CHECK(s.is_ok(), "{}", s.message());
    }

    Generator gen(cfg, *world, GenLayout{1});
    t0 = now_s();
    gen.load_full(full);
    sync_device(cfg);
    const double refit_s = now_s() - t0;

    // Refit from a training store as GRPO holds it on this device (fp32 master weights, whole: a DP-only
    // layout), device to device.
    double refit_dev_s = -1;
    {
      Transformer train_model(cfg.model, StageSpec{}, nullptr);
      ParamStore& ts = train_model.params();
      ts.init(cfg.train.seed);
      ts.flatten();
      if (cfg.train.device == "cuda")
        ts.to_device(Device::CUDA, cfg.train.effective_precision() == "bf16" ? DType::BF16 : DType::F32);
      sync_device(cfg);
      t0 = now_s();
      NDT_CHECK(gen.refit_from(ts), "refit_from refused a whole training store");
      sync_device(cfg);
      refit_dev_s = now_s() - t0;
    }

    std::mt19937 rng(static_cast<uint32_t>(seed));
    std::uniform_int_distribution<int32_t> tok(1, static_cast<int32_t>(cfg.model.vocab_size) - 1);
    std::vector<GenRequest> reqs;
    for (int64_t i = 0; i < batch; ++i) {
      GenRequest r;
      for (int64_t j = 0; j < prompt_len; ++j) r.prompt.push_back(tok(rng));
      r.prompt_key = static_cast<uint64_t>(i);
      reqs.push_back(std::move(r));
    }
    if (!prompts_out.empty()) {
      nlohmann::json j = nlohmann::json::array();
      for (const auto& r : reqs) j.push_back(r.prompt);
      std::ofstream(prompts_out) << j.dump() << "\n";
    }
    SamplingParams sp;
    sp.temperature = temperature;
    sp.top_k = top_k;
    sp.top_p = top_p;
    sp.max_new_tokens = new_tokens;
    sp.seed = seed;

    // Warm-up: a short batch (kernels, allocator pools), not timed.
    SamplingParams warm = sp;
    warm.max_new_tokens = std::min<int64_t>(new_tokens, 8);
    gen.generate(reqs, warm, 0);
    sync_device(cfg);

    std::vector<double> times;
    std::vector<GenOutput> outs;
    for (int64_t r = 0; r < repeats; ++r) {
      t0 = now_s();
      outs = gen.generate(reqs, sp, r);
      sync_device(cfg);
      times.push_back(now_s() - t0);
    }
#ifdef NDT_HAVE_CUDA
    if (!kernel_trace.empty()) {  // untimed: tracing costs a little
      std::string why;
      NDT_CHECK(cuda::KernelTrace::available(&why), "--kernel-trace: {}", why);
      std::filesystem::create_directories(kernel_trace);
      cuda::KernelTrace::start();
      gen.generate(reqs, sp, repeats);
      const std::vector<cuda::TraceRecord> recs = cuda::KernelTrace::stop();
      const std::string table = cuda::trace_summary(recs, new_tokens);  // "per step" = per decode step
      std::ofstream(kernel_trace + "/decode_kernels.json") << cuda::trace_chrome_json(recs, 0);
      std::ofstream(kernel_trace + "/decode_kernels.txt") << table;
      std::cerr << table.substr(0, 4000);
    }
#endif
    int64_t generated = 0;
    for (const auto& o : outs) generated += static_cast<int64_t>(o.tokens.size());
    const double best = *std::min_element(times.begin(), times.end());
    nlohmann::json res = {{"engine", "ndtrain"},
                          {"device", cfg.train.device},
                          {"precision", cfg.train.effective_precision()},
                          {"batch", batch},
                          {"prompt_len", prompt_len},
                          {"new_tokens", new_tokens},
                          {"temperature", temperature},
                          {"generated", generated},
                          {"seconds", times},
                          {"tokens_per_s", static_cast<double>(generated) / best},
                          {"ms_per_step", 1e3 * best / static_cast<double>(new_tokens)},
                          {"init_seconds", init_s},
                          {"refit_seconds", refit_s},
                          {"refit_device_seconds", refit_dev_s}};
    std::cout << res.dump() << std::endl;
    if (!json_out.empty()) std::ofstream(json_out, std::ios::app) << res.dump() << "\n";
    if (!tokens_out.empty()) {
      nlohmann::json j = nlohmann::json::array();
      for (const auto& o : outs) j.push_back(o.tokens);
      std::ofstream(tokens_out) << j.dump() << "\n";
    }
  } catch (const std::exception& e) {
    std::cerr << "decode_bench: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
