"""`dipaco serve`: an HTTP API over the single-path inference pipeline (FastAPI + uvicorn).

    GET  /healthz       {"status": "ok", experiment, checkpoint, num_paths, router, cache...}
    GET  /v1/paths      per path: id, module names, training shard size, validation perplexity
    POST /v1/route      {"text"} -> {"path", "scores"}
    POST /v1/generate   {"prompt", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "path"}
                        -> {"path", "scores", "text", "prompt_tokens", "completion_tokens",
                            "latency_ms", "finish_reason", "seed"}

Requests are Pydantic models: a missing or mistyped field, an unknown field, malformed JSON, or a
number that is NaN or infinite (JSON's ``NaN``/``Infinity`` literals, or ``1e999``) is a 422 that
names the problem; so are a prompt longer than ``max_prompt_tokens`` tokens, ``max_new_tokens``
above the server's cap, and a prompt plus ``max_new_tokens`` beyond the model's ``data.seq_len``
positions. A request the experiment cannot answer (routing without a router, an empty prompt) is
a 400.

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
- Caps default to the model's ``data.seq_len``; larger caps are lowered to it (positions past it
  were never trained and do not exist in the model).
- Endpoints are plain functions, which FastAPI runs in its thread pool; the pipeline is
  thread-safe with no global lock on tokenization (a tokenizer per concurrent call), one generation per
  cached path model at a time, different paths in parallel.

Needs the ``serve`` extra: ``pip install -e ".[serve]"``.
"""

# No `from __future__ import annotations`: FastAPI reads the endpoint annotations at runtime,
# and the request models are local to create_app.
import asyncio
import json
import math
import socket
from pathlib import Path

from dipaco.errors import DipacoError
from dipaco.metrics import echo
from dipaco.serve.pipeline import DEFAULT_CACHE_SIZE, Pipeline

DEFAULT_NEW_TOKENS = 32  # when a request does not say (never above the cap nor past the model's positions)
JSON_BYTES_PER_BYTE = 6  # the longest JSON spelling of one UTF-8 byte of a string: "\\u00XX" (or 12 for 4)
BODY_OVERHEAD_BYTES = 16 * 1024  # the other fields, keys and whitespace of a request
ERROR_INPUT_CHARS = 200  # a 422 echoes at most this much of the offending input


def _import_web():
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise DipacoError(f"dipaco serve needs FastAPI and uvicorn: pip install -e \".[serve]\" ({exc})") from None


def default_max_body_bytes(max_prompt_tokens: int, max_token_chars: int) -> int:
    """The largest valid request body, generously: a prompt of ``max_prompt_tokens`` tokens has at
    most ``max_prompt_tokens * max_token_chars`` UTF-8 bytes, each spelt with at most
    ``JSON_BYTES_PER_BYTE`` bytes of JSON, plus ``BODY_OVERHEAD_BYTES`` for everything else."""
    return max_prompt_tokens * max_token_chars * JSON_BYTES_PER_BYTE + BODY_OVERHEAD_BYTES


def resolve_caps(seq_len: int, max_prompt_tokens: int | None, max_new_tokens_cap: int | None) -> tuple[int, int, list[str]]:
    """The request caps: ``data.seq_len`` when not given, lowered to it when above; notes say what was lowered."""
    caps, notes = [], []
    for name, value in (("max_prompt_tokens", max_prompt_tokens), ("max_new_tokens_cap", max_new_tokens_cap)):
        if value is None:
            value = seq_len
        if value < 1:
            raise DipacoError(f"{name} must be >= 1, got {value}")
        if value > seq_len:
            notes.append(f"{name}={value} is above the model's data.seq_len={seq_len} positions: lowered to {seq_len}")
            value = seq_len
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

    async def _timed_out(self, send) -> None:
        body = json.dumps({"detail": f"the request body did not arrive within {self.timeout_s:g} s"}).encode()
        await send({"type": "http.response.start", "status": 408,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def _too_large(self, send) -> None:
        body = json.dumps({"detail": f"the request body is larger than this server's limit of {self.max_bytes} "
                                     f"bytes (max_body_bytes)"}).encode()
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
                    await self._too_large(send)
                    return
        chunks, size = [], 0
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - asyncio.get_running_loop().time()))
            except asyncio.TimeoutError:
                await self._timed_out(send)
                return
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(send)
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


