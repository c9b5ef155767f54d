"""What assert_close costs a test beside the gate's own comparison, with a warm golden cache (a
hit) and a cold one (the evaluation), against `attnoracle eval` of the same case file.

    PYTHONPATH=build/python /usr/bin/python3 python/examples/overhead.py [--heads 1] [--n 1024] [--d 128]

The kernel's output is the golden one (a passing test); times are medians of --repeat runs, as
elapsed time and as CPU time (all threads of this process, or of the `attnoracle eval` child),
which a busy machine disturbs less.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import attnoracle
from attnoracle import _native


def median_time(f, repeat, clock=time.perf_counter):
    times = []
    for _ in range(repeat):
        t = clock()
        f()
        times.append(clock() - t)
    return statistics.median(times)


class Timed:
    """assert_close's time outside the gate's comparison: the call's time less that of the
    check it makes (timed around the native call, elapsed and CPU)."""

    def __init__(self, module):
        self.module, self.check = module, module._native.check
        self.inside = [0.0, 0.0]

    def __enter__(self):
        def timed(*args):
            t, c = time.perf_counter(), time.process_time()
            try:
                return self.check(*args)
            finally:
                self.inside[0] += time.perf_counter() - t
                self.inside[1] += time.process_time() - c
        self.module._native = type("N", (), {"check": staticmethod(timed), "evaluate": staticmethod(_native.evaluate)})
        return self

    def __exit__(self, *exc):
        self.module._native = _native

    def outside(self, f, repeat, before=lambda: None):
        wall, cpu = [], []
        for _ in range(repeat):
            before()
            self.inside = [0.0, 0.0]
            t, c = time.perf_counter(), time.process_time()
            f()
            wall.append(time.perf_counter() - t - self.inside[0])
            cpu.append(time.process_time() - c - self.inside[1])
        return statistics.median(wall), statistics.median(cpu)


def children_cpu():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cli", default=os.environ.get("ATTNORACLE_CLI", "build/attnoracle"))
    a = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    torch.manual_seed(0)
    q, k, v = (torch.randn(a.batch, a.heads, a.n, a.d).to(dtype) for _ in range(3))
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["ATTNORACLE_CACHE"] = os.path.join(tmp, "cache")
        golden = attnoracle.evaluate(q, k, v)
        out = torch.from_numpy(golden.bits["out"].view("int16")).view(torch.bfloat16) if dtype == torch.bfloat16 \
            else torch.from_numpy(golden["out"])
        profile = {"bf16": "flash-bf16", "fp16": "flash-fp16", "fp32": "fp32"}[a.dtype]
        run = lambda: attnoracle.assert_close(out, q, k, v, profile=profile)  # noqa: E731

        def cold():
            attnoracle.clear_cache()
            run()

        from attnoracle import _assert_close

        with Timed(_assert_close) as timed:
            cold_out = timed.outside(run, a.repeat, before=attnoracle.clear_cache)
            run()
            warm_out = timed.outside(run, a.repeat)
        t_cold = median_time(cold, a.repeat)
        run()
        t_warm = median_time(run, a.repeat)
        # the gate's comparison alone, on tensors already made
        tensors, meta = attnoracle._case_tensors(dict(q=q, k=k, v=v), scale=None, causal=None, window=None,
                                                 softcap=None, masked_rows="zero", outputs=("out",), input_dtype=None,
                                                 output_dtype=None, round_values=False, file="<arrays>")
        g, gmeta, _ = _native.evaluate(tensors, meta, "<arrays>", os.cpu_count() or 1, 2048)
        result = [attnoracle._float_tensor("out", out, tensors[0][1], False, "actual")]
        t_check = median_time(lambda: _native.check("c", [], tensors + g, gmeta, "ok", "output", "", result, profile,
                                                    "zero", "out"), a.repeat)
        path = attnoracle.write_case(os.path.join(tmp, "c.safetensors"), q, k, v, masked_rows="zero")
        eval_cli = lambda: subprocess.run([a.cli, "eval", path, "-o", os.path.join(tmp, "g.safetensors"), "-q"],  # noqa: E731
                                          check=True)
        t_eval = median_time(eval_cli, a.repeat)
        cpu_eval = median_time(eval_cli, a.repeat, children_cpu)
    shape = f"B={a.batch}, H={a.heads}, N={a.n}, D={a.d}, {a.dtype}"
    print(json.dumps({"shape": shape, "warm_s": t_warm, "check_s": t_check, "warm_outside_check_s": warm_out[0],
                      "warm_outside_check_cpu_s": warm_out[1], "cold_s": t_cold, "cold_outside_check_s": cold_out[0],
                      "cold_outside_check_cpu_s": cold_out[1], "eval_cli_s": t_eval, "eval_cli_cpu_s": cpu_eval}))
    print(f"{shape}: warm {t_warm * 1e3:.1f} ms, of which outside the gate's comparison {warm_out[0] * 1e3:.1f} ms "
          f"({warm_out[1] * 1e3:.1f} ms CPU); the comparison alone {t_check * 1e3:.1f} ms; cold {t_cold:.3f} s, "
          f"outside the comparison {cold_out[0]:.3f} s ({cold_out[1]:.3f} s CPU); attnoracle eval {t_eval:.3f} s "
          f"({cpu_eval:.3f} s CPU)", file=sys.stderr)


if __name__ == "__main__":
    main()
