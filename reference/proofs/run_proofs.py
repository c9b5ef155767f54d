#!/usr/bin/env python3
"""Runs the fast path's proofs and checks error_bounds.hpp against what they establish.

Every Gappa (*.g) and Sollya (*.sollya) script in this directory, and published.txt, carries
directive lines in its comments:

  covers: <relation>         a relation the header's constants must satisfy, over header
                             constants (kName), established bounds, u = 2^-53 and exact numbers
                             (hex floats, decimals, 2^n); checked exactly (rationals).
  establishes: name = value  a bound the script proves (its goal uses @name@); Sollya scripts
                             also print "ESTABLISHED: name = value" lines for computed bounds.
  goal: name                 (Sollya) a goal that must be reported "PROVED: name".
  code: FILE: text           a line of reference/src/fast/FILE the proof models; the check fails
                             when the code no longer contains it (so a proof cannot silently
                             drift from the code it speaks about).

Before running, @name@ in a script is replaced by: a header constant as an exact hex float;
@prec:kName@ by the integer p with 2^-p >= kName (Gappa's add_rel / mul_rel take a precision);
an established bound; or a value the code computes (@ln2_hi@, @coef_3_lo@, ...: printed by
print_exp_constants, which compiles exp_dd.cpp itself).

The check fails if a tool is missing, if any proof fails (Gappa's exit code, Gappa warnings
about unverified hints, a Sollya goal not PROVED), if the code's exp constants differ from the
ones Sollya certifies, if a "code:" line is no longer in the source, if a covers relation is
false for the header's values, or if a source of reference/src/fast/ writes a hex float literal
outside error_bounds.hpp (every error constant and threshold is named there and covered).

  run_proofs.py --header H --printer P              the check (exit 0: everything holds)
  run_proofs.py ... --loosen kMulDD=0.5             the same on an edited copy of the header,
                                                    with that constant multiplied by 0.5 (or
                                                    =VALUE): exit 0 only if the check FAILS
  run_proofs.py ... --mutate-all                    for every constant in every covers relation,
                                                    a copy with the constant just past the bound
                                                    it must satisfy: exit 0 only if every copy
                                                    fails the check
"""
from __future__ import annotations

import argparse
import ast
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path

HERE = Path(__file__).resolve().parent
FAST_SRC = HERE.parent / "src" / "fast"
U = Fraction(1, 2**53)

# ---------------------------------------------------------------------------------------------
# Numbers: exact parsing of hex floats (any precision), decimals and Gappa's 123b-4.

def parse_hex(text: str) -> Fraction:
    t = text.strip()
    sign = -1 if t.startswith("-") else 1
    t = t.lstrip("+-")[2:]
    mant, _, exp = t.partition("p") if "p" in t else t.partition("P")
    whole, _, frac = mant.partition(".")
    digits = (whole or "0") + frac
    value = Fraction(int(digits, 16), 16 ** len(frac))
    e = int(exp) if exp else 0
    return sign * value * (Fraction(2) ** e)


def parse_number(text: str) -> Fraction:
    t = text.strip()
    if re.fullmatch(r"[-+]?0[xX].*", t):
        return parse_hex(t)
    m = re.fullmatch(r"([-+]?\d+)[bB]([-+]?\d+)", t)
    if m:
        return Fraction(int(m.group(1))) * Fraction(2) ** int(m.group(2))
    if t in ("0", "-0", "+0"):
        return Fraction(0)
    return Fraction(t)


def hex_literal(x: Fraction) -> str:
    """An exact hex-float literal for x (x must be a double)."""
    f = float(x)
    if Fraction(f) != x:
        raise ValueError(f"{x} is not a double")
    return f.hex()


# ---------------------------------------------------------------------------------------------
# Exact evaluation of covers relations.

class EvalError(Exception):
    pass


