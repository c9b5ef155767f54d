#!/usr/bin/env bash
# The whole test suite: set up, build, a short fuzzing run, every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
bash tools/build.sh
# A short libFuzzer run of the format's readers, the same inputs on every machine (clang, ASan,
# UBSan; a longer one: tools/fuzz.sh 600).
FUZZ_RUNS=8000 FUZZ_DIR="${BUILD_DIR:-build}-fuzz" bash tools/fuzz.sh
ctest --test-dir "${BUILD_DIR:-build}" --output-on-failure -j "$(nproc)"
