"""`dipaco serve`: an HTTP API over the single-path inference pipeline (FastAPI + uvicorn).

    GET  /healthz       {"status": "ok", experiment, checkpoint, num_paths, router, cache...}
    GET  /v1/paths      per path: id, module names, training shard size, validation perplexity
    POST /v1/route      {"text"} -> {"path", "scores"}
    POST /v1/generate   {"prompt", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "path"}
                        -> {"path", "scores", "text", "prompt_tokens", "completion_tokens",
                            "latency_ms", "finish_reason", "seed", "batch_size"}
    POST /v1/completions  OpenAI's completions API (dipaco.serve.openai_api), on /v1/generate's code path
    GET  /v1/models     OpenAI's model list: the served experiment
    GET  /metrics       Prometheus text format (dipaco.serve.metrics)

Requests are strict Pydantic models: a missing or mistyped field (``"5"`` or ``true`` for a number, a
float for an integer), an unknown field, malformed JSON, or a
number that is NaN or infinite (JSON's ``NaN``/``Infinity`` literals, or ``1e999``) is a 422 that
names the problem; so are a prompt longer than ``max_prompt_tokens`` tokens, ``max_new_tokens``
above the server's cap, and a prompt plus ``max_new_tokens`` beyond the model's positions
(:meth:`dipaco.checkpoint.spec.ExperimentSpec.served_positions`: an imported checkpoint's own
``max_position_embeddings``, ``data.seq_len`` for a model trained from scratch). A body not sent as
JSON (without ``Content-Type: application/json``) is a 415 that names the header. A request the
experiment cannot answer (routing without a router, an empty prompt) is a 400. The OpenAI endpoints
answer every error in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with 400
where this API says 422.

Hardening (a request costs the server at most what a valid one can):

- Body size: a body over ``max_body_bytes`` is a 413 before it is read: a ``Content-Length`` above
  the limit is refused from the headers alone, a chunked body as soon as it passes the limit
  (uvicorn discards the rest). The default fits the largest valid request (see
  :func:`default_max_body_bytes`).
- Prompt length: the characters are checked before any tokenization: a prompt over
  ``max_prompt_tokens * max_token_chars`` characters cannot be within the token cap
  (:func:`dipaco.serve.pipeline.max_token_chars`); only then is it tokenized (at most that many characters).
- ``/v1/route`` tokenizes only the routing prefix (:meth:`Pipeline.encode_prefix`), whatever the
  length of the text (which the body limit caps too).
- Caps default to the model's positions; larger caps are lowered to them (a model trained from scratch
  never attended over more than ``data.seq_len`` positions; an imported one has its checkpoint's).
- Headers: a connection that does not complete a request's headers within ``header_timeout_s`` is
  closed, and open connections are bounded (``dipaco.serve.connections``).

Generation is batched (``dipaco.serve.batching``): ``/v1/generate`` checks, tokenizes and routes on the
planning threads, then queues the request; a worker thread decodes it with other requests (up to ``max_batch``,
gathered for ``batch_wait_ms``), so the event loop never runs the model. With ``batching="module"`` (the
default) a batch holds requests of any paths, each level's modules running once per pass on the rows through
them (``dipaco.serve.module_batch``); with ``"path"`` only requests of one path, on its composed model. A
client that disconnects before its answer is dropped from its batch (logged as 499). The other endpoints are
plain functions, which FastAPI runs in its thread pool; the pipeline is thread-safe with no global lock on
tokenization (a tokenizer per concurrent call).

With a ``token``, every endpoint but ``/healthz`` needs ``Authorization: Bearer <token>``
(``dipaco.serve.auth``); ``serve`` refuses a non-loopback host without one. Every request is counted in
``/metrics`` and written to the access log (``dipaco.serve.metrics``).

Needs the ``serve`` extra: ``pip install -e ".[serve]"``.
"""

# No `from __future__ import annotations`: FastAPI reads the endpoint annotations at runtime,
# and the request models are local to create_app.
import asyncio
import contextlib
import functools
import gc
import json
import logging
import math
import socket
import sys
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dipaco.checkpoint.spec import Positions
from dipaco.errors import DipacoError
from dipaco.metrics import echo
from dipaco.serve import openai_api as oa
from dipaco.serve.auth import BearerToken, check_exposure
from dipaco.serve.batching import (
    BATCHING_MODES,
    DEFAULT_BATCH_WAIT_MS,
    DEFAULT_BATCHING,
    DEFAULT_DECODE_WORKERS,
    DEFAULT_MAX_BATCH,
    PathBatcher,
    Ticket,
)
from dipaco.serve.connections import (
    DEFAULT_HEADER_TIMEOUT_S,
    AdmissionSocket,
    ConnectionGuard,
    default_max_connections,
    guarded_protocol,
)
from dipaco.serve.heap import DEFAULT_HEAP_TRIM_S, HeapTrimmer
from dipaco.serve.metrics import ACCESS_LOGGER, CLIENT_GONE, AccessLog, ServeMetrics
from dipaco.serve.pipeline import DEFAULT_CACHE_SIZE, TOKENIZER_COPIES, Pipeline, PlannedGeneration, Scored
from dipaco.serve.router_passes import RouterOptions, leave_cpus

DEFAULT_NEW_TOKENS = 32  # when a request does not say (never above the cap nor past the model's positions)
JSON_BYTES_PER_BYTE = 6  # the longest JSON spelling of one UTF-8 byte of a string: "\\u00XX" (or 12 for 4)
BODY_OVERHEAD_BYTES = 16 * 1024  # the other fields, keys and whitespace of a request
ERROR_INPUT_CHARS = 200  # a 422 echoes at most this much of the offending input
PLAN_THREADS = TOKENIZER_COPIES  # threads that plan requests (tokenize, route): one tokenizer copy each
STREAM_INTERVAL_S = 0.05  # a streamed completion's events at most this often (the tokens between coalesce)


def _import_web():
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise DipacoError(f"dipaco serve needs FastAPI, uvicorn and prometheus-client: pip install -e \".[serve]\" "
                          f"({exc})") from None


def default_max_body_bytes(max_prompt_tokens: int, max_token_chars: int) -> int:
    """The largest valid request body, generously: a prompt of ``max_prompt_tokens`` tokens has at
    most ``max_prompt_tokens * max_token_chars`` UTF-8 bytes, each spelt with at most
    ``JSON_BYTES_PER_BYTE`` bytes of JSON, plus ``BODY_OVERHEAD_BYTES`` for everything else."""
    return max_prompt_tokens * max_token_chars * JSON_BYTES_PER_BYTE + BODY_OVERHEAD_BYTES


