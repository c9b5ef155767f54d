#!/usr/bin/env bash
# Throughput of `attnoracle check` (conformance/bench/check_bench.cpp): builds the benchmark in
# Release into ${BUILD_DIR:-build-bench}, runs it ${REPETITIONS:-5} times and prints the median of
# each benchmark: CPU milliseconds per run and MB/s of result bytes compared (10^6 bytes per CPU
# second; CPU rather than wall time because the machine may be shared). Extra arguments go to
# the benchmark, e.g. --benchmark_filter=CompareCase.
# Then the whole process: `attnoracle check --threads 1` (on CPU 0 where taskset exists) on a
# one-case set of B = 2, H = 4, Nq = Nk = 1024, D = 128 in F32 and in F16 (the benchmark's
# --write-set), ${REPETITIONS:-5} runs each: the median wall time and MB/s of result bytes.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build-bench}
reps=${REPETITIONS:-5}
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DATTNORACLE_TESTS=OFF -DATTNORACLE_BENCHMARKS=ON >/dev/null
cmake --build "$build" -j "$(nproc)" --target attnoracle_check_bench attnoracle >/dev/null
json=$(mktemp)
sets=$(mktemp -d)
trap 'rm -rf "$json" "$sets"' EXIT
"$build/conformance/bench/attnoracle_check_bench" --benchmark_repetitions="$reps" \
  --benchmark_report_aggregates_only=true --benchmark_out="$json" --benchmark_out_format=json "$@" >&2
python3 - "$json" "$reps" <<'EOF'
import json, sys
runs = json.load(open(sys.argv[1]))["benchmarks"]
print(f"median of {sys.argv[2]} repetitions (CPU time):")
for b in runs:
    if b.get("aggregate_name") != "median":
        continue
    scale = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[b.get("time_unit", "ns")]
    line = f"  {b['run_name']:<24} {b.get('label', ''):<10} {b['cpu_time'] * scale:9.1f} ms"
    if "bytes_per_second" in b:
        line += f"  {b['bytes_per_second'] / 1e6:8.0f} MB/s"
    print(line)
EOF

pin=()
command -v taskset >/dev/null && pin=(taskset -c 0)
echo "whole process, median of $reps runs (wall time):"
for bits in 32 16; do
  "$build/conformance/bench/attnoracle_check_bench" --write-set "$sets/$bits" "$bits"
  profile=fp$bits
  times=()
  for _ in $(seq "$reps"); do
    t0=$(date +%s%N)
    "${pin[@]}" "$build/attnoracle" check "$sets/$bits/set" --results "$sets/$bits/results" --profile "$profile" \
      --threads 1 --no-progress >/dev/null
    times+=($(( $(date +%s%N) - t0 )))
  done
  bytes=$(stat -c %s "$sets/$bits"/results/*.safetensors)
  python3 - "$bytes" "$profile" "${times[@]}" <<'EOF'
import statistics, sys
ns = statistics.median(int(t) for t in sys.argv[3:])
print(f"  check {sys.argv[2]:<18} {ns / 1e6:9.1f} ms  {int(sys.argv[1]) / (ns / 1e9) / 1e6:8.0f} MB/s")
EOF
done
