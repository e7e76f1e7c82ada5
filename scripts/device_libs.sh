#!/usr/bin/env bash
# Copies the shared libraries a locally built binary needs, other than glibc/libstdc++ and CUDA's own, into
# a folder that travels to the GPU machine (which lacks Debian's yaml-cpp, fmt, OpenBLAS, ...).
# Usage: scripts/device_libs.sh OUTDIR BINARY...
set -euo pipefail
out=$1; shift
mkdir -p "$out"
for bin in "$@"; do
  ldd "$bin" | awk '/=> \//{print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libstdc++*|libgcc_s*|libpthread*|libdl.so*|librt.so*|ld-linux*|libcuda.so*|libcudart*|libcublas*|libnccl*|libcudnn*) ;;
      # The GPU machine has its own OpenMPI 4.1.4 (mpirun, orted, plugins): Debian's copies would mix builds.
      libmpi*|libopen-pal*|libopen-rte*|libevent*|libhwloc*) ;;
      *) cp -Lu "$lib" "$out/" ;;
    esac
  done
done
