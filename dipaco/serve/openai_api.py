"""OpenAI's completions API over dipaco serving: the request schema, its checks and the answers' shapes.

    POST /v1/completions  {"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed",
                           "stream", "logprobs", "echo"}  ->  a ``text_completion`` object, or server-sent
                          ``text_completion`` chunks ending with ``data: [DONE]`` (``stream: true``)
    GET  /v1/models       the served experiment, as OpenAI's model list

This module only translates: ``dipaco.serve.http`` plans, batches and decodes a completion's prompts on
the code path of ``/v1/generate`` (its caps, routing, batching per path and token) and calls the
functions here to read the request and to write the answer.

- ``prompt`` is a string, a list of strings, a list of token ids or a list of lists of token ids (what
  lm-evaluation-harness sends). Each prompt is one choice (``n`` is 1), routed on its own prefix; the
  choice names its path in an extra field, ``path``.
- ``logprobs: k`` (0..``MAX_LOGPROBS``) returns each token's log-probability and its ``k`` most likely
  alternatives (plus the token itself) under the path's model, from its raw logits. With ``echo: true``
  the prompt's tokens come first (the first one has none: ``null``), and ``max_tokens: 0`` scores the
  prompt alone: lm-eval's loglikelihood requests. ``text_offset`` counts characters of the returned
  ``text``.
- ``stop``: up to ``MAX_STOP`` strings; the completion ends before the first one that appears.
- ``stream_options: {"include_usage": true}`` ends a stream with a chunk of the token counts, as OpenAI's.
- ``null`` is a field's default wherever OpenAI's schema lets a field be null (all but ``model`` and
  ``user``); a null ``prompt`` is OpenAI's default prompt, the document separator (the EOS token).
- Sampling controls this server does not apply are taken at their neutral values, which clients send
  unasked (LangChain's ``OpenAI`` sends ``frequency_penalty: 0`` and ``presence_penalty: 0``):
  ``frequency_penalty``/``presence_penalty`` 0, ``logit_bias`` of zeros, ``suffix`` null or empty,
  ``stream_options.include_obfuscation`` false; any other value is refused by name. ``user`` is taken
  and ignored.
- An echoed prompt is spelt with its special tokens (a token-id prompt may hold them), so its ``text``
  is its tokens' texts one after the other; the completion's text leaves them out (its EOS ends it).
- Errors are OpenAI's ``{"error": {"message", "type", "param", "code"}}``, with 4xx statuses.
"""

from __future__ import annotations

import itertools
import json
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # the answers read rows; importing torch is left to the decoding modules
    from dipaco.serve.decode import DecodeRow, TokenScore

FINISH_STOP = "stop"  # dipaco.serve.decode's name for a row ended by its EOS or a stop string

COMPLETIONS, MODELS = "/v1/completions", "/v1/models"
MAX_LOGPROBS = 5  # OpenAI's own cap on ``logprobs``
MAX_STOP = 16  # stop strings per request (OpenAI takes 4; lm-eval tasks list more, plus the EOS string)
MAX_STOP_CHARS = 256  # characters per stop string: each is searched for after every token
DEFAULT_MAX_TOKENS = 16  # OpenAI's default ``max_tokens``
OWNER = "dipaco"


def is_openai_path(path: str) -> bool:
    """Whether an HTTP path belongs to the OpenAI API (its errors take OpenAI's shape)."""
    return path == COMPLETIONS or path == MODELS or path.startswith(MODELS + "/")


def error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    return "invalid_request_error" if status < 500 else "server_error"


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