def create_app(pipeline: Pipeline, max_prompt_tokens: int | None = None, max_new_tokens_cap: int | None = None,
               max_body_bytes: int | None = None, body_timeout_s: float = 10.0):
    """The FastAPI application serving ``pipeline`` with these request caps.

    ``max_prompt_tokens`` and ``max_new_tokens_cap`` default to the experiment's ``data.seq_len``
    (and are lowered to it when above); ``max_body_bytes`` defaults to
    :func:`default_max_body_bytes` of the prompt cap.
    """
    _import_web()
    from fastapi import FastAPI, HTTPException, Request
    from fastapi.encoders import jsonable_encoder
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, ConfigDict, Field, field_validator

    seq_len = pipeline.cfg.data.seq_len
    max_prompt_tokens, max_new_tokens_cap, notes = resolve_caps(seq_len, max_prompt_tokens, max_new_tokens_cap)
    for note in notes:
        echo(f"[serve] {note}")
    max_prompt_chars = max_prompt_tokens * pipeline.max_token_chars
    if max_body_bytes is None:
        max_body_bytes = default_max_body_bytes(max_prompt_tokens, pipeline.max_token_chars)
    if max_body_bytes < 1:
        raise DipacoError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    routing_prefix = pipeline.routing_prefix_tokens()

    default_new_tokens = min(DEFAULT_NEW_TOKENS, max_new_tokens_cap)

    class Strict(BaseModel):
        # A misspelt field is an error, not silently ignored; NaN and infinities are not numbers here.
        model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

        @field_validator("*", mode="after")
        @classmethod
        def valid_unicode(cls, value):
            if isinstance(value, str):
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    raise ValueError("not valid Unicode: it holds a lone surrogate (\\ud800-\\udfff)") from None
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

    app = FastAPI(title="dipaco", summary="DiPaCo single-path inference: route a prompt, run one path")
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, timeout_s=body_timeout_s)
    app.state.caps = {"max_prompt_tokens": max_prompt_tokens, "max_prompt_chars": max_prompt_chars,
                      "max_new_tokens_cap": max_new_tokens_cap, "max_body_bytes": max_body_bytes}

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own handler echoes the input, which may be NaN or a lone surrogate: strict JSON
        # cannot encode those, and the 422 would become a 500 with the connection dropped.
        return JSONResponse(status_code=422, content={"detail": json_safe(jsonable_encoder(exc.errors()))})

    def check_prompt_chars(field: str, text: str) -> None:
        if len(text) > max_prompt_chars:
            raise HTTPException(422, f"{field}: {len(text)} characters is more than a text within this server's cap of "
                                     f"{max_prompt_tokens} tokens can have (at most {max_prompt_chars} characters: "
                                     f"{pipeline.max_token_chars} per token)")

    def bad_request(exc: DipacoError) -> HTTPException:
        return HTTPException(status_code=400, detail=str(exc))

    @app.get("/healthz")
    def healthz() -> dict:
        return {"status": "ok", **pipeline.describe(), "max_prompt_tokens": max_prompt_tokens,
                "max_prompt_chars": max_prompt_chars, "max_new_tokens_cap": max_new_tokens_cap,
                "max_body_bytes": max_body_bytes, "routing_prefix_tokens": routing_prefix}

    @app.get("/v1/paths")
    def paths() -> dict:
        return {"experiment": pipeline.experiment, "checkpoint": pipeline.checkpoint,
                "router": None if pipeline.router is None else pipeline.router.kind, "paths": pipeline.paths()}

    @app.post("/v1/route", response_model=RouteResponse)
    def route(req: RouteRequest) -> RouteResponse:
        if routing_prefix is None:  # the router reads the whole text (or there is none): cap it like a prompt
            check_prompt_chars("text", req.text)
        try:
            path, scores = pipeline.route(req.text)
        except DipacoError as exc:
            raise bad_request(exc) from None
        return RouteResponse(path=path, scores=scores)

    @app.post("/v1/generate", response_model=GenerateResponse)
    def generate(req: GenerateRequest) -> GenerateResponse:
        if req.max_new_tokens is not None and req.max_new_tokens > max_new_tokens_cap:
            raise HTTPException(422, f"max_new_tokens={req.max_new_tokens} is above this server's cap of {max_new_tokens_cap}")
        if req.path is not None and req.path >= pipeline.num_paths:
            raise HTTPException(422, f"path={req.path} does not exist: this experiment has paths 0..{pipeline.num_paths - 1}")
        check_prompt_chars("prompt", req.prompt)  # before tokenizing: bounds what is tokenized
        n_prompt = len(pipeline.encode(req.prompt))
        if n_prompt > max_prompt_tokens:
            raise HTTPException(422, f"prompt: {n_prompt} tokens, above this server's cap of {max_prompt_tokens}")
        room = seq_len - n_prompt
        max_new_tokens = min(default_new_tokens, room) if req.max_new_tokens is None else req.max_new_tokens
        if max_new_tokens < 1 or max_new_tokens > room:
            raise HTTPException(422, f"max_new_tokens: the prompt's {n_prompt} tokens plus {max(max_new_tokens, 1)} new "
                                     f"tokens do not fit the model's data.seq_len={seq_len} positions")
        try:
            result = pipeline.generate(req.prompt, max_new_tokens=max_new_tokens, temperature=req.temperature,
                                       top_p=req.top_p, top_k=req.top_k, seed=req.seed, path=req.path)
        except DipacoError as exc:
            raise bad_request(exc) from None
        return GenerateResponse(**vars(result))

    return app


