"""The HTML report and the pictures' data in the JSON report, end to end through the command.

Environment: ATTNORACLE_CLI (the command), ATTNORACLE_SUITE (vectors/core), ATTNORACLE_ADAPTER
(the NumPy example adapter), ATTNORACLE_ARTEFACTS (where the headless browser's screenshot and
DOM are kept). The class Chromium needs the Debian package chromium and skips without it.
"""
import json
import os
import re
import shutil
import struct
import subprocess
import tempfile
import unittest

CLI = os.environ.get("ATTNORACLE_CLI", "attnoracle")
SUITE = os.environ.get("ATTNORACLE_SUITE", "vectors/core")
ADAPTER = os.environ.get("ATTNORACLE_ADAPTER", "conformance/adapters/numpy/attention.py")
ARTEFACTS = os.environ.get("ATTNORACLE_ARTEFACTS", tempfile.gettempdir())
PY = "/usr/bin/python3"

# A planted bug (a causal mask one key too far) on a few cases, one with GQA and one without weights.
BUG_CASES = "causal-000,causal-002,broadcast-000,block_edges_causal-002,uniform-000"


def cli(*args):
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=600)


def failing_report(tmp):
    """run with the causal_leak bug, --json and --html; returns (json path, html path, report)."""
    j, h = os.path.join(tmp, "r.json"), os.path.join(tmp, "r.html")
    r = cli("run", SUITE, "--impl", f"{PY} {ADAPTER} --bug causal_leak", "--case", BUG_CASES,
            "--json", j, "--html", h)
    assert r.returncode == 1, r.stdout + r.stderr
    with open(j) as f:
        return j, h, json.load(f)


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n]), bytearray(data), 8 + n


def scale_f32(path, name, flat, factor):
    """Multiplies element `flat` of the F32 tensor `name` in place."""
    header, data, base = read_safetensors(path)
    t = header[name]
    assert t["dtype"] == "F32"
    at = base + t["data_offsets"][0] + 4 * flat
    (x,) = struct.unpack("<f", data[at:at + 4])
    data[at:at + 4] = struct.pack("<f", x * factor)
    with open(path, "wb") as f:
        f.write(data)
    return x


