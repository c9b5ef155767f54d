#!/usr/bin/env bash
# Whole-process benchmarks of `attnoracle eval` against NumPy float64 and mpmath, in one run.
#
#   bash bench/compare.sh [--large] [--sizes 64,256] [-k 5] [...]     (all options: --help)
#
# Installs what is missing (tools/setup.sh) and builds (tools/build.sh, into ${BUILD_DIR:-build}),
# then runs bench/compare.py with /usr/bin/python3 (Debian's, which has NumPy and mpmath).
# With ATTNORACLE=/path/to/attnoracle set, neither: that binary is measured as it is.
# The report goes to stdout and to bench/results.md (-o FILE to change).
set -euo pipefail
cd "$(dirname "$0")/.."
for a in "$@"; do
  if [[ $a == -h || $a == --help ]]; then exec /usr/bin/python3 bench/compare.py --help; fi
done
export BENCH_WRAPPER=compare.sh BENCH_GIVEN_BINARY=${ATTNORACLE:-}
if [[ -z ${ATTNORACLE:-} ]]; then
  bash tools/setup.sh
  bash tools/build.sh
  export ATTNORACLE="${BUILD_DIR:-build}/attnoracle"
fi
exec /usr/bin/python3 bench/compare.py "$@"