class OpenAIError(Exception):
    """A request the completions API refuses: its status, message and the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def validation_error(errors: list[dict]) -> OpenAIError:
    """One 400 from pydantic's errors: the first few, each naming its field (a union's alternatives each
    report an error: only the first of a field is kept)."""
    seen: dict[str, str] = {}
    for err in errors:
        loc = [str(part) for part in err.get("loc", ()) if part != "body"]
        field = loc[0] if loc and not loc[0].isdigit() else ""
        if field in seen:
            continue
        message = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden":
            message = "this field is not supported by this server"
        elif field == "prompt" and len(loc) > 1:  # inside the union's alternatives, one error each: name them all
            message = "a string, a list of strings, a list of token ids or a list of lists of token ids"
        seen[field] = f"{field}: {message}" if field else message
    parts = list(seen.values())
    first = next(iter(seen), "") or None
    return OpenAIError(400, "; ".join(parts[:3]) or "invalid request", param=first)


# The fields whose null is not their default, as OpenAI's schema has it: refused (model, user), or the default
# prompt (prompts_of); every other field's null is its default.
NULL_NOT_A_DEFAULT = frozenset({"model", "prompt", "user"})


def request_model(base: Any) -> Any:
    """The pydantic model of a completions request, on ``base`` (the server's strict model: unknown fields,
    coercion, NaN and lone surrogates refused). Numbers take OpenAI's ranges and defaults; ``null`` is the
    default of every field but ``model``, ``prompt`` (:func:`prompts_of`) and ``user``."""
    from pydantic import Field, model_validator

    class StreamOptions(base):
        include_usage: bool = False  # a last chunk with no choices and the request's token counts
        include_obfuscation: bool = False  # OpenAI's padding of chunks: not done here, so only false

    class CompletionRequest(base):
        model: str
        prompt: str | list[str] | list[int] | list[list[int]] | None
        max_tokens: int | None = Field(None, ge=0, description=f"default {DEFAULT_MAX_TOKENS}; 0 with echo")
        temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 = greedy decoding")
        top_p: float = Field(1.0, gt=0.0, le=1.0)
        n: int = Field(1, ge=1)
        best_of: int | None = Field(None, ge=1)
        stop: str | list[str] | None = None
        seed: int | None = Field(None, ge=0, lt=2**63)
        stream: bool = False
        stream_options: StreamOptions | None = None
        logprobs: int | None = Field(None, ge=0)
        echo: bool = False
        # Taken at their neutral values only (check_supported): clients send them unasked.
        frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
        presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
        logit_bias: dict[str, int] = Field(default_factory=dict)
        suffix: str | None = None
        user: str = ""  # the caller's end user, for OpenAI's abuse monitoring: nothing to do with it here

        @model_validator(mode="before")
        @classmethod
        def null_is_the_default(cls, data: Any) -> Any:
            """A known field sent as null takes its default (an unknown one stays, to be refused by name)."""
            if not isinstance(data, dict):
                return data
            return {k: v for k, v in data.items()
                    if v is not None or k in NULL_NOT_A_DEFAULT or k not in cls.model_fields}

    return CompletionRequest


# --- reading a request -----------------------------------------------------------------------------
Prompt = str | list[int]


def prompts_of(prompt: Any, max_prompts: int, eos_token_id: int) -> list[Prompt]:
    """The request's prompts, one per choice: a string, or a list of token ids. A null prompt is OpenAI's
    default, its document separator: here the EOS token that ends every training document."""
    if prompt is None:
        prompts: list[Prompt] = [[eos_token_id]]
    elif isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    else:
        prompts = list(prompt)
    if not prompts:
        raise OpenAIError(400, "prompt: the list is empty", param="prompt")
    if len(prompts) > max_prompts:
        raise OpenAIError(400, f"prompt: {len(prompts)} prompts, above this server's limit of {max_prompts} per request",
                          param="prompt")
    for i, p in enumerate(prompts):
        if not p:
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            raise OpenAIError(400, f"{where}: empty (no tokens to continue)", param="prompt")
    return prompts


def check_token_ids(prompt: list[int], vocab_size: int, where: str) -> None:
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise OpenAIError(400, f"{where}: token id {bad} is outside the vocabulary (0..{vocab_size - 1})", param="prompt")


def stops_of(stop: str | list[str] | None) -> tuple[str, ...]:
    strings = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
    if len(strings) > MAX_STOP:
        raise OpenAIError(400, f"stop: {len(strings)} strings, above this server's limit of {MAX_STOP}", param="stop")
    for s in strings:
        if not s or len(s) > MAX_STOP_CHARS:
            raise OpenAIError(400, f"stop: every string must have 1..{MAX_STOP_CHARS} characters", param="stop")
    return tuple(strings)


def check_supported(req: Any, model: str, n_prompts: int) -> None:
    """Refuses what this server does not do, each with its field named."""
    if req.model != model:
        raise OpenAIError(404, f"model: {req.model!r} is not served here; this server serves {model!r} (GET /v1/models)",
                          param="model", code="model_not_found")
    if req.n != 1:
        raise OpenAIError(400, f"n: only n=1 is supported (one completion per prompt), got {req.n}", param="n")
    if req.best_of not in (None, 1):
        raise OpenAIError(400, f"best_of: only best_of=1 is supported, got {req.best_of}", param="best_of")
    check_neutral(req)
    if req.logprobs is not None and req.logprobs > MAX_LOGPROBS:
        raise OpenAIError(400, f"logprobs: at most {MAX_LOGPROBS}, got {req.logprobs}", param="logprobs")
    if req.max_tokens == 0 and not (req.echo and req.logprobs is not None):
        raise OpenAIError(400, "max_tokens: 0 is only supported with echo and logprobs (scoring the prompt)",
                          param="max_tokens")
    if req.stream and (req.echo or req.logprobs is not None):
        raise OpenAIError(400, "stream: not supported together with echo or logprobs", param="stream")
    if req.stream_options is not None and not req.stream:
        raise OpenAIError(400, "stream_options: only with stream: true", param="stream_options")
    if req.stream and n_prompts > 1:
        raise OpenAIError(400, "stream: supported for one prompt per request", param="stream")


def check_neutral(req: Any) -> None:
    """Refuses a value of a control this server does not apply, unless it is the neutral one (which changes
    nothing, so the completion is what the client asked for)."""
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(req, name)
        if value != 0:
            raise OpenAIError(400, f"{name}: only 0 is supported (this server applies no penalties), got {value:g}",
                              param=name)
    if any(bias != 0 for bias in req.logit_bias.values()):
        raise OpenAIError(400, "logit_bias: only {} (or biases of 0) is supported: this server does not bias tokens",
                          param="logit_bias")
    if req.suffix:
        raise OpenAIError(400, "suffix: only null or \"\" is supported: this server does not insert text before a "
                               "suffix", param="suffix")
    if req.stream_options is not None and req.stream_options.include_obfuscation:
        raise OpenAIError(400, "stream_options: include_obfuscation is not supported (this server does not pad its "
                               "events): send false", param="stream_options")


# --- writing the answer ----------------------------------------------------------------------------
def completion_id() -> str:
    return "cmpl-" + secrets.token_hex(12)


def model_card(model: str, created: int) -> dict:
    return {"id": model, "object": "model", "created": created, "owned_by": OWNER}


def cut_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """``text`` up to the first stop string in it (excluded), and whether one was found."""
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(cuts)], True) if cuts else (text, False)


@dataclass(frozen=True)
class Decoded:
    """A finished choice: its index, the row that decoded it and its path."""

    index: int
    row: DecodeRow
    path: int


class Detokenizer(Protocol):
    """What the answer needs from the pipeline's tokenizer (``Pipeline`` has these methods)."""

    def decode(self, ids: list[int]) -> str: ...

    def token_texts(self, ids: list[int]) -> list[str]: ...

    def text_offsets(self, ids: list[int]) -> list[int]: ...


