// ndtrain tokenize: text files -> pretraining token shards (format in docs/data.md).
#include <cstdio>

#include "apps/commands.h"
#include "data/shards.h"
#include "data/tokenizer.h"

namespace ndt::app {

Runner add_tokenize(CLI::App& app) {
  auto* cmd =
      app.add_subcommand("tokenize", "Turn text files (or .jsonl with a \"text\" field) into token shards");
  struct Opts {
    std::string tokenizer = "byte", out;
    std::vector<std::string> inputs;
    int64_t shard_tokens = 100'000'000;
  };
  auto o = std::make_shared<Opts>();
  cmd->add_option("--tokenizer", o->tokenizer,
                  "\"byte\", a SentencePiece .model file, or a BPE tokenizer.json / vocab.json / directory");
  cmd->add_option("-o,--out", o->out, "Output prefix: PREFIX_000000.bin, ...")->required();
  cmd->add_option("--shard-tokens", o->shard_tokens, "Tokens per shard")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  cmd->add_option("inputs", o->inputs, "Text files")->required();
  return [o](Communicator& world) {
    NDT_CHECK(world.size() == 1, "tokenize runs in one process (got {} ranks)", world.size());
    auto tok = make_tokenizer(o->tokenizer).value();
    int64_t total = 0;
    tokenize_text_files(o->inputs, *tok, o->out, o->shard_tokens, &total).throw_if_error();
    std::printf("tokenized %zu file(s) into %lld tokens with the %s tokenizer: %s_*.bin\n", o->inputs.size(),
                static_cast<long long>(total), tok->name().c_str(), o->out.c_str());
    return 0;
  };
}

}  // namespace ndt::app
