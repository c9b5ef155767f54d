"""Runs `attnoracle run` on the committed core suite and returns its JSON report (for the tests of
the adapters beside the NumPy one).

    report = gate.run(["/usr/bin/python3", ADAPTER, "--block", "16"], "fp32")
    gate.failed(report)   # {case id: worst limit ratio}
"""
import json
import os
import shlex
import subprocess
import tempfile

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
CORE = os.path.join(REPO, "vectors", "core")


def cli():
    """The attnoracle binary: ATTNORACLE_CLI, else build/attnoracle; None when neither runs."""
    for c in (os.environ.get("ATTNORACLE_CLI", ""), os.path.join(REPO, "build", "attnoracle")):
        if c and os.access(c, os.X_OK):
            return c
    return None


def run(impl, profile, *options):
    """`attnoracle run vectors/core --impl IMPL --profile PROFILE OPTIONS...` -> (status, report)."""
    with tempfile.TemporaryDirectory(prefix="attn_gate_") as tmp:
        report = os.path.join(tmp, "report.json")
        p = subprocess.run([cli(), "run", CORE, "--impl", shlex.join(impl), "--profile", profile,
                            "--threads", "2", "--json", report, *options],
                           capture_output=True, text=True, cwd=REPO)
        if p.returncode not in (0, 1):
            raise RuntimeError(f"attnoracle run exited {p.returncode}: {p.stdout}{p.stderr}")
        with open(report, encoding="utf-8") as f:
            return p.returncode, json.load(f)


def failed(report):
    """{case id: the worst element's ratio to its limit (None when it failed otherwise)}."""
    return {c["id"]: (c.get("worst") or {}).get("limit_ratio") for c in report["cases"]
            if c["status"] == "fail"}
