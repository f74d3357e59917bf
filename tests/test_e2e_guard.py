"""tests/e2e_guard.py: end-to-end tests are marked, and DIPACO_REQUIRE_E2E=1 (CI) refuses their skips.

Each case runs pytest in a subprocess on a small test directory with the guard loaded as a plugin; the
cases CI depends on run again under pytest-xdist (`make test` runs the suite with two workers), where
tests run in the workers and the controller decides the session.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

CONFTEST = '''
import pytest

@pytest.fixture(scope="session")
def prepared_run():
    if {missing!r}:
        pytest.skip("no corpus here")
    return "run"

@pytest.fixture
def run_cfg(prepared_run):
    return prepared_run
'''

TESTS_FILE = '''
import pytest

def test_unit():
    pass

def test_e2e_through_a_fixture(run_cfg):
    assert run_cfg == "run"

@pytest.mark.slow
def test_marked_e2e():
    if {missing!r}:
        pytest.skip("no model here")

@pytest.mark.skipif(True, reason="not end-to-end")
def test_plain_skip():
    pass

@pytest.mark.slow
@pytest.mark.xfail(reason="known", strict=True)
def test_e2e_xfail():
    assert False
'''


def run_pytest(tmp_path: Path, *, require: bool, missing: bool, extra_files: dict[str, str] | None = None,
               files: dict[str, str] | None = None, workers: int = 0) -> tuple[int, dict[str, int], str]:
    tmp_path.joinpath("pytest.ini").write_text("[pytest]\nmarkers =\n    slow: end-to-end\n")
    chosen = files if files is not None else {"conftest.py": CONFTEST.format(missing=missing),
                                              "test_cases.py": TESTS_FILE.format(missing=missing)}
    for name, text in {**chosen, **(extra_files or {})}.items():
        tmp_path.joinpath(name).write_text(textwrap.dedent(text))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    env.pop("DIPACO_REQUIRE_E2E", None)
    if require:
        env["DIPACO_REQUIRE_E2E"] = "1"
    parallel = ["-n", str(workers)] if workers else ["-p", "no:xdist"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "e2e_guard", "-p", "no:cacheprovider",
                           *parallel, str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    summary = out.strip().splitlines()[-1]
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (failed|passed|skipped|xfailed|errors?)", summary)}
    return proc.returncode, counts, out


def test_without_the_variable_skips_stay_skips_with_their_reasons(tmp_path):
    rc, counts, out = run_pytest(tmp_path, require=False, missing=True)
    assert rc == 0, out
    assert counts == {"passed": 1, "skipped": 3, "xfailed": 1}, out
    assert "no corpus here" in out and "not end-to-end" in out  # -rs


WORKERS = pytest.mark.parametrize("workers", [0, 2], ids=["serial", "xdist"])


@WORKERS
def test_required_end_to_end_skips_fail_with_their_reason(tmp_path, workers):
    rc, counts, out = run_pytest(tmp_path, require=True, missing=True, workers=workers)
    assert rc == 1, out
    # Both end-to-end tests (marked through their fixture, or by hand) fail: the fixture's skip as an
    # error at setup, the test's own as a failure; the plain skip and the xfail stay what they are.
    assert counts == {"error": 1, "failed": 1, "passed": 1, "skipped": 1, "xfailed": 1}, out
    assert "end-to-end test skipped while DIPACO_REQUIRE_E2E=1: Skipped: no corpus here" in out
    assert "end-to-end test skipped while DIPACO_REQUIRE_E2E=1: Skipped: no model here" in out


@WORKERS
def test_required_and_nothing_skipped_passes(tmp_path, workers):
    rc, counts, out = run_pytest(tmp_path, require=True, missing=False, workers=workers)
    assert rc == 0, out
    assert counts == {"passed": 3, "skipped": 1, "xfailed": 1}, out


@WORKERS
def test_required_fails_a_module_skipped_as_a_whole(tmp_path, workers):
    skipped_module = "import pytest\npytest.importorskip('no_such_module_here')\n\ndef test_x(run_cfg):\n    pass\n"
    rc, _, out = run_pytest(tmp_path, require=True, missing=False, extra_files={"test_web.py": skipped_module},
                            workers=workers)
    assert rc == 1, out
    assert "test module skipped as a whole" in out and "test_web.py" in out


@WORKERS
@pytest.mark.parametrize("files", [
    {"test_unit_only.py": "def test_unit():\n    pass\n"},  # end-to-end tests all gone
    {},  # no tests at all: pytest's exit status 5 must not pass either
])
def test_required_fails_when_no_end_to_end_test_passed(tmp_path, files, workers):
    rc, _, out = run_pytest(tmp_path, require=True, missing=False, files=files, workers=workers)
    assert rc not in (0, 5), out
    assert "no end-to-end test (marker 'slow') passed" in out
