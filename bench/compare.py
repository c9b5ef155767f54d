#!/usr/bin/python3
"""Whole-process benchmarks of `attnoracle eval` against the usual references, in one run.

    bash bench/compare.sh [--large] [options]          (set-up, build, then this script)
    /usr/bin/python3 bench/compare.py --attnoracle build/attnoracle [--large] [options]

On the same case files (bench/make_case.py: sdpa, B = H = 1, Nq = Nk = N, Dk = Dv = D, F32
inputs and outputs, seeded normal data, `out` only) it times, alternating the commands round by
round (A B C D A B C D ...) so that machine noise spreads over all of them:

  - attnoracle eval --threads 1 and --threads 2 (the certified reference),
  - attnoracle_floor --threads 1 and 2 (bench/floor.cpp: plain float64 attention in the same
    SIMD kernels' shape, uncertified, the timing floor), where that binary was built,
  - bench/numpy_ref.py (the usual uncertified float64 NumPy reference),
  - bench/mpmath_ref.py (mpmath at 30 digits), only where its estimated time, extrapolated from
    the previous size (or a 32 x 32 calibration), fits in --mpmath-budget seconds,

at N = 64, 256, 1024 with D = 64 (--sizes, -d), and with --large `attnoracle eval` and the floor
at N = 4096, 8192 with D = 128 (--large-sizes, --large-d), then eval, the floor and NumPy at
B = 1, H = 32, N = 4096, D = 128, BF16 inputs and outputs (--large-heads, --large-heads-n); and the
backward, eval against bench/torch_grad_ref.py (PyTorch float64 autograd), on B = 1, H = 1, N = 1024
(and 4096 with --large), D = 128, BF16 inputs and outputs, dq, dk and dv (--backward-sizes,
--large-backward-sizes, --backward-heads, --backward-d). Each command:
wall time (median of the runs, measured around the process), peak resident memory (GNU time's
%M), for eval the rows decided by the fast path, by MPFR and those that fell back (parsed from
eval's summary line on stderr), for eval and the floor their evaluation time (from their
summary lines), and the certified over the floor's times. Then the rows falling back to MPFR on
random data for each output dtype of --fallback-dtypes (one eval each, several heads for
resolution), and the targets checked on what was measured. Markdown on stdout and in --output,
with the command line that reproduces it.
"""
import argparse
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import make_case  # noqa: E402

TIME = "/usr/bin/time"
MIB = 1024 * 1024


# ---------------------------------------------------------------------------------------------
# eval's summary line

def parse_eval_summary(stderr):
    """What eval's stderr summary says about rows, tolerantly: a dict with the counts found
    (rows, fast, mpfr, fell_back, raised, undecided, seconds), the raw line, and the fast-path
    note when eval says it did not apply. Works with the MPFR-only format
    ("... N rows, M needed more precision ...") and the fast-path one
    ("... N rows, F by the fast path, R by MPFR (X fell back), M needed more precision ...")."""
    lines = [l for l in stderr.splitlines() if re.search(r"\d+\s+rows\b", l)]
    line = lines[-1] if lines else ""
    line = line.strip()
    m = re.match(r"\S+\.safetensors\S*:\s+", line)     # the output path eval prints first
    info = {"line": line[m.end():] if m else line}

    def grab(key, pattern):
        m = re.search(pattern, line, re.IGNORECASE)
        if m:
            info[key] = int(m.group(1))

    grab("rows", r"(\d+)\s+rows\b")
    grab("undecided", r"(\d+)\s+undecided")
    grab("raised", r"(\d+)\s+(?:rows\s+)?needed more precision")
    grab("fast", r"(\d+)\s+(?:rows\s+)?(?:decided\s+)?by the fast path")
    grab("mpfr", r"(\d+)\s+(?:rows\s+)?(?:decided\s+)?by MPFR")
    # "X fell back", "X rows fell back to MPFR", "fell back to MPFR: X", "fell back: X"
    for pattern in (r"(\d+)\s+(?:rows?\s+)?fell back", r"fell back(?:\s+to\s+MPFR)?\s*[:=]\s*(\d+)"):
        m = re.search(pattern, line, re.IGNORECASE)
        if m:
            info["fell_back"] = int(m.group(1))
            break
    m = re.search(r"gradient units (\d+) by the fast path \((\d+) fell back", line)
    if m:
        info["grad_fast"], info["grad_fallback"] = int(m.group(1)), int(m.group(2))
    m = re.search(r"all by MPFR\s*\(([^)]*)\)", line)
    if m:
        info["note"] = m.group(1)
    m = re.search(r"([\d.]+)\s*s on \d+ thread", line)
    if m:
        info["seconds"] = float(m.group(1))
    for key in ("reading", "evaluation", "oracle", "writing"):  # the parts, where eval gives them
        m = re.search(key + r"\s+([\d.]+)\s*s", line)
        if m:
            info[key] = float(m.group(1))
    return info


def describe_rows(info):
    """A short cell for the table: how the rows were decided."""
    rows = info.get("rows")
    if rows is None:
        return "?"
    if "fell_back" in info:
        fb = info["fell_back"]
        cell = f"{fb}/{rows} fell back ({fb / rows:.2g})" if rows else f"{fb}/0"
        if "mpfr" in info and info["mpfr"] != fb:
            cell += f"; {info['mpfr']} by MPFR"
        return cell
    if "note" in info:
        return f"all {rows} by MPFR ({info['note']})"
    if "fast" in info:
        return f"{rows - info['fast']}/{rows} by MPFR"
    return f"all {rows} by MPFR (no fast path); {info.get('raised', '?')} raised"


def parse_floor_summary(text):
    """The floor's stdout line "CASE: R rows, evaluation X s, whole Y s on T threads, checksum S"
    and, with --compare, "... max relative error E, max error / out.bound F": a dict of what
    was found (rows, evaluation, whole, checksum, rel, vs_bound) and the raw line."""
    info = {}
    for line in text.splitlines():
        m = re.search(r"(\d+) rows, evaluation ([\d.eE+-]+) s, whole ([\d.eE+-]+) s on \d+ threads?, checksum (\S+)",
                      line)
        if m:
            info.update(line=line[m.start():], rows=int(m.group(1)), evaluation=float(m.group(2)),
                        whole=float(m.group(3)), checksum=m.group(4))
        m = re.search(r"max relative error (\S+?),? ", line + " ")
        if m:
            info["rel"] = float(m.group(1))
        m = re.search(r"max error / out\.bound (\S+)", line)
        if m:
            info["vs_bound"] = float(m.group(1))
    return info


# ---------------------------------------------------------------------------------------------
# running one command

class Failure(Exception):
    pass


