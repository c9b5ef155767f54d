"""The floor (bench/floor.cpp) on every case of vectors/core: a case it evaluates agrees with the
golden out.ref within a plain float64 evaluation's error; a case it refuses (kind mha, softcap,
sinks) exits with status 2 and one error line naming the file; so does a file it cannot read.

Environment: ATTNORACLE_FLOOR (the binary), ATTNORACLE_SUITE (vectors/core).
"""
import json
import os
import re
import subprocess
import tempfile
import unittest

FLOOR = os.environ.get("ATTNORACLE_FLOOR", "attnoracle_floor")
SUITE = os.environ.get("ATTNORACLE_SUITE", "vectors/core")
# A float64 evaluation errs by a few ulps of the bound |P| |V| on most cases, and by up to some
# 1e-12 of it where the scores are large (exp's relative error grows with its argument).
TOLERANCE = 1e-10


def run(*args):
    return subprocess.run([FLOOR, *args], capture_output=True, text=True, timeout=120)


def errors(stderr):
    return [l for l in stderr.splitlines() if "error:" in l]


class FloorTest(unittest.TestCase):
    def test_core_cases(self):
        with open(os.path.join(SUITE, "manifest.json")) as f:
            cases = json.load(f)["cases"]
        compared, refused = 0, {}
        for c in cases:
            path = os.path.join(SUITE, c["file"])
            with self.subTest(case=c["id"]):
                r = run(path, "--threads", "2", "--compare", path)
                if r.returncode == 2:
                    lines = errors(r.stderr)
                    self.assertEqual(len(lines), 1, r.stderr)
                    self.assertIn(path, lines[0])
                    if lines[0].endswith("no tensor out.ref or out"):  # a case the reference refuses
                        self.assertEqual(c["expect"], "error")
                        continue
                    why = re.search(r"(kind mha|softcap|sinks)", lines[0])
                    self.assertIsNotNone(why, lines[0])
                    refused[why.group(1)] = refused.get(why.group(1), 0) + 1
                    continue
                self.assertEqual(r.returncode, 0, r.stderr)
                m = re.search(r"max error / out\.bound ([0-9.eE+-]+|nan|inf)", r.stdout)
                self.assertIsNotNone(m, r.stdout)
                self.assertLessEqual(float(m.group(1)), TOLERANCE, r.stdout)
                compared += 1
        self.assertGreater(compared, 300)
        self.assertEqual(sorted(refused), ["kind mha", "sinks", "softcap"], refused)

    def test_unreadable_file(self):
        with tempfile.TemporaryDirectory() as d:
            missing = os.path.join(d, "missing.safetensors")
            r = run(missing)
            self.assertEqual(r.returncode, 2)
            self.assertEqual(len(errors(r.stderr)), 1, r.stderr)
            self.assertIn(missing, r.stderr)
            bad = os.path.join(d, "bad.safetensors")
            with open(bad, "wb") as f:
                f.write(b"\x08\x00\x00\x00\x00\x00\x00\x00{nonsense")
            r = run(bad)
            self.assertEqual(r.returncode, 2)
            self.assertEqual(len(errors(r.stderr)), 1, r.stderr)
            self.assertIn(bad, r.stderr)

    def test_bad_usage(self):
        for args in ([], ["--threads", "0", "x.safetensors"], ["--frobnicate"]):
            with self.subTest(args=args):
                r = run(*args)
                self.assertEqual(r.returncode, 2, r.stderr)


if __name__ == "__main__":
    unittest.main()
