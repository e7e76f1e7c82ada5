// ndtrain generate: completes prompts with the weights a training run saved, through the generation
// engine (KV cache, sampling, generation TP and replicas: docs/generation.md). Greedy by default.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "apps/commands.h"
#include "apps/setup.h"
#include "data/chat_template.h"
#include "data/tokenizer.h"
#include "generate/generator.h"
#include "train/config.h"

namespace ndt::app {

namespace {
// Prompts of a JSONL file, one {"prompt": "..."} per non-blank line.
// A prompt: text, or a conversation so far (formatted with the run's chat template).
struct PromptIn {
  std::string text;  // the prompt as written back in the output (a conversation: its JSON)
  std::vector<ChatMessage> messages;
  bool chat = false;
};

Result<std::vector<PromptIn>> read_prompts(const std::string& path) {
  std::ifstream f(path);
  if (!f) return Status::error(fmt::format("cannot open prompt file '{}'", path));
  std::vector<PromptIn> out;
  std::string line;
  for (int64_t lineno = 1; std::getline(f, line); ++lineno) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) return Status::error(fmt::format("{}:{}: invalid JSON", path, lineno));
    if (j.is_object() && j.contains("messages") && !j.contains("prompt")) {
      PromptIn p;
      p.chat = true;
      p.text = j["messages"].dump();
      const std::string err = parse_chat_messages(j["messages"], p.messages);
      if (!err.empty()) return Status::error(fmt::format("{}:{}: {}", path, lineno, err));
      if (p.messages.empty() || p.messages.back().role == "assistant")
        return Status::error(fmt::format(
            "{}:{}: \"messages\" must be non-empty and not end with an assistant message", path, lineno));
      out.push_back(std::move(p));
      continue;
    }
    if (!j.is_object() || !j.contains("prompt") || !j["prompt"].is_string())
      return Status::error(fmt::format(
          "{}:{}: expected an object with a string \"prompt\" or a \"messages\" list", path, lineno));
    out.push_back({j["prompt"].get<std::string>(), {}, false});
  }
  return out;
}
}  // namespace

