"""Shared fixtures and hooks.

The end-to-end tests need nothing outside the repository (their corpus is the built-in BBC News,
see tests/dipaco/tiny.py); `e2e_guard` marks them and makes CI fail when one is skipped. The real
corpora in ../shared/data, next to the repository, serve the benchmarks and one corpus test.
"""

import os
import signal
from pathlib import Path

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two workers on this 2-core machine: two torch processes of 2 threads each ran 4x
    # slower than with one each. Set before any test module imports torch; their subprocesses inherit it.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
from e2e_guard import (  # noqa: F401  (pytest finds hooks by name in this module)
    pytest_collection_modifyitems,
    pytest_collectreport,
    pytest_runtest_logreport,
    pytest_runtest_makereport,
    pytest_sessionfinish,
    pytest_sessionstart,
)
from signal_guard import pytest_runtest_setup, pytest_runtest_teardown  # noqa: F401  (hooks, as above)

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--sweep", choices=("smoke", "full"), default="smoke",
                     help="the fault-injection tests (SIGKILL mid-run, a full disk): smoke, a few points as CI runs "
                          "them; full, every point, as docs/results.md records them")
    parser.addoption("--device", default="cpu",
                     help="where tests/dipaco/test_device_paths.py runs dipaco's device code paths: cpu (their CPU "
                          "forms, at a tiny size) or cuda[:N] (at the GPU check's sizes)")


@pytest.fixture(scope="session")
def full_sweep(request: pytest.FixtureRequest) -> bool:
    return request.config.getoption("--sweep") == "full"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared corpora not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture
def sigint_from_a_terminal():
    """SIGINT handled as at a terminal (Python's KeyboardInterrupt) for the Ctrl-C tests. A suite started in
    the background without job control (`make test &`, a CI runner's shell) inherits SIGINT ignored, and
    so would a training subprocess; the tests would then measure that instead of dipaco's handler."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture
def sigterm_by_default():
    """SIGTERM with its default action, as in a fresh `dipaco` process: dipaco's handler installs itself
    only over the default (never over one someone else installed), and that is the case these tests check."""
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGTERM, before)
