"""Folders are layers: reference < oracle < conformance, vectors < tools, python.

Reads every C/C++ source of the tree and the folder each `#include "attnoracle/<layer>/..."`
names; a folder may include its own layer and those below it, and the libraries of
conformance and vectors (their src/ and include/) stay independent of each other.
"""
import pathlib
import re
import subprocess
import unittest

ROOT = pathlib.Path(__file__).resolve().parents[2]
RANK = {"reference": 0, "oracle": 1, "conformance": 2, "vectors": 2, "tools": 3, "bench": 3, "python": 3}
INCLUDE = re.compile(r'^\s*#\s*include\s+"attnoracle/(\w+)/', re.M)
SOURCES = ("*.cpp", "*.hpp", "*.h", "*.c")


def sources():
    out = subprocess.run(["git", "ls-files", *SOURCES], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.split()
    return [ROOT / p for p in out]


def edges():
    """(folder of the file, folder it includes, file) for every attnoracle/<layer>/ include."""
    for path in sources():
        rel = path.relative_to(ROOT)
        folder = rel.parts[0]
        if folder not in RANK:
            continue
        for layer in INCLUDE.findall(path.read_text(errors="replace")):
            yield folder, layer, rel


class Layers(unittest.TestCase):
    def test_includes_go_down_only(self):
        bad = [f"{rel}: includes attnoracle/{layer}/" for folder, layer, rel in edges()
               if layer in RANK and layer != folder and RANK[layer] >= RANK[folder]
               and not (rel.parts[1] == "tests" and RANK[layer] == RANK[folder])]
        self.assertEqual(bad, [])

    def test_oracle_includes_no_conformance_header(self):
        bad = [str(rel) for folder, layer, rel in edges()
               if folder == "oracle" and layer == "conformance"]
        self.assertEqual(bad, [])

    def test_public_headers_are_namespaced(self):
        loose = [str(p.relative_to(ROOT)) for p in sources()
                 if p.parent.name == "attnoracle" and p.parent.parent.name == "include"
                 and p.name != "plugin.h"]
        self.assertEqual(loose, [], "public headers belong under include/attnoracle/<layer>/")


if __name__ == "__main__":
    unittest.main()
