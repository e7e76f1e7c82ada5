#!/usr/bin/env python3
"""Writes the generated part of the seed corpus (tests/fuzz/corpus): safetensors files, token shards,
tokenizer files, JSONL lines and texts. The config seeds are copies of configs/*.yaml; the checkpoint and
hf_config seeds come from their targets (NDT_FUZZ_DUMP_SEED=DIR build-asan/tests/fuzz/fuzz_checkpoint
-runs=0). Run from anywhere: python3 tests/fuzz/make_corpus.py"""
import json
import os
import shutil
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus")
REPO = os.path.dirname(os.path.dirname(HERE))


def put(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


# ---- safetensors: header length, JSON header padded to 8 bytes, data buffer
def safetensors(tensors, metadata=None):
    header, buf = {}, b""
    if metadata:
        header["__metadata__"] = metadata
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(buf), len(buf) + len(raw)]}
        buf += raw
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    return struct.pack("<Q", len(h)) + h + buf


put("safetensors", "f32_bf16", safetensors(
    {"w": ("F32", [2, 3], struct.pack("<6f", 1, -2, 3.5, 0, 1e-3, 7)),
     "b": ("BF16", [3], struct.pack("<3H", 0x3F80, 0xC000, 0x0000))}, {"format": "pt"}))
put("safetensors", "ints", safetensors(
    {"i": ("I32", [4], struct.pack("<4i", 1, -1, 7, 2**31 - 1)),
     "l": ("I64", [1, 2], struct.pack("<2q", -5, 2**40)),
     "d": ("F64", [], struct.pack("<d", 3.25))}))
put("safetensors", "empty_tensor", safetensors({"z": ("F32", [0, 4], b""), "s": ("F32", [1], b"\0\0\x80\x3f")}))
put("safetensors", "no_tensors", safetensors({}, {"note": "empty"}))

# ---- token shards (data/shards.h): magic, version, token_bytes, num_tokens, vocab_size, 32 zero bytes
def shard(tokens, vocab, tb):
    h = b"NDTSHARD" + struct.pack("<IIQQ", 1, tb, len(tokens), vocab) + b"\0" * 32
    return h + b"".join(struct.pack("<H" if tb == 2 else "<I", t) for t in tokens)


put("shard", "u16", shard([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0, 258], 259, 2))
put("shard", "u32", shard([70000, 1, 99999, 5, 6, 7, 8], 100000, 4))
put("shard", "empty", shard([], 50257, 2))

# ---- JSONL: SFT, DPO, GRPO lines and {"text"} documents
jsonl = {
    "sft_prompt_response": [{"prompt": "12+34=", "response": "64"}, {"prompt": "hi", "response": "hello there"}],
    "dpo_pairs": [{"prompt": "2+2=", "chosen": "4", "rejected": "5"},
                  {"messages": [{"role": "user", "content": "Color of the sky?"}], "chosen": "blue",
                   "rejected": "green"}],
    "grpo_prompts": [{"prompt": "3+4=", "answer": "7"}, {"prompt": "pi?", "answer": 3.14159},
                     {"messages": [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "10*10="}], "answer": "100"}],
    "text_docs": [{"text": "The quick brown fox."}, {"text": "caf\u00e9 \u65e5\u672c"}],
}
for name, lines in jsonl.items():
    put("jsonl", name, "\n".join(json.dumps(x) for x in lines) + "\n")
shutil.copy(os.path.join(REPO, "data", "examples", "chat.jsonl"), os.path.join(CORPUS, "jsonl", "sft_chat"))


# ---- tokenizers: GPT-2's bytes_to_unicode, a few merges, one special token
def byte_symbols():
    out, n = [], 0
    for b in range(256):
        if 33 <= b <= 126 or 0xA1 <= b <= 0xAC or b >= 0xAE:
            out.append(chr(b))
        else:
            out.append(chr(256 + n))
            n += 1
    return out