def run_once(argv, timeout, scratch, stdout=False):
    """Runs argv under GNU time: (wall seconds, peak RSS bytes, stderr text; with stdout, the
    stdout text after it). Raises Failure on a non-zero exit or a timeout (the whole process
    group is killed)."""
    timefile = os.path.join(scratch, "time.txt")
    full = [TIME, "-f", "%e %M", "-o", timefile] + argv
    t0 = time.perf_counter()
    proc = subprocess.Popen(full, stdout=subprocess.PIPE if stdout else subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise Failure(f"timed out after {timeout:.0f} s")
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = " | ".join(err.strip().splitlines()[-3:])
        raise Failure(f"exit status {proc.returncode}: {tail}")
    with open(timefile) as f:
        last = f.read().strip().splitlines()[-1]
    _, kib = last.split()
    return wall, int(kib) * 1024, (err + (out or "") if stdout else err)


class Command:
    def __init__(self, label, kind, argv_for, threads=None):
        self.label, self.kind, self.argv_for, self.threads = label, kind, argv_for, threads
        self.walls, self.peaks, self.infos = [], [], []
        self.reps = None          # how many runs this command gets (None: the size's default)
        self.note = ""            # why it was skipped or cut short
        self.failed = None
        self.last_output = None   # the output file of the last run (kept for the agreement check)

    def median(self):
        return statistics.median(self.walls) if self.walls else None

    def peak(self):
        return max(self.peaks) if self.peaks else None


# ---------------------------------------------------------------------------------------------

def parse_list(text, cast=int):
    return [cast(x) for x in text.split(",") if x.strip()]


def environment(args):
    """Lines describing the machine and the software, for the report header."""
    lines = []
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    lines.append(f"- machine: {platform.node()}, {cpu}, {os.cpu_count()} logical CPUs, "
                 f"Linux {platform.release()}")
    try:
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        lines.append(f"- repository (these scripts{', and the binary built from it' if os.path.abspath(args.attnoracle).startswith(ROOT + os.sep) else ''}): "
                     f"commit {commit}{' with uncommitted changes' if dirty else ''}")
    except (OSError, subprocess.CalledProcessError):
        pass
    build_type = "?"
    cache = os.path.join(os.path.dirname(os.path.abspath(args.attnoracle)), "CMakeCache.txt")
    if os.path.exists(cache):
        with open(cache) as f:
            for line in f:
                if line.startswith("CMAKE_BUILD_TYPE:"):
                    build_type = line.split("=", 1)[1].strip()
    lines.append(f"- attnoracle: `{args.attnoracle}` (CMake build type {build_type})")
    lines.append(f"- floor: `{args.floor_path}` (plain float64, uncertified)" if args.floor_path
                 else "- floor: not built (no attnoracle_floor beside the attnoracle binary)")
    import numpy
    blas_env = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
                if k in os.environ}
    lines.append(f"- Python {platform.python_version()} (`{sys.executable}`), NumPy {numpy.__version__} "
                 f"(BLAS threads: {blas_env or 'library default'})")
    try:
        import mpmath
        lines.append(f"- mpmath {mpmath.__version__}, backend {mpmath.libmp.BACKEND}, 30 digits")
    except ImportError:
        lines.append("- mpmath: not installed (Debian python3-mpmath)")
    return lines


def loadavg():
    """The 1-minute load average, or None."""
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def agreement(golden_path, other_path, names=("out",)):
    """How many elements of the tensors `names` in other_path equal the golden ones (an undecided
    element may equal either candidate; +0 and -0 are the same value). Returns (equal, total)."""
    import numpy as np
    from numpy_ref import load
    g, _ = load(golden_path)
    o, _ = load(other_path)
    equal = total = 0
    for name in names:
        a, b = g[name].astype(np.float64).ravel(), o[name].astype(np.float64).ravel()
        same = a == b
        if name + ".undecided" in g:
            idx = g[name + ".undecided"]
            same[idx] |= g[name + ".alt"].astype(np.float64) == b[idx]
        equal, total = equal + int(same.sum()), total + int(a.size)
    return equal, total


def write_results(case_path, out_path, names):
    """Writes the tensors `names` of a case file as a result file (safetensors, standard library
    only); returns their bytes."""
    with open(case_path, "rb") as f:
        blob = f.read()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    data = blob[8 + n:]
    out_header, chunks, offset = {}, [], 0
    for name in names:
        t = header[name]
        start, end = t["data_offsets"]
        chunks.append(data[start:end])
        out_header[name] = {"dtype": t["dtype"], "shape": t["shape"], "data_offsets": [offset, offset + end - start]}
        offset += end - start
    text = json.dumps(out_header).encode()
    text += b" " * (-len(text) % 8)
    with open(out_path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(chunks))
    return offset


def shown_path(path):
    """A path for the report: relative to the repository when inside it."""
    path = os.path.abspath(path)
    return os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else path


def info_median(c, key):
    """The median of `key` over a command's parsed summary lines, or None."""
    vals = [i[key] for i in (c.infos if c else []) if key in i]
    return statistics.median(vals) if vals else None


