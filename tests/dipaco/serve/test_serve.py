"""`dipaco serve` over real HTTP on loopback: endpoints, request validation, concurrent clients,
and hardening against abusive requests (every network call targets 127.0.0.1, bounded in time)."""

import contextlib
import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from dipaco.cli import main
from dipaco.serve.http import AppOptions, create_app  # imports FastAPI only when called
from dipaco.serve.pipeline import Pipeline


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


@contextlib.contextmanager
def running(app, **guard):
    """``app`` served as `dipaco serve` serves it (its uvicorn config and guarded listening socket), in a
    background thread on a free loopback port; ``guard``: ``header_timeout_s``, ``max_connections``.
    Yields the port."""
    needs_web()
    import uvicorn

    from dipaco.serve.http import listening_socket, server_config

    sock = listening_socket("127.0.0.1", 0)
    config, connection_guard = server_config(app, log_level="warning", **guard)
    connection_guard.guard_listener(sock)
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield sock.getsockname()[1]
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.fixture(scope="module")
def pipe(served_run):
    return Pipeline.from_run(served_run.run.dir, cache_size=2)  # < 4 paths: evictions under load too


@pytest.fixture(scope="module")
def server(pipe):
    """The app with this module's caps; yields (port, pipeline)."""
    needs_web()
    caps = AppOptions(max_prompt_tokens=MAX_PROMPT_TOKENS, max_new_tokens_cap=MAX_NEW_TOKENS_CAP)
    with running(create_app(pipe, caps)) as port:
        yield port, pipe


def call(port: int, method: str, path: str, body=None, raw: bytes | None = None, timeout: float = 60) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
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


@pytest.mark.parametrize("field,value", [
    ("max_new_tokens", "5"), ("max_new_tokens", True), ("max_new_tokens", 5.0), ("path", "0"), ("path", False),
    ("seed", "12"), ("seed", 1.5), ("temperature", "0.5"), ("temperature", True), ("top_p", "0.9"), ("top_k", "3"),
    ("prompt", 5),
])
def test_mistyped_numbers_and_booleans_are_422(server, field, value):
    """Issue 47: "5", true, "0" and "12" were coerced and answered 200, though a mistyped field is a 422."""
    port, _ = server
    body = {"prompt": "hi", "temperature": 0.5, "seed": 1, **{field: value}}
    status, reply = call(port, "POST", "/v1/generate", body)
    assert status == 422, reply
    assert [e["loc"] for e in reply["detail"]] == [["body", field]]
    # An integer is a number (JSON has one kind): temperature 1 is fine.
    assert call(port, "POST", "/v1/generate", {"prompt": "hi", "max_new_tokens": 2, "temperature": 1})[0] == 200


def test_concurrent_clients_get_the_sequential_answers(server):
    port, _ = server
    requests = [{"prompt": p, "max_new_tokens": 12} for p in PROMPTS]
    sequential = [call(port, "POST", "/v1/generate", r) for r in requests]
    assert all(status == 200 for status, _ in sequential)
    assert len({body["path"] for _, body in sequential}) > 1  # the load spans several paths
    with ThreadPoolExecutor(max_workers=8) as pool:
        concurrent = list(pool.map(lambda r: call(port, "POST", "/v1/generate", r), requests * 2))
    strip = lambda reply: {k: v for k, v in reply[1].items() if k not in ("latency_ms", "batch_size")}  # noqa: E731
    assert [strip(r) for r in concurrent] == [strip(r) for r in sequential * 2]
    assert max(reply[1]["batch_size"] for reply in concurrent) > 1  # they were batched


def test_serve_with_a_bad_run_exits_nonzero(tmp_path, capsys):
    needs_web()
    assert main(["serve", "--run", str(tmp_path / "missing"), "--port", "0"]) == 2
    assert "run directory not found" in capsys.readouterr().err