def resolve_caps(positions: Positions, max_prompt_tokens: int | None,
                 max_new_tokens_cap: int | None) -> tuple[int, int, list[str]]:
    """The request caps: the model's ``positions`` when not given, lowered to them when above; notes say what was
    lowered."""
    limit = positions.limit
    caps, notes = [], []
    for name, value in (("max_prompt_tokens", max_prompt_tokens), ("max_new_tokens_cap", max_new_tokens_cap)):
        if value is None:
            value = limit
        if value < 1:
            raise DipacoError(f"{name} must be >= 1, got {value}")
        if value > limit:
            notes.append(f"{name}={value} is above the model's {limit} positions ({positions.source}): lowered to {limit}")
            value = limit
        caps.append(value)
    return caps[0], caps[1], notes


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` is a 413 before the application reads it, and
    one that has not fully arrived ``timeout_s`` after the request started is a 408.

    A ``Content-Length`` above the limit is refused from the headers, so none of the body is read
    (uvicorn discards what arrives after the response). Otherwise the body is read here, at most
    ``max_bytes`` of it, and handed on whole; a chunked body is refused as soon as it passes the limit.
    A client that stalls mid-body (slowloris) holds its connection for ``timeout_s`` at most.
    """

    def __init__(self, app, max_bytes: int, timeout_s: float = 10.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    @staticmethod
    def _error(scope, status: int, message: str) -> bytes:
        """The error's body in the shape of the endpoint's API (OpenAI's or dipaco's own)."""
        content = oa.error_body(status, message) if oa.is_openai_path(scope["path"]) else {"detail": message}
        return json.dumps(content).encode()

    async def _timed_out(self, scope, send) -> None:
        body = self._error(scope, 408, f"the request body did not arrive within {self.timeout_s:g} s")
        await send({"type": "http.response.start", "status": 408,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def _too_large(self, scope, send) -> None:
        body = self._error(scope, 413, f"the request body is larger than this server's limit of {self.max_bytes} "
                                       f"bytes (max_body_bytes)")
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for key, value in scope["headers"]:
            if key == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0  # the HTTP server refuses a malformed length before it gets here
                if declared > self.max_bytes:
                    await self._too_large(scope, send)
                    return
        chunks, size = [], 0
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - asyncio.get_running_loop().time()))
            except asyncio.TimeoutError:
                await self._timed_out(scope, send)
                return
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(scope, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: only the disconnect is left to wait for

        await self.app(scope, replay, send)


class CanonicalPaths:
    """ASGI middleware: a path with a trailing slash (``/v1/completions/``, ``/healthz/``) is served as the route
    without it, as OpenAI serves its own, where FastAPI would redirect (a 307 that clients do not follow with the
    body) and the token check, the errors and the access log would not know the path."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            path = scope["path"].rstrip("/") or "/"
            if path != scope["path"]:
                scope = {**scope, "path": path}
                if scope.get("raw_path"):
                    scope["raw_path"] = scope["raw_path"].rstrip(b"/") or b"/"
        await self.app(scope, receive, send)


def json_safe(value):
    """``value`` with what strict JSON cannot carry made printable: NaN and infinities become their
    names, strings that are not valid Unicode are escaped, long strings are cut."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, str):
        if len(value) > ERROR_INPUT_CHARS:
            value = value[:ERROR_INPUT_CHARS] + f"... ({len(value)} characters)"
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {json_safe(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


async def client_gone(receive) -> None:
    """Returns once the client has disconnected. Called after the request's body was read, so the next
    ASGI message is the disconnect (uvicorn sends nothing else before the answer)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def answers_unless_gone(batcher: PathBatcher, tickets: list[Ticket], receive) -> list | None:
    """The tickets' results, in order; None when the client disconnects first, whose rows are then
    cancelled (so are the others when one fails)."""
    answers = [asyncio.wrap_future(ticket.future) for ticket in tickets]
    for answer in answers:
        # Retrieved here so an answer nobody awaits any more (its client left) is not reported as lost.
        answer.add_done_callback(lambda f: f.cancelled() or f.exception())
    every: asyncio.Future = asyncio.gather(*answers)
    gone = asyncio.ensure_future(client_gone(receive))
    try:
        done, _ = await asyncio.wait({every, gone}, return_when=asyncio.FIRST_COMPLETED)
        if every in done:
            return every.result()
    except BaseException:  # a row failed, or the handler itself was cancelled (shutdown): none may run on
        for ticket in tickets:
            batcher.cancel(ticket)
        raise
    finally:
        gone.cancel()
    for ticket in tickets:
        batcher.cancel(ticket)
    return None


class Wakeup:
    """Wakes a coroutine from another thread, at most once per :meth:`wait`: the decoding thread calls
    :meth:`poke` after every token of a streamed row; the first poke schedules a wake-up, and the others
    cost nothing until the coroutine has woken and read what came (it reads after :meth:`wait` returns,
    so it sees every token poked before). Between two wake-ups the coroutine waits ``interval_s`` unless
    :meth:`finish` is called (the row has ended, the client has gone), so under load a stream's tokens
    coalesce into fewer events: a loop callback, a chunk and a client read per token and per stream took
    the decoding thread's CPU."""

    def __init__(self, loop: asyncio.AbstractEventLoop, interval_s: float = 0.0) -> None:
        self.loop = loop
        self.interval_s = interval_s
        self.event = asyncio.Event()
        self.finished = asyncio.Event()
        self._pending = False  # poked since the last wait() returned
        self._last = 0.0

    def _call(self, callback) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed (shutdown): nobody is listening
            self.loop.call_soon_threadsafe(callback)

    def poke(self) -> None:
        if not self._pending:
            self._pending = True
            self._call(self.event.set)

    def finish(self) -> None:
        self._call(self._finished)

    def _finished(self) -> None:
        self.finished.set()
        self.event.set()

    async def wait(self) -> None:
        pause = self._last + self.interval_s - self.loop.time()
        if pause > 0 and not self.finished.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.finished.wait(), pause)
        await self.event.wait()
        self.event.clear()
        self._pending = False
        self._last = self.loop.time()


@dataclass(frozen=True)
class AppOptions:
    """The request caps and batching of the application (``dipaco serve``'s flags of the same names)."""

    max_prompt_tokens: int | None = None
    max_new_tokens_cap: int | None = None
    max_body_bytes: int | None = None
    body_timeout_s: float = 10.0
    max_batch: int = DEFAULT_MAX_BATCH
    batch_wait_ms: float = DEFAULT_BATCH_WAIT_MS
    decode_workers: int = DEFAULT_DECODE_WORKERS
    max_prompts: int = DEFAULT_MAX_BATCH  # prompts in one completions request (each is a row of a batch)
    batching: str = DEFAULT_BATCHING  # module: rows of any paths together, level by level; path: one path per batch
    heap_trim_s: float = DEFAULT_HEAP_TRIM_S  # malloc_trim every this many seconds (dipaco.serve.heap); 0: never


class RequestError(Exception):
    """A request refused while it is planned: the status, the message and the field at fault; answered as
    ``{"detail"}`` on dipaco's own endpoints and in OpenAI's shape on OpenAI's."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


@dataclass(frozen=True)
class ServeOptions:
    """What `dipaco serve` loads and where it listens (the request caps: :class:`AppOptions`)."""

    host: str = "127.0.0.1"
    port: int = 8000
    experiment: str | None = None
    checkpoint: str | None = None
    cache_size: int = DEFAULT_CACHE_SIZE
    device: str = "cpu"
    precision: str = "auto"
    log_level: str = "info"
    token: str | None = None
    allow_unauthenticated: bool = False
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    max_connections: int | None = None
    # an LM-prefix router's forward in a process of its own (the default), its CPUs, and the prompts of one pass
    router: RouterOptions = field(default_factory=lambda: RouterOptions(in_child=True))
    app: AppOptions = field(default_factory=AppOptions)


def create_app(pipeline: Pipeline, options: AppOptions | None = None, token: str | None = None):
    """The FastAPI application serving ``pipeline`` with these request caps (``options``).

    ``max_prompt_tokens`` and ``max_new_tokens_cap`` default to the experiment's positions
    (:meth:`~dipaco.checkpoint.spec.ExperimentSpec.served_positions`; lowered to them when above);
    ``max_body_bytes`` defaults to :func:`default_max_body_bytes` of the prompt cap. ``token``: every
    endpoint but ``/healthz`` needs it as a bearer token. ``batching``: ``module`` batches requests of any
    paths (each level's modules run once per pass on the rows through them), ``path`` only requests of one
    path; ``max_batch`` / ``batch_wait_ms``: its batches (``max_batch=1``: none); ``decode_workers``: how
    many batches (of different paths, under ``path``) decode at once. The app's metrics are
    ``app.state.metrics``.
    """
    _import_web()
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, HTTPException, Request, Response
    from fastapi.concurrency import run_in_threadpool
    from fastapi.encoders import jsonable_encoder
    from fastapi.exception_handlers import http_exception_handler
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, ConfigDict, Field, field_validator
    from starlette.exceptions import HTTPException as StarletteHTTPException

    options = options or AppOptions()
    max_prompt_tokens, max_new_tokens_cap = options.max_prompt_tokens, options.max_new_tokens_cap
    max_body_bytes, body_timeout_s = options.max_body_bytes, options.body_timeout_s
    max_batch, batch_wait_ms, decode_workers = options.max_batch, options.batch_wait_ms, options.decode_workers
    # Planning (tokenizing, routing) runs on PLAN_THREADS long-lived threads, not starlette's pool of up to 40
    # threads that come and go: each new thread drew glibc another malloc arena (up to 8 per core), and each arena
    # kept its own high-water mark, so the server grew for minutes as the pool's threads turned over (issue 62).
    planner = ThreadPoolExecutor(PLAN_THREADS, thread_name_prefix="dipaco-plan")

    async def in_planner(fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(planner, functools.partial(fn, *args, **kwargs))

    positions = pipeline.spec.served_positions()  # what one row's prompt and new tokens fill together
    max_prompt_tokens, max_new_tokens_cap, notes = resolve_caps(positions, max_prompt_tokens, max_new_tokens_cap)
    for note in notes:
        echo(f"[serve] {note}")
    max_prompt_chars = max_prompt_tokens * pipeline.max_token_chars
    if max_body_bytes is None:
        max_body_bytes = default_max_body_bytes(max_prompt_tokens, pipeline.max_token_chars)
    if max_body_bytes < 1:
        raise DipacoError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    if options.max_prompts < 1:
        raise DipacoError(f"--max-prompts must be >= 1, got {options.max_prompts}")
    if not (isinstance(batch_wait_ms, (int, float)) and math.isfinite(batch_wait_ms)):
        raise DipacoError(f"--batch-wait-ms must be a finite number of milliseconds, got {batch_wait_ms}")
    routing_prefix = pipeline.routing_prefix_tokens()
    metrics = ServeMetrics()
    metrics.watch_routing(pipeline.router_stats)
    if options.batching not in BATCHING_MODES:
        raise DipacoError(f"--batching must be one of {', '.join(BATCHING_MODES)}, got {options.batching!r}")
    by_module = options.batching == "module"
    if by_module:
        metrics.watch_module_batching(pipeline.module_decoder.stats)
    batcher = PathBatcher(pipeline.run_module_batch if by_module else pipeline.run_batch, max_batch=max_batch,
                          batch_wait_s=batch_wait_ms / 1000.0, workers=decode_workers, observer=metrics,
                          one_queue=by_module)
    heap = HeapTrimmer(options.heap_trim_s)
    metrics.watch_heap(heap)

    default_new_tokens = min(DEFAULT_NEW_TOKENS, max_new_tokens_cap)

    class Strict(BaseModel):
        # A misspelt field is an error, not silently ignored; NaN and infinities are not numbers here; and no
        # coercion: "5" or true is not an integer, "0.5" not a number (an integer is a number: JSON has one kind).
        model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

        @field_validator("*", mode="after")
        @classmethod
        def valid_unicode(cls, value):
            listed = isinstance(value, list)
            for i, text in enumerate(value if listed else [value]):  # a list of strings: each of them
                if isinstance(text, str):
                    try:
                        text.encode("utf-8")
                    except UnicodeEncodeError:
                        where = f"item {i} holds" if listed else "it holds"
                        raise ValueError(f"not valid Unicode: {where} a lone surrogate (\\ud800-\\udfff)") from None
            return value

    class RouteRequest(Strict):
        text: str = Field(min_length=1, description="the text to route (its first prefix tokens, for LM-prefix routing)")

    class RouteResponse(BaseModel):
        path: int
        scores: list[float]

    class GenerateRequest(Strict):
        prompt: str = Field(min_length=1)
        max_new_tokens: int | None = Field(None, ge=1, description=f"default {default_new_tokens}; at most {max_new_tokens_cap}")
        temperature: float = Field(0.0, ge=0.0, le=100.0, description="0 = greedy decoding")
        top_p: float = Field(1.0, gt=0.0, le=1.0)
        top_k: int = Field(0, ge=0, description="0 = no top-k filtering")
        seed: int | None = Field(None, ge=0, lt=2**63, description="sampling seed (temperature > 0)")
        path: int | None = Field(None, ge=0, description="use this path instead of routing the prompt")

    class GenerateResponse(BaseModel):
        path: int
        scores: list[float] | None
        text: str
        prompt_tokens: int
        completion_tokens: int
        latency_ms: float
        finish_reason: str
        seed: int | None
        batch_size: int

    @asynccontextmanager
    async def lifespan(app):
        heap.start()
        yield
        await run_in_threadpool(batcher.close)  # joins the workers: not on the event loop
        await run_in_threadpool(heap.close)
        planner.shutdown(wait=False)

    app = FastAPI(title="dipaco", summary="DiPaCo single-path inference: route a prompt, run one path", lifespan=lifespan,
                  redirect_slashes=False)  # CanonicalPaths serves /x/ as /x: nothing is redirected
    app.state.caps = {"max_prompt_tokens": max_prompt_tokens, "max_prompt_chars": max_prompt_chars,
                      "max_new_tokens_cap": max_new_tokens_cap, "max_body_bytes": max_body_bytes}
    app.state.metrics = metrics
    app.state.batcher = batcher
    app.state.heap = heap

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        unread = body_not_json(request, exc)
        if unread is not None:
            return await refused(request, unread)
        if oa.is_openai_path(request.url.path):
            return openai_error(oa.validation_error(json_safe(jsonable_encoder(exc.errors()))))
        # FastAPI's own handler echoes the input, which may be NaN or a lone surrogate: strict JSON
        # cannot encode those, and the 422 would become a 500 with the connection dropped.
        return JSONResponse(status_code=422, content={"detail": json_safe(jsonable_encoder(exc.errors()))})

    @app.exception_handler(RequestError)
    async def refused(request: Request, exc: RequestError) -> JSONResponse:
        if oa.is_openai_path(request.url.path):  # OpenAI says 400 for what FastAPI calls 422
            return openai_error(oa.OpenAIError(400 if exc.status == 422 else exc.status, exc.message, exc.param))
        return JSONResponse(status_code=exc.status, content={"detail": exc.message})

    def body_not_json(request: Request, exc: RequestValidationError) -> RequestError | None:
        """The refusal of a body FastAPI did not read as JSON, naming why, or None. It reads one only under a
        JSON ``Content-Type`` (``application/json``, ``application/*+json``); any other body reaches validation
        as its bytes, and an empty one (or JSON's null) as None, where pydantic would only say the input is not
        an object."""
        if isinstance(exc.body, (bytes, bytearray)):
            sent = request.headers.get("content-type")
            got = f"got {json_safe(sent)!r}" if sent else "none was sent"
            return RequestError(415, f"Content-Type: the body is read as JSON only with 'Content-Type: "
                                     f"application/json' ({got})")
        if exc.body is None and any(tuple(e.get("loc", ())) == ("body",) for e in exc.errors()):
            return RequestError(422, "the request body is empty (or null): send a JSON object, with 'Content-Type: "
                                     "application/json'")
        return None

    @app.exception_handler(oa.OpenAIError)
    async def openai_refused(request: Request, exc: oa.OpenAIError) -> JSONResponse:
        return openai_error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if oa.is_openai_path(request.url.path):  # 404/405 of a route, 499, 503
            return openai_error(oa.OpenAIError(exc.status_code, str(exc.detail)), exc.headers)
        return await http_exception_handler(request, exc)

    def openai_error(exc: oa.OpenAIError, headers: Mapping[str, str] | None = None) -> JSONResponse:
        return JSONResponse(status_code=exc.status, content=exc.body(), headers=headers)

    def check_prompt_chars(field: str, text: str) -> None:
        if len(text) > max_prompt_chars:
            raise RequestError(422, f"{field}: {len(text)} characters is more than a text within this server's cap of "
                                    f"{max_prompt_tokens} tokens can have (at most {max_prompt_chars} characters: "
                                    f"{pipeline.max_token_chars} per token)", param="prompt")

    def bad_request(exc: DipacoError) -> HTTPException:
        return HTTPException(status_code=400, detail=str(exc))

    @app.get("/healthz")
    def healthz() -> dict:
        return {"status": "ok", **pipeline.describe(), "max_prompt_tokens": max_prompt_tokens,
                "max_prompt_chars": max_prompt_chars, "max_new_tokens_cap": max_new_tokens_cap,
                "max_body_bytes": max_body_bytes, "routing_prefix_tokens": routing_prefix,
                "max_batch": batcher.max_batch, "batch_wait_ms": batcher.batch_wait_s * 1000.0,
                "batching": options.batching}

    @app.get("/v1/paths")
    def paths() -> dict:
        return {"experiment": pipeline.experiment, "checkpoint": pipeline.checkpoint,
                "router": None if pipeline.router is None else pipeline.router.kind, "paths": pipeline.paths()}

    @app.get("/metrics")
    def prometheus_metrics() -> Response:
        body, content_type = metrics.render()
        return Response(content=body, media_type=content_type)

    @app.post("/v1/route", response_model=RouteResponse)
    def route(req: RouteRequest, request: Request) -> RouteResponse:
        if routing_prefix is None:  # the router reads the whole text (or there is none): cap it like a prompt
            check_prompt_chars("text", req.text)
        try:
            path, scores = pipeline.route(req.text)
        except DipacoError as exc:
            raise bad_request(exc) from None
        request.state.dipaco_path = path
        return RouteResponse(path=path, scores=scores)

    def plan(prompt: str | list[int], max_new_tokens: int | None, names: tuple[str, str] = ("prompt", "max_new_tokens"),
             default_new: int = default_new_tokens, path: int | None = None, scoring: Scored | None = None,
             **sampling) -> PlannedGeneration:
        """Every check, tokenizing and routing of one prompt (a text, or token ids already checked against the
        vocabulary): a request over a limit is refused here, before any batch. ``names``: the request's names
        of the prompt and the new tokens, for the messages."""
        field, new_field = names
        least = 0 if scoring is not None and scoring.prompt_logprobs else 1
        if max_new_tokens is not None and max_new_tokens > max_new_tokens_cap:
            raise RequestError(422, f"{new_field}={max_new_tokens} is above this server's cap of {max_new_tokens_cap}",
                               param=new_field)
        if path is not None and path >= pipeline.num_paths:
            raise RequestError(422, f"path={path} does not exist: this experiment has paths 0..{pipeline.num_paths - 1}",
                               param="path")
        if isinstance(prompt, str):
            check_prompt_chars(field, prompt)  # before tokenizing: bounds what is tokenized
            ids = pipeline.encode(prompt)
        else:
            ids, prompt = prompt, ""  # routing reads the ids
        n_prompt = len(ids)
        if n_prompt > max_prompt_tokens:
            raise RequestError(422, f"{field}: {n_prompt} tokens, above this server's cap of {max_prompt_tokens}",
                               param="prompt")
        room = positions.limit - n_prompt
        new_tokens = min(default_new, room) if max_new_tokens is None else max_new_tokens
        try:
            positions.check_fits(n_prompt, max(new_tokens, least), new_field)  # dipaco generate's rule too
        except DipacoError as exc:
            raise RequestError(422, str(exc), param=new_field) from None
        try:
            return pipeline.plan(prompt, max_new_tokens=new_tokens, path=path, ids=ids, scoring=scoring, **sampling)
        except DipacoError as exc:
            raise RequestError(400, str(exc), param="prompt") from None

    async def decoded(planned: list[PlannedGeneration], request: Request, result=None) -> list:
        """``planned`` decoded in their paths' batches: ``result(planned)(row)`` of each (the row itself by
        default), in order. A client gone first is a 499 (its rows cancelled), a server shutting down a 503."""
        tickets: list[Ticket] = []
        try:
            for one in planned:
                tickets.append(batcher.submit(one.path, one.row, result=(lambda row: row) if result is None else result(one)))
            answers = await answers_unless_gone(batcher, tickets, request.receive)
        except DipacoError as exc:  # the server is shutting down
            for ticket in tickets:
                batcher.cancel(ticket)
            raise HTTPException(503, str(exc)) from None
        if answers is None:
            raise HTTPException(CLIENT_GONE, "the client closed its connection before the answer")
        return answers

    @app.post("/v1/generate", response_model=GenerateResponse)
    async def generate(req: GenerateRequest, request: Request) -> GenerateResponse:
        planned = await in_planner(plan, req.prompt, req.max_new_tokens, temperature=req.temperature,
                                   top_p=req.top_p, top_k=req.top_k, seed=req.seed, path=req.path)
        request.state.dipaco_path = planned.path
        [result] = await decoded([planned], request, result=lambda one: lambda row: pipeline.finish(one))
        request.state.batch_size = result.batch_size
        return GenerateResponse(**vars(result))

    # --- OpenAI's API (dipaco.serve.openai_api): the same plan, batches and limits ---------------------
    CompletionRequest = oa.request_model(Strict)
    model_card = oa.model_card(pipeline.experiment, int(time.time()))

    @app.get(oa.MODELS)
    def models() -> dict:
        return {"object": "list", "data": [model_card]}

    @app.get(oa.MODELS + "/{model}")
    def model(model: str) -> dict:
        if model != pipeline.experiment:
            raise oa.OpenAIError(404, f"model {model!r} is not served here", param="model", code="model_not_found")
        return model_card

    spelling = oa.Spelling(pipeline, frozenset(pipeline.tokenizer.all_special_ids))

    def plan_completion(req) -> tuple[list[PlannedGeneration], tuple[str, ...]]:
        prompts = oa.prompts_of(req.prompt, options.max_prompts, pipeline.tokenizer.eos_token_id)
        oa.check_supported(req, pipeline.experiment, len(prompts))
        stops = oa.stops_of(req.stop)
        scoring = Scored(logprobs=req.logprobs, prompt_logprobs=req.echo and req.logprobs is not None, stop=stops)
        planned = []
        for i, prompt in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if not isinstance(prompt, str):
                oa.check_token_ids(prompt, pipeline.vocab_size, where)
            planned.append(plan(prompt, req.max_tokens, names=(where, "max_tokens"), default_new=oa.DEFAULT_MAX_TOKENS,
                                scoring=scoring, temperature=req.temperature, top_p=req.top_p, seed=req.seed))
        return planned, stops

    @app.post(oa.COMPLETIONS)
    async def completions(body: CompletionRequest, request: Request) -> Response:  # type: ignore[valid-type]
        req: Any = body  # built at run time: mypy cannot see its fields
        planned, stops = await in_planner(plan_completion, req)
        request.state.dipaco_path = planned[0].path if len({p.path for p in planned}) == 1 else None
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            return stream_completion(planned[0], stops, request, usage)
        rows = await decoded(planned, request)
        request.state.batch_size = max(row.batch_size for row in rows)
        choices = [oa.Decoded(i, row, one.path) for i, (row, one) in enumerate(zip(rows, planned))]
        args = (spelling, choices, pipeline.experiment, req.echo, req.logprobs, stops)
        if req.logprobs is None:  # the text alone: one short decode per choice, done here
            answer = oa.completion(*args)
        else:  # log-probabilities decode every prefix of the tokens: a thread's work
            answer = await in_planner(oa.completion, *args)
        return JSONResponse(answer)

    class EventStream(Response):
        """A ``text/event-stream`` response of the byte strings ``events(gone)`` yields, each sent as it comes;
        ``gone`` resolves when the client disconnects, and the events should then end. Starlette's
        StreamingResponse watches for the disconnect with a task group of its own per response, the
        streamed completion's own wake-ups (:class:`Wakeup`) see it here."""

        def __init__(self, events) -> None:  # no body, no content-length: the events are the body
            self.events = events
            self.status_code = 200
            self.background = None
            self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]

        async def __call__(self, scope, receive, send) -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            gone = asyncio.ensure_future(client_gone(receive))
            stream = self.events(gone)
            try:
                async for event in stream:
                    await send({"type": "http.response.body", "body": event, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            finally:
                gone.cancel()
                await stream.aclose()  # its row is cancelled if it has not ended (shutdown)
            if self.background is not None:
                await self.background()

    def stream_completion(planned: PlannedGeneration, stops: tuple[str, ...], request: Request, usage: bool) -> Response:
        """Queues the row (a server shutting down is a 503 here, before any event) and streams its text as it
        decodes: one event per wake-up that adds final text (the tokens decoded meanwhile), then the finish
        (and the usage) with ``[DONE]``. A client that leaves cancels the row."""
        row = planned.row
        wakeup = Wakeup(asyncio.get_running_loop(), STREAM_INTERVAL_S)
        row.on_token = lambda r: wakeup.poke()
        try:
            ticket = batcher.submit(planned.path, row)
        except DipacoError as exc:
            raise HTTPException(503, str(exc)) from None
        ticket.future.add_done_callback(lambda f: wakeup.finish())  # after the last token's poke
        cid, created, text, model = oa.completion_id(), int(time.time()), oa.TextStream(stops), pipeline.experiment

        async def events(gone: asyncio.Future):
            gone.add_done_callback(lambda f: wakeup.finish())
            try:
                while not ticket.future.done():
                    await wakeup.wait()
                    if gone.done():
                        return
                    if ticket.future.done():
                        break
                    delta, _ = text.delta(pipeline.decode(list(row.tokens)))  # a copy: the decoding thread appends
                    if delta:
                        yield oa.sse(oa.chunk(cid, created, model, delta, None, planned.path))
                if ticket.future.cancelled() or ticket.future.exception() is not None:
                    failure = "cancelled" if ticket.future.cancelled() else str(ticket.future.exception())
                    yield oa.sse(oa.error_body(503, f"the completion did not finish: {failure}")) + oa.DONE
                    return
                delta, stopped = text.delta(pipeline.decode(row.tokens), final=True)
                request.state.batch_size = row.batch_size
                last = oa.sse(oa.chunk(cid, created, model, delta, oa.finish_reason(row, stopped), planned.path))
                yield last + (oa.sse(oa.usage_chunk(cid, created, model, row)) if usage else b"") + oa.DONE
            finally:
                if not ticket.future.done():
                    batcher.cancel(ticket)

        return EventStream(events)

    # Outermost last: the access log sees every answer (401s and 413s included); the token is checked
    # before any body is read; and all of them see an OpenAI path as its route has it.
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, timeout_s=body_timeout_s)
    if token is not None:
        app.add_middleware(BearerToken, token=token)
    app.add_middleware(AccessLog, metrics=metrics, endpoints=frozenset(getattr(r, "path", "") for r in app.routes))
    app.add_middleware(CanonicalPaths)
    return app


def server_config(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                  header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S, max_connections: int | None = None):
    """uvicorn's config for ``app``: uvicorn's access log off (``AccessLog`` writes one), its HTTP protocol
    guarded (header deadline, connection bound: ``dipaco.serve.connections``); returns (config, guard)."""
    import uvicorn

    if not (header_timeout_s > 0 and math.isfinite(header_timeout_s)):
        raise DipacoError(f"--header-timeout-s must be a number of seconds > 0, got {header_timeout_s}")
    budget = default_max_connections()
    if max_connections is None:
        max_connections = budget
    elif max_connections < 1:
        raise DipacoError(f"--max-connections must be >= 1, got {max_connections}")
    elif max_connections > budget:
        echo(f"[serve] --max-connections={max_connections} is above what the file descriptor limit (ulimit -n) "
             f"leaves: lowered to {budget}")
        max_connections = budget
    metrics: ServeMetrics = app.state.metrics
    guard = ConnectionGuard(header_timeout_s=header_timeout_s, max_connections=max_connections,
                            on_count=metrics.connection_count, on_close=metrics.connection_closed)
    # asyncio's own loop, whose accept loop calls the listening socket's accept (AdmissionSocket); uvloop's
    # accepts in C.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            http=guarded_protocol(guard), loop="asyncio")
    return config, guard


def _log_access_to_stderr(log_level: str) -> None:
    log = logging.getLogger(ACCESS_LOGGER)
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(log_level.upper())


def router_placement(own_process: bool, cpus: tuple[int, ...] | None, server_cpus: tuple[int, ...] | None) -> str:
    if not own_process:
        return ""
    if cpus is None:
        return " (own process)"
    n = torch.get_num_threads()
    server = "the server shares them" if server_cpus is None else f"the server on {','.join(map(str, server_cpus))}"
    server += f", {n} torch thread{'s' if n > 1 else ''}"
    return f" (own process, CPUs {','.join(map(str, cpus))}; {server})"


def serve(run_dir: str | Path, options: ServeOptions | None = None) -> None:
    """Binds ``host:port`` and loads the run (a port in use, a bad run, or a non-loopback host without a
    token is one DipacoError), then serves until stopped."""
    o = options or ServeOptions()
    host, port, token, log_level, cache_size = o.host, o.port, o.token, o.log_level, o.cache_size
    max_batch, batch_wait_ms, header_timeout_s = o.app.max_batch, o.app.batch_wait_ms, o.header_timeout_s
    _import_web()

    check_exposure(host, token, o.allow_unauthenticated)  # before binding or loading anything
    sock = listening_socket(host, port)  # before loading: a port in use fails at once
    pipeline: Pipeline | None = None
    try:
        pipeline = Pipeline.from_run(run_dir, experiment=o.experiment, checkpoint=o.checkpoint, device=o.device,
                                     precision=o.precision, cache_size=cache_size,
                                     router=o.router)
        # Only a router with a process of its own has CPUs to leave to it (the process moved itself onto them);
        # every thread started so far moves, and those started later inherit it.
        router_cpus = o.router.cpus if pipeline.router_process is not None else None
        server_cpus = None if router_cpus is None else leave_cpus(router_cpus)
        app = create_app(pipeline, o.app, token=token)
        config, guard = server_config(app, host, port, log_level, header_timeout_s, o.max_connections)
        guard.guard_listener(sock)
        info = pipeline.describe()
        caps = app.state.caps
        echo(f"[serve] {info['experiment']} {info['checkpoint']}: {info['topology']}, router {info['router']}"
             f"{router_placement(pipeline.router_process is not None, router_cpus, server_cpus)}; "
             f"http://{host}:{port} (cache {cache_size} paths; positions: {info['positions']} ({info['positions_from']}); "
             f"caps: prompt {caps['max_prompt_tokens']} tokens, "
             f"{caps['max_new_tokens_cap']} new tokens, body {caps['max_body_bytes']} bytes; {o.app.batching} "
             f"batching, up to {max_batch} rows{' per path' if o.app.batching == 'path' else ''} within "
             f"{batch_wait_ms:g} ms, {o.app.decode_workers} decoding at once; {app.state.heap.describe()}; "
             f"{guard.max_connections} connections, headers within "
             f"{header_timeout_s:g} s; {'bearer token required' if token else 'no token'})")
        _log_access_to_stderr(log_level)
        import uvicorn

        server = uvicorn.Server(config)
        freeze_loaded_objects()
        server.run(sockets=[sock])
    finally:
        sock.close()
        if pipeline is not None:
            pipeline.close()
    if not server.started:
        raise DipacoError(f"the server could not start on {host}:{port}")


def freeze_loaded_objects() -> None:
    """Moves every object alive now (the run's modules, the tokenizer, the libraries: they live as long as the
    server) out of the garbage collector's reach. Under load a full collection comes about once a minute; walking
    them made it a 0.4-0.5 s pause of every request in flight (docs/notes/2026-11-27-serving-memory.md)."""
    gc.collect()  # garbage frozen would never be freed
    gc.freeze()


def listening_socket(host: str, port: int) -> AdmissionSocket:
    """A socket bound to ``host:port``; one that cannot be (a port in use, out of range, a host this machine
    is not) is a DipacoError naming it, where uvicorn would exit on its own with a log line."""
    if not 0 <= port <= 65535:
        raise DipacoError(f"--port: {port} is not a TCP port (0..65535)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise DipacoError(f"--host: cannot listen on {host!r}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = AdmissionSocket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise DipacoError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock
