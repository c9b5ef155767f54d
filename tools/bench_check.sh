#!/usr/bin/env bash
# Throughput of `attnoracle check` (conformance/bench/check_bench.cpp): builds the benchmark in
# Release into ${BUILD_DIR:-build-bench}, runs it ${REPETITIONS:-5} times and prints the median of
# each benchmark: CPU milliseconds per run and MB/s of result bytes compared (10^6 bytes per CPU
# second; CPU rather than wall time because the machine may be shared). Extra arguments go to
# the benchmark, e.g. --benchmark_filter=CompareCase.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build-bench}
reps=${REPETITIONS:-5}
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DATTNORACLE_TESTS=OFF -DATTNORACLE_BENCHMARKS=ON >/dev/null
cmake --build "$build" -j "$(nproc)" --target attnoracle_check_bench >/dev/null
json=$(mktemp)
trap 'rm -f "$json"' EXIT
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
