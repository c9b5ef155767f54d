"""The golden cache of assert_close: the reference's golden tensors of a case, kept on disk under
the hash of the case's bytes (its input tensors and metadata) and the reference's version, so
that a rerun never evaluates a case twice.

    $ATTNORACLE_CACHE, else $XDG_CACHE_HOME/attnoracle, else ~/.cache/attnoracle; entries in golden/
    $ATTNORACLE_CACHE_SIZE: the most it keeps (bytes, or with K, M, G; default 2G); 0 turns it off

Entries are safetensors files written to a temporary name and renamed into place, so that
concurrent writers (pytest-xdist workers) never leave a partial entry; a lock per entry makes a
second worker wait for the first one's evaluation instead of repeating it. An entry that does
not read back whole (its CRC-32 differs, or it does not parse) is ignored and recomputed. Past
the size, the entries least recently used (by modification time, renewed at each hit) go first.

    python3 -m attnoracle cache            # where it is, its entries and size
    python3 -m attnoracle cache --clear    # removes every entry (or attnoracle.clear_cache())
"""

import hashlib
import json
import mmap
import os
import struct
import sys
import tempfile
import zlib

try:
    import fcntl
except ImportError:  # no flock: concurrent misses may evaluate a case twice, never corrupt an entry
    fcntl = None

from . import _attnoracle as _native

DEFAULT_SIZE = 2 << 30
_SUFFIX = ".safetensors"
_FORMAT = "attnoracle-golden-cache/1"

# Counts of this process's lookups: hits, misses (each an evaluation), entries ignored as corrupt.
stats = {"hits": 0, "misses": 0, "corrupt": 0}


def cache_dir():
    """The cache's folder (its entries are in golden/ inside)."""
    d = os.environ.get("ATTNORACLE_CACHE")
    if d:
        return d
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "attnoracle")


def size_limit():
    """$ATTNORACLE_CACHE_SIZE in bytes (K, M, G: powers of 1024), DEFAULT_SIZE when unset; 0: off."""
    text = os.environ.get("ATTNORACLE_CACHE_SIZE", "").strip()
    if not text:
        return DEFAULT_SIZE
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1].upper(), 1)
    number = text[:-1] if scale > 1 else text
    try:
        value = int(float(number) * scale)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"ATTNORACLE_CACHE_SIZE: {text!r} is not a size (bytes, or a number with K, M or G)")
    return value


def _golden_dir():
    return os.path.join(cache_dir(), "golden")


def key(tensors, metadata, max_precision):
    """The entry's name: BLAKE2b of the reference's version, the working precision's cap, the
    case's metadata and every input tensor (name, dtype, shape, bytes)."""
    h = hashlib.blake2b(digest_size=32)
    head = {"format": _FORMAT, "reference": _native.name_and_version, "max_precision": int(max_precision),
            "metadata": sorted(metadata.items()),
            "tensors": [(name, dtype, list(shape), len(data)) for name, dtype, shape, data in tensors]}
    h.update(json.dumps(head, sort_keys=True).encode())
    for _, _, _, data in tensors:
        h.update(data)
    return h.hexdigest()


def _path(k):
    return os.path.join(_golden_dir(), k[:2], k + _SUFFIX)


def _serialize(tensors, metadata, stats_of_eval, k):
    header, offset, crc = {}, 0, 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        crc = zlib.crc32(data, crc)
    meta = dict(metadata)
    meta.update({"cache.format": _FORMAT, "cache.key": k, "cache.crc32": str(crc),
                 "cache.stats": json.dumps(stats_of_eval, sort_keys=True)})
    header["__metadata__"] = meta
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return [struct.pack("<Q", len(text)), text] + [data for *_, data in tensors]


def _parse(blob, k):
    """(tensors, metadata, stats) of an entry's bytes, or None when they are not a whole entry of key k."""
    try:
        (n,) = struct.unpack_from("<Q", blob, 0)
        header = json.loads(bytes(blob[8: 8 + n]))
        meta = header.pop("__metadata__")
        if meta.pop("cache.format") != _FORMAT or meta.pop("cache.key") != k:
            return None
        crc_text = meta.pop("cache.crc32")
        stats_of_eval = json.loads(meta.pop("cache.stats"))
        data = blob[8 + n:]
        tensors, crc, end = [], 0, 0
        for name, t in header.items():
            a, b = t["data_offsets"]
            if a != end or b < a:
                return None
            piece = bytes(data[a:b])
            if len(piece) != b - a:
                return None
            crc = zlib.crc32(piece, crc)
            tensors.append((name, t["dtype"], [int(x) for x in t["shape"]], piece))
            end = b
        if end != len(data) or str(crc) != crc_text:
            return None
        return tensors, meta, stats_of_eval
    except (ValueError, KeyError, TypeError, AttributeError, struct.error):
        return None


