#!/usr/bin/env bash
# The main job: set up, build, and evaluate the bundled example case with certified rounding.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
bash tools/build.sh
build=${BUILD_DIR:-build}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"$build/attnoracle" eval vectors/examples/example.safetensors -o "$out/example.golden.safetensors"
python3 tools/show_case.py "$out/example.golden.safetensors"
