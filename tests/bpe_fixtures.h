#pragma once
// Pieces of Hugging Face tokenizer.json files the BPE tests and the BPE fuzz target build their tokenizers
// from.
#include <nlohmann/json.hpp>

namespace ndt::testing {

// Llama 3's pre_tokenizer: its split regex (Unicode classes, a case-insensitive contraction group, a
// negative lookahead), then byte-level mapping without a regex of its own.
inline nlohmann::json llama3_pre_tokenizer() {
  return {
      {"type", "Sequence"},
      {"pretokenizers",
       {{{"type", "Split"},
         {"pattern",
          {{"Regex",
            R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"}}},
         {"behavior", "Isolated"},
         {"invert", false}},
        {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
}

}  // namespace ndt::testing
