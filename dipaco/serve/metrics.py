"""What ``dipaco serve`` reports about itself: Prometheus metrics (``GET /metrics``, prometheus-client's
text format) and one access-log line per request.

Metrics (each server has its own registry, so several apps in one process do not collide):

    dipaco_requests_total{endpoint,path,status}     requests answered (path: the DiPaCo path, "" if none)
    dipaco_request_duration_seconds{endpoint}       latency histogram, from the request's headers to its answer
    dipaco_batch_size                               rows per forward pass (histogram: prefills and decoding steps)
    dipaco_generated_tokens_total{path}             tokens generated, EOS included
    dipaco_queue_depth                              requests waiting for a batch
    dipaco_open_connections                         HTTP connections open now
    dipaco_connections_closed_total{reason}         closed by the server: header_timeout, evicted, refused
    dipaco_module_calls_total                       module batching: level modules run (one per module per pass)
    dipaco_module_rows_total                        module batching: rows those modules ran on (/ calls: rows per module)
    dipaco_module_seconds_total{stage}              module batching: time in embed, mask, layout, blocks, head
    dipaco_routed_requests_total                    requests the server routed (one router pass each)
    dipaco_router_seconds_total{stage}              pass: time in router passes; request: summed over requests,
                                                    from asking for a route to its answer (waiting included)
    dipaco_heap_trims_total                         malloc_trim calls (dipaco.serve.heap: --heap-trim-s)
    dipaco_heap_trim_seconds_total                  time in them

The access log (logger ``dipaco.serve.access``, INFO) writes, per request::

    127.0.0.1:52114 POST /v1/generate 200 41.3ms path=2 batch=8

(client, method, URL path, status, latency, the DiPaCo path and the rows of its batch; ``-`` where
there is none). Never the prompt, the query string or a header. A client that left before its answer
is logged with status 499 (nginx's "client closed request").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from dipaco.serve.decode import DecodeRow

ACCESS_LOGGER = "dipaco.serve.access"
CLIENT_GONE = 499  # the client closed its connection before the answer (nginx's code)
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)
OTHER_ENDPOINT = "other"  # URLs the app does not serve: one label, however many are tried


def printable(text: str, limit: int = 200) -> str:
    """``text`` for one log line: control characters escaped (a percent-encoded newline in a URL must not
    start a line of its own), cut to ``limit`` characters."""
    if len(text) > limit:
        text = text[:limit] + "..."
    return text.encode("unicode_escape").decode("ascii") if not text.isprintable() else text


def counter(name: str, documentation: str, value: float | Mapping[str, float], label: str | None = None):
    """A counter family read at scrape time: one sample, or, ``value`` a mapping, one per key as ``label``, sorted."""
    from prometheus_client.core import CounterMetricFamily

    if not isinstance(value, Mapping):
        family = CounterMetricFamily(name, documentation)
        family.add_metric([], value)
        return family
    assert label is not None, f"{name}: samples per key need the label's name"
    family = CounterMetricFamily(name, documentation, labels=[label])
    for key, sample in sorted(value.items()):
        family.add_metric([key], sample)
    return family


class ServeMetrics:
    """The server's Prometheus metrics; also the batcher's observer (:class:`~dipaco.serve.batching.BatchObserver`)."""

    def __init__(self) -> None:
        # Imported here: the serve extra's, like FastAPI (dipaco.serve.http imports this module up front).
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("dipaco_requests", "HTTP requests answered, by endpoint, DiPaCo path and status",
                                ["endpoint", "path", "status"], registry=r)
        self.latency = Histogram("dipaco_request_duration_seconds", "Time from a request's headers to its answer",
                                 ["endpoint"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.batch_size = Histogram("dipaco_batch_size", "Rows in one forward pass of a path (a prefill or a "
                                    "decoding step)", buckets=BATCH_BUCKETS, registry=r)
        self.tokens = Counter("dipaco_generated_tokens", "Tokens generated (a closing EOS included)", ["path"], registry=r)
        self.queue = Gauge("dipaco_queue_depth", "Requests waiting for a batch", registry=r)
        self.connections = Gauge("dipaco_open_connections", "HTTP connections open", registry=r)
        self.closed = Counter("dipaco_connections_closed", "Connections the server closed: header_timeout (no "
                              "complete request headers in time), evicted (the oldest idle one, to admit a new "
                              "connection at the limit), refused (at the limit with none idle)", ["reason"], registry=r)

    def watch_module_batching(self, stats) -> None:
        """Reports a module-batched decoder's :class:`~dipaco.serve.module_batch.ModuleBatchStats` at each scrape."""
        self._scraped(lambda: [
            counter("dipaco_module_calls", "Level modules run by module batching (one per module that has rows, per "
                    "forward pass)", stats.module_calls),
            counter("dipaco_module_rows", "Rows the level modules of module batching ran on", stats.module_rows),
            counter("dipaco_module_seconds", "Time module batching spent per stage", dict(stats.seconds), "stage")])

    def watch_heap(self, trimmer) -> None:
        """Reports a :class:`~dipaco.serve.heap.HeapTrimmer`'s calls and their time at each scrape."""
        self._scraped(lambda: [
            counter("dipaco_heap_trims", "malloc_trim calls handing free heap memory back", trimmer.trims),
            counter("dipaco_heap_trim_seconds", "Time in malloc_trim calls", trimmer.seconds)])

    def watch_routing(self, stats) -> None:
        """Reports the pipeline's :class:`~dipaco.serve.pipeline.RouterStats` at each scrape."""
        self._scraped(lambda: [
            counter("dipaco_routed_requests", "Requests the server routed", stats.requests),
            counter("dipaco_router_passes", "Router passes (each scores the prompts waiting)", stats.passes),
            counter("dipaco_router_seconds", "Time in router passes (pass), and summed over requests from asking for a "
                    "route to its answer (request)", {"pass": stats.pass_seconds, "request": stats.request_seconds},
                    "stage")])

    def _scraped(self, families: Callable[[], list]) -> None:
        """Registers a collector whose metric families ``families()`` builds afresh at each scrape."""

        class Scraped:
            def collect(self):
                return families()

        self.registry.register(Scraped())

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    # --- the batcher's observer --------------------------------------------------------------------
    def queue_depth(self, depth: int) -> None:
        self.queue.set(depth)

    def decode_step(self, rows: int) -> None:
        self.batch_size.observe(rows)

    def row_finished(self, path: int, row: DecodeRow) -> None:
        self.tokens.labels(path=str(path)).inc(len(row.tokens))

    # --- the connection guard's observer -----------------------------------------------------------
    def connection_count(self, n: int) -> None:
        self.connections.set(n)

    def connection_closed(self, reason: str) -> None:
        self.closed.labels(reason=reason).inc()


