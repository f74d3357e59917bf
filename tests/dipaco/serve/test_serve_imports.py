"""Serving a request loads nothing of training: not at import time (import-linter's contract, make
lint), and not at run time, which this test checks in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SERVING_MUST_NOT_LOAD = ("dipaco.train", "dipaco.sync", "dipaco.paths", "dipaco.comm", "dipaco.run")


@pytest.mark.slow
def test_serving_a_request_loads_nothing_of_training(served_run):
    """A fresh interpreter serves /v1/generate over HTTP, then lists what it imported."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    script = textwrap.dedent(f"""
        import http.client, json, socket, sys, threading, time
        import uvicorn
        from dipaco.serve.http import create_app
        from dipaco.serve.pipeline import Pipeline

        app = create_app(Pipeline.from_run({str(served_run.run.dir)!r}))
        sock = socket.socket(); sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        threading.Thread(target=server.run, kwargs={{"sockets": [sock]}}, daemon=True).start()
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        conn = http.client.HTTPConnection("127.0.0.1", sock.getsockname()[1], timeout=60)
        conn.request("POST", "/v1/generate", json.dumps({{"prompt": "Shares in the bank rose", "max_new_tokens": 4}}),
                     {{"Content-Type": "application/json"}})
        response = conn.getresponse()
        body = json.loads(response.read())
        server.should_exit = True
        print(json.dumps({{"status": response.status, "body": body,
                           "modules": sorted(m for m in sys.modules if m.split(".")[0] in ("dipaco", "routing"))}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["status"] == 200 and result["body"]["text"] is not None
    assert "dipaco.serve.pipeline" in result["modules"] and "dipaco.checkpoint.experiment" in result["modules"]
    loaded = [m for m in result["modules"] if m in SERVING_MUST_NOT_LOAD or m.startswith(
        tuple(f"{p}." for p in SERVING_MUST_NOT_LOAD))]
    assert loaded == []