def serve(run_dir: str | Path, host: str = "127.0.0.1", port: int = 8000, experiment: str | None = None,
          checkpoint: str | None = None, cache_size: int = DEFAULT_CACHE_SIZE,
          max_prompt_tokens: int | None = None, max_new_tokens_cap: int | None = None,
          device: str = "cpu", log_level: str = "info", max_body_bytes: int | None = None,
          precision: str = "auto", body_timeout_s: float = 10.0) -> None:
    """Binds ``host:port`` and loads the run (a port in use or a bad run is one DipacoError), then serves
    until stopped."""
    _import_web()
    import uvicorn

    sock = listening_socket(host, port)  # before loading: a port in use fails at once
    try:
        pipeline = Pipeline.from_run(run_dir, experiment=experiment, checkpoint=checkpoint, device=device, precision=precision,
                                     cache_size=cache_size)
        app = create_app(pipeline, max_prompt_tokens=max_prompt_tokens, max_new_tokens_cap=max_new_tokens_cap,
                         max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s)
        info = pipeline.describe()
        caps = app.state.caps
        echo(f"[serve] {info['experiment']} {info['checkpoint']}: {info['topology']}, router {info['router']}; "
             f"http://{host}:{port} (cache {cache_size} paths; caps: prompt {caps['max_prompt_tokens']} tokens, "
             f"{caps['max_new_tokens_cap']} new tokens, body {caps['max_body_bytes']} bytes)")
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))
        server.run(sockets=[sock])
    finally:
        sock.close()
    if not server.started:
        raise DipacoError(f"the server could not start on {host}:{port}")


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port``; one that cannot be (a port in use, out of range, a host this machine
    is not) is a DipacoError naming it, where uvicorn would exit on its own with a log line."""
    if not 0 <= port <= 65535:
        raise DipacoError(f"--port: {port} is not a TCP port (0..65535)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise DipacoError(f"--host: cannot listen on {host!r}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise DipacoError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock
