"""The Python examples of README.md and python/README.md run as printed: every ```python block
of a file, in order, in one namespace (a later block may use what an earlier one defined), in a
temporary directory whose vectors/ is the repository's; a block defining tests (`def test_`) is
a pytest file, run with the plugin from the repository's root, and must pass with no failure.
Needs the built package (ctest -R docs_python_examples_test sets PYTHONPATH):

    cd docs/tests && PYTHONPATH=$PWD/../../build/python python3 -m unittest -v readme_examples_test
"""
import contextlib
import io
import os
import re
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.M | re.S)


def python_blocks(rel):
    return BLOCK.findall((ROOT / rel).read_text(encoding="utf-8"))


class ReadmeExamples(unittest.TestCase):
    def run_file(self, rel):
        blocks = python_blocks(rel)
        self.assertTrue(blocks, rel)
        namespace = {"__name__": "readme"}
        cwd = os.getcwd()
        with tempfile.TemporaryDirectory() as tmp:
            os.environ["ATTNORACLE_CACHE"] = os.path.join(tmp, "cache")
            os.symlink(ROOT / "vectors", os.path.join(tmp, "vectors"))  # relative paths as from the root
            os.chdir(tmp)
            try:
                for n, block in enumerate(blocks):
                    with self.subTest(file=rel, block=n):
                        if "\ndef test_" in "\n" + block:
                            self.run_pytest(block, tmp, n)
                        else:
                            with contextlib.redirect_stdout(io.StringIO()):
                                exec(compile(block, f"{rel} python block {n}", "exec"), namespace)
            finally:
                os.chdir(cwd)
                del os.environ["ATTNORACLE_CACHE"]
        return namespace

    def run_pytest(self, block, tmp, n):
        test = Path(tmp) / f"test_block_{n}.py"
        test.write_text(block)
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "attnoracle.pytest_plugin", "-p",
                            "no:cacheprovider", str(test)], cwd=ROOT, env=env, capture_output=True, text=True)
        tail = r.stdout[-3000:] + r.stderr[-2000:]
        self.assertEqual(r.returncode, 0, tail)
        self.assertRegex(r.stdout, r"\d+ passed", tail)
        self.assertNotRegex(r.stdout, r"\d+ failed", tail)

    def test_readme(self):
        ns = self.run_file("README.md")
        self.assertTrue(ns["verdict"].passed, ns["verdict"].text)

    def test_python_readme(self):
        self.run_file("python/README.md")


if __name__ == "__main__":
    unittest.main()
