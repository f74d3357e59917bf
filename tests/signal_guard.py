"""pytest hooks that keep one test's signal handlers from reaching the next.

Several tests send SIGINT or SIGTERM to their own process (the pytest worker) to check dipaco's handlers,
which install themselves only over the default handler. A test that leaves another handler behind changes
what those signals do for every later test in the same worker: ``ray.init`` installs a SIGTERM handler that
calls ``sys.exit`` and ``ray.shutdown`` leaves it there, so a later SIGTERM test ended the worker instead
("node down: Not properly terminated"), and pytest-xdist 3.8's loadfile scheduler then waited forever for
the dead worker's files (CI ran out of time at 93%).

A test module's SIGINT and SIGTERM handlers after its last test's teardown (its module fixtures end there) must
be the ones before its first test's setup: a module that leaves another is an error at that teardown, naming
the signal and the handler, and the handler it found is put back. (Per module, not per test: a module
fixture such as a Ray session may hold a handler over several tests, as long as it puts it back.)

Loaded by tests/conftest.py, which re-exports these hooks.
"""

from __future__ import annotations

import signal

import pytest

GUARDED = (signal.SIGINT, signal.SIGTERM)
_HANDLERS = pytest.StashKey[dict]()


def pytest_runtest_setup(item: pytest.Item) -> None:
    if _HANDLERS not in item.session.stash:  # the module's first test: before its module fixtures
        item.session.stash[_HANDLERS] = {s: signal.getsignal(s) for s in GUARDED}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    result = yield
    if nextitem is not None and nextitem.module is item.module:
        return result
    before = item.session.stash.get(_HANDLERS, None)
    if before is None:
        return result
    del item.session.stash[_HANDLERS]
    changed = []
    for signum, handler in before.items():
        now = signal.getsignal(signum)
        if now is not handler and handler is not None:  # None: a handler set outside Python, which cannot be restored
            signal.signal(signum, handler)
            changed.append(f"{signal.Signals(signum).name} (left {now!r}, found {handler!r})")
    if changed:
        raise AssertionError(f"{item.module.__name__ if item.module else item.nodeid} left another signal handler "
                             f"behind; put back: {', '.join(changed)}")
    return result
