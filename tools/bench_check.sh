#!/usr/bin/env bash
# Throughput of `attnoracle check` (conformance/bench/check_bench.cpp): builds the benchmark in
# Release into ${BUILD_DIR:-build-bench}, runs it ${REPETITIONS:-5} times and prints the median of
# each benchmark: CPU milliseconds per run and MB/s of result bytes compared (10^6 bytes per CPU
# second; CPU rather than wall time because the machine may be shared). Extra arguments go to
# the benchmark, e.g. --benchmark_filter=CompareCase.
# Then the whole process: `attnoracle check --threads 1` (on CPU 0 where taskset exists) on a
# one-case set of B = 2, H = 4, Nq = Nk = 1024, D = 128 in F32 and in F16 (the benchmark's
# --write-set), ${REPETITIONS:-5} runs each: the median wall time and CPU time (user + system)
# of the process, each with its MB/s of result bytes; each set with the model's magnitudes stored
# with its golden tensors and its golden file recorded as verified (model), and without either
# (plain: check computes the model from the inputs and hashes the golden file).
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
echo "whole process, median of $reps runs (wall time, and CPU time: user + system):"
for bits in 32 16; do
 for form in model plain; do
  rm -rf "${sets:?}/$bits"
  "$build/conformance/bench/attnoracle_check_bench" --write-set "$sets/$bits" "$bits" "$form"
  python3 - "$reps" "fp$bits" "$sets/$bits" "$form" "${pin[@]}" "$build/attnoracle" <<'EOF'
import glob, os, resource, statistics, subprocess, sys, time
reps, profile, root, form, cmd = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
cmd += ["check", f"{root}/set", "--results", f"{root}/results", "--profile", profile, "--threads", "1", "--no-progress"]
size = sum(os.path.getsize(f) for f in glob.glob(f"{root}/results/*.safetensors"))
wall, cpu = [], []
for _ in range(reps):
    r0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    wall.append(t1 - t0)
    cpu.append((r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime))
for what, v in (("wall", statistics.median(wall)), ("cpu", statistics.median(cpu))):
    print(f"  check {profile:<6} {form:<5} {what:<4} {v * 1e3:9.1f} ms  {size / v / 1e6:8.0f} MB/s")
EOF
 done
done