class Pictures(unittest.TestCase):
    """The data, worked by hand: one element of out perturbed in a result checked offline."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="attnoracle-html-")
        work = os.path.join(cls.tmp, "work")
        case = "block_edges_causal-002"  # Nq = Nk = 129, Dv = 4, causal bottom right: row i has i + 1 keys
        r = cli("run", SUITE, "--impl", f"{PY} {ADAPTER}", "--case", case, "--work", work, "--keep")
        assert r.returncode == 0, r.stdout + r.stderr
        res = os.path.join(work, "outputs")
        # out[0, 0, 128, 3]: flat index 128 * 4 + 3; 1% off is far beyond an F32 limit
        cls.before = scale_f32(os.path.join(res, case + ".safetensors"), "out", 128 * 4 + 3, 1.01)
        cls.json = os.path.join(cls.tmp, "check.json")
        cls.html = os.path.join(cls.tmp, "check.html")
        r = cli("check", SUITE, "--results", res, "--case", case, "--json", cls.json, "--html", cls.html)
        assert r.returncode == 1, r.stdout + r.stderr
        with open(cls.json) as f:
            cls.report = json.load(f)
        cls.case = cls.report["cases"][0]

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_the_map_has_the_element_in_its_cell(self):
        c = self.case
        self.assertEqual(c["status"], "fail")
        self.assertEqual(c["worst"]["index"], [0, 0, 128, 3])
        ratio = c["worst"]["limit_ratio"]
        self.assertGreater(ratio, 1)
        maps = [m for m in c["pictures"]["maps"] if m["tensor"] == "out"]
        self.assertEqual(len(maps), 1)  # B = 1, Hq = 1
        m = maps[0]
        self.assertEqual((m["batch"], m["head"], m["kv_head"]), (0, 0, 0))
        self.assertEqual((m["rows"], m["cols"], m["cell_rows"], m["cell_cols"]), (129, 4, 128, 4))
        # row 128 falls in cell floor(128 * 128 / 129) = 127; rows 0..127 in cells 0..126 (cell 0 has rows 0 and 1)
        cells = m["cells"]
        self.assertEqual(len(cells), 128 * 4)
        self.assertAlmostEqual(cells[127 * 4 + 3], ratio, delta=ratio * 5e-3)  # 3 significant digits
        others = [v for k, v in enumerate(cells) if k != 127 * 4 + 3]
        self.assertTrue(all(v is not None and v <= 1 for v in others), max(others))
        self.assertAlmostEqual(m["worst_limit_ratio"], ratio, delta=ratio * 5e-3)
        # the means: cell 127 holds row 128 alone (cell 0 rows 0 and 1), so its mean is the element's
        self.assertEqual(len(m["means"]), 128 * 4)
        self.assertAlmostEqual(m["means"][127 * 4 + 3], ratio, delta=ratio * 5e-3)
        self.assertTrue(all(v <= c for v, c in zip(m["means"], cells)))
        self.assertNotIn("weights", [x["tensor"] for x in c["pictures"]["maps"]])  # the case returns none

    def test_rows_carry_keys_and_magnitudes(self):
        series = {s["tensor"]: s for s in self.case["pictures"]["rows"]}
        self.assertEqual(sorted(series), ["lse", "out"])
        out = series["out"]
        self.assertEqual(out["rows"], 129)
        self.assertEqual(len(out["points"]), 129)
        by_row = {p[2]: p for p in out["points"]}
        self.assertEqual(by_row[0][3], 1)      # causal bottom right with Nq = Nk: row i has i + 1 keys
        self.assertEqual(by_row[128][3], 129)
        self.assertGreater(by_row[128][5], 1)  # the perturbed row
        self.assertTrue(all(p[5] <= 1 for i, p in by_row.items() if i != 128))
        self.assertTrue(all(p[4] is not None and p[4] >= 0 for p in out["points"]))
        # lse was left alone: no row of it fails
        self.assertTrue(all(p[5] <= 1 for p in series["lse"]["points"]))

    def test_histogram_counts_every_compared_element(self):
        tensors = {t["tensor"]: t for t in self.case["tensors"]}
        for h in self.case["pictures"]["histograms"]:
            total = h["zero"] + h["below"] + h["above"] + h["infinite"] + sum(h["bins"])
            self.assertEqual(total, tensors[h["tensor"]]["compared"], h["tensor"])
            self.assertEqual(h["log2_from"], -32)
            self.assertEqual(len(h["bins"]), 64)
            # bin k holds ratios in [2^(k - 32), 2^(k - 31)): from bin 32 on, beyond the limit
            beyond = sum(h["bins"][32:]) + h["above"] + h["infinite"]
            self.assertEqual(beyond, tensors[h["tensor"]]["over_limit"], h["tensor"])
        out = [h for h in self.case["pictures"]["histograms"] if h["tensor"] == "out"][0]
        e = int.bit_length(int(self.case["worst"]["limit_ratio"])) - 1  # ratio in [2^e, 2^(e+1))
        self.assertEqual(out["bins"][32 + e], 1)

    def test_passing_cases_carry_no_pictures(self):
        tmp = tempfile.mkdtemp(prefix="attnoracle-html-")
        try:
            j = os.path.join(tmp, "r.json")
            r = cli("run", SUITE, "--impl", f"{PY} {ADAPTER}", "--case", "uniform-000", "--json", j)
            self.assertEqual(r.returncode, 0, r.stderr)
            with open(j) as f:
                self.assertNotIn("pictures", json.load(f)["cases"][0])
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


class Report(unittest.TestCase):
    """--html, report REPORT.json --html, and the refusals of report."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="attnoracle-html-")
        cls.json, cls.html, cls.report = failing_report(cls.tmp)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def page(self, path=None):
        with open(path or self.html, encoding="utf-8") as f:
            return f.read()

    def test_gqa_maps_name_their_kv_head(self):
        c = [c for c in self.report["cases"] if c["id"] == "broadcast-000"][0]
        self.assertEqual(c["status"], "fail")
        hq = max(m["head"] for m in c["pictures"]["maps"] if m["tensor"] == "weights") + 1
        kv = max(m["kv_head"] for m in c["pictures"]["maps"] if m["tensor"] == "weights") + 1
        self.assertLess(kv, hq)  # grouped
        for m in c["pictures"]["maps"]:
            self.assertEqual(m["kv_head"], m["head"] // (hq // kv))

    def test_no_address_in_the_page(self):
        page = self.page()
        self.assertIsNone(re.search(r"https?:", page, re.I))
        self.assertNotIn("<link", page)
        self.assertIsNone(re.search(r"<script[^>]*\bsrc=", page))
        self.assertIsNone(re.search(r"<img\b", page))

    def test_the_data_cannot_end_the_script(self):
        # an implementation's text with markup and an address goes in escaped
        with open(self.json) as f:
            j = json.load(f)
        j["implementation"] = "</script><b>x</b> https://example.org/ & more"
        j["cases"][0]["reason"] = "</SCRIPT> http://a"
        src = os.path.join(self.tmp, "markup.json")
        with open(src, "w") as f:
            json.dump(j, f)
        out = os.path.join(self.tmp, "markup.html")
        r = cli("report", src, "--html", out)
        self.assertEqual(r.returncode, 0, r.stderr)
        page = self.page(out)
        self.assertEqual(page.lower().count("</script>"), 3)  # the page's own three scripts
        self.assertIsNone(re.search(r"https?:", page, re.I))

    def test_report_from_the_json_gives_the_same_page(self):
        again = os.path.join(self.tmp, "again.html")
        r = cli("report", self.json, "--html", again)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout, "")
        self.assertEqual(self.page(again), self.page())

    def test_a_report_without_means_is_drawn(self):
        # what run --json wrote before the cells' means: the field is optional
        with open(self.json) as f:
            j = json.load(f)
        for c in j["cases"]:
            for m in c.get("pictures", {}).get("maps", []):
                del m["means"]
        src = os.path.join(self.tmp, "no-means.json")
        with open(src, "w") as f:
            json.dump(j, f)
        r = cli("report", src, "--html", os.path.join(self.tmp, "no-means.html"))
        self.assertEqual(r.returncode, 0, r.stderr)

    def test_a_report_without_pictures_is_drawn(self):
        # what run --json wrote before the pictures: the fields are optional
        with open(self.json) as f:
            j = json.load(f)
        for c in j["cases"]:
            c.pop("pictures", None)
        src = os.path.join(self.tmp, "old.json")
        with open(src, "w") as f:
            json.dump(j, f)
        r = cli("report", src, "--html", os.path.join(self.tmp, "old.html"))
        self.assertEqual(r.returncode, 0, r.stderr)

    def refused(self, text, field_and_what):
        src = os.path.join(self.tmp, "bad.json")
        out = os.path.join(self.tmp, "bad.html")
        with open(src, "w") as f:
            f.write(text)
        r = cli("report", src, "--html", out)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertEqual(r.stderr, f"attnoracle: error: {src}: {field_and_what}\n")
        self.assertFalse(os.path.exists(out))

    def edited(self, change):
        with open(self.json) as f:
            j = json.load(f)
        change(j)
        return json.dumps(j)

    def test_refusals(self):
        self.refused("{", "not JSON (a report written by run or check with --json)")
        self.refused("[]", "not a JSON object")
        self.refused(self.edited(lambda j: j.update(schema="attnoracle-report/9")), "schema: not attnoracle-report/1")
        self.refused(self.edited(lambda j: j.pop("cases")), "cases: missing")
        self.refused(self.edited(lambda j: j["cases"][1].update(status="maybe")), "cases[1].status: not pass, fail or skip")
        self.refused(self.edited(lambda j: j["cases"][0]["tensors"][0].update(compared=-1)),
                     "cases[0].tensors[0].compared: not a non-negative integer")
        k = [n for n, c in enumerate(self.report["cases"]) if "pictures" in c][0]
        at = f"cases[{k}].pictures"

        def pictures(j):
            return j["cases"][k]["pictures"]

        m = pictures(self.report)["maps"][0]
        n = m["cell_rows"] * m["cell_cols"]
        self.refused(self.edited(lambda j: pictures(j)["maps"][0]["cells"].pop()),
                     f"{at}.maps[0].cells: {n - 1} values, cell_rows x cell_cols is {n}")
        self.refused(self.edited(lambda j: pictures(j)["maps"][0]["cells"].__setitem__(0, -1)),
                     f"{at}.maps[0].cells: a value neither a non-negative number nor null")
        self.refused(self.edited(lambda j: pictures(j)["maps"][0]["means"].pop()),
                     f"{at}.maps[0].means: {n - 1} values, cell_rows x cell_cols is {n}")
        self.refused(self.edited(lambda j: pictures(j)["maps"][0].update(means="x")), f"{at}.maps[0].means: not an array")
        self.refused(self.edited(lambda j: pictures(j)["maps"][0].update(cell_rows=200)),
                     f"{at}.maps[0].cell_rows: must be 1 to min(rows, 128)")
        self.refused(self.edited(lambda j: pictures(j)["rows"][0]["points"][0].pop()),
                     f"{at}.rows[0].points[0]: not [batch, head, query, keys, score magnitude, ratio]")
        self.refused(self.edited(lambda j: pictures(j)["histograms"][0].update(zero="3")),
                     f"{at}.histograms[0].zero: not a non-negative integer")
        self.refused(self.edited(lambda j: pictures(j).pop("maps")), f"{at}.maps: missing")

    def test_refusals_of_the_paths(self):
        missing = os.path.join(self.tmp, "none.json")
        r = cli("report", missing, "--html", os.path.join(self.tmp, "x.html"))
        self.assertEqual(r.returncode, 2)
        self.assertTrue(r.stderr.startswith(f"attnoracle: error: {missing}: "), r.stderr)
        self.assertEqual(r.stderr.count("\n"), 1)
        nodir = os.path.join(self.tmp, "no", "x.html")
        for args in (["report", self.json, "--html", nodir],
                     ["run", SUITE, "--impl", f"{PY} {ADAPTER}", "--case", "uniform-000", "--html", nodir]):
            r = cli(*args)
            self.assertEqual(r.returncode, 2, args)
            self.assertEqual(r.stderr, f"attnoracle: error: {nodir}: directory {os.path.dirname(nodir)} does not exist\n")
        r = cli("report", self.json)
        self.assertEqual(r.returncode, 2)
        self.assertIn("--html", r.stderr)