def fmt(x, digits=3):
    if x is None:
        return "–"
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.{digits}g}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attnoracle", default=os.environ.get("ATTNORACLE", os.path.join(ROOT, "build", "attnoracle")),
                   help="the attnoracle binary (default $ATTNORACLE, else build/attnoracle)")
    p.add_argument("--sizes", default="64,256,1024", help="N of the comparison cases (default 64,256,1024)")
    p.add_argument("-d", type=int, default=64, help="D of the comparison cases (default 64)")
    p.add_argument("--floor",
                   help="the floor binary (default BUILD/bench/attnoracle_floor beside --attnoracle's BUILD)")
    p.add_argument("--large", action="store_true",
                   help="also eval and the floor at --large-sizes with --large-d, and the 32-head case")
    p.add_argument("--large-sizes", default="4096,8192", help="default 4096,8192")
    p.add_argument("--large-d", type=int, default=128, help="default 128")
    p.add_argument("-k", "--reps", type=int, default=3, help="runs per command (the median is reported; default 3)")
    p.add_argument("--large-reps", type=int, help="runs per command at the large sizes (default --reps)")
    p.add_argument("--large-heads", type=int, default=32,
                   help="heads of --large's many-head case (B = 1, N = --large-heads-n, D = --large-d, BF16 "
                        "inputs and outputs; eval, the floor and NumPy); 0 to skip (default 32)")
    p.add_argument("--large-heads-n", type=int, default=4096, help="N of the many-head case (default 4096)")
    p.add_argument("--threads", default="1,2", help="eval thread counts (default 1,2)")
    p.add_argument("--mpmath-budget", type=float, default=300,
                   help="seconds one mpmath run may take (estimated beforehand); beyond, skipped (default 300)")
    p.add_argument("--no-mpmath", action="store_true")
    p.add_argument("--no-decode", action="store_true",
                   help="skip the decode shape (B = 1, Hq = 32 over Hkv = 8, Nq = 8, Nk = 2048, D = 128, BF16)")
    p.add_argument("--long-rows-nk", type=int, default=65536,
                   help="Nk of the long-row shape (B = 1, H = 4, Nq = 16, D = 128, F16 inputs and outputs, "
                        "out and weights); 0 to skip (default 65536)")
    p.add_argument("--mpfr-only", action="store_true",
                   help="also time `eval --no-fast-path` (all rows by MPFR) with the most threads, where eval has it")
    p.add_argument("--fallback-dtypes", default="F32,F16,BF16",
                   help="output dtypes whose MPFR fallback rate is measured (one eval each; '' for none)")
    p.add_argument("--fallback-n", type=int, help="N of the fallback cases (default: the largest of --sizes)")
    p.add_argument("--fallback-heads", type=int, default=10,
                   help="heads of the fallback cases, for resolution: rows = heads * N (default 10)")
    p.add_argument("--check-n", type=int, default=1024,
                   help="N of the `check` throughput case (8 heads, D = 64, F32, out, weights and lse; "
                        "0 to skip; default 1024)")
    p.add_argument("--backward-sizes", default="1024",
                   help="N of the backward cases (sdpa, BF16 inputs and outputs, dq, dk, dv; default 1024; "
                        "--large adds --large-backward-sizes; empty: none)")
    p.add_argument("--large-backward-sizes", default="4096", help="default 4096")
    p.add_argument("--backward-heads", type=int, default=1, help="H of the backward cases (default 1)")
    p.add_argument("--backward-d", type=int, default=128, help="D of the backward cases (default 128)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=3600, help="seconds any one run may take (default 3600)")
    p.add_argument("--workdir", help="where the case and output files go (default a temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("-o", "--output", default=os.path.join(HERE, "results.md"),
                   help="the Markdown report (default bench/results.md)")
    args = p.parse_args(argv)

    if not os.access(args.attnoracle, os.X_OK):
        p.error(f"{args.attnoracle}: no attnoracle binary (build with tools/build.sh, or pass --attnoracle)")
    if not os.access(TIME, os.X_OK):
        p.error(f"{TIME} is missing (Debian package time)")
    if args.reps < 1:
        p.error("--reps must be at least 1")
    if args.large_heads < 0 or args.large_heads_n < 1:
        p.error("--large-heads must be at least 0 and --large-heads-n at least 1")
    threads = parse_list(args.threads)
    sizes = sorted(parse_list(args.sizes))
    large = sorted(parse_list(args.large_sizes)) if args.large else []
    have_mpmath = False
    if not args.no_mpmath:
        import importlib.util
        if importlib.util.find_spec("mpmath"):
            have_mpmath = True
        else:
            print("compare: mpmath is not installed (Debian python3-mpmath): mpmath skipped", file=sys.stderr)
    default_floor = os.path.join(os.path.dirname(os.path.abspath(args.attnoracle)), "bench", "attnoracle_floor")
    floor = args.floor or default_floor
    if not os.access(floor, os.X_OK):
        if args.floor:
            p.error(f"{floor}: no attnoracle_floor binary")
        print(f"compare: {floor} is missing: the floor is not measured", file=sys.stderr)
        floor = None
    args.floor_path = floor
    eval_help = subprocess.run([args.attnoracle, "eval", "--help"], capture_output=True, text=True).stdout
    has_no_fast = "--no-fast-path" in eval_help

    wrapper = os.environ.get("BENCH_WRAPPER")
    shown = [a for a in (argv if argv is not None else sys.argv[1:])]
    if wrapper:
        reproduce = "bash bench/compare.sh " + shlex.join(shown)
        if os.environ.get("BENCH_GIVEN_BINARY"):
            reproduce = f"ATTNORACLE={shlex.quote(os.environ['BENCH_GIVEN_BINARY'])} " + reproduce
    else:
        reproduce = f"{sys.executable} bench/compare.py " + shlex.join(shown)
    reproduce = reproduce.strip()

    workdir = args.workdir or tempfile.mkdtemp(prefix="attnoracle-bench-")
    os.makedirs(workdir, exist_ok=True)
    py = sys.executable
    numpy_ref = os.path.join(HERE, "numpy_ref.py")
    torch_ref = os.path.join(HERE, "torch_grad_ref.py")
    mpmath_ref = os.path.join(HERE, "mpmath_ref.py")
    started = datetime.datetime.now()
    load_before = loadavg()
    if load_before is not None and load_before > 0.5:
        print(f"compare: warning: load average {load_before:.2f} before the start: other processes "
              "compete for the CPUs (thread scaling and ratios will suffer)", file=sys.stderr)
    log = lambda msg: print(f"[{time.perf_counter() - t_start:7.1f} s] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    t_start = time.perf_counter()

    notes = []
    if not floor:
        notes.append(f"the floor (`{shown_path(default_floor)}`) is missing: build it with "
                     "`cmake --build BUILD --target attnoracle_floor` (ATTNORACLE_BENCHMARKS on), "
                     "or pass --floor; its figures and target are not measured")
    if args.mpfr_only and not has_no_fast:
        notes.append("--mpfr-only ignored: this attnoracle eval has no --no-fast-path")
    mp_cost = None  # seconds per unit of work Nq * Nk * (Dk + Dv), from the last mpmath run

    def work(n, d):
        return n * n * (d + d)

    def eval_cmd(t, extra=()):
        return lambda case, out: [args.attnoracle, "eval", case, "-o", out, "--threads", str(t), *extra]

    def measure_size(n, d, with_refs, reps, decode=False, heads=None, long_nk=None, backward=False):
        """Builds the case, runs the commands alternately, returns (case bytes, [Command]).
        decode: the decode shape instead (B = 1, Hq = 32 over Hkv = 8, Nq = 8, Nk = 2048,
        D = 128, BF16 inputs and outputs), with NumPy but no mpmath. heads: that many heads,
        BF16 inputs and outputs, no mpmath either. long_nk: the long-row shape (B = 1, H = 4,
        Nq = n, Nk = long_nk, D = d, F16 inputs and outputs, out and weights), NumPy but no
        mpmath. backward: the backward case (B = 1, H = heads, BF16 inputs and outputs, dout,
        dq, dk and dv), eval against torch_grad_ref.py only. The floor runs at every size but the
        backward's."""
        nonlocal mp_cost
        tag = (f"backward {n}x{n} D={d} H={heads}" if backward else "decode" if decode else f"long rows {n}x{long_nk}" if long_nk
               else f"{n}x{n} D={d}" + (f" H={heads}" if heads else ""))
        if backward:
            case = os.path.join(workdir, f"backward-H{heads}-{n}x{n}-D{d}-bf16.safetensors")
            case_bytes = make_case.make_case(case, n, d, heads=heads, seed=args.seed, input_dtype="BF16",
                                             output_dtype="BF16", backward=True)
        elif long_nk:
            case = os.path.join(workdir, f"long-rows-{n}x{long_nk}-D{d}-f16.safetensors")
            case_bytes = make_case.make_case(case, n, d, heads=4, nk=long_nk, seed=args.seed, input_dtype="F16",
                                             output_dtype="F16", weights=True)
        elif decode:
            case = os.path.join(workdir, "decode.safetensors")
            case_bytes = make_case.make_case(case, 8, 128, heads=32, kv_heads=8, nk=2048, seed=args.seed,
                                             input_dtype="BF16", output_dtype="BF16")
        elif heads:
            case = os.path.join(workdir, f"sdpa-H{heads}-{n}x{n}-D{d}-bf16.safetensors")
            case_bytes = make_case.make_case(case, n, d, heads=heads, seed=args.seed, input_dtype="BF16",
                                             output_dtype="BF16")
        else:
            case = os.path.join(workdir, f"sdpa-{n}x{n}-D{d}.safetensors")
            case_bytes = make_case.make_case(case, n, d, seed=args.seed)
        cmds = [Command(f"attnoracle eval, {t} thread{'s' if t > 1 else ''}", "eval", eval_cmd(t), t)
                for t in threads]
        if args.mpfr_only and has_no_fast:
            t = max(threads)
            cmds.append(Command(f"attnoracle eval --no-fast-path, {t} thread{'s' if t > 1 else ''}",
                                "eval-mpfr", eval_cmd(t, ["--no-fast-path"]), t))
        if backward:
            cmds.append(Command("torch_grad_ref.py (float64 autograd)", "torch",
                                lambda c, o: [py, torch_ref, c, "-o", o]))
        if floor and not backward:
            cmds += [Command(f"floor (fp64, uncertified), {t} thread{'s' if t > 1 else ''}", "floor",
                             lambda c, o, t=t: [floor, c, "--threads", str(t)], t) for t in threads]
        if with_refs and not backward:
            cmds.append(Command("numpy_ref.py (float64)", "numpy", lambda c, o: [py, numpy_ref, c, "-o", o]))
            if have_mpmath and not decode and not heads and not long_nk:
                mp = Command("mpmath_ref.py (30 digits)", "mpmath", lambda c, o: [py, mpmath_ref, c, "-o", o])
                if mp_cost is None:  # calibrate on a 32 x 32 case
                    cal = os.path.join(workdir, f"calibration-32x32-D{d}.safetensors")
                    make_case.make_case(cal, 32, d, seed=args.seed)
                    try:
                        w, _, _ = run_once([py, mpmath_ref, cal, "-o", cal + ".out"], args.timeout, workdir)
                        mp_cost = w / work(32, d)
                        notes.append(f"mpmath calibration: 32x32, D={d}: {w:.2f} s")
                    except Failure as e:
                        notes.append(f"mpmath calibration failed: {e}")
                        mp_cost = float("inf")
                    for f in (cal, cal + ".out"):
                        if os.path.exists(f):
                            os.remove(f)
                estimate = mp_cost * work(n, d)
                if estimate > args.mpmath_budget:
                    mp.reps = 0
                    mp.note = (f"skipped: estimated {estimate:.0f} s per run (from the previous size) "
                               f"> --mpmath-budget {args.mpmath_budget:.0f} s")
                elif estimate * reps > args.mpmath_budget:
                    mp.reps = 1
                    mp.note = f"1 run only: estimated {estimate:.0f} s per run"
                mp.estimate = estimate
                cmds.append(mp)
        for r in range(reps):
            for c in cmds:
                if c.failed or (c.reps is not None and r >= c.reps):
                    continue
                out = os.path.join(workdir, f"out-{c.kind}-{c.threads or 0}-{n}-{d}.safetensors")
                timeout = args.timeout
                if c.kind == "mpmath":
                    timeout = min(args.timeout, max(60.0, 3 * c.estimate))
                try:
                    wall, peak, err = run_once(c.argv_for(case, out), timeout, workdir, stdout=c.kind == "floor")
                except Failure as e:
                    c.failed = str(e)
                    log(f"{tag} {c.label}: FAILED {e}")
                    continue
                c.walls.append(wall)
                c.peaks.append(peak)
                if c.kind.startswith("eval") or c.kind == "floor":
                    info = parse_eval_summary(err) if c.kind != "floor" else parse_floor_summary(err)
                    c.infos.append(info)
                log(f"{tag} {c.label} run {r + 1}: {wall:.3f} s, {peak / MIB:.1f} MiB"
                    + (f"; {info.get('line', '')}" if c.kind.startswith("eval") or c.kind == "floor" else ""))
                if c.last_output and c.last_output != out and os.path.exists(c.last_output):
                    os.remove(c.last_output)
                c.last_output = out
        for c in cmds:  # mpmath's cost per unit of work, for the next size's estimate
            if c.kind == "mpmath" and c.walls:
                mp_cost = c.median() / work(n, d)
        return case, case_bytes, cmds

    def measure_check(n):
        """`check` on two result sets of one case: its own golden tensors (every element equal to
        the golden one: the comparison's fast path) and the NumPy adapter's float32 results (most
        elements differ: every element through the full comparison, as for most implementations).
        Returns [(label, result bytes, Command)], runs alternating between the two."""
        spec = os.path.join(workdir, "check-spec.json")
        with open(spec, "w") as f:
            json.dump({"suite": "bench-check", "seed": args.seed, "families": [
                {"name": "check", "generator": "normal", "fixed": {
                    "dtype": "F32", "shape": [1, 8, 8, n, n, 64, 64], "outputs": "out,weights,lse"}}]}, f)
        vset = os.path.join(workdir, "check-set")
        try:
            wall, _, _ = run_once([args.attnoracle, "gen", spec, "-o", vset, "--quiet"], args.timeout, workdir)
            log(f"check: vector set of {n}x{n}, 8 heads generated in {wall:.1f} s")
        except Failure as e:
            cmd = Command("attnoracle check, 1 thread", "check", None, 1)
            cmd.failed = f"gen failed: {e}"
            return [("golden copy", 0, cmd)]
        case_file = os.path.join(vset, "cases", "check-000.safetensors")
        sets = []
        rdir = os.path.join(workdir, "check-golden")
        os.makedirs(rdir, exist_ok=True)
        sets.append(("golden copy", rdir, write_results(case_file, os.path.join(rdir, "check-000.safetensors"),
                                                        ("out", "weights", "lse"))))
        rdir = os.path.join(workdir, "check-numpy")
        os.makedirs(rdir, exist_ok=True)
        out = os.path.join(rdir, "check-000.safetensors")
        jobs = os.path.join(workdir, "check-jobs.jsonl")
        with open(jobs, "w") as f:
            f.write(json.dumps({"id": "check-000", "input": case_file, "output": out}) + "\n")
        adapter = os.path.join(HERE, "..", "conformance", "adapters", "numpy", "attention.py")
        try:
            run_once([sys.executable, adapter, jobs], args.timeout, workdir)
            with open(out, "rb") as f:
                blob = f.read()
            header = json.loads(blob[8:8 + struct.unpack("<Q", blob[:8])[0]])
            sets.append(("NumPy float32", rdir, sum(t["data_offsets"][1] - t["data_offsets"][0]
                                                    for k, t in header.items() if k != "__metadata__")))
        except (Failure, OSError, ValueError) as e:
            log(f"check: no NumPy results ({e})")
        measured = []
        for label, rdir, result_bytes in sets:
            measured.append((label, result_bytes, Command(f"attnoracle check, 1 thread, {label}", "check", None, 1),
                             [args.attnoracle, "check", vset, "--results", rdir, "--profile", "fp32", "--threads", "1",
                              "--no-progress"]))
        for r in range(args.reps):
            for label, result_bytes, cmd, argv in measured:
                if cmd.failed:
                    continue
                try:
                    wall, peak, _ = run_once(argv, args.timeout, workdir)
                except Failure as e:
                    cmd.failed = str(e)
                    log(f"check ({label}): FAILED {e}")
                    continue
                cmd.walls.append(wall)
                cmd.peaks.append(peak)
                log(f"check ({label}) run {r + 1}: {wall:.3f} s, {result_bytes / wall / 1e6:.0f} MB/s")
        return [(label, result_bytes, cmd) for label, result_bytes, cmd, _ in measured]

    def floor_agreement(case, golden, cmds, agree):
        """One untimed floor run with --compare on eval's golden output: agree[label] = the
        floor's max error over out.bound (and relative), for every floor command."""
        if not floor or not golden or not os.path.exists(golden):
            return
        try:
            _, _, text = run_once([floor, case, "--threads", str(max(threads)), "--compare", golden], args.timeout,
                                  workdir, stdout=True)
        except Failure as e:
            log(f"floor --compare: FAILED {e}")
            return
        info = parse_floor_summary(text)
        for c in cmds:
            if c.kind == "floor":
                agree[c.label] = info

    def golden_cell(value):
        """The `out = golden` cell: (equal, total) of eval's agreement, or the floor's errors."""
        if isinstance(value, dict):
            if "vs_bound" in value:
                return f"max err / out.bound {value['vs_bound']:.2g}"
            return f"max rel. err {value['rel']:.2g}" if "rel" in value else "?"
        return f"{value[0]}/{value[1]}"

    results = []   # (n, d, case_bytes, cmds, agreement dict)
    try:
        for n in sizes:
            case, case_bytes, cmds = measure_size(n, args.d, True, args.reps)
            agree = {}
            golden = next((c.last_output for c in cmds if c.kind == "eval" and c.last_output), None)
            if golden:
                for c in cmds:
                    if c.kind in ("numpy", "mpmath", "eval-mpfr") and c.last_output:
                        agree[c.label] = agreement(golden, c.last_output)
            floor_agreement(case, golden, cmds, agree)
            results.append((n, args.d, case_bytes, cmds, agree))
            for c in cmds:
                if c.last_output and os.path.exists(c.last_output):
                    os.remove(c.last_output)
            os.remove(case)
        def shape(*a, **kw):
            """measure_size with NumPy, then the agreement of NumPy and the floor with eval's
            golden out; the files removed. Returns (case bytes, cmds, agreement)."""
            case, case_bytes, cmds = measure_size(*a, **kw)
            golden = next((c.last_output for c in cmds if c.kind == "eval" and c.last_output), None)
            agree = {c.label: agreement(golden, c.last_output) for c in cmds
                     if golden and c.kind == "numpy" and c.last_output}
            floor_agreement(case, golden, cmds, agree)
            for c in cmds:
                if c.last_output and os.path.exists(c.last_output):
                    os.remove(c.last_output)
            os.remove(case)
            return case_bytes, cmds, agree

        # (case bytes, cmds, agreement) of the decode shape and the long-row shape (B = 1, H = 4,
        # Nq = 16, Nk = --long-rows-nk, F16)
        decode = None if args.no_decode else shape(8, 128, True, args.reps, decode=True)
        long_rows = shape(16, 128, True, args.reps, long_nk=args.long_rows_nk) if args.long_rows_nk > 0 else None
        for n in large:
            case, case_bytes, cmds = measure_size(n, args.large_d, False, args.large_reps or args.reps)
            agree = {}
            floor_agreement(case, next((c.last_output for c in cmds if c.kind == "eval" and c.last_output), None),
                            cmds, agree)
            results.append((n, args.large_d, case_bytes, cmds, agree))
            for c in cmds:
                if c.last_output and os.path.exists(c.last_output):
                    os.remove(c.last_output)
            os.remove(case)
        # The backward: (n, case bytes, cmds, agreement of torch's dq, dk, dv with the golden ones).
        backward = []
        for n in sorted(set(parse_list(args.backward_sizes) + (parse_list(args.large_backward_sizes)
                                                               if args.large else []))):
            case, case_bytes, cmds = measure_size(n, args.backward_d, False, args.reps, heads=args.backward_heads,
                                                  backward=True)
            golden = next((c.last_output for c in cmds if c.kind == "eval" and c.last_output), None)
            agree = {c.label: agreement(golden, c.last_output, ("dq", "dk", "dv")) for c in cmds
                     if golden and c.kind == "torch" and c.last_output}
            backward.append((n, case_bytes, cmds, agree))
            for c in cmds:
                if c.last_output and os.path.exists(c.last_output):
                    os.remove(c.last_output)
            os.remove(case)
        heads = None  # (case bytes, cmds, agreement): B = 1, H = 32, N = 4096, D = 128, BF16
        if args.large and args.large_heads > 0:
            heads = shape(args.large_heads_n, args.large_d, True, args.large_reps or args.reps, heads=args.large_heads)

        # Fallback rates per output dtype, on random data with several heads.
        fallback = []
        fb_n = args.fallback_n or (sizes[-1] if sizes else 256)
        for dtype in parse_list(args.fallback_dtypes, str):
            case = os.path.join(workdir, f"fallback-{dtype}.safetensors")
            make_case.make_case(case, fb_n, args.d, heads=args.fallback_heads, seed=args.seed + 1,
                                output_dtype=dtype)
            out = case + ".out"
            t = max(threads)
            try:
                wall, peak, err = run_once([args.attnoracle, "eval", case, "-o", out, "--threads", str(t)],
                                           args.timeout, workdir)
                info = parse_eval_summary(err)
                log(f"fallback {dtype}: {wall:.2f} s; {info['line']}")
                fallback.append((dtype, wall, info, None))
            except Failure as e:
                fallback.append((dtype, None, {}, str(e)))
            for f in (case, out):
                if os.path.exists(f):
                    os.remove(f)

        # `check` on one thread: a one-case vector set made by `attnoracle gen`, the results its
        # own golden out, weights and lse (what a correct implementation returns at best) and the
        # NumPy adapter's.
        check = None  # [(label, result bytes, Command)]
        if args.check_n > 0:
            check = measure_check(args.check_n)
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)

    # ---- the report ----
    md = []
    md.append(f"# attnoracle eval against the usual references ({started:%Y-%m-%d %H:%M})")
    md.append("")
    md.append("Reproduce:")
    md.append("")
    md.append(f"    {reproduce}")
    md.append("")
    md.extend(environment(args))
    if load_before is not None:
        md.append(f"- load average (1 min) before the start: {load_before:.2f}"
                  + (" (other processes were competing for the CPUs: the figures are noisy)"
                     if load_before > 0.5 else ""))
    md.append(f"- cases: bench/make_case.py, sdpa, B = H = 1, Nq = Nk = N, Dk = Dv = D, F32 inputs and "
              f"outputs, standard normal data (seed {args.seed}), `out` only; {args.reps} runs per command "
              f"(alternating), median wall time measured around the process; peak = GNU time's maximum "
              f"resident set size (MiB = 2^20 bytes)")
    md.append("")
    md.append("| size | command | runs | median wall s | peak MiB | vs NumPy | mpmath / this | 2 vs 1 thread "
              "| rows by MPFR | out = golden |")
    md.append("|---|---|---|---|---|---|---|---|---|---|")
    by_size = {}
    for n, d, case_bytes, cmds, agree in results:
        get = lambda kind, t=None: next((c for c in cmds if c.kind == kind and (t is None or c.threads == t)  # noqa: E731
                                         and c.walls), None)
        npy, mpm = get("numpy"), get("mpmath")
        e1 = get("eval", min(threads)) if threads else None
        f1 = get("floor", min(threads)) if threads else None
        by_size[(n, d)] = (case_bytes, cmds)
        size = f"{n}x{n}, D={d} ({case_bytes / MIB:.2f} MiB case)"
        for c in cmds:
            if not c.walls:
                why = c.failed or c.note or "not run"
                md.append(f"| {size} | {c.label} | 0 | – | – | – | – | – | – | {why} |")
                continue
            med = c.median()
            vs_np = fmt(med / npy.median()) + "x" if npy else "–"
            vs_mp = fmt(mpm.median() / med) + "x" if (mpm and c.kind.startswith("eval")) else "–"
            speed = "–"
            one = {"eval": e1, "floor": f1}.get(c.kind)
            if one and c.threads != one.threads:
                speed = f"{one.median() / med:.2f}x"
            rows = describe_rows(c.infos[-1]) if c.infos and c.kind.startswith("eval") else "–"
            same = golden_cell(agree[c.label]) if c.label in agree else "–"
            runs = str(len(c.walls)) + (f" ({c.note})" if c.note else "") + (f" ({c.failed})" if c.failed else "")
            md.append(f"| {size} | {c.label} | {runs} | {fmt(med, 4)} | {c.peak() / MIB:.1f} | {vs_np} | {vs_mp} "
                      f"| {speed} | {rows} | {same} |")
    md.append("")
    md.append("`vs NumPy`: this command's median wall time over numpy_ref.py's. `mpmath / this`: mpmath_ref.py's "
              "median over this command's. `2 vs 1 thread`: eval's (the floor's) 1-thread median over "
              "this one's. "
              "`rows by MPFR`: from eval's summary line (fast path: the rows that fell back). "
              "`out = golden`: elements of the command's `out` equal to the golden `out` of eval (with the fast path); "
              "for the floor, which writes no file, its largest error against eval's `out.ref` over `out.bound` "
              "(one more run with --compare, not timed).")

    def shape_table(title, shape):
        case_bytes, cmds, agree = shape
        npy = next((c for c in cmds if c.kind == "numpy" and c.walls), None)
        md.append("")
        md.append(f"## {title} ({case_bytes / MIB:.2f} MiB case)")
        md.append("")
        md.append("eval's parts are the medians of what its summary line gives (evaluation, the oracle's twin "
                  "checks), the floor's its evaluation; `whole / evaluation` is the median wall time over the "
                  "median evaluation time.")
        md.append("")
        md.append("| command | runs | median wall s | peak MiB | vs NumPy | evaluation s | oracle s "
                  "| whole / evaluation | out = golden |")
        md.append("|---|---|---|---|---|---|---|---|---|")
        for c in cmds:
            if not c.walls:
                md.append(f"| {c.label} | 0 | – | – | – | – | – | – | {c.failed or 'not run'} |")
                continue
            med = c.median()
            part = lambda key: statistics.median([i[key] for i in c.infos if key in i]) if any(  # noqa: E731
                key in i for i in c.infos) else None
            ev, orc = part("evaluation"), part("oracle")
            eq = golden_cell(agree[c.label]) if c.label in agree else "–"
            md.append(f"| {c.label} | {len(c.walls)} | {fmt(med, 4)} | {c.peak() / MIB:.1f} "
                      f"| {fmt(med / npy.median()) + 'x' if npy else '–'} | {fmt(ev, 4) if ev else '–'} "
                      f"| {fmt(orc, 4) if orc is not None else '–'} | {fmt(med / ev) + 'x' if ev else '–'} | {eq} |")

    if decode:
        shape_table("Decode shape: B = 1, Hq = 32 over Hkv = 8, Nq = 8, Nk = 2048, D = 128, BF16 inputs and outputs",
                    decode)
    if long_rows:
        shape_table(f"Long rows: B = 1, H = 4, Nq = 16, Nk = {args.long_rows_nk}, D = 128, F16 inputs and outputs, "
                    "out and weights", long_rows)
    if heads:
        shape_table(f"Many heads (--large): B = 1, H = {args.large_heads}, Nq = Nk = {args.large_heads_n}, "
                    f"D = {args.large_d}, BF16 inputs and outputs", heads)

    if backward:
        md.append("")
        md.append(f"## Backward: sdpa, B = 1, H = {args.backward_heads}, Nq = Nk = N, D = {args.backward_d}, "
                  "BF16 inputs and outputs, dq, dk and dv")
        md.append("")
        md.append("eval's whole process (the forward rows, the three gradient passes, the oracle's twin checks, "
                  "reading and writing) against torch_grad_ref.py's (PyTorch float64 autograd of plain attention, "
                  "forward and backward, the import of torch included). Evaluation and oracle: the medians of "
                  "eval's summary line's parts. `grads = golden`: elements of torch's dq, dk, dv (rounded once "
                  "to BF16) equal to eval's golden ones.")
        md.append("")
        md.append("| N | command | runs | median wall s | peak MiB | vs torch | evaluation s | oracle s "
                  "| oracle / torch | units by MPFR | grads = golden |")
        md.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for n, case_bytes, cmds, agree in backward:
            tor = next((c for c in cmds if c.kind == "torch" and c.walls), None)
            for c in cmds:
                if not c.walls:
                    md.append(f"| {n} | {c.label} | 0 | – | – | – | – | – | – | – | {c.failed or 'not run'} |")
                    continue
                med = c.median()
                ev, orc = info_median(c, "evaluation"), info_median(c, "oracle")
                units = "–"
                if c.infos and "grad_fast" in c.infos[-1]:
                    i = c.infos[-1]
                    units = f"{i['grad_fallback']}/{i['grad_fast'] + i['grad_fallback']}"
                md.append(f"| {n} | {c.label} | {len(c.walls)} | {fmt(med, 4)} | {c.peak() / MIB:.1f} "
                          f"| {fmt(med / tor.median()) + 'x' if tor else '–'} | {fmt(ev, 4) if ev else '–'} "
                          f"| {fmt(orc, 4) if orc is not None else '–'} "
                          f"| {fmt(orc / tor.median()) + 'x' if tor and orc is not None else '–'} | {units} "
                          f"| {golden_cell(agree[c.label]) if c.label in agree else '–'} |")

    # ---- the floor ----
    def cmd_of(cmds, kind, t):
        return next((c for c in cmds if c.kind == kind and c.threads == t and c.walls), None)

    if floor:
        sets = [(f"{n}x{n}, D={d}", cmds) for n, d, _, cmds, _ in results]
        if decode:
            sets.append(("decode shape", decode[1]))
        if long_rows:
            sets.append((f"long rows, 16x{args.long_rows_nk}", long_rows[1]))
        if heads:
            sets.append((f"H = {args.large_heads}, {args.large_heads_n}x{args.large_heads_n}, D={args.large_d}, "
                         "BF16", heads[1]))
        md.append("")
        md.append("## The floor: uncertified fp64 SIMD evaluation by the same kernels")
        md.append("")
        md.append(f"`{shown_path(floor)}` (bench/floor.cpp): plain float64 attention with the fast path's layout "
                  "and SIMD lanes (keys in blocks of 8, MulAdd dots, exp, P V with the columns in lanes), nothing "
                  "certified. Whole: median wall time around the process; evaluation: the median of the evaluation "
                  "time each prints (eval: the evaluation part of its summary line, without reading, the oracle's "
                  "twins and writing, in milliseconds; the floor: after reading, the key transposition "
                  "included).")
        md.append("")
        md.append("| size | threads | floor whole s | floor evaluation s | eval whole s | eval evaluation s "
                  "| certified / floor, evaluation | certified / floor, whole |")
        md.append("|---|---|---|---|---|---|---|---|")
        for label, cmds in sets:
            for t in threads:
                f, e = cmd_of(cmds, "floor", t), cmd_of(cmds, "eval", t)
                if not f and not e:
                    continue
                fw, fe = (f.median(), info_median(f, "evaluation")) if f else (None, None)
                ew, ee = (e.median(), info_median(e, "evaluation")) if e else (None, None)
                r_ev = fmt(ee / fe) + "x" if ee and fe else "–"
                r_wh = fmt(ew / fw) + "x" if ew and fw else "–"
                md.append(f"| {label} | {t} | {fmt(fw, 4)} | {fmt(fe, 3)} | {fmt(ew, 4)} | {fmt(ee, 3)} "
                          f"| {r_ev} | {r_wh} |")

    if fallback:
        md.append("")
        md.append(f"## Rows falling back to MPFR, random data ({fb_n}x{fb_n}, D={args.d}, "
                  f"{args.fallback_heads} heads, F32 inputs; one eval on {max(threads)} threads)")
        md.append("")
        md.append("| output dtype | rows | fast path | by MPFR | fell back | fraction | wall s |")
        md.append("|---|---|---|---|---|---|---|")
        for dtype, wall, info, err in fallback:
            if err:
                md.append(f"| {dtype} | – | – | – | – | {err} | – |")
                continue
            rows = info.get("rows")
            fb = info.get("fell_back")
            frac = f"{fb / rows:.2g}" if (fb is not None and rows) else (
                "no fast path" if "fast" not in info else "?")
            mpfr = info.get("mpfr", rows - info["fast"] if "fast" in info and rows is not None else rows)
            md.append(f"| {dtype} | {rows} | {info.get('fast', 0)} | {mpfr} | {fb if fb is not None else '–'} "
                      f"| {frac} | {fmt(wall, 4)} |")
        md.append("")
        md.append("Summary lines: " + "; ".join(f"{dt}: `{i.get('line', '')}`" for dt, _, i, _ in fallback if i))

    if check:
        md.append("")
        md.append(f"## `attnoracle check`, one thread: 1 case, 8 heads, {args.check_n}x{args.check_n}, D = 64, "
                  f"F32, out, weights and lse")
        md.append("")
        md.append("Whole process (reading and hashing the golden file, reading the results, the comparison, "
                  "the report), median wall time; MB/s of results (10^6 bytes of result tensors per second).")
        md.append("")
        md.append("| results | MB | runs | median s | MB/s | peak MiB |")
        md.append("|---|---|---|---|---|---|")
        for label, result_bytes, c in check:
            if c.walls:
                md.append(f"| {label} | {result_bytes / 1e6:.1f} | {len(c.walls)} | {fmt(c.median(), 4)} "
                          f"| **{result_bytes / c.median() / 1e6:.0f}** | {c.peak() / MIB:.1f} |")
            else:
                md.append(f"| {label} | {result_bytes / 1e6:.1f} | 0 | – | not measured: {c.failed} | – |")

    # ---- issue 6 targets, on what was measured ----
    md.append("")
    md.append("## Issue 6 targets, on this run")
    md.append("")
    verdict = lambda ok: "**met**" if ok else "**not met**"  # noqa: E731

    def eval_at(n, d, t):
        cmds = by_size.get((n, d), (None, []))[1]
        return next((c for c in cmds if c.kind == "eval" and c.threads == t and c.walls), None)

    def ref_at(n, d, kind):
        cmds = by_size.get((n, d), (None, []))[1]
        return next((c for c in cmds if c.kind == kind and c.walls), None)

    npy = ref_at(1024, 64, "numpy")
    parts = []
    for t in threads:
        e = eval_at(1024, 64, t)
        if e and npy:
            r = e.median() / npy.median()
            parts.append(f"{t} thread{'s' if t > 1 else ''}: {r:.2f}x NumPy ({verdict(r <= 5)})")
    md.append("- F32 at 1024x1024, D = 64, at most 5x NumPy's wall time: "
              + ("; ".join(parts) if parts else "not measured (needs 1024 in --sizes)"))

    parts = []
    for n, d, _, cmds, _ in results:
        mpm = ref_at(n, d, "mpmath")
        if not mpm:
            continue
        for t in threads:
            e = eval_at(n, d, t)
            if e:
                r = mpm.median() / e.median()
                parts.append(f"{n}x{n} {t}t: {r:.0f}x ({verdict(r >= 1000)})")
    skipped = [f"{n}x{n}" for n, d, _, cmds, _ in results for c in cmds if c.kind == "mpmath" and not c.walls]
    md.append("- At least 1000x faster than mpmath wherever it finishes: "
              + ("; ".join(parts) if parts else "not measured")
              + (f" (mpmath skipped at {', '.join(skipped)})" if skipped else ""))

    parts = []
    for n in large:
        case_bytes, cmds = by_size.get((n, args.large_d), (0, []))
        limit = 2 * case_bytes + 64e6
        for c in cmds:
            if c.kind != "eval":
                continue
            if not c.walls:
                parts.append(f"{n}x{n} {c.threads}t: did not complete ({c.failed}) (**not met**)")
            else:
                parts.append(f"{n}x{n} {c.threads}t: completed, peak {c.peak() / MIB:.1f} MiB vs limit "
                             f"{limit / MIB:.1f} MiB (2 x {case_bytes / MIB:.1f} MiB + 64 MB) "
                             f"({verdict(c.peak() <= limit)})")
    md.append(f"- {args.large_d}-D large cases complete, peak under 2x the case file + 64 MB: "
              + ("; ".join(parts) if parts else "not measured (run with --large)"))

    parts = []
    if 1 in threads and 2 in threads:
        for n, d, _, cmds, _ in results:
            e1, e2 = eval_at(n, d, 1), eval_at(n, d, 2)
            if e1 and e2:
                s = e1.median() / e2.median()
                parts.append(f"{n}x{n} D={d}: {s:.2f}x ({verdict(s >= 1.7)})")
    md.append("- 2 threads at least 1.7x faster than 1: " + ("; ".join(parts) if parts else "not measured")
              + " (process start-up and file I/O weigh on the smallest sizes)")

    parts = []
    for dtype, _, info, err in fallback:
        rows, fb = info.get("rows"), info.get("fell_back")
        if fb is not None and rows:
            if fb == 0 and rows < 10000:
                parts.append(f"{dtype}: 0/{rows} (not resolved: fewer than 10,000 rows; raise --fallback-heads)")
            else:
                parts.append(f"{dtype}: {fb}/{rows} = {fb / rows:.2g} ({verdict(fb / rows < 1e-4)}"
                             + (f"; {fb} event{'s' if fb > 1 else ''} only, a rough estimate" if 0 < fb < 10 else "")
                             + ")")
        elif rows:
            parts.append(f"{dtype}: eval reports no fast-path counts (all rows by MPFR)")
    timed = []  # the timed cases are random F32 data too: their counts, from the last eval run
    for n, d, _, cmds, _ in results:
        e = next((c for c in cmds if c.kind == "eval" and c.infos and "fell_back" in c.infos[-1]), None)
        if e and e.infos[-1].get("rows"):
            timed.append(f"{n}x{n} D={d}: {e.infos[-1]['fell_back']}/{e.infos[-1]['rows']}")
    md.append("- Rows falling back to MPFR under 1 in 10,000 (F32, F16, BF16 outputs): "
              + ("; ".join(parts) if parts else "not measured")
              + (f"; F32 in the timed cases: {', '.join(timed)}" if timed else ""))
    # ---- issue 12 targets ----
    md.append("")
    md.append("## Issue 12 targets, on this run")
    md.append("")
    parts = []
    for t in threads:
        e = eval_at(1024, 64, t)
        if e and npy:
            r = e.median() / npy.median()
            parts.append(f"{t} thread{'s' if t > 1 else ''}: {r:.2f}x ({verdict(r <= 1)})")
    md.append("- 1024x1024, D = 64, F32, whole process at most 1x NumPy float64's: "
              + ("; ".join(parts) if parts else "not measured (needs 1024 in --sizes)"))
    parts = []
    if decode:
        for c in decode[1]:
            if c.kind == "eval" and c.walls:
                parts.append(f"{c.threads} thread{'s' if c.threads > 1 else ''}: {c.median():.2f} s "
                             f"({verdict(c.median() <= 2)})")
    md.append("- Decode shape, whole process (oracle included) at most 2 s: "
              + ("; ".join(parts) if parts else "not measured (--no-decode)"))
    parts = []
    for n in large:
        if n != 8192:
            continue
        case_bytes, cmds = by_size.get((n, args.large_d), (0, []))
        for c in cmds:
            if c.kind == "eval" and c.walls and c.threads == 2:
                limit = 2 * case_bytes + 64e6
                parts.append(f"{c.median():.1f} s ({verdict(c.median() <= 10)}), peak {c.peak() / MIB:.1f} MiB "
                             f"vs {limit / MIB:.1f} MiB ({verdict(c.peak() <= limit)})")
    md.append(f"- 8192x8192, D = {args.large_d}, F32, at most 10 s on 2 threads, peak at most 2 x file + 64 MB: "
              + ("; ".join(parts) if parts else "not measured (run with --large)"))
    parts = []
    for n, d, _, cmds, _ in results:
        mpm = ref_at(n, d, "mpmath")
        e = eval_at(n, d, 1)
        if mpm and e:
            r = mpm.median() / e.median()
            parts.append(f"{n}x{n}: {r:.0f}x ({verdict(r >= 5000)})")
    md.append("- At least 5000x faster than mpmath at 30 digits (1 thread): " + ("; ".join(parts) if parts else "not measured"))
    parts = []
    if 1 in threads and 2 in threads:
        for n, d, _, cmds, _ in results:
            e1, e2 = eval_at(n, d, 1), eval_at(n, d, 2)
            if e1 and e2 and n >= 1024:
                s2 = e1.median() / e2.median()
                parts.append(f"{n}x{n} D={d}: {s2:.2f}x ({verdict(s2 >= 1.8)})")
    md.append("- 2 threads at least 1.8x faster than 1 (N >= 1024): " + ("; ".join(parts) if parts else "not measured"))
    if check and any(c.walls for _, _, c in check):
        rates = [(label, b / c.median() / 1e6) for label, b, c in check if c.walls]
        md.append("- `check` at least 1 GB/s of results on one core: " +
                  "; ".join(f"{label} {rate:.0f} MB/s ({verdict(rate >= 1000)})" for label, rate in rates))
    else:
        md.append("- `check` at least 1 GB/s of results on one core: not measured (--check-n 0)")
    # ---- the backward's targets ----
    md.append("")
    md.append("## Backward targets, on this run")
    md.append("")
    whole, twins = [], []
    for n, _, cmds, _ in backward:
        tor = next((c for c in cmds if c.kind == "torch" and c.walls), None)
        for c in cmds:
            if c.kind != "eval" or not c.walls or not tor:
                continue
            tag = f"N = {n}, {c.threads} thread{'s' if c.threads > 1 else ''}"
            r = c.median() / tor.median()
            whole.append(f"{tag}: {r:.2f}x ({verdict(r <= 1)})")
            orc = info_median(c, "oracle")
            if orc is not None:
                twins.append(f"{tag}: {orc / tor.median():.2f}x ({verdict(orc <= 0.25 * tor.median())})")
    md.append("- sdpa backward, BF16, D = 128, whole eval at most 1x PyTorch float64 autograd's whole process: "
              + ("; ".join(whole) if whole else "not measured (--backward-sizes)"))
    md.append("- the oracle's gradient twins at most 25% of PyTorch's time: "
              + ("; ".join(twins) if twins else "not measured"))

    # ---- the floor's target ----
    md.append("")
    md.append("## Target against the floor, on this run")
    md.append("")
    parts = []
    for t in threads:
        e, f = eval_at(1024, 64, t), cmd_of(by_size.get((1024, 64), (None, []))[1], "floor", t)
        ev, fv = info_median(e, "evaluation"), info_median(f, "evaluation")
        if ev and fv:
            r = ev / fv
            parts.append(f"{t} thread{'s' if t > 1 else ''}: {ev:.3f} s vs the floor's {fv:.4f} s, {r:.1f}x "
                         f"({verdict(r <= 3)})")
    md.append("- Certified evaluation at most 3x the uncertified fp64 evaluation by the same kernels "
              "(1024x1024, D = 64, F32; the evaluation times of eval's and the floor's summary lines): "
              + ("; ".join(parts) if parts else "not measured (needs 1024 in --sizes and the floor)"))
    if notes:
        md.append("")
        md.append("Notes: " + "; ".join(notes) + ".")
    md.append("")
    md.append(f"Total benchmark time: {time.perf_counter() - t_start:.0f} s.")
    text = "\n".join(md) + "\n"
    sys.stdout.write(text)
    with open(args.output, "w") as f:
        f.write(text)
    print(f"compare: report written to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
