"""Faults injected into a `dipaco` command run in a process of its own, for tests/dipaco/test_crash_recovery.py.

    CRASH_HOOK='{"kind": "kill", "at": 3, "log": "hook.json"}' python -m crash_hooks prepare KEY=VALUE...

``kill``: SIGKILL the process just before the ``at``-th unlink, rmdir or rename that ``dipaco.atomic.remove_tree``
does (the removal of ``prepare.work`` and ``routing.work``). ``enospc``: the ``at``-th write to metrics.jsonl
fails with ENOSPC (or, with ``"short": true``, lands half its bytes) and the disk stays full for metrics.jsonl.
``at`` 0 counts without injecting. The log (JSON) holds what the hook counted and where it struck.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from dipaco import json_text

HOOK = "CRASH_HOOK"


def _install_kill_hook(at: int, log: Path) -> dict:
    """Counts the unlinks, rmdirs and renames that ``dipaco.atomic.remove_tree`` does (in the thread that called
    it); just before the ``at``-th, writes which one it is to ``log`` and SIGKILLs this process (0: never)."""
    import dipaco.atomic as atomic

    state: dict[str, Any] = {"ops": []}
    inside = threading.local()

    def counted(name: str):
        real = getattr(os, name)

        def op(*args, **kwargs):
            if getattr(inside, "depth", 0):
                state["ops"].append([name, *(os.fspath(a) for a in args)])
                if len(state["ops"]) == at:
                    log.write_text(json_text.dumps({**state, "killed_before": state["ops"][-1]}))
                    os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)

        return op

    for name in ("unlink", "remove", "rmdir", "rename", "replace"):
        setattr(os, name, counted(name))
    original = atomic.remove_tree

    def remove_tree(path):
        inside.depth = getattr(inside, "depth", 0) + 1
        try:
            original(path)
        finally:
            inside.depth -= 1

    # prepare.py and assign.py take the name at import: they are imported after this (see child)
    for module in list(sys.modules.values()):
        if getattr(module, "remove_tree", None) is original:
            module.remove_tree = remove_tree  # type: ignore[attr-defined]
    return state


def _install_enospc_hook(at: int, short: bool, log: Path) -> dict:
    """Counts the writes to metrics.jsonl (``os.write`` on a MetricsLogger's descriptor). The ``at``-th raises
    ENOSPC, or with ``short`` writes half its bytes; every later write there raises ENOSPC (0: never)."""
    import dipaco.metrics as metrics

    state: dict[str, Any] = {"writes": [], "injected": None}
    fds: set[int] = set()
    init, close, real_write = metrics.MetricsLogger.__init__, metrics.MetricsLogger.close, os.write

    def logger_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        fds.add(self._fd)

    def logger_close(self):
        fds.discard(self._fd)
        close(self)

    def full(what: str):
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), what)

    def write(fd, data):
        if fd not in fds:
            return real_write(fd, data)
        if state["injected"] is not None:
            raise full("metrics.jsonl")
        state["writes"].append(len(data))
        if len(state["writes"]) != at:
            return real_write(fd, data)
        state["injected"] = {"write": at, "bytes": len(data), "landed": len(data) // 2 if short else 0}
        log.write_text(json_text.dumps(state))
        if short:
            return real_write(fd, bytes(data)[: len(data) // 2])
        raise full("metrics.jsonl")

    metrics.MetricsLogger.__init__ = logger_init  # type: ignore[method-assign]
    metrics.MetricsLogger.close = logger_close  # type: ignore[method-assign]
    os.write = write
    return state


def child(argv: list[str]) -> int:
    """`dipaco COMMAND ARGS...` with the hook ``$CRASH_HOOK`` installed; what the hook saw goes to its log when
    the command returns."""
    hook = json.loads(os.environ[HOOK])
    log = Path(hook["log"])
    if hook["kind"] == "kill":
        state = _install_kill_hook(hook["at"], log)
    else:
        state = _install_enospc_hook(hook["at"], hook["short"], log)
    from dipaco.cli import main

    rc = 1
    try:
        rc = main(argv)
        return rc
    finally:
        log.write_text(json_text.dumps({**state, "rc": rc}))


if __name__ == "__main__":
    sys.exit(child(sys.argv[1:]))