Runner add_generate(CLI::App& app) {
  auto* cmd = app.add_subcommand("generate", "Complete prompts with a trained model (greedy by default)");
  struct Opts {
    std::string run_dir, input, output, device = "cpu";
    std::vector<std::string> prompts;
    int64_t max_new_tokens = 32, top_k = 0, samples = 1, gen_tp = 1;
    double temperature = 0, top_p = 1;
    uint64_t seed = 0;
    bool chat = false;
  };
  auto o = std::make_shared<Opts>();
  cmd->add_option("--run", o->run_dir, "Directory of a training run (config.yaml + model.safetensors)")
      ->required();
  cmd->add_option("-p,--prompt", o->prompts, "Prompt text (repeatable)");
  cmd->add_option("--input", o->input, "Prompts as JSONL, one {\"prompt\": \"...\"} per line");
  cmd->add_option("--output", o->output,
                  "Write completions as JSONL ({prompt, sample, completion, tokens, logprobs, stopped}) "
                  "instead of printing them");
  cmd->add_option("-n,--max-new-tokens", o->max_new_tokens, "Tokens to generate at most")
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--temperature", o->temperature, "Sampling temperature (0 = greedy)")
      ->check(CLI::Range(0.0, 100.0));
  cmd->add_option("--top-k", o->top_k, "Sample among the k most likely tokens (0 = all)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  cmd->add_option("--top-p", o->top_p, "Nucleus sampling mass")->check(CLI::Range(1e-9, 1.0));
  cmd->add_option("--seed", o->seed, "Sampling seed");
  cmd->add_option("--samples", o->samples, "Completions per prompt")->check(CLI::Range(1, 1 << 16));
  cmd->add_option("--gen-tp", o->gen_tp, "Generation tensor parallelism (divides the ranks)")
      ->check(CLI::Range(1, 1 << 16));
  cmd->add_option("--device", o->device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_flag("--chat", o->chat,
                "Format each text prompt as a user turn of the run's data.chat_template (JSONL \"messages\" "
                "lines always are) and strip the end-of-turn marker from completions");
  return [o](Communicator& world) {
    std::vector<PromptIn> texts;
    for (const auto& p : o->prompts) texts.push_back({p, {}, false});
    if (!o->input.empty()) {
      auto file = read_prompts(o->input);
      agree_or_throw(file.status(), world);
      texts.insert(texts.end(), file.value().begin(), file.value().end());
    }
    agree_or_throw(
        texts.empty() ? Status::error("generate: no prompts (give --prompt or --input)") : Status::ok(),
        world);
    const std::filesystem::path dir(o->run_dir);
    auto loaded = load_config((dir / "config.yaml").string(), {});
    agree_or_throw(loaded.status(), world);
    Config cfg = loaded.value();
    cfg.train.device = o->device;
    auto tok = make_tokenizer(cfg.data.tokenizer);
    agree_or_throw(tok.status(), world);
    auto tmpl = ChatTemplate::named(cfg.data.chat_template);
    agree_or_throw(tmpl.status(), world);

    Generator gen(cfg, world, GenLayout{o->gen_tp});
    gen.load_full(read_weights(dir.string(), world));
    const Tokenizer& tk = *tok.value();
    std::vector<GenRequest> reqs;
    for (size_t i = 0; i < texts.size(); ++i) {
      std::vector<int32_t> ids;
      if (texts[i].chat) {
        ids = tmpl.value().chat_prompt(tk, texts[i].messages);
      } else if (o->chat) {
        ids = tmpl.value().text_prompt(tk, texts[i].text);
      } else {
        ids = {tk.bos_id()};
        const auto body = tk.encode(texts[i].text);
        ids.insert(ids.end(), body.begin(), body.end());
      }
      for (int64_t s = 0; s < o->samples; ++s)
        reqs.push_back({ids, static_cast<uint64_t>(i), static_cast<uint64_t>(s)});
    }
    SamplingParams sp;
    sp.temperature = o->temperature;
    sp.top_k = o->top_k;
    sp.top_p = o->top_p;
    sp.max_new_tokens = o->max_new_tokens;
    sp.stop_ids = {tk.eos_id()};
    sp.seed = o->seed;
    const std::vector<GenOutput> outs = gen.generate(reqs, sp, 0);
    if (world.rank() != 0) return 0;

    std::ofstream f;
    if (!o->output.empty()) {
      f.open(o->output);
      if (!f) NDT_FAIL("cannot write {}", o->output);
    }
    for (size_t r = 0; r < outs.size(); ++r) {
      const GenOutput& g = outs[r];
      const PromptIn& in = texts[r / static_cast<size_t>(o->samples)];
      const std::string& prompt = in.text;
      std::vector<int32_t> body = g.tokens;
      if (g.stopped) body.pop_back();  // the stop token (EOS) is not text
      const std::string completion =
          in.chat || o->chat ? tmpl.value().completion_text(tk.decode(body)) : tk.decode(body);
      if (!f.is_open()) {
        std::printf("%s%s\n", prompt.c_str(), completion.c_str());
        continue;
      }
      nlohmann::json j;
      if (in.chat)
        j["messages"] = nlohmann::json::parse(prompt);
      else
        j["prompt"] = prompt;
      j["sample"] = r % static_cast<size_t>(o->samples);
      j["completion"] = completion;
      j["tokens"] = g.tokens;
      j["logprobs"] = g.logprobs;
      j["stopped"] = g.stopped;
      // Byte-level tokens can decode to invalid UTF-8: replace it rather than fail.
      f << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    }
    if (f.is_open())
      std::printf("generated %zu completions (gen_tp=%lld, %lld replicas) -> %s\n", outs.size(),
                  static_cast<long long>(o->gen_tp), static_cast<long long>(world.size() / o->gen_tp),
                  o->output.c_str());
    return 0;
  };
}

}  // namespace ndt::app
