"""The `attnoracle` script of a pip installation: runs the command built into the package."""

import os
import sys


def main():
    exe = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "attnoracle")
    if not os.path.isfile(exe):
        sys.exit("attnoracle: error: the attnoracle command is not in this installation of the package")
    os.execv(exe, [exe] + sys.argv[1:])