class AccessLog:
    """ASGI middleware, outermost: counts and times every request and writes its access-log line.

    The endpoint handlers leave the DiPaCo path and batch size in the request's state
    (``request.state.dipaco_path`` / ``.batch_size``), which is the ASGI scope's ``state`` dict.
    """

    def __init__(self, app, metrics: ServeMetrics, endpoints: frozenset[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.endpoints = endpoints
        self.log = logging.getLogger(ACCESS_LOGGER)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        state = scope.setdefault("state", {})
        status: int | None = None

        async def recorded_send(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recorded_send)
        except BaseException:
            status = status or 500
            raise
        finally:
            self._record(scope, state, status or CLIENT_GONE, time.perf_counter() - start)

    def _record(self, scope, state: dict, status: int, seconds: float) -> None:
        endpoint = scope["path"] if scope["path"] in self.endpoints else OTHER_ENDPOINT
        path = state.get("dipaco_path")
        batch = state.get("batch_size")
        self.metrics.requests.labels(endpoint=endpoint, path="" if path is None else str(path), status=str(status)).inc()
        self.metrics.latency.labels(endpoint=endpoint).observe(seconds)
        if self.log.isEnabledFor(logging.INFO):
            client = scope.get("client")
            who = f"{client[0]}:{client[1]}" if client else "-"
            self.log.info("%s %s %s %d %.1fms path=%s batch=%s", who, scope["method"], printable(scope["path"]), status,
                          seconds * 1000, "-" if path is None else path, "-" if batch is None else batch)
