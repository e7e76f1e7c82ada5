#!/usr/bin/env bash
# Installs the Debian packages ndtrain builds against (skips what is already there). Needs root.
# --test: also clang and its sanitizer/libFuzzer runtimes, for scripts/fuzz.sh and scripts/sanitize.sh.
set -euo pipefail
PKGS=(build-essential cmake ninja-build pkg-config libopenblas-dev libopenblas-openmp-dev libopenmpi-dev openmpi-bin
      libyaml-cpp-dev nlohmann-json3-dev libcli11-dev libfmt-dev libsentencepiece-dev sentencepiece libpcre2-dev
      libgtest-dev libgmock-dev)
if [[ ${1:-} == --test ]]; then PKGS+=(clang libclang-rt-dev); fi
missing=()
for p in "${PKGS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
  echo "[ndtrain] installing: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
echo "[ndtrain] dependencies present"
