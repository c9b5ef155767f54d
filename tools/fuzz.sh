#!/usr/bin/env bash
# Builds the libFuzzer harnesses (fuzz/) with clang, AddressSanitizer and UBSan, and runs each
# for SECONDS (default 30) on a seed corpus from vectors/core, or for FUZZ_RUNS inputs each when
# that is set (a run that is the same on every machine, with libFuzzer's seed FUZZ_SEED, 1).
# A crash leaves its input under ${FUZZ_DIR:-build-fuzz}/crashes/ and fails the run; keep it
# under fuzz/regressions/, whose files are run first.
#   bash tools/fuzz.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-30}
dir=${FUZZ_DIR:-build-fuzz}
flags="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g"
CC=clang CXX=clang++ cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DATTNORACLE_TESTS=OFF \
  -DATTNORACLE_BENCHMARKS=OFF -DATTNORACLE_TORCH=OFF -DATTNORACLE_FUZZ=ON \
  "-DCMAKE_CXX_FLAGS=$flags" "-DCMAKE_C_FLAGS=$flags" >/dev/null
cmake --build "$dir" -j "$(nproc)" --target attnoracle_fuzz_case_file attnoracle_fuzz_manifest >/dev/null

mkdir -p "$dir/crashes" "$dir/corpus/case_file" "$dir/corpus/manifest"
# Seeds: the smallest core cases (whole files), the manifest, and every kept regression.
# (No `head` in a pipeline: under pipefail, sort killed by SIGPIPE would end the run with 141.)
mapfile -t seeds < <(find vectors/core/cases -name '*.safetensors' -size -64k | LC_ALL=C sort)
cp "${seeds[@]:0:64}" "$dir/corpus/case_file/"
cp vectors/core/manifest.json "$dir/corpus/manifest/core.json"
for h in case_file manifest; do
  if [[ -d fuzz/regressions/$h ]]; then cp fuzz/regressions/$h/* "$dir/corpus/$h/" 2>/dev/null || true; fi
  # Regressions first: each must run clean.
  if compgen -G "fuzz/regressions/$h/*" >/dev/null; then
    "$dir/fuzz/attnoracle_fuzz_$h" fuzz/regressions/$h/* >/dev/null 2>&1
  fi
  budget=(-max_total_time="$seconds")
  [[ -n ${FUZZ_RUNS:-} ]] && budget=(-runs="$FUZZ_RUNS")
  "$dir/fuzz/attnoracle_fuzz_$h" "$dir/corpus/$h" "${budget[@]}" -max_len=262144 -seed="${FUZZ_SEED:-1}" \
    -rss_limit_mb=4096 -artifact_prefix="$dir/crashes/$h-" -print_final_stats=1 2>"$dir/$h.log" ||
    { tail -40 "$dir/$h.log" >&2; echo "fuzz: $h crashed; input in $dir/crashes/" >&2; exit 1; }
  echo "fuzz: $h: $(grep -o 'stat::number_of_executed_units: *[0-9]*' "$dir/$h.log" | grep -o '[0-9]*$') executions, no crash"
done