sym = byte_symbols()
vocab = {s: i for i, s in enumerate(sym)}
merges = [("\u0120", "t"), ("h", "e"), ("\u0120t", "he"), ("i", "n"), ("e", "r"), ("\u0120", "a")]
for a, b in merges:
    vocab.setdefault(a + b, len(vocab))
eot = len(vocab)
tok = {"model": {"type": "BPE", "vocab": vocab, "merges": [a + " " + b for a, b in merges]},
       "added_tokens": [{"id": eot, "content": "<|endoftext|>", "special": True}],
       "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}}
put("tokenizer", "gpt2_tokenizer_json", json.dumps(tok, ensure_ascii=False))
tok3 = dict(tok)
tok3["model"] = dict(tok["model"], ignore_merges=True, merges=[[a, b] for a, b in merges])
tok3["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": r"(?i:'s|'t)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+|\s+"},
     "behavior": "Isolated", "invert": False},
    {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]}
put("tokenizer", "llama3_tokenizer_json",
    json.dumps(tok3, ensure_ascii=False) + "\n#tokenizer_config.json\n" +
    json.dumps({"bos_token": "<|endoftext|>", "eos_token": {"content": "<|endoftext|>"}}) + "\n")
v = dict(vocab)
v["<|endoftext|>"] = eot
put("tokenizer", "vocab_merges",
    json.dumps(v, ensure_ascii=False) + "\n#merges.txt\n#version: 0.2\n" +
    "".join(a + " " + b + "\n" for a, b in merges))

# SentencePiece-style BPE with byte fallback (the Llama 2 layout): <unk> <s> </s>, <0x00>..<0xFF>, ▁-words;
# the older normalizer form with a tokenizer_config.json, and the newer Metaspace form.
sp_vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
for b in range(256):
    sp_vocab["<0x%02X>" % b] = 3 + b
for c in ["\u2581", "h", "e", "l", "o", "w", "r", "d", "t", "\u00e9"]:
    sp_vocab.setdefault(c, len(sp_vocab))
sp_merges = [("\u2581", "h"), ("e", "l"), ("l", "o"), ("\u2581h", "el"), ("\u2581", "w"), ("\u2581hel", "lo"),
             ("o", "r"), ("\u2581w", "or"), ("\u2581", "\u2581"), ("\u2581", "t")]
for a, b in sp_merges:
    sp_vocab.setdefault(a + b, len(sp_vocab))
sp = {"added_tokens": [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                        "normalized": False, "special": True} for i, c in enumerate(["<unk>", "<s>", "</s>"])],
      "normalizer": {"type": "Sequence", "normalizers": [
          {"type": "Prepend", "prepend": "\u2581"},
          {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
      "pre_tokenizer": None,
      "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "vocab": sp_vocab,
                "merges": [a + " " + b for a, b in sp_merges]},
      "decoder": {"type": "Sequence", "decoders": [
          {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
          {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}}
put("tokenizer", "llama2_byte_fallback_json",
    json.dumps(sp, ensure_ascii=False) + "\n#tokenizer_config.json\n" +
    json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": None}) + "\n")
sp_meta = dict(sp, normalizer=None, pre_tokenizer={"type": "Metaspace", "replacement": "\u2581",
                                                   "prepend_scheme": "first", "split": False})
put("tokenizer", "metaspace_byte_fallback_json", json.dumps(sp_meta, ensure_ascii=False))

# ---- texts for the encode / decode round trip
texts = {
    "english": "Hello world! It's 2024: the weather's fine, isn't it?\n\n  Indented    spaces\ttab.",
    "unicode": "caf\u00e9 na\u00efve \u65e5\u672c\u8a9e \u0645\u0631\u062d\u0628\u0627 \U0001F600\U0001F44D \u00a0nbsp",
    "digits": "3.14159 1000000 0x1F -42 1e-9 12,345",
    "special": "before<|endoftext|>after <|endoftext|>",
}
for name, t in texts.items():
    put("bpe_roundtrip", name, t)
put("bpe_roundtrip", "invalid_utf8", b"ok \xff\xfe bad \xc3( \xe2\x82 end")
