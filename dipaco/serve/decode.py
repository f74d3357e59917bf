"""Decoding several prompts of one path together: left-padded prefill, then one forward per step with
the KV cache, each row choosing its own tokens and stopping on its own.

    rows = [DecodeRow(ids, max_new_tokens=32, chooser=greedy_chooser()), ...]
    decode_batch(model, rows, eos_token_id, pad_token_id)     # every row ends with .tokens, .finish_reason

This is the only decoding loop of dipaco: ``Pipeline.generate`` runs it on a batch of one row, and
``dipaco serve`` on the batches its :class:`~dipaco.serve.batching.PathBatcher` gathers (``--max-batch 1``
is the unbatched server).

How a row is computed, and why it matches HF ``generate``:

- Prefill: the prompts are left-padded to the longest (``pad_token_id``, attention mask 0) so that every
  row's last prompt token sits in the last column; each row's ``position_ids`` count its own tokens
  from 0 (padding gets position 0, as ``generate`` gives it). A batch without padding (one row, or
  prompts of one length) passes no mask, as ``generate`` does when its mask is all ones: a lone row
  takes exactly ``generate``'s code path and numerics.
- Steps: one token per running row, the cache grown by one column, the mask by a 1, each position by 1.
- Logits are the last position's (``logits_to_keep=1``, as ``generate``), copied to float32.
- Token choice is per row. Greedy rows (temperature 0) take the argmax; sampling rows run their own
  processors (temperature, top-k, top-p) and draw from their own ``torch.Generator``, seeded per request,
  on their own row of logits only. A row's draws therefore do not depend on what else is in the batch:
  a seeded request samples the same tokens batched or alone as long as its logits are the same.
- A row ends at its EOS (``stop``), at its own ``max_new_tokens`` (``length``), when its own ``stop``
  check says so (a stop string: ``stop``), or when its client has gone (``cancelled``). It is reported at
  once (``on_finish``) and dropped from the cache (``batch_select_indices``), so the others continue without
  it and it never waits for the longest row.

- Log-probabilities (the completions API's ``logprobs`` / ``echo``): a row with ``logprobs`` set records the
  model's log-probability of each token it takes and of its ``logprobs`` most likely alternatives, from the
  raw logits (before temperature or top-k/top-p). A row with ``prompt_logprobs`` records them for its prompt
  tokens too: its prefill keeps every position's logits, not only the last. Such a row may ask for no new
  tokens (``max_new_tokens=0``): it ends after the prefill.

What batching can change: a padded row attends over more (masked) columns and its matrix products run
at another batch size, so its logits can differ from the lone row's in the last bits of float32; a
greedy token flips only where two logits tie to that precision (docs/results.md measures how often).
"""

from __future__ import annotations

import inspect
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import DynamicCache, LlamaForCausalLM
from transformers.generation import (
    LogitsProcessor,
    LogitsProcessorList,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from dipaco.errors import DipacoError

# transformers 5 renamed forward's `past_key_values` to `cache` (the old name warns until 5.40); 4.x knows
# only the old one. Resolved once from the signature, not from the version string.
CACHE_KWARG = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"

FINISH_STOP, FINISH_LENGTH, FINISH_CANCELLED = "stop", "length", "cancelled"


# --- sampling that does not touch the global RNG ---------------------------------------------------
class SeededSampler(LogitsProcessor):
    """Draws the next token from softmax(scores) with a private generator and leaves only that token.

    Run last, it turns the argmax that follows into multinomial sampling (after the temperature / top-k /
    top-p warpers before it) whose randomness belongs to one request: torch's process-wide generator is
    shared by concurrent requests, so a seed would not reproduce a result.
    """

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(scores.double(), dim=-1)
        token = torch.multinomial(probs, num_samples=1, generator=self.generator)
        out = torch.full_like(scores, -math.inf)
        return out.scatter_(1, token, 0.0)


class SafeTemperature(LogitsProcessor):
    """scores / T, computed as (scores - max) / T in float64: the best token scores 0, the others a
    non-positive number that may round to -inf but never to NaN, for any T > 0 down to the smallest
    positive double (a tiny T is then greedy decoding, its limit). Dividing the raw scores (as
    ``TemperatureLogitsWarper`` does) overflows to inf - inf = NaN below T ~ 1e-37."""

    def __init__(self, temperature: float) -> None:
        if not (temperature > 0 and math.isfinite(temperature)):
            raise DipacoError(f"temperature must be a finite number > 0 to sample, got {temperature}")
        self.temperature = temperature

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.double()
        return (scores - scores.max(dim=-1, keepdim=True).values) / self.temperature


def sampling_processors(temperature: float, top_p: float, top_k: int, seed: int, device) -> LogitsProcessorList:
    processors: list[LogitsProcessor] = [SafeTemperature(temperature)]
    if top_k > 0:
        processors.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p))
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    processors.append(SeededSampler(generator))
    return LogitsProcessorList(processors)


