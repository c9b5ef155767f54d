#!/usr/bin/env bash
# The main job: set up, build, check the committed golden vectors, and gate the bundled NumPy
# implementation on them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
bash tools/build.sh
build=${BUILD_DIR:-build}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

echo "== one case, evaluated with certified rounding (vectors/examples/example.safetensors)"
"$build/attnoracle" eval vectors/examples/example.safetensors -o "$out/example.golden.safetensors"
python3 tools/show_case.py "$out/example.golden.safetensors"

echo
echo "== the committed core vector set: manifest, hashes, invariants of the stored golden values"
"$build/attnoracle" verify vectors/core

echo
echo "== the conformance gate: the NumPy example implementation on vectors/core, F32, F16 and BF16 in one run"
"$build/attnoracle" run vectors/core --profile fp32,fp16,bf16 \
  --impl "/usr/bin/python3 conformance/adapters/numpy/attention.py" \
  --json "$out/report.json" --junit "$out/report.xml"

echo
echo "== metamorphic checks of the same implementation, no golden data (one profile per input dtype)"
for pd in fp32:F32 fp16:F16 bf16:BF16; do
  "$build/attnoracle" invariants --problems 8 --profile "${pd%%:*}" --dtypes "${pd##*:}" \
    --impl "/usr/bin/python3 conformance/adapters/numpy/attention.py" --failures "$out/failures-${pd%%:*}"
done
