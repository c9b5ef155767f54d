"""pytest plugin: a test taking the `attnoracle_case` fixture runs once per case of a vector set.

    pytest -p attnoracle.pytest_plugin --attnoracle-suite vectors/core --attnoracle-profile fp16

(a pip installation registers it by its `pytest11` entry point: no -p needed)

or, per test, `@attnoracle.parametrize_suite("vectors/core", profile="fp32", unsupported=("mha",))`
(the same as `@pytest.mark.attnoracle(suite=..., profile=..., unsupported=...)`). One item per case,
its id the case id; a case using a feature the test declares unsupported (attnoracle.FEATURES) is
skipped with that reason. The fixture is the Case, with `check(outputs)` judged under the profile
and `assert_conforms(outputs)`, which fails the test with the gate's verdict and diagnosis.
Options given on the command line take precedence over the decorator's.
"""

import os

import pytest

import attnoracle

_SUITES = {}


def pytest_addoption(parser):
    g = parser.getgroup("attnoracle", "AttnOracle conformance")
    g.addoption("--attnoracle-suite", metavar="DIR", default=None,
                help="vector set whose cases parametrize tests taking the attnoracle_case fixture")
    g.addoption("--attnoracle-profile", metavar="P", default=None,
                help="profile judging the results, as for `attnoracle check --profile` (default fp32)")
    g.addoption("--attnoracle-tag", metavar="T", action="append", default=None,
                help="only cases with one of these tags (repeatable, or comma-separated)")
    g.addoption("--attnoracle-case", metavar="ID", action="append", default=None,
                help="only these case ids (repeatable, or comma-separated)")


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "attnoracle(suite=None, profile=None, tags=None, ids=None, unsupported=(), masked_rows=None, returns=None): "
        "run the test once per case of the vector set, skipping cases that use an unsupported feature")


def parametrize_suite(path, profile="fp32", *, tags=None, ids=None, unsupported=(), masked_rows=None, returns=None):
    """The decorator: one test item per case of the vector set at `path` (see the module's text)."""
    return pytest.mark.attnoracle(suite=os.fspath(path), profile=profile, tags=tags, ids=ids,
                                  unsupported=tuple(unsupported), masked_rows=masked_rows, returns=returns)


def _split(values):
    if values is None:
        return None
    if isinstance(values, str):
        values = [values]
    return [x for v in values for x in str(v).split(",") if x]


def _settings(config, marker):
    kw = dict(marker.kwargs) if marker else {}
    cli_suite = config.getoption("attnoracle_suite")
    cli_profile = config.getoption("attnoracle_profile")
    suite = cli_suite or kw.get("suite")
    if suite and not os.path.isabs(suite):
        base = config.invocation_params.dir if cli_suite else config.rootpath
        if not cli_suite and not os.path.exists(os.path.join(base, suite)):
            base = config.invocation_params.dir
        suite = os.path.join(str(base), suite)
    unsupported = kw.get("unsupported", ())
    unsupported = (unsupported,) if isinstance(unsupported, str) else tuple(unsupported)
    unknown = [f for f in unsupported if f not in attnoracle.FEATURES]
    if unknown:
        raise pytest.UsageError(f"attnoracle: unsupported: unknown feature {unknown[0]!r} "
                                f"(features: {', '.join(attnoracle.FEATURES)})")
    return dict(suite=suite, profile=cli_profile or kw.get("profile") or "fp32",
                tags=_split(config.getoption("attnoracle_tag")) or _split(kw.get("tags")),
                ids=_split(config.getoption("attnoracle_case")) or _split(kw.get("ids")),
                unsupported=unsupported, masked_rows=kw.get("masked_rows"), returns=kw.get("returns"))


def _suite(path):
    if path not in _SUITES:
        try:
            _SUITES[path] = attnoracle.Suite(path)
        except attnoracle.InputError as e:
            raise pytest.UsageError(f"attnoracle: {e}")
    return _SUITES[path]


def pytest_generate_tests(metafunc):
    if "attnoracle_case" not in metafunc.fixturenames:
        return
    s = _settings(metafunc.config, metafunc.definition.get_closest_marker("attnoracle"))
    if not s["suite"]:
        raise pytest.UsageError(f"attnoracle: {metafunc.definition.nodeid} takes attnoracle_case but no vector set "
                                "is given (--attnoracle-suite DIR, or @attnoracle.parametrize_suite(DIR))")
    suite = _suite(s["suite"])
    entries = suite.select(s["tags"], s["ids"])
    if not entries:
        raise pytest.UsageError(f"attnoracle: no case of {s['suite']} matches the tags {s['tags']} and ids {s['ids']}")
    metafunc.parametrize("attnoracle_case", [(e, s) for e in entries], ids=[e.id for e in entries], indirect=True)


class SuiteCase:
    """The attnoracle_case fixture: the Case (every attribute of attnoracle.Case), the profile that
    judges it, check(outputs) and assert_conforms(outputs)."""

    def __init__(self, case, settings):
        self.case = case
        self.profile = settings["profile"]
        self._masked_rows = settings["masked_rows"]
        self._returns = settings["returns"]

    def __getattr__(self, name):
        return getattr(self.case, name)

    def __repr__(self):
        return repr(self.case)

    def check(self, outputs):
        """The gate's Verdict under this test's profile. `outputs` as for attnoracle.Case.check, or a
        function of no argument returning them (an exception it raises is a refusal, Unsupported a skip)."""
        if callable(outputs) and not isinstance(outputs, dict):
            try:
                outputs = outputs()
            except Exception as e:  # noqa: BLE001 - the implementation's refusal, whatever its type
                outputs = e
        return self.case.check(outputs, self.profile, masked_rows=self._masked_rows, returns=self._returns)

    def assert_conforms(self, outputs):
        """Fails the test with the gate's verdict and diagnosis, or skips it with the gate's reason."""
        v = self.check(outputs)
        if v.failed:
            pytest.fail(f"attnoracle: case {self.case.id} fails under profile {self.profile}:\n{v.text}", pytrace=False)
        if v.skipped:
            pytest.skip(f"attnoracle: {v.reason}")
        return v


@pytest.fixture
def attnoracle_case(request):
    """One case of the vector set (see the module's text)."""
    if not hasattr(request, "param"):
        raise pytest.UsageError("attnoracle_case is given by the attnoracle plugin's parametrization")
    entry, settings = request.param
    case = entry.load()
    used = sorted(case.features & set(settings["unsupported"]))
    if used:
        pytest.skip(f"attnoracle: case {case.id} uses {', '.join(used)}, declared unsupported by this test")
    return SuiteCase(case, settings)
