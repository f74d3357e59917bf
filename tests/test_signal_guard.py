"""tests/signal_guard.py: a test module that leaves another SIGTERM handler behind is an error, and the next
module in the same worker finds the handler as before; under `make test`'s options a worker that dies names its test
and ends the run instead of hanging it.

Each case runs pytest in a subprocess on a small test directory with the guard loaded as a plugin.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parent

LEAKS = '''
import signal
import sys


def test_leaves_a_sigterm_handler():  # as ray.init does, and ray.shutdown does not undo
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))


def test_in_the_same_module():
    pass
'''

SENDS = '''
import os
import signal


def test_sends_itself_sigterm():  # in the next module, as tests/dipaco/test_runtime.py does
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    caught = []
    signal.signal(signal.SIGTERM, lambda signum, frame: caught.append(signum))
    try:
        os.kill(os.getpid(), signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert caught == [signal.SIGTERM]
'''

HOLDS = '''
import signal

import pytest


@pytest.fixture(scope="module")
def session():  # a module fixture that holds a handler over its tests and puts it back
    before = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    yield
    signal.signal(signal.SIGTERM, before)


def test_one(session):
    pass


def test_two(session):
    pass
'''

DIES = '''
import os


def test_dies():
    os._exit(3)


def test_after():
    pass
'''

LATER = '''
def test_later():
    pass
'''


def run_pytest(tmp_path: Path, files: dict[str, str], *options: str) -> subprocess.CompletedProcess:
    for name, text in files.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    env.pop("PYTEST_XDIST_WORKER", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "signal_guard", "-p", "no:cacheprovider", "-rA",
                           *options, str(tmp_path)], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)


def test_a_leaked_sigterm_handler_is_an_error_and_is_put_back(tmp_path):
    proc = run_pytest(tmp_path, {"test_a_holds.py": HOLDS, "test_b_leaks.py": LEAKS, "test_c_sends.py": SENDS})
    out = proc.stdout
    assert proc.returncode == 1, out
    assert "ERROR test_b_leaks.py::test_in_the_same_module" in out, out  # at the module's end
    assert "test_b_leaks left another signal handler behind; put back: SIGTERM" in out, out
    assert "PASSED test_c_sends.py::test_sends_itself_sigterm" in out, out
    assert "PASSED test_a_holds.py::test_two" in out and "ERROR test_a_holds" not in out, out


def test_a_dead_worker_ends_the_run_naming_its_test(tmp_path):
    # make test's xdist options (Makefile): with workers restarted, pytest-xdist 3.8's loadfile scheduler can
    # wait forever for a dead worker's files.
    makefile = (TESTS.parent / "Makefile").read_text()
    assert "--max-worker-restart=0" in makefile
    proc = run_pytest(tmp_path, {"test_dies.py": DIES, "test_later.py": LATER}, "-n", "1", "--dist", "loadfile",
                      "--max-worker-restart=0")
    out = proc.stdout
    assert proc.returncode != 0, out
    assert "crashed while running 'test_dies.py::test_dies'" in out, out
