"""Shared fixtures and hooks.

The end-to-end tests need nothing outside the repository (their corpus is the built-in BBC News,
see tests/dipaco/tiny.py); `e2e_guard` marks them and makes CI fail when one is skipped. The real
corpora in ../shared/data, next to the repository, serve the benchmarks and one corpus test.
"""

from pathlib import Path

import pytest

from e2e_guard import (  # noqa: F401  (pytest finds hooks by name in this module)
    pytest_collection_modifyitems,
    pytest_collectreport,
    pytest_runtest_makereport,
    pytest_sessionfinish,
    pytest_sessionstart,
)

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared corpora not found at {SHARED_DATA}")
    return SHARED_DATA
