"""`dipaco serve` over real HTTP on loopback: endpoints, request validation, concurrent clients."""

import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from dipaco.cli import main
from dipaco.serve.pipeline import Pipeline
from dipaco.serve.http import create_app  # imports FastAPI only when called


def needs_web():
    """Skip (in test, not at import) without FastAPI/uvicorn, so the skip is reported per end-to-end test."""
    pytest.importorskip("fastapi")
    return pytest.importorskip("uvicorn")

MAX_PROMPT_TOKENS = 48
MAX_NEW_TOKENS_CAP = 24
PROMPTS = [
    "The government said on Tuesday that the economy",
    "The striker scored twice in the second half",
    "Shares in the bank rose after the results",
    "In the beginning of the war the army",
    "The film won three awards at the festival",
    "Researchers found that the new drug",
    "The election campaign entered its final week",
    "Microsoft released a new version of its software",
]


@pytest.fixture(scope="module")
def server(served_run):
    """uvicorn in a background thread on a free loopback port; yields (port, pipeline)."""
    uvicorn = needs_web()
    pipe = Pipeline.from_run(served_run.run.dir, cache_size=2)  # < 4 paths: evictions under load too
    app = create_app(pipe, max_prompt_tokens=MAX_PROMPT_TOKENS, max_new_tokens_cap=MAX_NEW_TOKENS_CAP)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    yield sock.getsockname()[1], pipe
    srv.should_exit = True
    thread.join(timeout=10)
    sock.close()


def call(port: int, method: str, path: str, body=None, raw: bytes | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        payload = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        conn.request(method, path, body=payload, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


def test_health_and_paths(server, served_run):
    port, pipe = server
    status, health = call(port, "GET", "/healthz")
    assert status == 200 and health["status"] == "ok" and health["num_paths"] == 4 and health["router"] == "kmeans"
    status, body = call(port, "GET", "/v1/paths")
    assert status == 200 and [p["id"] for p in body["paths"]] == [0, 1, 2, 3]
    eval_report = json.loads((pipe.loaded.dir / "eval.json").read_text())
    for row, evaluated in zip(body["paths"], eval_report["paths"]):
        assert row["modules"] == evaluated["modules"]
        assert row["val_ppl"] == pytest.approx(evaluated["ppl"])
        assert row["train_docs"] > 0 and row["train_tokens"] > row["train_docs"]
    routed_train = json.loads((pipe.loaded.run.routing / "routing_report.json").read_text())["train"]
    assert [p["train_docs"] for p in body["paths"]] == routed_train["docs_per_path"]


def test_route_and_generate_match_the_pipeline(server):
    port, pipe = server
    status, body = call(port, "POST", "/v1/route", {"text": PROMPTS[0]})
    path, scores = pipe.route(PROMPTS[0])
    assert status == 200 and body["path"] == path and body["scores"] == pytest.approx(scores)
    status, body = call(port, "POST", "/v1/generate", {"prompt": PROMPTS[0], "max_new_tokens": 8})
    expected = pipe.generate(PROMPTS[0], max_new_tokens=8)
    assert status == 200
    assert (body["path"], body["text"], body["prompt_tokens"], body["completion_tokens"]) == (
        expected.path, expected.text, expected.prompt_tokens, expected.completion_tokens)
    assert body["latency_ms"] > 0 and body["finish_reason"] in ("stop", "length")
    request = {"prompt": PROMPTS[1], "max_new_tokens": 8, "temperature": 0.9, "top_p": 0.9, "seed": 3, "path": 1}
    first, second = call(port, "POST", "/v1/generate", request), call(port, "POST", "/v1/generate", request)
    assert first[0] == second[0] == 200 and first[1]["text"] == second[1]["text"]
    assert first[1]["path"] == 1 and first[1]["seed"] == 3


@pytest.mark.parametrize("path,body,raw,status,needle", [
    ("/v1/generate", {"prompt": "word " * 200}, None, 422, "cap of 48"),
    ("/v1/generate", {"prompt": "hello", "max_new_tokens": 25}, None, 422, "cap of 24"),
    ("/v1/generate", {"prompt": "hello", "path": 4}, None, 422, "0..3"),
    ("/v1/generate", {"prompt": ""}, None, 422, "prompt"),
    ("/v1/generate", {"max_new_tokens": 4}, None, 422, "prompt"),
    ("/v1/generate", {"prompt": "hello", "max_tokens": 4}, None, 422, "max_tokens"),
    ("/v1/generate", {"prompt": "hello", "temperature": -1}, None, 422, "temperature"),
    ("/v1/generate", {"prompt": "hello", "max_new_tokens": "many"}, None, 422, "max_new_tokens"),
    ("/v1/generate", None, b'{"prompt": "hello",', 422, "json"),
    ("/v1/route", None, b"not json at all", 422, "json"),
    ("/v1/route", {"txt": "hello"}, None, 422, "text"),
])
def test_bad_requests_are_4xx_with_a_message(server, path, body, raw, status, needle):
    port, _ = server
    got, reply = call(port, "POST", path, body, raw)
    assert got == status
    assert needle in json.dumps(reply["detail"]).lower()


def test_concurrent_clients_get_the_sequential_answers(server):
    port, _ = server
    requests = [{"prompt": p, "max_new_tokens": 12} for p in PROMPTS]
    sequential = [call(port, "POST", "/v1/generate", r) for r in requests]
    assert all(status == 200 for status, _ in sequential)
    assert len({body["path"] for _, body in sequential}) > 1  # the load spans several paths
    with ThreadPoolExecutor(max_workers=8) as pool:
        concurrent = list(pool.map(lambda r: call(port, "POST", "/v1/generate", r), requests * 2))
    strip = lambda reply: {k: v for k, v in reply[1].items() if k != "latency_ms"}  # noqa: E731
    assert [strip(r) for r in concurrent] == [strip(r) for r in sequential * 2]


def test_serve_with_a_bad_run_exits_nonzero(tmp_path, capsys):
    needs_web()
    assert main(["serve", "--run", str(tmp_path / "missing"), "--port", "0"]) == 2
    assert "run directory not found" in capsys.readouterr().err
