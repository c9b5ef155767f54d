#!/usr/bin/env bash
# Builds the libFuzzer harnesses (fuzz/) with clang, AddressSanitizer and UBSan, and runs each
# for SECONDS (default 30) on a seed corpus, or for FUZZ_RUNS inputs each when that is set (a run
# that is the same on every machine, with libFuzzer's seed FUZZ_SEED, 1). The harnesses: case_file
# (the safetensors reader and the case validator), manifest, suite (suite specs, attnoracle gen)
# and profile (--profile FILE.json, one profile or a family); FUZZ_HARNESSES picks some of them.
# A crash leaves its input under ${FUZZ_DIR:-build-fuzz}/crashes/ and fails the run; keep it
# under fuzz/regressions/<harness>/, whose files are run first. tools/test.sh (CI) runs it with
# FUZZ_RUNS=8000.
#   bash tools/fuzz.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-30}
dir=${FUZZ_DIR:-build-fuzz}
read -r -a harnesses <<<"${FUZZ_HARNESSES:-case_file manifest suite profile}"
flags="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g"
CC=clang CXX=clang++ cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DATTNORACLE_TESTS=OFF \
  -DATTNORACLE_BENCHMARKS=OFF -DATTNORACLE_TORCH=OFF -DATTNORACLE_PYTHON=OFF -DATTNORACLE_FUZZ=ON \
  "-DCMAKE_CXX_FLAGS=$flags" "-DCMAKE_C_FLAGS=$flags" >/dev/null
cmake --build "$dir" -j "$(nproc)" --target "${harnesses[@]/#/attnoracle_fuzz_}" >/dev/null

mkdir -p "$dir/crashes" "$dir/corpus/case_file" "$dir/corpus/manifest" "$dir/corpus/suite" "$dir/corpus/profile"
# Seeds: the smallest core cases (whole files), the manifest, the families of the suite specs,
# the profiles of conformance/profiles, one per built-in profile (no command prints them: the
# names of builtin_profile_names() in conformance/src/profile.cpp) and a family, and every kept
# regression.
# (No `head` in a pipeline: under pipefail, sort killed by SIGPIPE would end the run with 141.)
mapfile -t seeds < <(find vectors/core/cases -name '*.safetensors' -size -64k | LC_ALL=C sort)
cp "${seeds[@]:0:64}" "$dir/corpus/case_file/"
cp vectors/core/manifest.json "$dir/corpus/manifest/core.json"
# A suite spec for each family of vectors/suites (whole specs expand to hundreds of cases, too
# slow an input).
python3 - "$dir/corpus/suite" vectors/suites/*.json <<'PY'
import json, os, sys
for path in sys.argv[2:]:
    with open(path) as f:
        spec = json.load(f)
    for fam in spec["families"]:
        one = {"suite": spec["suite"], "seed": spec["seed"], "families": [fam]}
        with open(os.path.join(sys.argv[1], f"{spec['suite']}-{fam['name']}.json"), "w") as f:
            json.dump(one, f, indent=1)
PY
cp conformance/profiles/*.json "$dir/corpus/profile/"
for name in fp64 fp32 fp16 bf16 flash-fp16 flash-bf16 torch-cpu-bf16 fp8 flash-fp8; do
  printf '{"name": "seed-%s", "base": "%s"}\n' "$name" "$name" >"$dir/corpus/profile/builtin-$name.json"
done
printf '{"name": "seed-family", "profiles": ["fp32", {"base": "bf16", "p": "BF16", "key_block": 0}]}\n' \
  >"$dir/corpus/profile/family.json"
for h in "${harnesses[@]}"; do
  if [[ -d fuzz/regressions/$h ]]; then cp fuzz/regressions/$h/* "$dir/corpus/$h/" 2>/dev/null || true; fi
  # Regressions first: each must run clean.
  if compgen -G "fuzz/regressions/$h/*" >/dev/null; then
    "$dir/fuzz/attnoracle_fuzz_$h" fuzz/regressions/$h/* >"$dir/$h-regressions.log" 2>&1 ||
      { tail -40 "$dir/$h-regressions.log" >&2; echo "fuzz: $h: a kept regression fails" >&2; exit 1; }
  fi
  budget=(-max_total_time="$seconds")
  [[ -n ${FUZZ_RUNS:-} ]] && budget=(-runs="$FUZZ_RUNS")
  [[ -f fuzz/$h.dict ]] && budget+=(-dict="fuzz/$h.dict")  # the format's words, for the JSON readers
  "$dir/fuzz/attnoracle_fuzz_$h" "$dir/corpus/$h" "${budget[@]}" -max_len=262144 -seed="${FUZZ_SEED:-1}" \
    -rss_limit_mb=4096 -artifact_prefix="$dir/crashes/$h-" -print_final_stats=1 2>"$dir/$h.log" ||
    { tail -40 "$dir/$h.log" >&2; echo "fuzz: $h crashed; input in $dir/crashes/" >&2; exit 1; }
  echo "fuzz: $h: $(grep -o 'stat::number_of_executed_units: *[0-9]*' "$dir/$h.log" | grep -o '[0-9]*$') executions, no crash"
done