def finish_reason(row: DecodeRow, stopped: bool) -> str:
    return "stop" if stopped or row.finish_reason == FINISH_STOP else "length"


def _top(tokenizer: Detokenizer, score: TokenScore, token: int) -> dict[str, float]:
    """The alternatives and the token itself, by text (tokens of one text keep the best log-probability)."""
    pairs = [*score.top, (token, score.logprob)]
    texts = tokenizer.token_texts([t for t, _ in pairs])
    top: dict[str, float] = {}
    for text, (_, lp) in zip(texts, pairs):
        top[text] = max(lp, top.get(text, lp))
    return top


@dataclass(frozen=True)
class Spelling:
    """How an answer spells tokens: ``tokenizer``'s decoding, which leaves the ``special`` ids out, except in an
    echoed prompt, whose special tokens are spelt out: a token-id prompt may hold them (lm-eval's contexts may
    start with the EOS), and its echoed text must be its tokens' texts one after the other, at their offsets."""

    tokenizer: Detokenizer
    special: frozenset[int]

    def _runs(self, ids: list[int]) -> list[tuple[bool, list[int]]]:
        return [(is_special, list(run)) for is_special, run in itertools.groupby(ids, lambda t: t in self.special)]

    def _run_texts(self, is_special: bool, run: list[int]) -> list[str]:
        """A special token's own text each, or the run's one decoding (a character may span its tokens)."""
        return self.tokenizer.token_texts(run) if is_special else [self.tokenizer.decode(run)]

    def prompt_text(self, ids: list[int]) -> str:
        return "".join(text for is_special, run in self._runs(ids) for text in self._run_texts(is_special, run))

    def prompt_offsets(self, ids: list[int]) -> list[int]:
        """Where each of the prompt's tokens starts in :meth:`prompt_text`."""
        offsets: list[int] = []
        start = 0
        for is_special, run in self._runs(ids):
            texts = self._run_texts(is_special, run)
            if is_special:
                for text in texts:
                    offsets.append(start)
                    start += len(text)
            else:
                offsets.extend(start + o for o in self.tokenizer.text_offsets(run))
                start += len(texts[0])
        return offsets


