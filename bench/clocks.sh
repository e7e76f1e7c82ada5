# Sourced by the GPU benchmarks (gpu_bench.sh, dp_scaling.sh): with CLOCKS=1, an nvidia-smi sampler beside
# each training run writes STEM.clocks.csv (SM and memory clocks, power, temperature and throttle reasons
# every 100 ms) for one GPU: the first of CUDA_VISIBLE_DEVICES, else GPU 0 (rank 0's under mpirun).
# bench_report.py's clock_stats reads it against the run's metrics.jsonl times. Without CLOCKS=1 or
# nvidia-smi both functions do nothing.
clocks_pid="" clocks_gpu="" clocks_fields=""
clocks_start() {  # FILE_STEM
  [ "${CLOCKS:-0}" = 1 ] && command -v nvidia-smi > /dev/null || return 0
  if [ -z "$clocks_fields" ]; then  # the throttle reasons' field has two names across drivers
    clocks_gpu=${CUDA_VISIBLE_DEVICES:-0}
    clocks_gpu=${clocks_gpu%%,*}
    clocks_fields=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu
    for r in clocks_event_reasons.active clocks_throttle_reasons.active; do
      if nvidia-smi -i "$clocks_gpu" --format=csv --query-gpu="$clocks_fields,$r" > /dev/null 2>&1; then
        clocks_fields+=",$r"
        break
      fi
    done
  fi
  nvidia-smi -i "$clocks_gpu" --format=csv -lms 100 --query-gpu="$clocks_fields" > "$1.clocks.csv" 2> /dev/null &
  clocks_pid=$!
}
clocks_stop() {
  [ -n "$clocks_pid" ] || return 0
  kill "$clocks_pid" 2> /dev/null
  wait "$clocks_pid" 2> /dev/null
  clocks_pid=""
}
