#pragma once
// BPE tokenizers read from a Hugging Face tokenizer.json or from GPT-2's vocab.json + merges.txt pair
// (docs/data.md, "Tokenizers"), in one of two styles:
//   - byte-level (GPT-2, Llama 3, Qwen2): the pre-tokenizer's regex (PCRE2 with Unicode properties: GPT-2's
//     pattern for a ByteLevel pre-tokenizer with use_regex, the pattern of a Split pre-tokenizer otherwise;
//     "Isolated": matches and the text between them are pieces) cuts the text into pieces, whose bytes
//     become GPT-2's byte-to-unicode characters;
//   - SentencePiece style (Llama 2, Mistral, TinyLlama: model.byte_fallback, a Metaspace pre-tokenizer, or a
//     Prepend / Replace normalizer without a ByteLevel pre-tokenizer): the normalizer and the Metaspace
//     pre-tokenizer turn spaces into "▁" and prepend one, and the pieces' Unicode characters are the
//     symbols; a character missing from the vocabulary becomes its UTF-8 bytes as <0xXX> tokens
//     (byte_fallback), else unk_token (one per run with fuse_unk), else encode() throws.
// In both, added tokens (tokenizer.json "added_tokens") are cut out of the text first, leftmost then
// longest (those with "normalized" in the normalized text; lstrip / rstrip take the whitespace beside them),
// and each piece's symbols are merged by rank, lowest first, leftmost among equals, as the reference
// implementation does; with ignore_merges a piece that is itself in the vocabulary is one token.
// decode() skips special added tokens; byte-level maps characters back through the inverse byte table,
// SentencePiece style runs the file's decoder (Replace, ByteFallback, Fuse, Strip, Metaspace), keeping the
// bytes of byte tokens as they are.
// BOS / EOS / PAD: tokenizer_config.json's bos_token / eos_token / pad_token when that file sits beside
// tokenizer.json, else the first of <|begin_of_text|>, <s>, <|endoftext|> (BOS) and <|end_of_text|>,
// <|endoftext|>, </s> (EOS) that exists; PAD = EOS.
#include <memory>
#include <string>

#include "core/status.h"
#include "data/tokenizer.h"

namespace ndt {

// path: a tokenizer.json, a vocab.json (merges.txt beside it), or a directory holding either. Errors name
// the file and what is wrong or unsupported (model type, pre-tokenizer, normalizer or decoder type, bad
// regex, a merge whose symbols are not in the vocabulary, missing <0xXX> tokens under byte_fallback).
Result<std::unique_ptr<Tokenizer>> load_bpe_tokenizer(const std::string& path);

}  // namespace ndt
