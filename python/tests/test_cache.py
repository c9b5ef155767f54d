"""The golden cache of assert_close: hits and misses, concurrent writers, eviction, corrupted
entries, clearing, its folder and size from the environment."""

import multiprocessing
import os
import subprocess
import sys

import numpy as np
import pytest

import attnoracle
from attnoracle import cache


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNORACLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("ATTNORACLE_CACHE_SIZE", raising=False)
    for k in cache.stats:
        cache.stats[k] = 0
    return tmp_path / "cache"


def problem(seed=0, n=8):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((1, 2, n, 8)).astype(np.float32) for _ in range(3))
    return q, k, v, np.array(attnoracle.evaluate(q, k, v)["out"])


def entries(root):
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root / "golden") for f in fs if f.endswith(".safetensors"))


def test_miss_then_hit_with_the_same_golden_values(private_cache):
    q, k, v, out = problem()
    v1 = attnoracle.assert_close(out, q, k, v, profile="fp32")
    assert cache.stats == {"hits": 0, "misses": 1, "corrupt": 0}
    [entry] = entries(private_cache)
    v2 = attnoracle.assert_close(out, q, k, v, profile="fp32")
    assert cache.stats == {"hits": 1, "misses": 1, "corrupt": 0}
    assert v1.report == v2.report
    # a hit gives the bytes evaluate gives
    tensors, meta = attnoracle._case_tensors(dict(q=q, k=k, v=v), scale=None, causal=None, window=None, softcap=None,
                                             masked_rows="zero", outputs=("out",), input_dtype=None, output_dtype=None,
                                             round_values=False, file="<arrays>")
    hit, hit_meta, _, from_cache = cache.golden(tensors, meta, 2048, lambda: pytest.fail("evaluated again"))
    fresh = attnoracle._native.evaluate(tensors, meta, "<arrays>", 1, 2048)
    assert from_cache and hit == [tuple(t) for t in fresh[0]] and hit_meta == fresh[1]
    # another case (one bit of one input, or an option) is another entry
    q2 = q.copy()
    q2.view(np.uint32)[0, 0, 0, 0] ^= 1
    attnoracle.assert_close(attnoracle.evaluate(q2, k, v)["out"], q2, k, v, profile="fp32")
    attnoracle.assert_close(attnoracle.evaluate(q, k, v, causal=True)["out"], q, k, v, causal=True, profile="fp32")
    assert cache.stats["misses"] == 3 and len(entries(private_cache)) == 3
    # and cache=False evaluates without it
    attnoracle.assert_close(out, q, k, v, profile="fp32", cache=False)
    assert cache.stats["misses"] == 3 and cache.stats["hits"] == 2


def test_a_failing_kernel_is_judged_on_cached_values_too():
    q, k, v, out = problem(1)
    bad = out.copy()
    bad[0, 1, 2, 3] += 0.5
    messages = []
    for _ in range(2):
        with pytest.raises(AssertionError) as e:
            attnoracle.assert_close(bad, q, k, v, profile="fp32")
        messages.append(str(e.value))
    assert messages[0] == messages[1] and cache.stats["hits"] == 1


def _worker(args):
    folder, seed = args
    os.environ["ATTNORACLE_CACHE"] = folder
    q, k, v, out = problem(seed, n=48)
    cache.stats.update(hits=0, misses=0, corrupt=0)
    v1 = attnoracle.assert_close(out, q, k, v, profile="fp32")
    return v1.passed, dict(cache.stats)


def test_concurrent_writers_evaluate_a_case_once(private_cache):
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(6) as pool:
        # six processes on one case at once, then on three cases, two each
        same = pool.map(_worker, [(str(private_cache), 11)] * 6)
        mixed = pool.map(_worker, [(str(private_cache), s) for s in (12, 13, 14, 12, 13, 14)])
    assert all(passed for passed, _ in same + mixed)
    assert sum(s["misses"] for _, s in same) == 1 and sum(s["hits"] for _, s in same) == 5
    assert sum(s["misses"] for _, s in mixed) == 3 and sum(s["hits"] for _, s in mixed) == 3
    assert sum(s["corrupt"] for _, s in same + mixed) == 0
    # four whole entries, no temporary file and no lock left
    names = [f for _, _, fs in os.walk(private_cache) for f in fs]
    assert len(entries(private_cache)) == 4 and len(names) == 4


