"""pytest hooks that mark the end-to-end tests and, in CI, refuse to let them be skipped.

A test is end-to-end (marker `slow`) when it uses the `prepared_run` fixture, directly or through
another fixture (`run_cfg`, `served_run`, ...): it prepares a corpus and trains a tiny model.
Tests can also carry `@pytest.mark.slow` themselves.

With DIPACO_REQUIRE_E2E=1 (set by `.ci/run`) a skipped end-to-end test is reported as a failure
with its skip reason, a test module skipped as a whole (it could hold end-to-end tests) fails the
session, and so does a session in which no end-to-end test passed. Without it, skips stay skips
(`make test` lists their reasons).

Loaded by tests/conftest.py, which re-exports these hooks; the marker is registered in pyproject.toml.
"""

from __future__ import annotations

import os

import pytest

REQUIRE_E2E = "DIPACO_REQUIRE_E2E"
E2E_MARKER = "slow"
E2E_FIXTURES = ("prepared_run",)

_skipped_modules: list[str] = []
_e2e_passed: list[str] = []


def e2e_required() -> bool:
    return os.environ.get(REQUIRE_E2E, "").strip() not in ("", "0")


def is_e2e(item: pytest.Item) -> bool:
    return item.get_closest_marker(E2E_MARKER) is not None


def pytest_sessionstart(session: pytest.Session) -> None:
    _skipped_modules.clear()
    _e2e_passed.clear()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if any(name in getattr(item, "fixturenames", ()) for name in E2E_FIXTURES):
            item.add_marker(E2E_MARKER)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    outcome = yield
    report = outcome.get_result()
    if not is_e2e(item):
        return
    if report.skipped and not hasattr(report, "wasxfail") and e2e_required():
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"end-to-end test skipped while {REQUIRE_E2E}=1: {reason}"
    report.user_properties.append((E2E_MARKER, True))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # Counted where reports are logged, not where they are made: under pytest-xdist that is the
    # controller, which runs no test itself and receives the workers' reports (user_properties travel).
    if report.when == "call" and report.passed and any(key == E2E_MARKER for key, _ in report.user_properties):
        _e2e_passed.append(report.nodeid)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.skipped:
        _skipped_modules.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not e2e_required() or hasattr(session.config, "workerinput"):  # an xdist worker: the controller decides
        return
    problems = [f"test module skipped as a whole (it may hold end-to-end tests): {nodeid}"
                for nodeid in _skipped_modules]
    if not _e2e_passed:
        problems.append(f"no end-to-end test (marker '{E2E_MARKER}') passed")
    if problems:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        for line in problems:
            if reporter is not None:
                reporter.write_line(f"{REQUIRE_E2E}=1: {line}", red=True)
        if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