def evaluate(expr: str, names: dict[str, Fraction]) -> Fraction:
    consts: dict[str, Fraction] = {}

    def keep(m: re.Match) -> str:
        key = f"__n{len(consts)}"
        consts[key] = parse_number(m.group(0))
        return key

    # hex floats first, then decimals with a point or exponent (integers stay Python ints)
    s = re.sub(r"0[xX](?:[0-9a-fA-F]+\.?[0-9a-fA-F]*|\.[0-9a-fA-F]+)(?:[pP][-+]?\d+)?", keep, expr)
    s = re.sub(r"(?<![\w.])(?:\d+\.\d*|\.\d+|\d+[eE][-+]?\d+)(?:[eE][-+]?\d+)?", keep, s)
    s = s.replace("^", "**")
    try:
        tree = ast.parse(s, mode="eval")
    except SyntaxError as e:
        raise EvalError(f"cannot parse {expr!r}: {e}")

    def ev(node) -> Fraction:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return Fraction(node.value)
        if isinstance(node, ast.Name):
            if node.id in consts:
                return consts[node.id]
            if node.id == "u":
                return U
            if node.id in names:
                return names[node.id]
            raise EvalError(f"unknown name {node.id!r} in {expr!r}")
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp):
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Add):
                return a + b
            if isinstance(node.op, ast.Sub):
                return a - b
            if isinstance(node.op, ast.Mult):
                return a * b
            if isinstance(node.op, ast.Div):
                return a / b
            if isinstance(node.op, ast.Pow):
                if b.denominator != 1:
                    raise EvalError(f"non-integer exponent in {expr!r}")
                return a ** int(b)
        raise EvalError(f"unsupported expression {expr!r}")

    return ev(tree)


REL_RE = re.compile(r"^(.*?)\s*(>=|<=|==|>|<)\s*(.*)$")


def check_relation(rel: str, names: dict[str, Fraction]) -> tuple[bool, Fraction, Fraction]:
    m = REL_RE.match(rel)
    if not m:
        raise EvalError(f"not a relation: {rel!r}")
    lhs, op, rhs = evaluate(m.group(1), names), m.group(2), evaluate(m.group(3), names)
    ok = {">=": lhs >= rhs, "<=": lhs <= rhs, "==": lhs == rhs, ">": lhs > rhs, "<": lhs < rhs}[op]
    return ok, lhs, rhs


def log2_str(x: Fraction) -> str:
    if x <= 0:
        return str(float(x))
    return f"2^{math.log2(x.numerator) - math.log2(x.denominator):.3f}"


# ---------------------------------------------------------------------------------------------
# The header.

HEX_LITERAL_RE = re.compile(r"\b0[xX][0-9a-fA-F.]*[pP][-+]?\d+")
CONST_RE = re.compile(r"^\s*inline\s+constexpr\s+double\s+(k\w+)\s*=\s*([^;]+);")


def parse_header(path: Path) -> dict[str, Fraction]:
    consts: dict[str, Fraction] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if "constexpr" in line and re.search(r"\bk\w+\s*=", line):
            m = CONST_RE.match(line)
            if not m:
                raise SystemExit(f"{path}:{n}: cannot parse the constant on this line: {line.strip()}")
            lit = m.group(2).strip()
            try:
                if re.fullmatch(r"[-+]?0[xX].*", lit):
                    value = float.fromhex(lit)  # rounds to nearest, as the compiler does
                else:
                    value = float(lit)
            except ValueError:
                raise SystemExit(f"{path}:{n}: {m.group(1)} = {lit} is not a number literal")
            consts[m.group(1)] = Fraction(value)
    if not consts:
        raise SystemExit(f"{path}: no 'inline constexpr double kName = <number>;' lines found")
    return consts


# ---------------------------------------------------------------------------------------------
# Scripts and their directives.

DIRECTIVE_RE = re.compile(r"^\s*(?:#|//|/\*|\*)?\s*(covers|establishes|goal|code):\s*(.*?)\s*(?:\*/)?\s*$")
PLACEHOLDER_RE = re.compile(r"@([A-Za-z_]\w*(?::\w+)?)@")


class Script:
    def __init__(self, path: Path):
        self.path = path
        self.name = path.name
        self.text = path.read_text()
        self.kind = {".g": "gappa", ".sollya": "sollya"}.get(path.suffix, "published")
        self.covers: list[str] = []
        self.establishes: dict[str, str] = {}
        self.goals: list[str] = []
        self.code: list[tuple[str, str]] = []
        for line in self.text.splitlines():
            m = DIRECTIVE_RE.match(line)
            if not m:
                continue
            kind, body = m.group(1), m.group(2)
            if kind == "covers":
                self.covers.append(body.split("  #")[0].strip())
            elif kind == "establishes":
                name, _, value = body.partition("=")
                self.establishes[name.strip()] = value.strip()
            elif kind == "goal":
                self.goals.append(body.strip())
            elif kind == "code":
                file, _, text = body.partition(":")
                self.code.append((file.strip(), text.strip()))
        self.placeholders = sorted(set(PLACEHOLDER_RE.findall(self.text)))


