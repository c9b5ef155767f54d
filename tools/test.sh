#!/usr/bin/env bash
# The whole test suite, as CI (.ci/run) runs it: set up, build, a short fuzzing run, every test,
# then the unit and end-to-end tests again under AddressSanitizer and UBSan.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
bash tools/build.sh
# A short libFuzzer run of the readers (case files, manifests, suite specs, profiles), the same
# inputs on every machine (clang, ASan, UBSan; a longer one: tools/fuzz.sh 600).
FUZZ_RUNS=8000 FUZZ_DIR="${BUILD_DIR:-build}-fuzz" bash tools/fuzz.sh
ctest --test-dir "${BUILD_DIR:-build}" --output-on-failure -j "$(nproc)"
# The tests labelled "unit" but the slowest, built with ASan and UBSan (tools/sanitize.sh).
ASAN_DIR="${BUILD_DIR:-build}-asan" bash tools/sanitize.sh
