"""python3 -m attnoracle cache [--clear]: the golden cache of assert_close (attnoracle/cache.py)."""

import argparse
import sys

from . import cache


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python3 -m attnoracle", description="AttnOracle's Python package")
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("cache", help="the golden cache of assert_close: where it is, its size")
    c.add_argument("--clear", action="store_true", help="remove every entry")
    args = ap.parse_args(argv)
    if args.clear:
        n, size = cache.clear()
        print(f"{cache.cache_dir()}: removed {n} entries, {size / 2**20:.1f} MiB")
    else:
        folder, n, size = cache.info()
        print(f"{folder}: {n} entries, {size / 2**20:.1f} MiB (at most {cache.size_limit() / 2**20:.0f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