def _load(k):
    """(entry or None, whether a file was there but not a whole entry)."""
    path = _path(k)
    try:
        with open(path, "rb") as f:
            try:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # an empty file
                return None, True
    except OSError:
        return None, False
    with mapped:
        blob = memoryview(mapped)
        entry = _parse(blob, k)  # copies the tensors out of the mapping
        blob.release()
    if entry is None:
        return None, True
    try:
        os.utime(path)  # least recently used: by modification time
    except OSError:
        pass
    return entry, False


def _store(k, tensors, metadata, stats_of_eval, limit):
    path = _path(k)
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=_SUFFIX, dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            for piece in _serialize(tensors, metadata, stats_of_eval, k):
                f.write(piece)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _evict(limit, keep=path)


def _entries():
    """(mtime, size, path) of every entry and of temporary files left by a killed writer a day ago."""
    out = []
    root = _golden_dir()
    try:
        folders = os.listdir(root)
    except OSError:
        return out
    for d in folders:
        try:
            names = os.listdir(os.path.join(root, d))
        except OSError:
            continue
        for n in names:
            if not n.endswith(_SUFFIX):
                continue
            p = os.path.join(root, d, n)
            try:
                st = os.stat(p)
            except OSError:
                continue
            out.append((st.st_mtime, st.st_size, p, n.startswith(".tmp-")))
    return out


def _evict(limit, keep=None):
    """Removes the least recently used entries until the rest fit in `limit` bytes (never `keep`)."""
    import time

    entries = _entries()
    total = sum(size for _, size, _, tmp in entries if not tmp)
    stale = time.time() - 86400
    for mtime, size, p, tmp in sorted(entries):
        if tmp:
            if mtime < stale:
                _remove(p)
            continue
        if total <= limit:
            break
        if p != keep and _remove(p):
            total -= size


def _remove(p):
    try:
        os.unlink(p)
        return True
    except OSError:
        return False


class _Lock:
    """flock on <entry>.lock while a case is evaluated; removed by whoever holds it once the entry
    is in place (a waiter on the removed file then finds the entry; a duplicate evaluation is the
    worst a race can cause)."""

    def __init__(self, k):
        self.path = _path(k) + ".lock"
        self.fd = None

    def __enter__(self):
        if fcntl is not None:
            try:
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
                fcntl.flock(self.fd, fcntl.LOCK_EX)
            except OSError:
                self.fd = None
        return self

    def done(self):
        if self.fd is not None:
            _remove(self.path)

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)


def golden(tensors, metadata, max_precision, evaluate):
    """The golden (tensors, metadata, stats) of the case: from the cache, or evaluate() stored there.
    Returns them and whether they came from the cache."""
    limit = size_limit()
    if limit == 0:
        stats["misses"] += 1
        return evaluate() + (False,)
    k = key(tensors, metadata, max_precision)
    entry, corrupt = _load(k)
    if entry is not None:
        stats["hits"] += 1
        return entry + (True,)
    with _Lock(k) as lock:
        entry, again = _load(k)  # written by another process while this one waited
        if entry is not None:
            stats["hits"] += 1
            lock.done()
            return entry + (True,)
        stats["corrupt"] += corrupt or again
        stats["misses"] += 1
        entry = evaluate()
        try:
            _store(k, *entry, limit)
            lock.done()
        except OSError as e:  # a read-only or full disk: the result stands, uncached
            print(f"attnoracle: warning: golden cache {cache_dir()}: {e}", file=sys.stderr)
    return entry + (False,)


def info():
    """(folder, number of entries, their bytes)."""
    entries = [e for e in _entries() if not e[3]]
    return cache_dir(), len(entries), sum(size for _, size, _, _ in entries)


def clear():
    """Removes every entry; returns (entries removed, their bytes)."""
    n = size = 0
    for _, s, p, _ in _entries():
        if _remove(p):
            n += 1
            size += s
    root = _golden_dir()
    for top, dirs, files in os.walk(root, topdown=False):
        for f in files:
            if f.endswith(".lock"):
                _remove(os.path.join(top, f))
        if top != root:
            try:
                os.rmdir(top)
            except OSError:
                pass
    return n, size
