"""`dipaco serve`: an HTTP API over the single-path inference pipeline (FastAPI + uvicorn).

    GET  /healthz       {"status": "ok", experiment, checkpoint, num_paths, router, cache...}
    GET  /v1/paths      per path: id, module names, training shard size, validation perplexity
    POST /v1/route      {"text"} -> {"path", "scores"}
    POST /v1/generate   {"prompt", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "path"}
                        -> {"path", "scores", "text", "prompt_tokens", "completion_tokens",
                            "latency_ms", "finish_reason", "seed"}

Requests are Pydantic models: a missing or mistyped field, an unknown field, or malformed JSON
is a 422 that names the problem; so are a prompt longer than ``max_prompt_tokens`` tokens and
``max_new_tokens`` above the server's cap. A request the experiment cannot answer (routing
without a router, an empty prompt) is a 400. Endpoints are plain functions, which FastAPI runs in
its thread pool; :class:`dipaco.serve.pipeline.Pipeline` is thread-safe (one generation per cached
path model at a time, different paths in parallel).

Needs the ``serve`` extra: ``pip install -e ".[serve]"``.
"""

# No `from __future__ import annotations`: FastAPI reads the endpoint annotations at runtime,
# and the request models are local to create_app.
from pathlib import Path
from typing import Optional

from dipaco.errors import DipacoError
from dipaco.metrics import echo
from dipaco.serve.pipeline import DEFAULT_CACHE_SIZE, Pipeline

DEFAULT_MAX_PROMPT_TOKENS = 512
DEFAULT_MAX_NEW_TOKENS_CAP = 256
DEFAULT_NEW_TOKENS = 32  # when a request does not say (never above the cap)


def _import_web():
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise DipacoError(f"dipaco serve needs FastAPI and uvicorn: pip install -e \".[serve]\" ({exc})") from None


def create_app(pipeline: Pipeline, max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
               max_new_tokens_cap: int = DEFAULT_MAX_NEW_TOKENS_CAP):
    """The FastAPI application serving ``pipeline`` with these request caps."""
    _import_web()
    from fastapi import FastAPI, HTTPException
    from pydantic import BaseModel, ConfigDict, Field

    if max_prompt_tokens < 1 or max_new_tokens_cap < 1:
        raise DipacoError(f"max_prompt_tokens and max_new_tokens_cap must be >= 1, "
                          f"got {max_prompt_tokens} and {max_new_tokens_cap}")

    default_new_tokens = min(DEFAULT_NEW_TOKENS, max_new_tokens_cap)

    class Strict(BaseModel):
        model_config = ConfigDict(extra="forbid")  # a misspelt field is an error, not silently ignored

    class RouteRequest(Strict):
        text: str = Field(min_length=1, description="the text to route (its first prefix tokens, for LM-prefix routing)")

    class RouteResponse(BaseModel):
        path: int
        scores: list[float]

    class GenerateRequest(Strict):
        prompt: str = Field(min_length=1)
        max_new_tokens: Optional[int] = Field(None, ge=1, description=f"default {default_new_tokens}; at most {max_new_tokens_cap}")
        temperature: float = Field(0.0, ge=0.0, le=100.0, description="0 = greedy decoding")
        top_p: float = Field(1.0, gt=0.0, le=1.0)
        top_k: int = Field(0, ge=0, description="0 = no top-k filtering")
        seed: Optional[int] = Field(None, ge=0, lt=2**63, description="sampling seed (temperature > 0)")
        path: Optional[int] = Field(None, ge=0, description="use this path instead of routing the prompt")

    class GenerateResponse(BaseModel):
        path: int
        scores: Optional[list[float]]
        text: str
        prompt_tokens: int
        completion_tokens: int
        latency_ms: float
        finish_reason: str
        seed: Optional[int]

    app = FastAPI(title="dipaco", summary="DiPaCo single-path inference: route a prompt, run one path")

    def bad_request(exc: DipacoError) -> HTTPException:
        return HTTPException(status_code=400, detail=str(exc))

    @app.get("/healthz")
    def healthz() -> dict:
        return {"status": "ok", **pipeline.describe(),
                "max_prompt_tokens": max_prompt_tokens, "max_new_tokens_cap": max_new_tokens_cap}

    @app.get("/v1/paths")
    def paths() -> dict:
        return {"experiment": pipeline.experiment, "checkpoint": pipeline.checkpoint,
                "router": None if pipeline.router is None else pipeline.router.kind, "paths": pipeline.paths()}

    @app.post("/v1/route", response_model=RouteResponse)
    def route(req: RouteRequest) -> RouteResponse:
        try:
            path, scores = pipeline.route(req.text)
        except DipacoError as exc:
            raise bad_request(exc) from None
        return RouteResponse(path=path, scores=scores)

    @app.post("/v1/generate", response_model=GenerateResponse)
    def generate(req: GenerateRequest) -> GenerateResponse:
        max_new_tokens = default_new_tokens if req.max_new_tokens is None else req.max_new_tokens
        if max_new_tokens > max_new_tokens_cap:
            raise HTTPException(422, f"max_new_tokens={max_new_tokens} is above this server's cap of {max_new_tokens_cap}")
        if req.path is not None and req.path >= pipeline.num_paths:
            raise HTTPException(422, f"path={req.path} does not exist: this experiment has paths 0..{pipeline.num_paths - 1}")
        n_prompt = len(pipeline.encode(req.prompt))
        if n_prompt > max_prompt_tokens:
            raise HTTPException(422, f"the prompt has {n_prompt} tokens, above this server's cap of {max_prompt_tokens}")
        try:
            result = pipeline.generate(req.prompt, max_new_tokens=max_new_tokens, temperature=req.temperature,
                                       top_p=req.top_p, top_k=req.top_k, seed=req.seed, path=req.path)
        except DipacoError as exc:
            raise bad_request(exc) from None
        return GenerateResponse(**vars(result))

    return app


def serve(run_dir: str | Path, host: str = "127.0.0.1", port: int = 8000, experiment: str | None = None,
          checkpoint: str | None = None, cache_size: int = DEFAULT_CACHE_SIZE,
          max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS, max_new_tokens_cap: int = DEFAULT_MAX_NEW_TOKENS_CAP,
          device: str = "cpu", log_level: str = "info") -> None:
    """Loads the run (a bad one is a DipacoError before any socket opens), then serves until stopped."""
    _import_web()
    import uvicorn

    pipeline = Pipeline.from_run(run_dir, experiment=experiment, checkpoint=checkpoint, device=device,
                                 cache_size=cache_size)
    app = create_app(pipeline, max_prompt_tokens=max_prompt_tokens, max_new_tokens_cap=max_new_tokens_cap)
    info = pipeline.describe()
    echo(f"[serve] {info['experiment']} {info['checkpoint']}: {info['topology']}, router {info['router']}; "
         f"http://{host}:{port} (cache {cache_size} paths)")
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))
    server.run()
    if not server.started:  # e.g. the port is taken: uvicorn logged why
        raise DipacoError(f"the server could not start on {host}:{port}")
