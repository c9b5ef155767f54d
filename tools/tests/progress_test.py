"""The progress line of gen, verify and run: on a terminal (a pseudo-terminal here) it appears,
rewritten with carriage returns; in a pipe, or with CI set, it does not; --progress and
--no-progress force it either way.

Environment: ATTNORACLE_CLI, ATTNORACLE_SUITE (vectors/core), ATTNORACLE_ADAPTER (the NumPy
example adapter).
"""
import json
import os
import pty
import re
import select
import shutil
import subprocess
import tempfile
import termios
import unittest

CLI = os.environ.get("ATTNORACLE_CLI", "attnoracle")
SUITE = os.environ.get("ATTNORACLE_SUITE", "vectors/core")
ADAPTER = os.environ.get("ATTNORACLE_ADAPTER", "conformance/adapters/numpy/attention.py")

SPEC = {"suite": "tiny", "seed": 3, "families": [
    {"name": "gens", "generator": "normal", "cross": {"dtype": ["F32", "F16", "BF16", "F64"]},
     "fixed": {"shape": [1, 2, 1, 4, 6, 4, 3], "outputs": "out,weights,lse"}}]}


def core_cases():
    """How many cases the suite's manifest lists."""
    with open(os.path.join(SUITE, "manifest.json")) as f:
        return len(json.load(f)["cases"])


def environment(ci):
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci:
        env["CI"] = "true"
    return env


def on_terminal(args, ci=False):
    """Runs the command with stderr on a pseudo-terminal (stdout a pipe); (status, stderr bytes)."""
    master, slave = pty.openpty()
    attrs = termios.tcgetattr(slave)
    attrs[1] &= ~termios.ONLCR  # "\n" as written, not "\r\n"
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    p = subprocess.Popen([CLI, *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave,
                         env=environment(ci))
    os.close(slave)
    err = b""
    while True:  # read while it runs: a full terminal buffer would block it
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer has closed the terminal
                break
            if not chunk:
                break
            err += chunk
        elif p.poll() is not None:
            break
    p.stdout.read()
    p.stdout.close()
    status = p.wait(timeout=600)
    os.close(master)
    return status, err


def in_pipe(args, ci=False):
    r = subprocess.run([CLI, *args], capture_output=True, env=environment(ci), timeout=600)
    return r.returncode, r.stderr


# "verify: 12/514 cases, 0.3 s, about 9.1 s left" (the estimate once a case is done)
LINE = re.compile(rb"\r(gen|verify|run|check): \d+/\d+ (cases|results|compared), [0-9.]+ s")


class Progress(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="attnoracle-progress-")
        cls.spec = os.path.join(cls.tmp, "tiny.json")
        with open(cls.spec, "w") as f:
            json.dump(SPEC, f)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_verify(self):
        status, err = on_terminal(["verify", SUITE])
        self.assertEqual(status, 0, err)
        self.assertRegex(err, LINE)
        n = str(core_cases()).encode()
        self.assertIn(b"verify: " + n + b"/" + n + b" cases", err)
        self.assertIn(b" left", err)  # an estimate was given before the end
        # the line is erased before the summary, which stays
        self.assertTrue(err.rstrip().endswith(n + b" checked, 0 problems"), err[-200:])
        status, err = in_pipe(["verify", SUITE])
        self.assertEqual(status, 0)
        self.assertNotIn(b"\r", err)
        self.assertIsNone(LINE.search(err))
        status, err = on_terminal(["verify", SUITE], ci=True)
        self.assertEqual(status, 0)
        self.assertNotIn(b"\r", err)
        status, err = on_terminal(["verify", SUITE, "--no-progress"])
        self.assertNotIn(b"\r", err)
        status, err = in_pipe(["verify", SUITE, "--progress"], ci=True)
        self.assertRegex(err, LINE)
        status, err = on_terminal(["verify", SUITE, "--quiet"])
        self.assertEqual(err, b"")

    def test_gen(self):
        out = os.path.join(self.tmp, "set-tty")
        status, err = on_terminal(["gen", self.spec, "-o", out, "--jobs", "1"])
        self.assertEqual(status, 0, err)
        self.assertRegex(err, LINE)
        self.assertIn(b"gen: 4/4 cases", err)
        self.assertNotIn(b"[1/4]", err)  # the line, not the log of each case
        # in a pipe the log of each case, without the line
        status, err = in_pipe(["gen", self.spec, "-o", os.path.join(self.tmp, "set-pipe"), "--jobs", "1"])
        self.assertEqual(status, 0, err)
        self.assertNotIn(b"\r", err)
        self.assertIsNone(LINE.search(err))
        self.assertIn(b"[1/4] gens-000", err)

    def test_run(self):
        args = ["run", SUITE, "--impl", f"/usr/bin/python3 {ADAPTER}", "--case", "uniform-000,causal-000,decode-001"]
        status, err = on_terminal(args)
        self.assertEqual(status, 0, err)
        self.assertRegex(err, LINE)
        self.assertIn(b"run: 3/3 compared", err)
        status, err = in_pipe(args)
        self.assertEqual(status, 0, err)
        self.assertEqual(err, b"")
        status, err = on_terminal(args, ci=True)
        self.assertEqual(err, b"")

    def test_both_flags_refused(self):
        status, err = in_pipe(["verify", SUITE, "--progress", "--no-progress"])
        self.assertEqual(status, 2)
        self.assertEqual(err.count(b"\n"), 1)
        self.assertTrue(err.startswith(b"attnoracle: error: usage: "), err)


if __name__ == "__main__":
    unittest.main()