def test_least_recently_used_entries_are_evicted_past_the_size(private_cache, monkeypatch):
    problems = [problem(20 + s) for s in range(4)]
    q, k, v, out = problems[0]
    attnoracle.assert_close(out, q, k, v, profile="fp32")
    [first] = entries(private_cache)
    size = os.path.getsize(first)
    monkeypatch.setenv("ATTNORACLE_CACHE_SIZE", str(3 * size + size // 2))  # room for three
    for t, (q, k, v, out) in enumerate(problems[1:3]):
        attnoracle.assert_close(out, q, k, v, profile="fp32")
    paths = entries(private_cache)
    for t, p in enumerate(sorted(paths, key=os.path.getmtime)):
        os.utime(p, (1000 + t, 1000 + t))
    q, k, v, out = problems[0]
    attnoracle.assert_close(out, q, k, v, profile="fp32")  # a hit renews the oldest
    assert cache.stats["hits"] == 1
    oldest = min(entries(private_cache), key=os.path.getmtime)
    q, k, v, out = problems[3]
    attnoracle.assert_close(out, q, k, v, profile="fp32")  # a fourth: the least recently used goes
    left = entries(private_cache)
    assert len(left) == 3 and oldest not in left and first in left
    assert sum(os.path.getsize(p) for p in left) <= 3 * size + size // 2
    # size 0: nothing kept, every call evaluates
    monkeypatch.setenv("ATTNORACLE_CACHE_SIZE", "0")
    misses = cache.stats["misses"]
    attnoracle.assert_close(out, q, k, v, profile="fp32")
    assert cache.stats["misses"] == misses + 1
    monkeypatch.setenv("ATTNORACLE_CACHE_SIZE", "2G")
    assert cache.size_limit() == 2 << 30
    monkeypatch.setenv("ATTNORACLE_CACHE_SIZE", "lots")
    with pytest.raises(ValueError, match="ATTNORACLE_CACHE_SIZE: 'lots' is not a size"):
        cache.size_limit()


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "empty"])
def test_a_corrupted_entry_is_ignored_and_recomputed(private_cache, damage):
    q, k, v, out = problem(30)
    attnoracle.assert_close(out, q, k, v, profile="fp32")
    [path] = entries(private_cache)
    with open(path, "rb") as f:
        blob = bytearray(f.read())
    if damage == "flip":
        blob[-5] ^= 0x10  # a bit of the golden data: the CRC differs
    elif damage == "truncate":
        blob = blob[: len(blob) - 100]
    elif damage == "garbage":
        blob[8:40] = b"x" * 32
    else:
        blob = bytearray()
    with open(path, "wb") as f:
        f.write(blob)
    attnoracle.assert_close(out, q, k, v, profile="fp32")
    assert cache.stats == {"hits": 0, "misses": 2, "corrupt": 1}
    attnoracle.assert_close(out, q, k, v, profile="fp32")  # rewritten whole
    assert cache.stats == {"hits": 1, "misses": 2, "corrupt": 1}


def test_clear_and_the_folder(private_cache, tmp_path, monkeypatch):
    q, k, v, out = problem(40)
    attnoracle.assert_close(out, q, k, v, profile="fp32")
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    r = subprocess.run([sys.executable, "-m", "attnoracle", "cache"], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.startswith(f"{private_cache}: 1 entries, ")
    assert attnoracle.clear_cache()[0] == 1 and entries(private_cache) == []
    attnoracle.assert_close(out, q, k, v, profile="fp32")
    r = subprocess.run([sys.executable, "-m", "attnoracle", "cache", "--clear"], capture_output=True, text=True,
                       env=env)
    assert r.returncode == 0 and r.stdout.startswith(f"{private_cache}: removed 1 entries") and not entries(private_cache)
    # without ATTNORACLE_CACHE: $XDG_CACHE_HOME/attnoracle, else ~/.cache/attnoracle
    monkeypatch.delenv("ATTNORACLE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == str(tmp_path / "xdg" / "attnoracle")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.cache_dir() == str(tmp_path / "home" / ".cache" / "attnoracle")


def test_an_unwritable_cache_warns_and_judges(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("ATTNORACLE_CACHE", str(blocker))
    q, k, v, out = problem(50)
    assert attnoracle.assert_close(out, q, k, v, profile="fp32").passed
    assert "attnoracle: warning: golden cache " + str(blocker) in capsys.readouterr().err