def logprobs_of(spelling: Spelling, d: Decoded, echoed: str | None, cut: int | None) -> dict:
    """OpenAI's ``logprobs`` object of a choice: the echoed prompt's tokens (the first without a score; ``echoed``:
    the prompt's text, None without echo), then the completion's after it; ``cut``: where a stop string ended the
    text (the tokens from there are left out)."""
    row = d.row
    prompt = [] if echoed is None else row.prompt_ids
    prompt_offsets = [] if echoed is None else spelling.prompt_offsets(prompt)
    shift = 0 if echoed is None else len(echoed)
    completion_offsets = [shift + o for o in spelling.tokenizer.text_offsets(row.tokens)]
    scores: list[TokenScore | None] = ([] if echoed is None else [None, *row.prompt_scores]) + list(row.token_scores)
    if cut is not None:
        completion_offsets = [o for o in completion_offsets if o < cut]
    ids = prompt + row.tokens[: len(completion_offsets)]
    scores = scores[: len(ids)]
    tokenizer = spelling.tokenizer
    return {"tokens": tokenizer.token_texts(ids),
            "token_logprobs": [None if s is None else s.logprob for s in scores],
            "top_logprobs": [None if s is None else _top(tokenizer, s, t) for s, t in zip(scores, ids)],
            "text_offset": prompt_offsets + completion_offsets}


def choice(spelling: Spelling, d: Decoded, echo: bool, logprobs: int | None, stops: tuple[str, ...]) -> dict:
    completion, stopped = cut_at_stop(spelling.tokenizer.decode(d.row.tokens), stops)
    # With echo, the text (and the offsets) are those of the tokens: a token-id prompt has no other spelling.
    echoed = spelling.prompt_text(d.row.prompt_ids) if echo else None
    text = completion if echoed is None else echoed + completion
    cut = len(text) if stopped else None
    return {"index": d.index, "text": text,
            "logprobs": None if logprobs is None else logprobs_of(spelling, d, echoed, cut),
            "finish_reason": finish_reason(d.row, stopped), "path": d.path}


def completion(spelling: Spelling, decoded: list[Decoded], model: str, echo: bool, logprobs: int | None,
               stops: tuple[str, ...]) -> dict:
    """The ``text_completion`` object of finished choices."""
    prompt_tokens = sum(len(d.row.prompt_ids) for d in decoded)
    completion_tokens = sum(len(d.row.tokens) for d in decoded)
    return {"id": completion_id(), "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [choice(spelling, d, echo, logprobs, stops) for d in decoded],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


# --- streaming -------------------------------------------------------------------------------------
def sse(data: dict | str) -> bytes:
    """One server-sent event (``data: ...`` and a blank line)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


DONE = sse("[DONE]")


class TextStream:
    """The text deltas of a streamed choice: sends only what is final. It holds back a trailing U+FFFD
    (a character whose bytes are still arriving) and any tail that may begin a stop string, and ends the
    text before a stop string."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.sent = 0

    def _held(self, text: str) -> int:
        held = len(text) - len(text.rstrip("\ufffd"))
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    held = max(held, n)
                    break
        return held

    def delta(self, text: str, final: bool = False) -> tuple[str, bool]:
        """The text not sent yet of the completion so far, ``text``; and whether a stop string ended it."""
        text, stopped = cut_at_stop(text, self.stops)
        if not (final or stopped):
            text = text[: len(text) - self._held(text)]
        out = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return out, stopped


def chunk(cid: str, created: int, model: str, text: str, finish: str | None, path: int) -> dict:
    return {"id": cid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "path": path}]}


def usage_chunk(cid: str, created: int, model: str, row: DecodeRow) -> dict:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, the token counts."""
    prompt, completion = len(row.prompt_ids), len(row.tokens)
    return {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": [],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}