# --- one request's decoding state ------------------------------------------------------------------
@dataclass(frozen=True)
class TokenScore:
    """A token's log-probability under the model and its ``k`` most likely alternatives (token id, log-prob)."""

    logprob: float
    top: list[tuple[int, float]]


@dataclass(eq=False)
class DecodeRow:
    """One prompt in a batch: its tokens, its own stopping rule and its own token choice.

    ``processors`` is None for greedy decoding; otherwise the row's sampling processors
    (:func:`sampling_processors`), whose last one draws the token. ``logprobs``: record a
    :class:`TokenScore` (with that many alternatives) of every token taken, and of every prompt token
    after the first with ``prompt_logprobs``. ``stop(row)``, asked after each token, ends the row when true.
    """

    prompt_ids: list[int]
    max_new_tokens: int
    processors: LogitsProcessorList | None = None
    path: int = 0  # the path it decodes on: a module-batched decoder runs each row on its own path's modules
    min_new_tokens: int = 0  # EOS is suppressed until this many tokens exist (benchmarks force lengths)
    on_finish: Callable[[DecodeRow], None] | None = None  # called once, from the decoding thread, as the row ends
    logprobs: int | None = None  # None: no log-probabilities; k >= 0: each token's and its k best alternatives'
    prompt_logprobs: bool = False  # the prompt tokens' log-probabilities too (the prefill keeps every position)
    stop: Callable[[DecodeRow], bool] | None = None  # a stop string has appeared (asked after every token)
    on_token: Callable[[DecodeRow], None] | None = None  # after each token taken, from the decoding thread (streaming)
    tokens: list[int] = field(default_factory=list)
    token_scores: list[TokenScore] = field(default_factory=list)  # one per token taken, with ``logprobs``
    prompt_scores: list[TokenScore] = field(default_factory=list)  # prompt tokens 1..n-1, with ``prompt_logprobs``
    finish_reason: str | None = None
    batch_size: int = 0  # rows prefilled together with this one (itself included)
    _cancelled: threading.Event = field(default_factory=threading.Event, repr=False)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise DipacoError("the prompt is empty: it has no tokens to continue")
        if self.prompt_logprobs and self.logprobs is None:
            raise DipacoError("prompt_logprobs needs logprobs (how many alternatives to record)")
        least = 0 if self.prompt_logprobs else 1  # scoring the prompt alone is a whole answer
        if self.max_new_tokens < least:
            raise DipacoError(f"max_new_tokens must be >= {least}, got {self.max_new_tokens}")

    def cancel(self) -> None:
        """The client is gone: the row stops at the next step (or never starts)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def finish(self, reason: str) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            # Dropped once called: the batcher's callback holds the request's ticket, which holds this row; kept,
            # that cycle left every answered request (about 45 objects) to the cyclic collector, whose full
            # passes paused the server (docs/notes/2026-11-27-serving-memory.md).
            on_finish, self.on_finish = self.on_finish, None
            if on_finish is not None:
                on_finish(self)


# --- the loop ---------------------------------------------------------------------------------------
Admit = Callable[[int], list[DecodeRow]]  # rows decoding now -> rows to join them
OnStep = Callable[[int], None]  # the rows of each forward pass


class KVState(Protocol):
    """The KV caches of a set of rows (row i of every tensor is row i of the batch) and the forward pass over them.

    Every row's cache columns are right-aligned: a row's latest token sits in the last column, shorter rows are
    left-padded (attention mask 0). ``forward`` appends the columns of ``input_ids`` to every row's cache."""

    def forward(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, keep: int) -> torch.Tensor:
        """float32 logits [B, keep, V] of each row's last ``keep`` positions (0: all); ``mask`` [B, T] covers the
        cache's columns and the new ones, ``positions`` [B, q] are the new tokens' positions."""
        ...

    def select(self, index: torch.Tensor) -> None:
        """Keeps only the rows ``index`` (ascending), in that order."""
        ...

    def cut_left(self, columns: int) -> None:
        """Drops the first ``columns`` columns of every row (padding in every row)."""
        ...

    def append(self, other: Any, width: int) -> None:
        """Puts ``other``'s rows (a state of the same kind) after these, both left-padded to ``width`` columns."""
        ...

    @property
    def joinable(self) -> bool:
        """Whether rows can be cut and joined (transformers 5's cache layout); else the batch only shrinks by masking."""
        ...


