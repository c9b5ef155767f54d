#!/usr/bin/env bash
# pip install of the checkout into a fresh virtual environment (offline: --no-build-isolation
# against the system's setuptools, --system-site-packages for NumPy and pytest), then from that
# environment: the attnoracle command, the pytest plugin found by its entry point (no -p), and
# assert_close. Skipped (77) where python3 has no venv or pip.
# Usage: pip_install_test.sh SOURCE_DIR
set -euo pipefail
src=$1
python=/usr/bin/python3
if ! $python -c 'import setuptools, wheel, ensurepip, venv' 2>/dev/null || ! $python -m pip --version >/dev/null 2>&1; then
  echo "pip install test skipped: python3-venv, python3-pip, python3-setuptools or python3-wheel missing"
  exit 77
fi
start=$SECONDS
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# pip builds in the tree it is given: a copy without the build trees
$python - "$src" "$work/src" <<'PY'
import shutil, sys
shutil.copytree(sys.argv[1], sys.argv[2], symlinks=True, ignore=shutil.ignore_patterns(
    "build", "build-*", ".git", "node_modules", "__pycache__", "*.egg-info"))
PY
# a compiler launcher (ccache) keeps its hits across runs: paths relative to the copy
export CCACHE_BASEDIR="$work" CCACHE_NOHASHDIR=1
$python -m venv --system-site-packages "$work/venv"
"$work/venv/bin/python" -m pip install -q --no-build-isolation --no-index "$work/src" >"$work/pip.log" 2>&1 \
  || { cat "$work/pip.log"; exit 1; }
echo "pip install: $((SECONDS - start)) s"

cd "$work"
"$work/venv/bin/attnoracle" --version
"$work/venv/bin/attnoracle" verify "$("$work/venv/bin/python" -c 'import attnoracle; print(attnoracle.vector_set())')" >/dev/null
cat >test_installed.py <<'PY'
import numpy as np
import attnoracle

def test_the_installed_package():
    assert attnoracle.__file__.startswith(__import__("sys").prefix)

@attnoracle.parametrize_suite(attnoracle.vector_set("core"), profile="standard", ids=["normal-015", "gqa-001"])
def test_golden_outputs_pass(attnoracle_case):
    attnoracle_case.assert_conforms({n: attnoracle_case.golden[n] for n in attnoracle_case.outputs})

def test_assert_close():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 16, 8)).astype(np.float32) for _ in range(3))
    out = attnoracle.evaluate(q, k, v, causal=True)["out"]
    assert attnoracle.assert_close(out, q, k, v, causal=True, profile="fp32").passed
PY
ATTNORACLE_CACHE="$work/cache" PYTHONDONTWRITEBYTECODE=1 "$work/venv/bin/python" -m pytest -q -p no:cacheprovider \
  test_installed.py | tee "$work/pytest.log"
grep -q "4 passed" "$work/pytest.log"
echo "pip install test: passed in $((SECONDS - start)) s"
