"""The progress line of gen, verify, run and eval: on a terminal (a pseudo-terminal here) it appears,
rewritten with carriage returns; in a pipe, or with CI set, it does not; --progress and
--no-progress force it either way.

Environment: ATTNORACLE_CLI, ATTNORACLE_SUITE (vectors/core), ATTNORACLE_ADAPTER (the NumPy
example adapter).
"""
import json
import os
import pty
import random
import re
import select
import shutil
import struct
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


def write_case(path, nk, seed=5):
    """An sdpa case, B = Hq = Hkv = 1, Nq = 1, Dk = Dv = 1, F32 normal inputs, outputs out."""
    rng = random.Random(seed)
    tensors = {"q": [rng.gauss(0, 1)], "k": [rng.gauss(0, 1) for _ in range(nk)],
               "v": [rng.gauss(0, 1) for _ in range(nk)]}
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        data = struct.pack(f"<{len(tensors[name])}f", *tensors[name])
        header[name] = {"dtype": "F32", "shape": [1, 1, len(tensors[name]), 1],
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    header["__metadata__"] = {"attn.format": "1", "attn.kind": "sdpa", "attn.causal": "none",
                              "attn.window": "none", "attn.softcap": "0", "attn.output_dtype": "F32",
                              "attn.outputs": "out", "attn.masked_rows": "error"}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + b"".join(blobs))


def in_pipe(args, ci=False):
    r = subprocess.run([CLI, *args], capture_output=True, env=environment(ci), timeout=600)
    return r.returncode, r.stderr


# A duration as the command writes it: "250 ms", "1.5 s", "2 min 5 s", "1 h 5 min".
DURATION = rb"(?:[0-9.]+ (?:ms|s)|\d+ min(?: \d+ s)?|\d+ h(?: \d+ min)?)"
# "verify: 12/514 cases, 300 ms, about 9.1 s left" (the estimate once a case is done)
LINE = re.compile(rb"\r(gen|verify|run|check): \d+/\d+ (cases|results|compared), " + DURATION)
# "eval: 20/36 rows, 100 ms": the units of each pass of one evaluation
EVAL_LINE = re.compile(rb"\reval: \d+/\d+ ([a-z]+ )*(rows|keys|columns|heads)( of oracle twin \d+)?, " + DURATION)
# A case with every pass: rows, then the gradients' rows, keys, dbias columns and dsinks heads.
EVAL_CASE = "bwd_sinks-000"


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
        # the line is erased before the summary, which stays
        self.assertTrue(err.rstrip().endswith(n + b" checked, 0 problems"), err[-200:])
        # a run of seconds (the plain one can end before the first redraw, 100 ms in) gives an
        # estimate before the end
        status, err = on_terminal(["verify", SUITE, "--recompute", "--jobs", "2"])
        self.assertEqual(status, 0, err)
        self.assertIn(b" left", err)
        self.assertTrue(err.rstrip().endswith(n + b" checked and recomputed, 0 problems"), err[-200:])
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

    def test_eval(self):
        case = os.path.join(SUITE, "cases", EVAL_CASE + ".safetensors")
        out_tty, out_pipe = os.path.join(self.tmp, "eval-tty.safetensors"), os.path.join(self.tmp, "eval-pipe.safetensors")
        status, err = on_terminal(["eval", case, "-o", out_tty, "--threads", "2"])
        self.assertEqual(status, 0, err)
        self.assertRegex(err, EVAL_LINE)
        # each pass is drawn at its last unit: B Hq Nq = 36 rows, B Hkv Nk = 10 keys, the bias's
        # 1 x 4 x 5 columns, Hq = 4 heads; then the oracle's 16 sampled rows and its twins
        for part in [b"36/36 rows", b"36/36 gradient rows", b"10/10 gradient keys", b"20/20 dbias columns",
                     b"4/4 dsinks heads", b"16/16 oracle rows"]:
            self.assertIn(b"\reval: " + part + b", ", err)
        self.assertRegex(err, rb"\reval: \d+/\d+ gradient rows of oracle twin 1, ")
        # the line is erased before the summary, which stays
        summary = err[err.rindex(b"\r") + 1:]
        self.assertTrue(summary.startswith(out_tty.encode() + b": "), err[-300:])
        self.assertEqual(summary.count(b"\n"), 1)
        self.assertTrue(summary.endswith(b"\n"))
        status, err = in_pipe(["eval", case, "-o", out_pipe, "--threads", "2"])
        self.assertEqual(status, 0, err)
        self.assertNotIn(b"\r", err)
        self.assertIsNone(EVAL_LINE.search(err))
        self.assertTrue(err.startswith(out_pipe.encode() + b": "), err)
        # the same bytes with or without the line, and those of the committed vector
        with open(out_tty, "rb") as a, open(out_pipe, "rb") as b, open(case, "rb") as c:
            tty_bytes = a.read()
            self.assertEqual(tty_bytes, b.read())
            self.assertEqual(tty_bytes, c.read())
        status, err = on_terminal(["eval", case, "-o", out_pipe], ci=True)
        self.assertEqual(status, 0, err)
        self.assertNotIn(b"\r", err)
        status, err = on_terminal(["eval", case, "-o", out_pipe, "--no-progress"])
        self.assertEqual(status, 0, err)
        self.assertNotIn(b"\r", err)
        status, err = in_pipe(["eval", case, "-o", out_pipe, "--progress"], ci=True)
        self.assertEqual(status, 0, err)
        self.assertIn(b"\reval: 36/36 rows, ", err)
        status, err = on_terminal(["eval", case, "-o", out_pipe, "--quiet"])
        self.assertEqual((status, err), (0, b""))

    def test_eval_redraws_during_one_unit(self):
        """One row of 262144 keys by MPFR takes seconds: the line is redrawn meanwhile, with the
        same count (no unit has finished) and the time elapsed."""
        case = os.path.join(self.tmp, "one-long-row.safetensors")
        write_case(case, nk=262144)
        out = os.path.join(self.tmp, "long.safetensors")
        status, err = on_terminal(["eval", case, "-o", out, "--threads", "1", "--no-fast-path"])
        self.assertEqual(status, 0, err)
        self.assertRegex(err, rb"\reval: 0/1 rows, [0-9.]+ s")
        self.assertIn(b"\reval: 1/1 rows, ", err)

    def test_both_flags_refused(self):
        status, err = in_pipe(["verify", SUITE, "--progress", "--no-progress"])
        self.assertEqual(status, 2)
        self.assertEqual(err.count(b"\n"), 1)
        self.assertTrue(err.startswith(b"attnoracle: error: usage: "), err)


if __name__ == "__main__":
    unittest.main()