class Decoder(Protocol):
    """What decodes rows: the device and a fresh :class:`KVState` for a set of rows."""

    device: torch.device

    def new_state(self, rows: Sequence[DecodeRow]) -> KVState: ...


class PathDecoder:
    """One composed path, an HF ``LlamaForCausalLM``: every row runs the whole model (a per-path batch)."""

    def __init__(self, model) -> None:
        self.model = model
        self.device = next(model.parameters()).device

    def new_state(self, rows: Sequence[DecodeRow]) -> PathState:
        return PathState(self.model, new_cache(self.model))


@dataclass
class PathState:
    """A per-path batch's state: the model's own cache, its forward pass as ``generate`` calls it."""

    model: Any
    cache: Any

    def forward(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, keep: int) -> torch.Tensor:
        return _logits(self.model, input_ids, mask, positions, self.cache, keep)

    def select(self, index: torch.Tensor) -> None:
        self.cache.batch_select_indices(index)

    def cut_left(self, columns: int) -> None:
        cut_cache_left(self.cache, columns)

    def append(self, other: PathState, width: int) -> None:
        join_caches(self.cache, other.cache, width)

    @property
    def joinable(self) -> bool:
        return _cache_tensors(self.cache)


def cut_cache_left(cache, columns: int) -> None:
    """Drops the first ``columns`` columns of every layer of a transformers 5 cache."""
    for layer in cache.layers:
        layer.keys = layer.keys[..., columns:, :]
        layer.values = layer.values[..., columns:, :]


def join_caches(cache, other, width: int) -> None:
    """``other``'s rows after ``cache``'s, every layer of both left-padded to ``width`` columns."""
    for mine, theirs in zip(cache.layers, other.layers):
        mine.keys = torch.cat([_left_pad(mine.keys, width, 2), _left_pad(theirs.keys, width, 2)])
        mine.values = torch.cat([_left_pad(mine.values, width, 2), _left_pad(theirs.values, width, 2)])


def attention_mask_or_none(mask: torch.Tensor) -> torch.Tensor | None:
    """An all-ones mask as None, as ``generate`` passes it: a batch without padding takes the unmasked kernels."""
    return None if bool(mask.all()) else mask


def as_decoder(model) -> Decoder:
    """``model`` itself when it is a :class:`Decoder`, else a :class:`PathDecoder` of the HF model."""
    return model if hasattr(model, "new_state") else PathDecoder(model)


@dataclass
class _Running:
    """The rows decoding together and their tensors, aligned (row i is tensor row i)."""

    rows: list[DecodeRow]
    state: KVState
    mask: torch.Tensor  # [B, T] 1 for a token, 0 for left padding; T = the cache's columns
    positions: torch.Tensor  # [B] the position of each row's last token
    logits: torch.Tensor  # [B, V] each row's next-token logits

    def keep(self, indices: list[int]) -> None:
        """Drops every row not in ``indices`` from the tensors and the cache."""
        self.rows = [self.rows[i] for i in indices]
        if not indices:
            return
        index = torch.tensor(indices, dtype=torch.long, device=self.mask.device)
        self.state.select(index)
        self.mask = self.mask[index]
        self.positions = self.positions[index]
        # Columns that are padding in every remaining row (their longer prompts have ended) carry nothing:
        # cut them, so no row attends over dead columns and rows of one length left need no mask.
        pad_columns = int((self.mask.sum(dim=0) == 0).long().cumprod(dim=0).sum())
        if pad_columns and self.state.joinable:
            self.state.cut_left(pad_columns)
            self.mask = self.mask[:, pad_columns:]

    def join(self, other: _Running) -> None:
        """Appends ``other``'s rows (prefilled apart): both caches and masks left-padded to the wider."""
        if not self.rows:
            self.rows, self.state, self.mask, self.positions = other.rows, other.state, other.mask, other.positions
            return
        width = max(self.mask.shape[1], other.mask.shape[1])
        self.state.append(other.state, width)
        self.mask = torch.cat([_left_pad(self.mask, width, 1), _left_pad(other.mask, width, 1)])
        self.positions = torch.cat([self.positions, other.positions])
        self.rows = self.rows + other.rows


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """``t`` with zeros prepended along ``dim`` up to ``width`` (masked columns: their values never count)."""
    missing = width - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _cache_tensors(cache) -> bool:
    """Whether the cache holds each layer's keys and values as tensors it lets us cut and join (a
    transformers 5 DynamicCache); without, padding columns stay (masked) and no row joins a running batch."""
    layers = getattr(cache, "layers", None) or []
    return bool(layers) and all(isinstance(getattr(layer, "keys", None), torch.Tensor) for layer in layers)