def test_a_port_in_use_or_out_of_range_is_one_error_line(served_run, capsys):
    """Issue 34: --port 99999 and a taken port ended in a traceback and uvicorn's own exit 3."""
    needs_web()
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        assert main(["serve", "--run", str(served_run.run.dir), "--port", str(taken.getsockname()[1])]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: cannot listen on 127.0.0.1:") and err.count("\n") == 1 and "Traceback" not in err
    finally:
        taken.close()
    with pytest.raises(SystemExit) as stop:
        main(["serve", "--run", str(served_run.run.dir), "--port", "99999"])
    assert stop.value.code == 2 and "99999 is not a TCP port" in capsys.readouterr().err


def test_a_stalled_request_body_is_closed_with_408(pipe):
    """Issue 34: bodies that stopped arriving held their connections forever."""
    needs_web()
    with running(create_app(pipe, AppOptions(body_timeout_s=0.5))) as port:
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        try:
            sock.sendall(b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"prompt\": ")
            start = time.monotonic()
            answer = sock.recv(4096)
            assert answer.startswith(b"HTTP/1.1 408") and time.monotonic() - start < 5
        finally:
            sock.close()


# --- hardening: abusive requests cost no more than valid ones ----------------------------------------
BIG = 4 * 1024 * 1024  # far over any body limit of the tiny run


def health(port: int) -> dict:
    status, body = call(port, "GET", "/healthz")
    assert status == 200
    return body


def longest_token_chars(pipe) -> int:
    return max(len(t) for t in pipe.tokenizer.get_vocab())


def record_encodes(monkeypatch, pipe) -> list[int]:
    """Wraps pipe.encode (which the server calls): the lengths of the texts it tokenizes."""
    lengths: list[int] = []
    encode = pipe.encode

    def recorded(text):
        lengths.append(len(text))
        return encode(text)

    monkeypatch.setattr(pipe, "encode", recorded)
    return lengths


def post_chunked(port: int, path: str, chunks, timeout: float = 30) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=chunks, headers={"Content-Type": "application/json"}, encode_chunked=True)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


