#pragma once
// Byte-level BPE tokenizers (GPT-2, Llama 3, Qwen2 style), read from a Hugging Face tokenizer.json or from
// GPT-2's vocab.json + merges.txt pair (docs/data.md, "Tokenizers"):
//   1. added tokens (tokenizer.json "added_tokens") are cut out of the text first, longest match first;
//   2. the rest is split into pieces by the pre-tokenizer's regex (PCRE2 with Unicode properties: GPT-2's
//      pattern for a ByteLevel pre-tokenizer with use_regex, the pattern of a Split pre-tokenizer
//      otherwise; "Isolated" behaviour: matches and the text between them are pieces);
//   3. each piece's bytes become GPT-2's byte-to-unicode characters and are merged pairwise by merge
//      rank (lowest first), as in the reference implementation; with ignore_merges (Llama 3) a piece that
//      is itself in the vocabulary is one token.
// decode() maps tokens back through the inverse byte table; special added tokens are skipped.
// BOS / EOS / PAD: tokenizer_config.json's bos_token / eos_token / pad_token when that file sits beside
// tokenizer.json, else the first of <|begin_of_text|>, <s>, <|endoftext|> (BOS) and <|end_of_text|>,
// <|endoftext|>, </s> (EOS) that exists; PAD = EOS.
#include <memory>
#include <string>

#include "core/status.h"
#include "data/tokenizer.h"

namespace ndt {

// path: a tokenizer.json, a vocab.json (merges.txt beside it), or a directory holding either. Errors name
// the file and what is wrong (unsupported model or pre-tokenizer type, bad regex, missing merge symbol).
Result<std::unique_ptr<Tokenizer>> load_bpe_tokenizer(const std::string& path);

}  // namespace ndt
