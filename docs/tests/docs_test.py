"""The docs in step with the tree: links, the core set's figures, the contract's names, keys,
options and exit statuses. Standard library only:

    cd docs/tests && python3 -m unittest -v docs_test
"""
import json
import os
import re
import subprocess
import unittest
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = ROOT / "docs" / "CONTRACT.md"
CORE = ROOT / "vectors" / "core"
# Paths outside the repository that no file may mention (split so that this file does not).
FORBIDDEN = (".." + "/shared", "shared" + "/spec")
SKIP_DIRS = {".git", "node_modules", "__pycache__"}
NOT_YET = "not in this release"
SECTIONS = ["Semantics", "Case file", "Golden tensors", "Vector set (manifest)",
            "Adapter protocol", "Command line", "Gradients", "Serving kernels",
            "Quantized KV caches and FP8 outputs", "Training kernels"]


def repo_files(*suffixes):
    """Tracked files (git ls-files; a walk of the tree outside git) ending in one of suffixes."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], check=True,
                             capture_output=True).stdout.decode()
        names = [n for n in out.split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        names = []
        for top, dirs, files in os.walk(ROOT):
            dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith("build")]
            names += [os.path.relpath(os.path.join(top, f), ROOT) for f in files]
    return sorted(n for n in names if n.endswith(suffixes) and "node_modules/" not in n
                  and (ROOT / n).is_file())


def read(rel):
    return (ROOT / rel).read_text(encoding="utf-8", errors="replace")


def blank(m):
    """The matched text as spaces (newlines kept), so that offsets stay valid."""
    return re.sub(r"[^\n]", " ", m.group(0))


FENCE = re.compile(r"^[ \t]*(```+|~~~+)[^\n]*\n.*?^[ \t]*\1[ \t]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?:(?!\n[ \t]*\n).)+?\1", re.S)
LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\(\s*(<[^>]*>|[^)\s]+)"
                  r"(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
REF_DEF = re.compile(r"^[ \t]{0,3}\[[^\]]+\]:[ \t]*(<[^>]*>|\S+)", re.M)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def links(text):
    """(start, end, target) of every link outside code, targets as written."""
    prose = CODE_SPAN.sub(blank, FENCE.sub(blank, text))
    found = [(m.start(), m.end(), m.group(2)) for m in LINK.finditer(prose)]
    found += [(m.start(), m.end(), m.group(1)) for m in REF_DEF.finditer(prose)]
    return [(a, b, t[1:-1] if t.startswith("<") else t) for a, b, t in found]


def resolve(md, target):
    """The repository path a relative link points to, or None for URLs and anchors."""
    if SCHEME.match(target) or target.startswith("#"):
        return None
    path = unquote(target.split("#", 1)[0].split("?", 1)[0])
    if not path:
        return None
    if path.startswith("/"):
        return Path(path)  # absolute: never inside the repository
    return ((ROOT / md).parent / path).resolve()


def inside(path):
    try:
        path.relative_to(ROOT)
        return True
    except ValueError:
        return False


def literals(paths):
    """String literals of C++ sources, comments skipped."""
    token = re.compile(r"//[^\n]*|/\*.*?\*/|\"((?:\\.|[^\"\\\n])*)\"|'(?:\\.|[^'\\\n])*'", re.S)
    out = set()
    for p in paths:
        for m in token.finditer(p.read_text(encoding="utf-8", errors="replace")):
            if m.group(0).startswith('"'):
                out.add(m.group(1))
    return out


def sources(folder, *suffixes, skip=()):
    base = ROOT / folder
    return sorted(p for p in base.rglob("*") if p.suffix in suffixes and p.is_file()
                  and not any(part in skip for part in p.relative_to(base).parts))


def case_reader():
    found = sorted((ROOT / "reference").rglob("case_file.cpp"))
    if len(found) != 1:
        raise AssertionError(f"expected one reference/**/case_file.cpp, found {found}")
    return found[0]


def sections(text):
    """{number: (title, body)} of the '## N. Title' sections."""
    parts = re.split(r"^## (\d+)\. (.+)$", text, flags=re.M)
    return {int(parts[k]): (parts[k + 1].strip(), parts[k + 2]) for k in range(1, len(parts), 3)}


def tables(body):
    """Every table of a section: (header cells, rows of cells)."""
    out, block = [], []
    for line in body.splitlines() + [""]:
        if line.lstrip().startswith("|"):
            block.append(line.strip())
            continue
        if len(block) >= 2:
            cells = [split_row(r) for r in block]
            out.append((cells[0], [c for c in cells[2:]]))
        block = []
    return out


def split_row(row):
    return [c.strip() for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))]


def one_line(text):
    return " ".join(text.split())


class Links(unittest.TestCase):
    def test_relative_links_resolve_inside_the_repository(self):
        bad = []
        for md in repo_files(".md"):
            for _, _, target in links(read(md)):
                path = resolve(md, target)
                if path is None:
                    continue
                if not inside(path):
                    bad.append(f"{md}: ({target}) points outside the repository")
                elif not path.exists():
                    bad.append(f"{md}: ({target}) does not exist")
        self.assertFalse(bad, "\n" + "\n".join(bad))

    def test_contract_references_link_to_docs_contract(self):
        bad = []
        for md in repo_files(".md"):
            if (ROOT / md).resolve() == CONTRACT:
                continue
            text = read(md)
            spans = [(a, b) for a, b, t in links(text) if resolve(md, t) == CONTRACT]
            for m in re.finditer(r"\bCONTRACT\b", FENCE.sub(blank, text)):
                if not any(a <= m.start() < b for a, b in spans):
                    line = text.count("\n", 0, m.start()) + 1
                    bad.append(f"{md}:{line}: CONTRACT without a link to docs/CONTRACT.md")
        self.assertFalse(bad, "\n" + "\n".join(bad))

    def test_nothing_mentions_paths_outside_the_repository(self):
        bad = [f"{f}: mentions {s}" for f in repo_files(".md", ".h", ".hpp", ".cpp", ".py", ".js")
               for s in FORBIDDEN if s in read(f)]
        self.assertFalse(bad, "\n" + "\n".join(bad))


class CoreFigures(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        manifest = CORE / "manifest.json"
        cls.cases = json.loads(manifest.read_text(encoding="utf-8"))["cases"]
        sizes = [(CORE / c["file"]).stat().st_size for c in cls.cases]
        cls.count = len(cls.cases)
        cls.errors = sum(c["expect"] == "error" for c in cls.cases)
        cls.bytes = sum(sizes) + manifest.stat().st_size  # the definition in vectors/core/README.md
        cls.mb = f"{cls.bytes / 1e6:.1f}"
        cls.families = {}
        for c, size in zip(cls.cases, sizes):
            f = cls.families.setdefault(c["id"].rsplit("-", 1)[0], [0, 0, 0])
            f[0] += 1
            f[1] += c["expect"] == "error"
            f[2] += size

    def figures(self, rel, pattern):
        m = re.search(pattern, one_line(read(rel)))
        self.assertIsNotNone(m, f"{rel}: no sentence matching {pattern!r}")
        return m.groups()

    def test_readme(self):
        n, mb = self.figures("README.md", r"`vectors/core` \((\d+) cases, (\d+\.\d) MB\)")
        self.assertEqual((int(n), mb), (self.count, self.mb), "README.md")

    def test_readme_console_run(self):
        text = read("README.md")
        # the time as the report writes durations: "660 ms", "1.5 s", "2 min 5 s"
        m = re.search(r"^(\d+) cases in (?:[\d.]+ m?s|\d+ min(?: \d+ s)?): (\d+) passed, (\d+) failed, (\d+) skipped$",
                      text, re.M)
        self.assertIsNotNone(m, "README.md: no run summary of vectors/core")
        n, passed, failed, skipped = map(int, m.groups())
        self.assertEqual(n, self.count, "README.md: run summary")
        self.assertEqual(passed + failed + skipped, n, "README.md: run summary")
        listed = sum(int(k) for k in re.findall(r"^skipped (\d+): ", text, re.M))
        self.assertEqual(listed, skipped, "README.md: skipped lines of the run")

    def test_suites(self):
        n, mb = self.figures("vectors/SUITES.md",
                             r"committed in `vectors/core/` \(see its README; (\d+) cases, "
                             r"(\d+\.\d) MB")
        self.assertEqual((int(n), mb), (self.count, self.mb), "vectors/SUITES.md")

    def test_core_readme(self):
        n, errors, mb, size = self.figures(
            "vectors/core/README.md",
            r"committed: (\d+) cases, (\d+) of them to be refused \(`expect: error`\), "
            r"(\d+\.\d) MB \((\d+) bytes:")
        self.assertEqual((int(n), int(errors), mb, int(size)),
                         (self.count, self.errors, self.mb, self.bytes), "vectors/core/README.md")

    def test_core_readme_families(self):
        rows = re.findall(r"^\| `([^`]+)` \| (\d+) \| (\d+) \|.*\| (\d+) \|$",
                          read("vectors/core/README.md"), re.M)
        table = {name: [int(c), int(e), int(b)] for name, c, e, b in rows}
        self.assertEqual(table, self.families,
                         "vectors/core/README.md: family table (cases, expect error, bytes)")


class Contract(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.text = CONTRACT.read_text(encoding="utf-8")
        cls.sections = sections(cls.text)
        cls.reference = literals(sources("reference", ".cpp", ".hpp", ".h",
                                         skip={"tests", "proofs"}))
        cls.reader = literals([case_reader()])
        # (name, implemented) of the tensor and key tables of sections 2 and 3
        cls.names, cls.keys = [], set()
        for n in (2, 3):
            for header, rows in tables(cls.sections[n][1]):
                if header[0].lower() not in ("tensor", "key"):
                    continue
                for row in rows:
                    implemented = NOT_YET not in " ".join(row).lower()
                    for name in re.findall(r"`([^`]+)`", row[0]):
                        cls.names.append((name, implemented))
                        if header[0].lower() == "key":
                            cls.keys.add(name)

    def test_title_and_sections(self):
        self.assertRegex(self.text.splitlines()[0], r"^# .*version 1\.1$")
        self.assertEqual([self.sections[n][0] for n in sorted(self.sections)], SECTIONS)

    def test_documented_names_are_known_to_the_reference(self):
        self.assertGreater(len(self.names), 20, "tables of sections 2 and 3 not found")
        missing = []
        for name, implemented in self.names:
            placeholder = re.fullmatch(r"[A-Z](\..+)", name)  # T.undecided: the suffix
            literal = placeholder.group(1) if placeholder else name
            if implemented and literal not in self.reference:
                missing.append(name)
        self.assertFalse(missing, f"documented but unknown to reference/: {missing}")

    def test_names_not_in_this_release_are_unknown_to_the_reader(self):
        known = [n for n, implemented in self.names if not implemented and n in self.reader]
        self.assertFalse(known, f"marked '{NOT_YET}' but the case reader knows them: {known}")

    def test_every_key_of_the_reader_is_documented(self):
        code = {k for s in self.reader for k in re.findall(r"attn\.[a-z_]+", s)}
        self.assertGreaterEqual(len(code), 11)
        self.assertFalse(code - self.keys, "keys of the case reader missing from the tables")

    def test_manifest_fields_are_known_to_the_reader(self):
        reader = literals(sources("reference", ".cpp", skip={"tests"}) + sources("vectors", ".cpp", skip={"tests"}))
        fields = [name.split(".")[-1] for header, rows in tables(self.sections[4][1])
                  if header[0] == "field" for row in rows
                  for name in re.findall(r"`([^`]+)`", row[0])]
        self.assertIn("sha256", fields)
        self.assertFalse([f for f in fields if f not in reader], "manifest fields")

    def test_exit_statuses(self):
        statuses = [row[0] for header, rows in tables(self.sections[6][1])
                    if header[0] == "status" for row in rows]
        self.assertEqual(statuses, ["0", "1", "2"])
        self.assertIn("attnoracle: error: <file>: <tensor or key>: <what>", self.text)
        tools = literals(sources("tools", ".cpp", skip={"tests"}))
        self.assertIn("attnoracle: error: ", tools)

    def test_every_subcommand_and_option_is_documented(self):
        body = self.sections[6][1]
        code = "\n".join(p.read_text(encoding="utf-8")
                         for p in sources("tools", ".cpp", skip={"tests"}))
        commands = re.findall(r'add_subcommand\("([a-z-]+)"', code)
        self.assertGreaterEqual(len(commands), 7)
        missing = [c for c in commands if f"`attnoracle {c}" not in body]
        for spec in re.findall(r'add_(?:option|flag)\("([^"]+)"', code):
            missing += [o for o in spec.split(",") if o.startswith("-") and f"`{o}" not in body
                        and f", {o}" not in body]
        self.assertFalse(missing, "subcommands or options missing from section 6")


if __name__ == "__main__":
    unittest.main()
