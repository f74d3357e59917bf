"""/metrics in Prometheus' text format (read back with prometheus_client's own parser) and the access log."""

import http.client
import logging

import pytest
from test_serve import PROMPTS, call, needs_web, running

from dipaco.errors import DipacoError
from dipaco.serve.http import AppOptions, create_app
from dipaco.serve.metrics import ACCESS_LOGGER, printable
from dipaco.serve.pipeline import Pipeline


def scrape(port: int) -> dict:
    """{(sample name, frozenset of labels): value}, parsed by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        assert resp.status == 200 and resp.getheader("content-type").startswith("text/plain")
        text = resp.read().decode()
    finally:
        conn.close()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset((k, str(v)) for k, v in labels.items())), 0.0)


@pytest.fixture(scope="module")
def served(served_run):
    needs_web()
    pipe = Pipeline.from_run(served_run.run.dir)
    with running(create_app(pipe, AppOptions(max_batch=8, batch_wait_ms=50))) as port:
        yield port, pipe


# A batch closes when it holds max_batch rows or when its window ends. Tests that count batch sizes close it
# by size alone (a window no test waits out): a loaded CI machine may take longer than any short window to
# deliver four concurrent requests, and then they were split (seen: [1, 2, 1, 2]).
NO_WINDOW_MS = 60_000


@pytest.fixture(scope="module")
def served_by_fours(served_run):
    """A server whose batches close at four rows."""
    needs_web()
    pipe = Pipeline.from_run(served_run.run.dir)
    with running(create_app(pipe, AppOptions(max_batch=4, batch_wait_ms=NO_WINDOW_MS))) as port:
        yield port, pipe


def test_metrics_count_requests_latency_batches_tokens_and_queue(served, caplog):
    port, pipe = served
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    replies = [call(port, "POST", "/v1/generate", {"prompt": p, "max_new_tokens": 5}) for p in PROMPTS[:3]]
    assert all(status == 200 for status, _ in replies)
    assert call(port, "POST", "/v1/generate", {"prompt": "hi", "max_new_tokens": "5"})[0] == 422
    assert call(port, "GET", "/no/such/page")[0] == 404
    assert call(port, "POST", "/v1/route", {"text": PROMPTS[0]})[0] == 200
    m = scrape(port)
    for _, reply in replies:
        assert value(m, "dipaco_requests_total", endpoint="/v1/generate", path=reply["path"], status=200) >= 1
    assert value(m, "dipaco_requests_total", endpoint="/v1/generate", path="", status=422) == 1
    assert value(m, "dipaco_requests_total", endpoint="other", path="", status=404) == 1  # one label for any unknown URL
    route_path = pipe.route(PROMPTS[0])[0]
    assert value(m, "dipaco_requests_total", endpoint="/v1/route", path=route_path, status=200) == 1
    assert value(m, "dipaco_request_duration_seconds_count", endpoint="/v1/generate") == 4
    assert value(m, "dipaco_request_duration_seconds_sum", endpoint="/v1/generate") > 0
    # One at a time: a row per forward pass (a prefill and 4 steps each).
    assert value(m, "dipaco_batch_size_count") == 3 * 5 and value(m, "dipaco_batch_size_sum") == 3 * 5
    generated = sum(value(m, "dipaco_generated_tokens_total", path=p) for p in range(pipe.num_paths))
    assert generated == sum(reply["completion_tokens"] for _, reply in replies)
    assert value(m, "dipaco_queue_depth") == 0
    assert value(m, "dipaco_open_connections") >= 1
    # three generates and a route, each one router pass; a route's time from asking includes its pass
    assert value(m, "dipaco_routed_requests_total") == 4
    assert value(m, "dipaco_router_seconds_total", stage="request") >= value(m, "dipaco_router_seconds_total", stage="pass") > 0

    lines = [r.getMessage() for r in caplog.records if r.name == ACCESS_LOGGER]
    generate_lines = [line for line in lines if " POST /v1/generate 200 " in line]
    assert len(generate_lines) == 3 and len(lines) >= 6
    for line, (_, reply) in zip(generate_lines, replies):
        assert line.startswith("127.0.0.1:") and line.endswith(f"path={reply['path']} batch=1")
        assert "ms path=" in line
    assert any(" POST /v1/generate 422 " in line and line.endswith("path=- batch=-") for line in lines)
    assert not any(p in line for line in lines for p in PROMPTS)  # never the prompt


def test_concurrent_requests_of_a_path_are_one_batch_in_the_metrics(served_by_fours):
    port, pipe = served_by_fours
    from concurrent.futures import ThreadPoolExecutor

    before = scrape(port)
    with ThreadPoolExecutor(max_workers=4) as pool:
        replies = list(pool.map(lambda p: call(port, "POST", "/v1/generate", {"prompt": p, "max_new_tokens": 4, "path": 1}),
                                PROMPTS[:4]))
    after = scrape(port)
    assert [r[1]["batch_size"] for r in replies] == [4, 4, 4, 4]
    # 4 forward passes (a prefill and 3 steps) of 4 rows each.
    assert value(after, "dipaco_batch_size_count") - value(before, "dipaco_batch_size_count") == 4
    assert value(after, "dipaco_batch_size_sum") - value(before, "dipaco_batch_size_sum") == 16


def test_a_url_with_control_characters_is_one_log_line():
    assert printable("/v1/x\nINFO forged line") == "/v1/x\\nINFO forged line"
    assert printable("/ok") == "/ok" and printable("x" * 500).endswith("...")


def test_requests_of_different_paths_are_one_module_batch(served_by_fours):
    """Module batching (the default): four requests naming the 2x2's four paths decode as one batch, each level
    module running on the two rows through it, and each answer is its path's alone."""
    port, pipe = served_by_fours
    from concurrent.futures import ThreadPoolExecutor

    bodies = [{"prompt": p, "max_new_tokens": 4, "path": i} for i, p in enumerate(PROMPTS[:4])]
    before = scrape(port)
    with ThreadPoolExecutor(max_workers=4) as pool:
        replies = list(pool.map(lambda body: call(port, "POST", "/v1/generate", body), bodies))
    after = scrape(port)
    assert [r[1]["batch_size"] for r in replies] == [4, 4, 4, 4]
    assert value(after, "dipaco_batch_size_sum") - value(before, "dipaco_batch_size_sum") == 16  # 4 passes of 4 rows
    calls = value(after, "dipaco_module_calls_total") - value(before, "dipaco_module_calls_total")
    rows = value(after, "dipaco_module_rows_total") - value(before, "dipaco_module_rows_total")
    assert calls == 4 * 4 and rows == 4 * 8  # per pass: 2 levels x 2 modules, each on 2 of the 4 rows
    for stage in ("embed", "mask", "layout", "blocks", "head"):
        assert value(after, "dipaco_module_seconds_total", stage=stage) > 0
    for body, (status, reply) in zip(bodies, replies):
        assert status == 200 and reply["text"] == pipe.generate(body["prompt"], path=body["path"], max_new_tokens=4).text


def test_path_batching_keeps_each_batch_to_one_path(served_run):
    needs_web()
    from concurrent.futures import ThreadPoolExecutor

    pipe = Pipeline.from_run(served_run.run.dir)
    with running(create_app(pipe, AppOptions(max_batch=2, batch_wait_ms=NO_WINDOW_MS, batching="path"))) as port:
        bodies = [{"prompt": p, "max_new_tokens": 3, "path": i % 2} for i, p in enumerate(PROMPTS[:4])]
        with ThreadPoolExecutor(max_workers=4) as pool:
            replies = list(pool.map(lambda body: call(port, "POST", "/v1/generate", body), bodies))
        assert [r[1]["batch_size"] for r in replies] == [2, 2, 2, 2]  # two paths: a batch of two each
        assert call(port, "GET", "/healthz")[1]["batching"] == "path"
        assert value(scrape(port), "dipaco_module_calls_total") == 0
    with pytest.raises(DipacoError, match="--batching must be one of module, path, got .level."):
        create_app(pipe, AppOptions(batching="level"))