class Chromium(unittest.TestCase):
    """The page in headless Chromium: its script runs without errors and draws the pictures."""

    @classmethod
    def setUpClass(cls):
        cls.browser = shutil.which("chromium") or shutil.which("chromium-browser")
        if not cls.browser:
            raise unittest.SkipTest("chromium not found (Debian package chromium, tools/setup.sh installs it)")
        cls.tmp = tempfile.mkdtemp(prefix="attnoracle-html-")
        cls.json, cls.html, cls.report = failing_report(cls.tmp)
        os.makedirs(ARTEFACTS, exist_ok=True)
        shutil.copy(cls.html, os.path.join(ARTEFACTS, "html_report.html"))

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def chromium(self, *args, page=None, address=""):
        profile = tempfile.mkdtemp(prefix="attnoracle-chromium-")
        try:
            return subprocess.run([self.browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                                   "--no-first-run", f"--user-data-dir={profile}", *args,
                                   "file://" + os.path.abspath(page or self.html) + address],
                                  capture_output=True, text=True, timeout=180)
        finally:
            shutil.rmtree(profile, ignore_errors=True)

    def dom(self, page=None, address=""):
        r = self.chromium("--dump-dom", page=page, address=address)
        self.assertEqual(r.returncode, 0, r.stderr[-2000:])
        self.assertIn('data-report-status="ok"', r.stdout)
        return r.stdout

    def test_page_runs_and_draws(self):
        dom = self.dom()
        with open(os.path.join(ARTEFACTS, "html_report.dom.html"), "w") as f:
            f.write(dom)
        self.assertIsNone(re.search(r'<pre id="script-errors"[^>]*>[^<]', dom), "script errors in the page")
        # the summary table opens on the failing cases, the worst first
        failing = [c for c in self.report["cases"] if c["status"] == "fail"]
        self.assertEqual(re.findall(r'<tr data-status="(\w+)"', dom), ["fail"] * len(failing))
        shown = re.findall(r'<tr data-status="fail" data-id="([^"]+)"', dom)
        worst = {c["id"]: c["worst"]["limit_ratio"] for c in failing}
        self.assertEqual(shown, sorted(worst, key=lambda i: -worst[i]))
        self.assertIn(f"{len(failing)} of {len(self.report['cases'])} cases shown", dom)
        # the failing cases in the same order, each with the address its link gives
        self.assertEqual(re.findall(r'<details class="case" id="case-([^"]+)"', dom), shown)
        self.assertEqual(re.findall(r'<a href="#case-([^"]+)" class="case-link"', dom), shown)
        # the first failing case, opened and drawn
        first = [c for c in self.report["cases"] if c["status"] == "fail"][0]
        at = dom.index(f'data-id="{first["id"]}"', dom.index('id="failing"'))
        end = dom.find("<details", at + 1)
        section = dom[at:end if end > 0 else len(dom)]
        canvases = re.findall(r'<canvas class="heatmap"[^>]*>', section)
        self.assertEqual({re.search(r'data-tensor="(\w+)"', c).group(1) for c in canvases}, {"out", "weights"})
        for c in canvases:
            self.assertGreater(int(re.search(r'data-over="(\d+)"', c).group(1)), 0, c)
        self.assertGreater(section.count("<circle"), 0)
        hists = re.findall(r'<svg class="histogram"[^>]*data-elements="(\d+)"', section)
        self.assertEqual(len(hists), 3)  # out, weights, lse
        self.assertTrue(all(int(n) > 0 for n in hists))
        self.assertIn("masked_weight", section)  # the finding, in words

    def test_an_address_opens_and_shows_its_case(self):
        last = re.findall(r'<details class="case" id="(case-[^"]+)"', self.dom())[-1]
        dom = self.dom(address="#" + last)
        self.assertIn(f'data-shown="{last}"', dom)
        self.assertIsNotNone(re.search(f'<details class="case" id="{last}"[^>]* open=""', dom))

    def test_large_maps_are_binned_and_small_ones_readable(self):
        """A map of 2048 x 2048 elements in 128 x 128 cells, as a kernel-sized case gives, and one of
        5 x 8 elements: the first fits in about 512 pixels and says what a cell covers, the second
        has cells of 32 pixels."""
        with open(self.json) as f:
            j = json.load(f)
        c = [c for c in j["cases"] if c.get("pictures") and any(m["tensor"] == "weights" for m in c["pictures"]["maps"])][0]
        maps = c["pictures"]["maps"]
        big = [m for m in maps if m["tensor"] == "weights"][0]
        small = [m for m in maps if m["tensor"] == "out"][0]
        big.update(rows=2048, cols=2048, cell_rows=128, cell_cols=128, worst_limit_ratio=40.0,
                   cells=[40.0 if r == c else 0.5 for r in range(128) for c in range(128)],
                   means=[2.5 if r == c else 0.01 for r in range(128) for c in range(128)])
        small.update(rows=5, cols=8, cell_rows=5, cell_cols=8, worst_limit_ratio=3.0,
                     cells=[3.0] + [0.25] * 39, means=[3.0] + [0.25] * 39)
        for m in maps:
            if m is not big and m is not small:
                m.update(worst_limit_ratio=0)
        for other in j["cases"]:
            if other is not c and other["status"] == "fail":
                other["status"] = "pass"
        src, page = os.path.join(self.tmp, "sizes.json"), os.path.join(self.tmp, "sizes.html")
        with open(src, "w") as f:
            json.dump(j, f)
        r = cli("report", src, "--html", page)
        self.assertEqual(r.returncode, 0, r.stderr)
        dom = self.dom(page)
        canvases = {re.search(r'data-tensor="(\w+)"', x).group(1): x for x in re.findall(r'<canvas class="heatmap"[^>]*>', dom)}
        width = lambda x: int(re.search(r'width="(\d+)"', x).group(1))
        height = lambda x: int(re.search(r'height="(\d+)"', x).group(1))
        # 128 cells of 4 pixels, the axes' margins (52 + 16 across, 8 + 40 down)
        self.assertEqual((width(canvases["weights"]), height(canvases["weights"])), (52 + 512 + 16, 8 + 512 + 40))
        self.assertIn('data-mode="max"', canvases["weights"])
        self.assertIn('data-over="128"', canvases["weights"])  # the diagonal
        self.assertIn("2048 x 2048 elements in 128 x 128 cells of 16 query rows x 16 keys, each the largest ratio of its elements", dom)
        # 5 x 8 cells of 32 pixels
        self.assertEqual((width(canvases["out"]), height(canvases["out"])), (52 + 8 * 32 + 16, 8 + 5 * 32 + 40))
        self.assertIn("5 x 8 elements, one cell each", dom)
        self.assertEqual(dom.count('<select class="mode-select">'), 2)
        shot = os.path.join(ARTEFACTS, "html_report_sizes.png")
        r = self.chromium(f"--screenshot={shot}", "--window-size=1280,1600", page=page)
        self.assertEqual(r.returncode, 0, r.stderr[-2000:])
        print(f"screenshot kept: {shot}")

    def test_screenshot(self):
        shot = os.path.join(ARTEFACTS, "html_report.png")
        if os.path.exists(shot):
            os.remove(shot)
        r = self.chromium(f"--screenshot={shot}", "--window-size=1280,2400")
        self.assertEqual(r.returncode, 0, r.stderr[-2000:])
        with open(shot, "rb") as f:
            png = f.read()
        self.assertEqual(png[:8], b"\x89PNG\r\n\x1a\n")
        self.assertGreater(len(png), 20000)  # a drawn page, not a blank one
        print(f"screenshot kept: {shot}")


if __name__ == "__main__":
    unittest.main()