def load_scripts() -> list[Script]:
    paths = sorted(HERE.glob("*.g")) + sorted(HERE.glob("*.sollya")) + [HERE / "published.txt"]
    return [Script(p) for p in paths if p.exists()]


def norm_ws(s: str) -> str:
    return " ".join(s.split())


# ---------------------------------------------------------------------------------------------
# The check.

GAPPA_BENIGN = ("renaming identifier",)


class Checker:
    def __init__(self, header: Path, printer: Path | None, gappa: str, sollya: str, verbose: bool):
        self.header = header
        self.printer = printer
        self.gappa = gappa
        self.sollya = sollya
        self.verbose = verbose
        self.failures: list[str] = []
        self.lines: list[str] = []
        self.outputs: dict[str, str] = {}

    def fail(self, msg: str) -> None:
        self.failures.append(msg)
        self.lines.append("FAIL  " + msg)

    def code_values(self) -> dict[str, str]:
        if self.printer is None:
            return {}
        r = subprocess.run([str(self.printer)], capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            self.fail(f"print_exp_constants failed: {r.stderr.strip()}")
            return {}
        vals: dict[str, str] = {}
        for line in r.stdout.splitlines():
            w = line.split()
            if not w:
                continue
            if w[0] == "ln2":
                vals["ln2_hi"], vals["ln2_lo"] = w[1], w[2]
            elif w[0] == "coef":
                vals[f"coef_{w[1]}_hi"], vals[f"coef_{w[1]}_lo"] = w[2], w[3]
        return vals

    def substitute(self, s: Script, consts, established, code_vals) -> str | None:
        def rep(m: re.Match) -> str:
            key = m.group(1)
            if key.startswith("prec:"):
                k = consts[key[5:]]
                p = 0
                while Fraction(1, 2 ** (p + 1)) >= k:
                    p += 1
                return str(p)
            if key in consts:
                return hex_literal(consts[key])
            if key in established:
                return established[key][1]
            if key in code_vals:
                return code_vals[key]
            raise KeyError(key)

        try:
            return PLACEHOLDER_RE.sub(rep, s.text)
        except KeyError:
            return None

    def run_tool(self, s: Script, text: str, workdir: Path) -> tuple[bool, str, dict[str, str], float]:
        f = workdir / s.name
        f.write_text(text)
        cmd = [self.gappa, str(f)] if s.kind == "gappa" else [self.sollya, str(f)]
        t0 = time.monotonic()
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return False, "timed out after 600 s", {}, time.monotonic() - t0
        dt = time.monotonic() - t0
        out = r.stdout + r.stderr
        self.outputs[s.name] = r.stdout
        est: dict[str, str] = {}
        problems = []
        if s.kind == "gappa":
            if r.returncode != 0:
                problems.append(f"gappa exit code {r.returncode}")
            for line in r.stderr.splitlines():
                if line.startswith("Warning") and not any(b in line for b in GAPPA_BENIGN):
                    problems.append(line.strip())
                if line.startswith("Error"):
                    problems.append(line.strip())
        else:
            proved = set()
            for line in out.splitlines():
                if line.startswith("PROVED:"):
                    proved.add(line.split(":", 1)[1].strip())
                elif line.startswith("ESTABLISHED:"):
                    name, _, value = line.split(":", 1)[1].partition("=")
                    est[name.strip()] = value.strip()
                elif line.startswith("FAILED") or re.match(r"\s*(Warning|Error|error)", line):
                    problems.append(line.strip())
            if r.returncode != 0:
                problems.append(f"sollya exit code {r.returncode}")
            for g in s.goals:
                if g not in proved:
                    problems.append(f"goal {g} not proved")
        problems = list(dict.fromkeys(problems))  # each message once
        detail = "; ".join(problems) if problems else ""
        if problems and self.verbose:
            detail += "\n" + out
        return not problems, detail, est, dt

    def run(self, only_with: set[str] | None = None, baseline_est=None) -> bool:
        """The whole check. only_with: re-run only the scripts that substitute one of these
        header constants (the others' results come from baseline_est)."""
        consts = parse_header(self.header)
        self.consts = consts
        scripts = load_scripts()
        code_vals = self.code_values()
        self.lines.append(f"header {self.header}: {len(consts)} constants")

        # no error constant written inline: a hex float literal outside the header is one
        for src in sorted(FAST_SRC.iterdir()):
            if src.name == "error_bounds.hpp" or src.suffix not in (".cpp", ".hpp"):
                continue
            for n, line in enumerate(src.read_text().splitlines(), 1):
                code = line.split("//")[0]
                if HEX_LITERAL_RE.search(code):
                    self.fail(f"{src.name}:{n}: an inline constant (name it in error_bounds.hpp "
                              f"and cover it by a proof): {line.strip()}")

        # code: lines still in the source
        for s in scripts:
            for file, text in s.code:
                src = FAST_SRC / file
                if not src.exists() or norm_ws(text) not in norm_ws(src.read_text()):
                    self.fail(f"{s.name}: models this line of {file}, which is no longer in the code: {text}")

        # established bounds: static ones first (name -> (script, literal))
        established: dict[str, tuple[str, str]] = {}
        for s in scripts:
            for name, value in s.establishes.items():
                established[name] = (s.name, value)
        if baseline_est:
            for name, v in baseline_est.items():
                established.setdefault(name, v)

        pending = [s for s in scripts if s.kind != "published"]
        if only_with is not None:
            pending = [s for s in pending if any(p.split(":")[-1] in only_with for p in s.placeholders)]
        self.timings: list[tuple[str, float]] = []
        workdir = Path(tempfile.mkdtemp(prefix="attnoracle-proofs-"))
        try:
            progress = True
            while pending and progress:
                progress = False
                for s in list(pending):
                    text = self.substitute(s, consts, established, code_vals)
                    if text is None:
                        continue
                    pending.remove(s)
                    progress = True
                    ok, detail, est, dt = self.run_tool(s, text, workdir)
                    self.timings.append((s.name, dt))
                    for name, value in est.items():
                        established[name] = (s.name, value)
                    if ok:
                        self.lines.append(f"ok    {s.name} ({dt:.2f} s)")
                    else:
                        self.fail(f"{s.name}: proof failed: {detail}")
            for s in pending:
                missing = [p for p in s.placeholders if self.substitute_one(p, consts, established, code_vals) is None]
                self.fail(f"{s.name}: cannot run, no value for {', '.join('@' + m + '@' for m in missing)}")
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        self.established = established

        # covers relations
        names: dict[str, Fraction] = dict(consts)
        for name, (src, value) in established.items():
            try:
                names[name] = evaluate(value, {})
            except EvalError as e:
                self.fail(f"{src}: established {name} = {value}: {e}")
        covered: dict[str, list[str]] = {k: [] for k in consts}
        self.relations: list[tuple[str, str]] = []
        for s in scripts:
            for rel in s.covers:
                self.relations.append((s.name, rel))
                try:
                    ok, lhs, rhs = check_relation(rel, names)
                except EvalError as e:
                    self.fail(f"{s.name}: covers {rel}: {e}")
                    continue
                for k in consts:
                    if re.search(rf"\b{k}\b", rel):
                        covered[k].append(s.name)
                if ok:
                    self.lines.append(f"ok    {s.name}: {rel}   [{log2_str(lhs)} vs {log2_str(rhs)}]")
                else:
                    self.fail(f"{s.name}: covers {rel} is FALSE: left {log2_str(lhs)} ({float(lhs):.6g}), "
                              f"right {log2_str(rhs)} ({float(rhs):.6g})")
        for k, where in covered.items():
            if not where:
                self.fail(f"{k} (error_bounds.hpp) is covered by no proof")
        return not self.failures

    def substitute_one(self, key, consts, established, code_vals):
        if key.startswith("prec:"):
            return "" if key[5:] in consts else None
        for d in (consts, established, code_vals):
            if key in d:
                return ""
        return None



def check_coefficients(checker: Checker, code_vals: dict[str, str]) -> None:
    """The code's LN2 and Taylor coefficients against the ones the Sollya scripts certify."""
    for script, prefix in (("exp_poly.sollya", "coef"), ("exp_constants.sollya", "ln2")):
        certified = {}
        for line in checker.outputs.get(script, "").splitlines():
            w = line.split()
            if w and w[0] == prefix and prefix == "coef" and len(w) == 4:
                certified[f"coef_{w[1]}_hi"], certified[f"coef_{w[1]}_lo"] = w[2], w[3]
            elif w and w[0] == prefix and prefix == "ln2" and len(w) == 3:
                certified["ln2_hi"], certified["ln2_lo"] = w[1], w[2]
        if not certified:
            checker.fail(f"{script} printed no '{prefix}' lines")
            continue
        bad = False
        for key, value in sorted(certified.items()):
            code = code_vals.get(key)
            if code is None:
                checker.fail(f"print_exp_constants prints no {key}")
                bad = True
            elif parse_number(code) != parse_number(value):
                checker.fail(f"{key}: the code holds {code}, {script} certifies {value}")
                bad = True
        if len(certified) != len([k for k in code_vals if k.startswith(prefix)]):
            checker.fail(f"the code holds {len([k for k in code_vals if k.startswith(prefix)])} "
                         f"{prefix} values, {script} certifies {len(certified)}")
            bad = True
        if not bad:
            checker.lines.append(f"ok    the code's {prefix} values equal those {script} certifies "
                                 f"({len(certified)} doubles)")


def find_tool(name: str, env: str) -> str:
    path = os.environ.get(env) or shutil.which(name)
    if not path or not os.access(path, os.X_OK):
        raise SystemExit(
            f"error: {name} is not installed. The proofs of the fast path's error bounds need it: "
            f"run tools/setup.sh (it installs the Debian packages gappa and sollya), or set {env}.")
    return path


def full_check(header: Path, printer: Path | None, gappa: str, sollya: str, verbose: bool) -> Checker:
    c = Checker(header, printer, gappa, sollya, verbose)
    c.run()
    if printer is not None:
        check_coefficients(c, c.code_values())
    else:
        c.fail("no --printer: the code's exp constants were not compared")
    return c


def edited_header(src: Path, name: str, value: float, where: Path) -> Path:
    """A copy of the header with one constant's literal replaced."""
    text = src.read_text()
    pat = re.compile(rf"(inline\s+constexpr\s+double\s+{name}\s*=\s*)([^;]+)(;)")
    if not pat.search(text):
        raise SystemExit(f"{name} is not in {src}")
    text = pat.sub(lambda m: m.group(1) + value.hex() + m.group(3), text, count=1)
    out = where / "error_bounds.hpp"
    out.write_text(text)
    return out


def boundary(rel: str, name: str, names: dict[str, Fraction]) -> float | None:
    """The double closest to the bound that `name` must satisfy in `rel`, on the failing side
    (None if the relation holds for every value tried)."""

    def holds(v: float) -> bool:
        n = dict(names)
        n[name] = Fraction(v)
        try:
            return check_relation(rel, n)[0]
        except (EvalError, ZeroDivisionError, OverflowError):
            return False

    def key(x: float) -> int:  # doubles in order, as integers
        i = struct.unpack("<q", struct.pack("<d", x))[0]
        return i if i >= 0 else -(i & 0x7FFFFFFFFFFFFFFF)

    def unkey(i: int) -> float:
        if i >= 0:
            return struct.unpack("<d", struct.pack("<q", i))[0]
        return struct.unpack("<d", struct.pack("<Q", (-i) | (1 << 63)))[0]

    cur = float(names[name])
    if not holds(cur):
        return None
    k0 = key(cur)
    for direction in (-1, 1):  # towards -inf, then towards +inf
        step, good, bad = 1, k0, None
        while step < (1 << 64):  # gallop over the ordered doubles
            k = k0 + direction * step
            v = unkey(k) if abs(k) <= key(sys.float_info.max) else None
            if v is None:
                break
            if holds(v):
                good = k
            else:
                bad = k
                break
            step *= 2
        if bad is None:
            continue
        while abs(bad - good) > 1:
            mid = (good + bad) // 2
            if holds(unkey(mid)):
                good = mid
            else:
                bad = mid
        return unkey(bad)
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--header", type=Path, default=FAST_SRC / "error_bounds.hpp")
    ap.add_argument("--printer", type=Path, help="the print_exp_constants program")
    ap.add_argument("--loosen", metavar="NAME=FACTOR", help="check an edited copy; succeed only if it fails")
    ap.add_argument("--mutate-all", action="store_true", help="every constant just past its bound must fail")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args()

    gappa = find_tool("gappa", "GAPPA")
    sollya = find_tool("sollya", "SOLLYA")
    t0 = time.monotonic()

    if a.loosen:
        name, _, factor = a.loosen.partition("=")
        base = full_check(a.header, a.printer, gappa, sollya, a.verbose)
        if base.failures:  # a copy must fail because of the edit, not for some other reason
            print("the check fails on the header itself, so an edited copy proves nothing:")
            for f_ in base.failures:
                print("  " + f_)
            return 1
        consts = parse_header(a.header)
        if name not in consts:
            raise SystemExit(f"{name} is not a constant of {a.header}")
        f = parse_number(factor)
        value = float(consts[name] * f)
        with tempfile.TemporaryDirectory() as d:
            copy = edited_header(a.header, name, value, Path(d))
            print(f"edited copy of {a.header.name}: {name} = {float(consts[name]).hex()} -> {value.hex()}")
            c = full_check(copy, a.printer, gappa, sollya, a.verbose)
        for f_ in c.failures:
            print("caught: " + f_)
        if c.failures:
            print(f"the check fails on the copy, as it must ({time.monotonic() - t0:.1f} s)")
            return 0
        print(f"NOT CAUGHT: the check passes with {name} = {value.hex()}")
        return 1

    c = full_check(a.header, a.printer, gappa, sollya, a.verbose)
    print("\n".join(c.lines))
    if c.failures:
        print(f"\n{len(c.failures)} failure(s):")
        for f_ in c.failures:
            print("  " + f_)
        return 1
    total = sum(t for _, t in c.timings)
    print(f"\nall proofs pass; {len(c.timings)} scripts ({total:.1f} s in the tools), "
          f"{len(c.relations)} covers relations, {len(c.consts)} constants; {time.monotonic() - t0:.1f} s")
    if not a.mutate_all:
        return 0

    # Every constant, just past each bound it must satisfy, must fail the check.
    names: dict[str, Fraction] = dict(c.consts)
    for name, (src, value) in c.established.items():
        names[name] = evaluate(value, {})
    missed = []
    tried = 0
    print("\nmutations (each on an edited copy of the header):")
    for src, rel in c.relations:
        for k in c.consts:
            if not re.search(rf"\b{k}\b", rel):
                continue
            v = boundary(rel, k, names)
            if v is None:
                print(f"  {k:13s} {rel}: no unsound side found (skipped)")
                continue
            tried += 1
            with tempfile.TemporaryDirectory() as d:
                copy = edited_header(a.header, k, v, Path(d))
                m = Checker(copy, a.printer, gappa, sollya, False)
                m.run(only_with={k}, baseline_est=c.established)
            status = "caught" if m.failures else "NOT CAUGHT"
            if not m.failures:
                missed.append(f"{k} = {v.hex()} ({rel})")
            print(f"  {k:13s} = {v.hex():24s} ({src}: {rel}): {status}")
    # Constants whose unsound direction goes through a computed bound (not a literal relation).
    extra = [("kExpMin", float(c.consts["kExpMin"]) + 1.0)]
    for k, v in extra:
        tried += 1
        with tempfile.TemporaryDirectory() as d:
            copy = edited_header(a.header, k, v, Path(d))
            m = Checker(copy, a.printer, gappa, sollya, False)
            m.run(only_with={k}, baseline_est={n: e for n, e in c.established.items()
                                              if not e[0].endswith(".sollya")})
        status = "caught" if m.failures else "NOT CAUGHT"
        if not m.failures:
            missed.append(f"{k} = {v!r}")
        print(f"  {k:13s} = {v!r:24} (exp(kExpMin + 2^-19) must stay below kTinyExp): {status}")
    if missed:
        print(f"\n{len(missed)} of {tried} unsound copies NOT caught: " + "; ".join(missed))
        return 1
    print(f"\nall {tried} unsound copies caught ({time.monotonic() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
