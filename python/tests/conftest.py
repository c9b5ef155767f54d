import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORE = os.path.join(ROOT, "vectors", "core")
# how many cases the manifest lists (the tests count every one)
with open(os.path.join(CORE, "manifest.json")) as _f:
    CORE_CASES = len(__import__("json").load(_f)["cases"])
CLI = os.environ.get("ATTNORACLE_CLI", os.path.join(ROOT, "build", "attnoracle"))


def run_cli(*args):
    return subprocess.run([CLI, *args], capture_output=True, text=True)


def run_pytest(tmp_path, test_text, *args):
    """pytest run in a subprocess on one test file, with the plugin: (exit status, output)."""
    f = tmp_path / "test_under_test.py"
    f.write_text(test_text)
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "attnoracle.pytest_plugin", "-p", "no:cacheprovider",
                        "-q", "-rs", str(f), *args], capture_output=True, text=True, cwd=ROOT, env=env)
    return r.returncode, r.stdout + r.stderr


@pytest.fixture(scope="session")
def core():
    import attnoracle

    return attnoracle.Suite(CORE)