def new_cache(model) -> DynamicCache:
    try:
        return DynamicCache(config=model.config)
    except TypeError:  # transformers 4.x: a DynamicCache takes no config
        return DynamicCache()


def _logits(model, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache,
            keep: int = 1) -> torch.Tensor:
    """float32 logits [B, keep, V] of each row's last ``keep`` positions (0: all of them). An all-ones mask
    is passed as None, as ``generate`` does."""
    out = model(input_ids=input_ids, attention_mask=attention_mask_or_none(mask), position_ids=positions, use_cache=True,
                logits_to_keep=keep, **{CACHE_KWARG: cache})
    return out.logits.to(dtype=torch.float32, copy=True)


def token_scores(logprobs: torch.Tensor, tokens: Sequence[int], k: int) -> list[TokenScore]:
    """The :class:`TokenScore` of ``tokens[i]`` under the log-probabilities ``logprobs[i]`` ([N, V]), with
    its ``k`` best alternatives."""
    if not len(tokens):
        return []
    index = torch.tensor(list(tokens), dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(1, index[:, None])[:, 0].tolist()
    if k <= 0:
        return [TokenScore(lp, []) for lp in chosen]
    values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return [TokenScore(lp, list(zip(i, v))) for lp, i, v in zip(chosen, ids.tolist(), values.tolist())]


def left_padded(rows: Sequence[DecodeRow], pad_token_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, attention mask and position ids [B, L] of the prompts, left-padded to the longest."""
    width = max(len(r.prompt_ids) for r in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row.prompt_ids):] = torch.tensor(row.prompt_ids, dtype=torch.long)
        mask[i, width - len(row.prompt_ids):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # padding at 0, as generate's masked_fill
    return ids.to(device), mask.to(device), positions.to(device)


def _score_prompts(rows: Sequence[DecodeRow], logits: torch.Tensor) -> None:
    """Records the prompt tokens' scores of the rows that ask for them, from the prefill's logits [B, W, V]
    of the left-padded prompts (row i's prompt fills its last ``len(prompt)`` columns)."""
    width = logits.shape[1]
    for i, row in enumerate(rows):
        if row.prompt_logprobs:
            n = len(row.prompt_ids)
            # The logits at column c predict the token at c + 1: prompt tokens 1..n-1.
            logprobs = torch.log_softmax(logits[i, width - n:width - 1], dim=-1)
            row.prompt_scores = token_scores(logprobs, row.prompt_ids[1:], row.logprobs or 0)


def _choose(rows: list[DecodeRow], logits: torch.Tensor, eos_token_id: int) -> list[int]:
    """Each row's next token: greedy rows by one argmax over the batch (the same per row), sampling rows
    by their own processors on their own row."""
    suppress = [i for i, r in enumerate(rows) if len(r.tokens) < r.min_new_tokens]
    if suppress:
        logits[suppress, eos_token_id] = -math.inf
    tokens = torch.argmax(logits, dim=-1).tolist()
    for i, row in enumerate(rows):
        if row.processors is not None:
            prefix = torch.tensor([row.prompt_ids + row.tokens], dtype=torch.long, device=logits.device)
            tokens[i] = int(torch.argmax(row.processors(prefix, logits[i:i + 1]), dim=-1))
    return tokens


def _prefill(decoder: Decoder, rows: list[DecodeRow], pad_token_id: int, on_step: OnStep | None) -> _Running:
    """One forward over the left-padded prompts of ``rows``, into a cache of their own."""
    ids, mask, positions = left_padded(rows, pad_token_id, decoder.device)
    state = decoder.new_state(rows)
    if on_step is not None:
        on_step(len(rows))
    # Every position's logits only when a row scores its prompt (B x W x V floats); else the last one's.
    every = any(row.prompt_logprobs for row in rows)
    logits = state.forward(ids, mask, positions, 0 if every else 1)
    if every:
        _score_prompts(rows, logits)
    running = _Running(list(rows), state, mask, positions[:, -1], logits[:, -1].contiguous())
    going = [i for i, row in enumerate(rows) if row.max_new_tokens > 0]
    if len(going) < len(rows):  # rows that only score their prompt end here
        for row in rows:
            if row.max_new_tokens == 0:
                row.batch_size = len(rows)
                row.finish(FINISH_LENGTH)
        running.keep(going)
        running.logits = running.logits[going]
    return running


def _step_logits(running: _Running, step_ids: torch.Tensor) -> torch.Tensor:
    """One decoding step: each running row's next-token logits after its token in ``step_ids`` [B, 1]."""
    return running.state.forward(step_ids, running.mask, running.positions[:, None], 1)[:, -1]


def _take_tokens(running: _Running, eos_token_id: int) -> list[int]:
    """Chooses every row's next token, finishes the rows it ends, keeps the others; their tokens, in order."""
    if not running.rows:
        return []
    scored = [i for i, row in enumerate(running.rows) if row.logprobs is not None]
    # From the raw logits, before _choose suppresses an early EOS in place: the model's own probabilities.
    logprobs = torch.log_softmax(running.logits[scored], dim=-1)
    tokens = _choose(running.rows, running.logits, eos_token_id)
    for j, i in enumerate(scored):
        row = running.rows[i]
        row.token_scores.extend(token_scores(logprobs[j:j + 1], [tokens[i]], row.logprobs or 0))
    keep = []
    for i, (row, token) in enumerate(zip(running.rows, tokens)):
        row.tokens.append(token)
        if row.on_token is not None:
            row.on_token(row)
        if token == eos_token_id or (row.stop is not None and row.stop(row)):
            row.finish(FINISH_STOP)
        elif len(row.tokens) >= row.max_new_tokens:
            row.finish(FINISH_LENGTH)
        elif row.cancelled:
            row.finish(FINISH_CANCELLED)
        else:
            keep.append(i)
    if len(keep) < len(running.rows):
        running.keep(keep)
    return [tokens[i] for i in keep]


def _live(rows: Sequence[DecodeRow]) -> list[DecodeRow]:
    """The rows whose clients are still there; the others are finished as cancelled."""
    live = []
    for row in rows:
        if row.cancelled:
            row.finish(FINISH_CANCELLED)
        else:
            live.append(row)
    return live


@torch.inference_mode()
def decode_batch(model, rows: Sequence[DecodeRow], eos_token_id: int, pad_token_id: int,
                 admit: Admit | None = None, on_step: OnStep | None = None) -> None:
    """Decodes ``rows`` together until each has ended; every row is finished (``on_finish``) as it ends.

    ``admit(n)``, asked between steps with the number of rows decoding, returns rows to join them: they
    are prefilled on their own (as a batch would be), take their first token, and decode with the others
    from the next step. ``on_step(n)`` is told the rows of every forward pass. A row already cancelled
    is finished without running. An exception leaves the rows it interrupted unfinished: the caller
    reports it to them.
    """
    todo = _live(rows)
    if not todo:
        return
    decoder = as_decoder(model)
    running = _prefill(decoder, todo, pad_token_id, on_step)
    for row in todo:
        row.batch_size = len(todo)
    if admit is not None and not running.state.joinable:
        admit = None
    next_tokens = _take_tokens(running, eos_token_id)
    while True:
        joining = _live(admit(len(running.rows))) if admit is not None else []
        if joining:
            newcomers = _prefill(decoder, joining, pad_token_id, on_step)
            for row in joining:
                row.batch_size = len(running.rows) + len(joining)
            newcomer_tokens = _take_tokens(newcomers, eos_token_id)
            if newcomers.rows:
                running.join(newcomers)
                next_tokens = next_tokens + newcomer_tokens
        if not running.rows:
            return
        running.mask = torch.cat([running.mask, running.mask.new_ones((len(running.rows), 1))], dim=1)
        running.positions = running.positions + 1
        if on_step is not None:
            on_step(len(running.rows))
        step_ids = torch.tensor(next_tokens, dtype=torch.long, device=running.mask.device)[:, None]
        running.logits = _step_logits(running, step_ids)
        next_tokens = _take_tokens(running, eos_token_id)
