#!/usr/bin/env bash
# Builds the single-process unit tests (ndtrain_tests: every tests/test_*.cpp) with clang, AddressSanitizer
# and UndefinedBehaviorSanitizer in build-asan (NDT_CUDA=OFF; scripts/sanitize_build.sh, shared with
# scripts/fuzz.sh), and runs them; the multi-rank (mpirun),
# CLI and GPU tests are not part of it. Exits non-zero on a failing test or any sanitizer report (ASan,
# LeakSanitizer, UBSan: every report aborts the process). docs/reliability.md, "Fuzzing and sanitizers".
#
# Environment: JOBS build parallelism (default: the number of cores); SANITIZE_SHARDS test processes run
# side by side (gtest sharding, default: the number of cores); GTEST_FILTER as usual.
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${JOBS:-$(nproc)}
SHARDS=${SANITIZE_SHARDS:-$(nproc)}
BUILD=build-asan

start=$(date +%s)
JOBS=$JOBS scripts/sanitize_build.sh ndtrain_tests
built=$(date +%s)
echo "sanitize.sh: built in $((built - start)) s; running ndtrain_tests in $SHARDS shard(s)"

# Leaks inside the MPI / hwloc / OpenMP runtimes (not ours) are suppressed; ours are reported.
supp="$BUILD/lsan.supp"
printf '%s\n' 'leak:libmpi' 'leak:libopen-pal' 'leak:libopen-rte' 'leak:libhwloc' 'leak:libevent' \
  'leak:libomp' 'leak:libgomp' 'leak:libopenblas' >"$supp"
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:detect_stack_use_after_return=0"
export LSAN_OPTIONS="suppressions=$PWD/$supp:print_suppressions=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OPENBLAS_NUM_THREADS=1
logs=$(mktemp -d "${TMPDIR:-/tmp}/ndt_sanitize.XXXXXX")
trap 'rm -rf "$logs"' EXIT
for ((i = 0; i < SHARDS; i++)); do
  GTEST_TOTAL_SHARDS=$SHARDS GTEST_SHARD_INDEX=$i "$BUILD/tests/ndtrain_tests" \
    >"$logs/shard$i.log" 2>&1 && echo 0 >"$logs/shard$i.rc" || echo $? >"$logs/shard$i.rc" &
done
wait
failed=0
for ((i = 0; i < SHARDS; i++)); do
  rc=$(cat "$logs/shard$i.rc")
  summary=$(grep -E '^\[  (PASSED|FAILED|SKIPPED) *\]' "$logs/shard$i.log" | tr '\n' ' ' || true)
  reports=$(grep -cE 'ERROR: (Address|Leak)Sanitizer|runtime error:' "$logs/shard$i.log" || true)
  echo "shard $i: exit $rc, $reports sanitizer report(s); $summary"
  if [ "$rc" != 0 ] || [ "$reports" != 0 ]; then
    failed=1
    cp "$logs/shard$i.log" "$BUILD/sanitize-shard$i.log"
    grep -E -A12 'ERROR: (Address|Leak)Sanitizer|runtime error:|^\[  FAILED  \]' "$logs/shard$i.log" | head -60
    echo "  log: $BUILD/sanitize-shard$i.log"
  fi
done
echo "sanitize.sh: $(( $(date +%s) - start )) s in total"
exit "$failed"