@pytest.mark.parametrize("path,field", [("/v1/generate", "prompt"), ("/v1/route", "text")])
@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_the_limit_is_413_before_it_is_read(server, pipe, monkeypatch, path, field, chunked):
    port, _ = server
    limit = health(port).get("max_body_bytes")
    lengths = record_encodes(monkeypatch, pipe)
    body = json.dumps({field: "word " * (BIG // 5)}).encode()
    start = time.monotonic()
    if chunked:  # no Content-Length: refused as the stream passes the limit
        status, reply = post_chunked(port, path, (body[i:i + 65536] for i in range(0, len(body), 65536)))
    else:
        status, reply = call(port, "POST", path, raw=body, timeout=30)
    assert status == 413, reply
    assert f"limit of {limit} bytes" in reply["detail"]
    assert time.monotonic() - start < 10 and lengths == []  # nothing was tokenized
    from dipaco.serve.http import default_max_body_bytes
    assert limit == default_max_body_bytes(MAX_PROMPT_TOKENS, longest_token_chars(pipe))
    assert call(port, "POST", path, {field: PROMPTS[0]})[0] == 200  # the server is fine


def test_an_over_long_prompt_is_refused_before_it_is_tokenized(server, pipe, monkeypatch):
    port, _ = server
    max_chars = MAX_PROMPT_TOKENS * longest_token_chars(pipe)
    lengths = record_encodes(monkeypatch, pipe)
    status, reply = call(port, "POST", "/v1/generate", {"prompt": "x" * (max_chars + 1)})  # within the body limit
    assert status == 422 and "prompt" in reply["detail"] and f"at most {max_chars} characters" in reply["detail"]
    assert lengths == []
    # At the character bound, a prompt is tokenized (once, whole) and judged by its tokens.
    status, reply = call(port, "POST", "/v1/generate", {"prompt": "x" * max_chars})
    assert status == 422 and "cap of 48" in reply["detail"] and max(lengths) == max_chars


def test_route_tokenizes_only_the_routing_prefix(server, pipe, monkeypatch):
    port, _ = server
    text = PROMPTS[0] + "  and then\nthe  market" * 500  # ~11k characters, within the body limit
    expected_path, expected_scores = pipe._route(text, pipe.encode(text))  # from every token
    k = int(pipe.router.featurizer["prefix_tokens"])
    lengths = record_encodes(monkeypatch, pipe)
    status, body = call(port, "POST", "/v1/route", {"text": text})
    assert status == 200 and body["path"] == expected_path and body["scores"] == pytest.approx(expected_scores)
    assert lengths and max(lengths) <= k * longest_token_chars(pipe) < len(text)


def test_encode_prefix_is_the_prefix_of_the_whole_encoding(pipe):
    texts = [PROMPTS[0] + " rose" * 400, "a   b\n\n  c " * 300, "x" * 5000, "word" + " " * 3000 + "end",
             " ".join(PROMPTS) * 20, "short"]
    for text in texts:
        whole = pipe.encode(text)
        for n in (1, 5, 16, 33):
            assert pipe.encode_prefix(text, n) == whole[:n], (text[:40], n)


@pytest.mark.parametrize("path,raw,needle", [
    ("/v1/generate", b'{"prompt": "hello", "temperature": NaN}', "temperature"),
    ("/v1/generate", b'{"prompt": "hello", "temperature": 1e999}', "temperature"),
    ("/v1/generate", b'{"prompt": "hello", "top_p": Infinity}', "top_p"),
    ("/v1/generate", b'{"prompt": "hello", "top_p": -Infinity}', "top_p"),
    ("/v1/generate", b'{"prompt": "hello", "top_k": -Infinity}', "top_k"),
    ("/v1/generate", b'{"prompt": "hello", "max_new_tokens": NaN}', "max_new_tokens"),
    ("/v1/generate", b'{"prompt": "hello", "seed": Infinity}', "seed"),
    ("/v1/generate", b'{"prompt": "hello", "path": NaN}', "path"),
    ("/v1/generate", b'{"prompt": "hello", "bogus": NaN}', "bogus"),
    ("/v1/generate", b'{"prompt": [NaN, Infinity]}', "prompt"),
    ("/v1/generate", b'{"prompt": "hello \\ud800"}', "prompt"),
    ("/v1/route", b'{"text": NaN}', "text"),
    ("/v1/route", b'{"text": "\\udfff"}', "text"),
])
def test_non_finite_numbers_and_broken_unicode_are_422(server, path, raw, needle):
    port, _ = server
    status, reply = call(port, "POST", path, raw=raw, timeout=30)
    assert status == 422 and needle in json.dumps(reply["detail"])


def test_tokenizing_does_not_wait_for_another_thread(pipe):
    big = "The government said the economy grew " * 60_000  # ~2.2 MB: seconds to tokenize
    started, done = threading.Event(), threading.Event()

    def tokenize_big():
        started.set()
        pipe.encode(big)
        done.set()

    thread = threading.Thread(target=tokenize_big, daemon=True)
    thread.start()
    started.wait(10)
    time.sleep(0.2)
    start = time.monotonic()
    small = [pipe.encode(p) for p in PROMPTS]
    elapsed = time.monotonic() - start
    finished_first = not done.is_set()
    thread.join(120)
    assert finished_first and elapsed < 2 and all(small)


def test_a_large_request_does_not_stall_small_ones(server):
    port, _ = server
    big = json.dumps({"prompt": "The government said the economy grew " * 500_000}).encode()  # ~18 MB
    replies = []
    sender = threading.Thread(target=lambda: replies.append(call(port, "POST", "/v1/generate", raw=big, timeout=120)),
                              daemon=True)
    sender.start()
    latencies = []
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline or (sender.is_alive() and time.monotonic() < deadline + 10):
        start = time.monotonic()
        status, _ = call(port, "POST", "/v1/generate", {"prompt": PROMPTS[len(latencies) % 8], "max_new_tokens": 4},
                         timeout=10)
        latencies.append(time.monotonic() - start)
        assert status == 200
    assert max(latencies) < 5, latencies
    sender.join(120)
    assert replies and replies[0][0] == 413


def test_caps_default_to_the_models_seq_len(pipe):
    seq_len = pipe.spec.seq_len
    with running(create_app(pipe)) as port:
        caps = health(port)
        assert (caps["max_prompt_tokens"], caps["max_new_tokens_cap"]) == (seq_len, seq_len)
        status, reply = call(port, "POST", "/v1/generate", {"prompt": PROMPTS[0], "max_new_tokens": seq_len})
        assert status == 422 and f"{seq_len} positions (data.seq_len: trained from scratch)" in reply["detail"]
        prompt = pipe.decode(pipe.encode(" ".join(PROMPTS) * 3)[: seq_len - 6])
        n_prompt = len(pipe.encode(prompt))
        status, reply = call(port, "POST", "/v1/generate", {"prompt": prompt, "path": 0})  # default 32 new tokens: too many
        assert status == 200 and reply["prompt_tokens"] == n_prompt
        assert reply["completion_tokens"] <= seq_len - n_prompt
    with running(create_app(pipe, AppOptions(max_prompt_tokens=10 * seq_len, max_new_tokens_cap=10 * seq_len))) as port:
        caps = health(port)
        assert (caps["max_prompt_tokens"], caps["max_new_tokens_cap"]) == (seq_len, seq_len)


def test_bench_serve_abuse_mode_runs_clean(served_run):
    """`python -m bench serve --abuse`, briefly: `dipaco serve` in a subprocess answers every kind of
    abusive request with its 4xx, with no 500 and no dropped connection."""
    from pathlib import Path

    from bench import serve as bench

    out = bench.bench_abuse(Path(served_run.run.dir), None, PROMPTS, clients=2, seconds=4, threads=1)
    assert out["requests"] > 10 and out["server_alive_after"]
    assert out["responses_500"] == 0 and out["dropped_connections"] == 0 and out["unexpected_status"] == {}, json.dumps(out)
    assert out["status_by_kind"]["valid_generate"] and set(out["status_by_kind"]["body_50mb"]) == {"413"}
    assert out["server_rss_kb"]["before"] and out["server_rss_kb"]["after"]


# --- batching over HTTP ---------------------------------------------------------------------------------
def test_a_client_that_leaves_mid_batch_is_dropped_without_harming_the_others(pipe, monkeypatch):
    """Three requests of one path share a batch; one client disconnects while it decodes. Its row stops
    (a 499 in the metrics, fewer tokens than it asked for); the others get their full answers, the same
    as without it."""
    needs_web()
    from dipaco.serve import decode

    expected = {p: pipe.generate(p, max_new_tokens=24, path=0) for p in PROMPTS[1:3]}
    step = decode._step_logits

    def slow_step(*args, **kwargs):  # ~25 ms a step: the batch decodes long enough to leave mid-way
        time.sleep(0.025)
        return step(*args, **kwargs)

    monkeypatch.setattr(decode, "_step_logits", slow_step)
    # The batch closes at its three rows, not at a window's end, which a loaded machine may pass first.
    app = create_app(pipe, AppOptions(max_batch=3, batch_wait_ms=60_000))
    metrics = app.state.metrics
    with running(app) as port:
        leaver = socket.create_connection(("127.0.0.1", port), timeout=10)
        body = json.dumps({"prompt": PROMPTS[0], "max_new_tokens": 24, "path": 0}).encode()
        leaver.sendall(b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        with ThreadPoolExecutor(max_workers=2) as pool:
            stayers = [pool.submit(call, port, "POST", "/v1/generate", {"prompt": p, "max_new_tokens": 24, "path": 0})
                       for p in PROMPTS[1:3]]
            deadline = time.monotonic() + 60
            while metrics.batch_size._sum.get() < 3 * 4:  # the prefill and 3 of the 24 steps, on 3 rows
                assert time.monotonic() < deadline, "the batch of three did not start"
                time.sleep(0.01)
            leaver.close()
            replies = [f.result(60) for f in stayers]
        deadline = time.monotonic() + 5
        while metrics.requests.labels(endpoint="/v1/generate", path="0", status="499")._value.get() < 1:
            assert time.monotonic() < deadline, "the leaving client was not recorded"
            time.sleep(0.05)
        tokens = metrics.tokens.labels(path="0")._value.get()
    for prompt, (status, reply) in zip(PROMPTS[1:3], replies):
        assert status == 200 and reply["batch_size"] == 3
        assert (reply["text"], reply["completion_tokens"]) == (expected[prompt].text, expected[prompt].completion_tokens)
    left_with = tokens - sum(reply["completion_tokens"] for _, reply in replies)
    assert 1 <= left_with < 24  # its row stopped mid-way
    assert app.state.batcher.waiting == 0
