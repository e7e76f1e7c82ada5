#!/usr/bin/env bash
# Fuzzes every parser of untrusted input (tests/fuzz, docs/reliability.md "Fuzzing and sanitizers"):
# builds the fuzz_* targets in the clang build it shares with scripts/sanitize.sh (scripts/sanitize_build.sh:
# build-asan, ndtrain_lib instrumented for libFuzzer with ASan + UBSan), and runs each for FUZZ_SECONDS on a copy of its
# seed corpus (tests/fuzz/corpus/<name>, left unchanged). Prints, per target, the inputs run and whether it
# crashed (sanitizer report, uncaught exception, abort, timeout or memory limit); exits 1 on any crash.
# Crashing inputs are kept in build-asan/artifacts/<name>/ (replay: build-asan/tests/fuzz/fuzz_<name> FILE).
#
# Environment: FUZZ_SECONDS (default 20) per target; FUZZ_TARGETS (default: all, e.g. "config shard");
# FUZZ_JOBS targets run at the same time (default: the number of cores); JOBS build parallelism (default:
# the number of cores); FUZZ_SEED the mutation seed (default 1: CI runs explore the same inputs each time;
# 0 = a random seed); FUZZ_ARGS extra libFuzzer flags.
set -euo pipefail
cd "$(dirname "$0")/.."
FUZZ_SECONDS=${FUZZ_SECONDS:-20}
FUZZ_JOBS=${FUZZ_JOBS:-$(nproc)}
JOBS=${JOBS:-$(nproc)}
BUILD=build-asan
# Largest input per target: a little above the largest seed.
declare -A MAX_LEN=([config]=4096 [safetensors]=4096 [checkpoint]=8192 [shard]=2048 [jsonl]=4096
                    [hf_config]=4096 [tokenizer]=16384 [bpe_roundtrip]=4096)
ALL_TARGETS=$(ls tests/fuzz/fuzz_*.cpp | sed 's|.*/fuzz_||; s|\.cpp$||' | tr '\n' ' ')
TARGETS=${FUZZ_TARGETS:-$ALL_TARGETS}

start=$(date +%s)
JOBS=$JOBS scripts/sanitize_build.sh $(for t in $TARGETS; do echo "fuzz_$t"; done)
built=$(date +%s)
echo "fuzz.sh: built in $((built - start)) s; fuzzing ${TARGETS% } for ${FUZZ_SECONDS} s each, $FUZZ_JOBS at a time"

work=$(mktemp -d "${TMPDIR:-/tmp}/ndt_fuzz.XXXXXX")
trap 'rm -rf "$work"' EXIT
run_one() {
  local t=$1
  local rc corpus="$work/corpus/$t" art="$BUILD/artifacts/$t"
  rm -rf "$art"
  mkdir -p "$corpus" "$art" "$work/tmp/$t"
  cp tests/fuzz/corpus/"$t"/* "$corpus"/
  # TMPDIR: the target's own scratch files; one input at a time (-fork would hide the execution count).
  TMPDIR="$work/tmp/$t" OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
    ASAN_OPTIONS=abort_on_error=0:detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    "$BUILD/tests/fuzz/fuzz_$t" -max_total_time="$FUZZ_SECONDS" -max_len="${MAX_LEN[$t]:-4096}" \
    -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=1024 -print_final_stats=1 \
    -artifact_prefix="$art/" -seed="${FUZZ_SEED:-1}" ${FUZZ_ARGS:-} "$corpus" >"$work/$t.log" 2>&1 && rc=0 || rc=$?
  echo "$rc" >"$work/$t.rc"
}
for t in $TARGETS; do
  while [ "$(jobs -rp | wc -l)" -ge "$FUZZ_JOBS" ]; do wait -n || true; done
  run_one "$t" &
done
wait
failed=0
printf '%-14s %12s %8s  %s\n' target executions corpus result
for t in $TARGETS; do
  rc=$(cat "$work/$t.rc" 2>/dev/null || echo 99)
  log="$work/$t.log"
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  cov=$(ls "$work/corpus/$t" | wc -l)
  if [ "$rc" -eq 0 ]; then
    result=ok
  else
    result="CRASH (exit $rc)"
    failed=1
    cp "$log" "$BUILD/artifacts/$t/fuzz.log"
  fi
  printf '%-14s %12s %8s  %s\n' "$t" "${execs:-?}" "$cov" "$result"
  if [ "$rc" -ne 0 ]; then
    grep -m1 -E 'ERROR: |runtime error|fuzz property failed|deadly signal|terminate called|Timeout|out-of-memory' \
      "$log" | sed 's/^/    /' || true
    echo "    log: $BUILD/artifacts/$t/fuzz.log; input: $(ls "$BUILD/artifacts/$t" | grep -v fuzz.log | tail -1)"
  fi
done
echo "fuzz.sh: $(( $(date +%s) - start )) s in total"
exit "$failed"
