#!/usr/bin/env bash
# The gate on the serving suite: the serving kernels of conformance/adapters/serving_numpy, of two
# structures, correct (0 failures expected) and with each planted bug (caught expected), under
# the flash profiles. Usage: bench/serving_gate.sh SET (a generated vectors/suites/serving.json).
set -euo pipefail
cd "$(dirname "$0")/.."
set_dir=${1:?usage: bench/serving_gate.sh SET}
cli=${ATTNORACLE_CLI:-build/attnoracle}
kernel="/usr/bin/python3 conformance/adapters/serving_numpy/attention.py"
summary() {  # label, JSON report
  /usr/bin/python3 - "$@" <<'PY'
import json, sys
r = json.load(open(sys.argv[2]))
fails = [c["id"] for c in r["cases"] if c["status"] == "fail"]
ran = sum(c["status"] != "skip" for c in r["cases"])
heads = sorted(t["tier"]["headroom"] for c in r["cases"] for t in c.get("tensors", [])
               if t.get("tier", {}).get("tested") and t["tier"].get("headroom") is not None)
med = heads[len(heads) // 2] if heads else float("nan")
print(f"{sys.argv[1]:<58} {ran:3d} run {len(fails):3d} failed  median headroom {med:8.3g}  {' '.join(fails[:4])}")
PY
}
json=$(mktemp)
trap 'rm -f "$json"' EXIT
run() {  # label, kernel options...
  local label=$1; shift
  "$cli" run "$set_dir" --impl "$kernel $*" --profile flash --threads 2 --json "$json" >/dev/null || true
  summary "$label" "$json"
}
run "splitkv split 64 chunk 16 partials f32" --structure splitkv --split 64 --chunk 16 --partials f32 --arith input
run "splitkv split 128 chunk 64 partials f32 log2" --structure splitkv --split 128 --chunk 64 --partials f32 --arith input --log2
run "pagewise" --structure pagewise
for bug in last_page_wrong table_batch0 page_boundary_off_by_one unused_slot_nan split_off_by_one \
           empty_split_nan merge_nan_on_neginf merge_ignores_sink partials_bf16_undeclared \
           mask_sentinel_5e4 mask_dropped_last_block gqa_group3; do
  run "bug $bug" --structure splitkv --split 64 --chunk 16 --partials f32 --arith input --bug "$bug"
done
