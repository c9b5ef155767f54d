#!/usr/bin/env bash
# `attnoracle invariants --shapes serving` on the serving kernels of
# conformance/adapters/serving_numpy: correct kernels of both structures over several seeds
# (0 violated expected), then each planted bug (violated relations expected), with the wall time
# of each run. Usage: bench/serving_invariants.sh [PROBLEMS [SEEDS...]] (default 12, seeds 1 2 3).
set -euo pipefail
cd "$(dirname "$0")/.."
problems=${1:-12}
shift || true
seeds=("$@")
[ ${#seeds[@]} -eq 0 ] && seeds=(1 2 3)
cli=${ATTNORACLE_CLI:-build/attnoracle}
kernel="/usr/bin/python3 conformance/adapters/serving_numpy/attention.py"
json=$(mktemp)
work=$(mktemp -d)
trap 'rm -rf "$json" "$work"' EXIT
run() {  # label, seed, kernel options...
  local label=$1 seed=$2; shift 2
  local start end
  start=$(date +%s.%N)
  "$cli" invariants --shapes serving --problems "$problems" --seed "$seed" --impl "$kernel $*" \
    --work "$work/w" --failures "$work/f" --json "$json" >/dev/null || true
  end=$(date +%s.%N)
  /usr/bin/python3 - "$label" "$seed" "$json" "$start" "$end" <<'PY'
import collections, json, sys
label, seed, path, start, end = sys.argv[1:]
r = json.load(open(path))
by = collections.Counter(x["invariant"] for x in r["relations"] if x["status"] == "violated")
names = " ".join(f"{k}:{v}" for k, v in sorted(by.items()))
print(f"{label:<44} seed {seed}  {len(r['relations']):4d} relations {r['violated']:4d} violated "
      f"{r['skipped']:3d} skipped  {float(end) - float(start):6.1f} s  {names}")
PY
}
for seed in "${seeds[@]}"; do
  run "splitkv split 64 chunk 16" "$seed" --structure splitkv --split 64 --chunk 16
  run "splitkv split 5 chunk 64 log2" "$seed" --structure splitkv --split 5 --chunk 64 --log2
  run "pagewise fp32" "$seed" --structure pagewise --arith fp32
done
for bug in table_batch0 page_boundary_off_by_one last_page_wrong unused_slot_nan split_off_by_one \
           empty_split_nan merge_nan_on_neginf merge_ignores_sink partials_bf16_undeclared \
           mask_sentinel_5e4 mask_dropped_last_block gqa_group3; do
  run "bug $bug" "${seeds[0]}" --structure splitkv --split 64 --chunk 16 --bug "$bug"
done
