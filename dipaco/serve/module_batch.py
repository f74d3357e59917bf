"""Module-batched decoding: rows of different paths decode together, level by level, each module once per pass.

A path is one module per part (:mod:`dipaco.model.topology`), and in a K x K grid each module of a level
is on K paths. Batching whole paths (:class:`dipaco.serve.decode.PathDecoder`) puts two requests in one
forward pass only when the router sent them to the same path, which at 16 or 256 paths is rare. Here a
batch holds rows of any paths:

- embedding: each embedding module embeds the rows whose path goes through it (one call when it is shared);
- each level: every module of the level runs its decoder blocks once, on the rows whose path goes through
  it. A level whose rows all go through one module runs that module's transformers blocks on the batch; a
  level whose rows spread over several runs them as one (:class:`dipaco.serve.grouped_level.GroupedLevel`):
  the rows laid out module by module, each projection one batched matmul over the modules' stacked weights;
- head: the final norm and the LM head of each row's path, grouped by module the same way (a tied head is
  the row's embedding matrix, so with a path-owned embedding it is grouped by embedding module).

A level's rows at a module are about N / K of the batch's N, where per-path batching gives N / P.

The one-module blocks are transformers' own (``LlamaDecoderLayer``, ``LlamaRMSNorm``, ``LlamaRotaryEmbedding``,
the causal mask of ``transformers.masking_utils``), called as ``LlamaModel.forward`` calls them, so a lone row's
computation is the one its composed path (an ordinary ``LlamaForCausalLM``) runs. Every weight is a view of the
bank's on its device (the bank first moves each level's modules into one tensor, ``ModuleBank.colocate``, so that
a level's stacked weights are views too), but on a CPU, where the levels' stacked projections are held once more
in the layout its batched matmul runs fastest (:func:`dipaco.serve.grouped_level.kernel_layout`): serving every
path costs the bank's memory (the levels' twice on a CPU), not one model per path.

KV caches: each level keeps one cache of its layers for the batch's rows, in batch order, every row
right-aligned to the batch's width (shorter rows left-padded and masked, as in a per-path batch). A row that
leaves is selected out of the caches; rows that join are prefilled apart and appended, both sides left-padded to
the wider, exactly as :mod:`dipaco.serve.decode` does for one cache.

Exactness: a lone row's logits are its path's, bitwise. In a batch they can differ in the last bits of float32
where padding, the batch size or a batched matmul changes a kernel's summation order, as per-path batching's
can (docs/results.md measures how often a token changes: the exactness tests require none on 200 prompts).
"""

from __future__ import annotations

import inspect
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from dipaco.errors import DipacoError
from dipaco.model.bank import ModuleBank
from dipaco.model.topology import EMBEDDING, HEAD, Topology
from dipaco.serve.decode import CACHE_KWARG, DecodeRow, attention_mask_or_none, cut_cache_left, join_caches
from dipaco.serve.grouped_level import GroupedLevel, GroupLayout, StackedBlock

try:
    from transformers.masking_utils import create_causal_mask
except ImportError:  # transformers 4.x builds its masks inside LlamaModel.forward
    create_causal_mask = None

# transformers renamed create_causal_mask's `past_key_values` to `cache` as it did forward's (decode.CACHE_KWARG)
MASK_CACHE_KWARG = ("cache" if create_causal_mask is not None and "cache" in inspect.signature(create_causal_mask).parameters
                    else "past_key_values")


@dataclass
class ModuleBatchStats:
    """What the passes did: the rows each level module ran on, and where the time went (seconds)."""

    passes: int = 0
    module_calls: int = 0  # level modules run, summed over passes
    module_rows: int = 0  # rows those calls ran on
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # embed, mask, layout, blocks, head

    def rows_per_module(self) -> float:
        return self.module_rows / self.module_calls if self.module_calls else 0.0

    def as_dict(self) -> dict:
        return {"passes": self.passes, "module_calls": self.module_calls, "rows_per_module": self.rows_per_module(),
                "seconds": dict(self.seconds)}


class ModuleBatchedDecoder:
    """Every module of a bank once, as transformers blocks; a :class:`dipaco.serve.decode.Decoder` whose rows
    may be on any paths (``DecodeRow.path``)."""

    def __init__(self, bank: ModuleBank, config: LlamaConfig, device: torch.device | str = "cpu") -> None:
        if create_causal_mask is None:
            raise DipacoError("module-batched decoding needs transformers >= 5 (its masking_utils); "
                              "serve with --batching path")
        self.topology: Topology = bank.topology
        self.config = config
        self.device = torch.device(device)
        self.tied = bool(config.tie_word_embeddings)
        missing = [bank.module_name(m) for m in range(len(self.topology.modules)) if not bank.holds(m)]
        if missing:
            raise DipacoError(f"the bank does not hold every module: {missing[:3]}")
        for part in self.topology.parts:  # a level's modules in one tensor: its stacked weights are views of it
            if part.kind not in (EMBEDDING, HEAD) and part.num_modules > 1 and bank.device == self.device:
                bank.colocate([m.id for m in self.topology.modules if m.part.name == part.name])
        tensors = bank.state_dict()  # views of the flat vectors
        self.parts = self.topology.parts
        self.embeddings: list[nn.Embedding] = []
        self.levels: list[GroupedLevel] = []  # per level part: its modules' blocks
        self.norms: list[LlamaRMSNorm] = []
        self.heads: list[torch.Tensor | None] = []  # untied: each head module's matrix
        for part in self.parts:
            states = [{k.split("/", 1)[1]: self._on_device(v) for k, v in tensors.items() if k.startswith(f"{part.name}.{i}/")}
                      for i in range(part.num_modules)]
            if part.kind == EMBEDDING:
                self.embeddings += [self._embedding(own) for own in states]
            elif part.kind == HEAD:
                self.norms += [self._norm(own) for own in states]
                self.heads += [None if self.tied else own["lm_head.weight"] for own in states]
            else:
                self.levels.append(GroupedLevel(config, states, part.layers))
        self.rotary = LlamaRotaryEmbedding(config=config).to(self.device)
        # per path: its module index in every part, in forward order
        self.path_modules = [tuple(self.topology.module_index(part, p) for part in self.parts)
                             for p in range(self.topology.num_paths)]
        self.level_parts = [i for i, part in enumerate(self.parts) if part.kind == "level"]
        self.stats = ModuleBatchStats()
        # Synchronise a CUDA device at each stage's timer: exact stage times, at the cost of overlap (benchmarks only)
        self.sync_timers = False

    # --- building the modules from the bank -------------------------------------------------------
    def _on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor.device == self.device else tensor.to(self.device)

    def _embedding(self, own: dict[str, torch.Tensor]) -> nn.Embedding:
        embedding = nn.Embedding(self.config.vocab_size, self.config.hidden_size, device="meta")
        embedding.load_state_dict({"weight": own["model.embed_tokens.weight"]}, assign=True)
        return embedding.eval()

    def _norm(self, own: dict[str, torch.Tensor]) -> LlamaRMSNorm:
        with torch.device("meta"):
            norm = LlamaRMSNorm(self.config.hidden_size, eps=self.config.rms_norm_eps)
        norm.load_state_dict({"weight": own["model.norm.weight"]}, assign=True)
        return norm.eval()

    # --- the Decoder protocol -----------------------------------------------------------------
    def new_state(self, rows: Sequence[DecodeRow]) -> ModuleBatchState:
        for row in rows:
            if not 0 <= row.path < self.topology.num_paths:
                raise DipacoError(f"path {row.path} is not a path of this bank (0..{self.topology.num_paths - 1})")
        return ModuleBatchState(self, [row.path for row in rows])

    def groups(self, paths: Sequence[int], part: int) -> list[tuple[int, torch.Tensor | None]]:
        """(module index, the batch rows through it) for the modules of part ``part`` that rows go through."""
        return group_rows([self.path_modules[path][part] for path in paths], self.device)

    def head_groups(self, paths: Sequence[int]) -> list[tuple[tuple[int, int], torch.Tensor | None]]:
        """((head module, embedding module of a tied head or 0), the batch rows using them): a tied head is the
        row's embedding matrix."""
        return group_rows([(m[-1], m[0] if self.tied else 0) for m in (self.path_modules[p] for p in paths)],
                          self.device)

    def _tick(self, stage: str, since: float) -> float:
        if self.sync_timers and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.stats.seconds[stage] += now - since
        return now


def group_rows(keys: Sequence, device: torch.device) -> list[tuple]:
    """(key, the rows with that key, ascending) for each distinct key, in key order; the rows are None when every
    row has the one key (nothing to gather)."""
    members: dict = defaultdict(list)
    for i, key in enumerate(keys):
        members[key].append(i)
    if len(members) == 1:
        return [(next(iter(members)), None)]
    return [(key, torch.tensor(rows, dtype=torch.long, device=device)) for key, rows in sorted(members.items())]


def _take(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return t if rows is None else t.index_select(0, rows)


class ModuleBatchState:
    """A running batch's KV caches under module batching: one cache per level for every row, in batch order."""

    def __init__(self, decoder: ModuleBatchedDecoder, paths: list[int]) -> None:
        self.decoder = decoder
        self.paths = paths
        self.caches = [DynamicCache() for _ in decoder.levels]
        self._groups: dict[int | str, list[tuple]] = {}  # part (or "head") -> its modules' rows, while the rows stay
        # (level, padded) -> its rows module by module and their modules' weights, while the rows stay
        self._layouts: dict[tuple[int, bool], tuple[GroupLayout, list[StackedBlock]]] = {}

    def _level_groups(self, part: int) -> list[tuple[int, torch.Tensor | None]]:
        if part not in self._groups:
            self._groups[part] = self.decoder.groups(self.paths, part)
        return self._groups[part]

    def _head_groups(self) -> list[tuple[tuple[int, int], torch.Tensor | None]]:
        if "head" not in self._groups:
            self._groups["head"] = self.decoder.head_groups(self.paths)
        return self._groups["head"]

    def _layout(self, level: int, groups: list[tuple[int, torch.Tensor | None]],
                padded: bool) -> tuple[GroupLayout, list[StackedBlock]]:
        if (level, padded) not in self._layouts:
            layout = GroupLayout.of(groups, self.decoder.device, padded)
            self._layouts[level, padded] = layout, self.decoder.levels[level].weights_for(layout)
        return self._layouts[level, padded]

    @property
    def joinable(self) -> bool:
        return True

    # --- the forward pass ---------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, keep: int) -> torch.Tensor:
        d = self.decoder
        d.stats.passes += 1
        t = time.perf_counter()
        hidden = self._embed(input_ids)
        t = d._tick("embed", t)
        position_embeddings = d.rotary(hidden, positions)
        # every level's cache holds the same positions: one mask serves them all
        causal = create_causal_mask(config=d.config, inputs_embeds=hidden, attention_mask=attention_mask_or_none(mask),
                                    position_ids=positions, **{MASK_CACHE_KWARG: self.caches[0]})
        t = d._tick("mask", t)
        for level, part in enumerate(d.level_parts):
            groups = self._level_groups(part)
            cache = self.caches[level]
            if groups[0][1] is None:  # one module: its transformers blocks, as the row's composed path runs them
                k = groups[0][0]
                for block in d.levels[level].modules[k]:
                    hidden = block(hidden, attention_mask=causal, position_ids=positions, use_cache=True,
                                   position_embeddings=position_embeddings, **{CACHE_KWARG: cache})
            else:
                layout, blocks = self._layout(level, groups, padded=input_ids.shape[1] == 1)  # a step pads, a prefill packs
                t = d._tick("layout", t)
                hidden = d.levels[level].forward(hidden, layout, blocks, cache, causal, position_embeddings)
            t = d._tick("blocks", t)
            d.stats.module_calls += len(groups)
            d.stats.module_rows += hidden.shape[0]
        logits = self._head(hidden, keep)
        d._tick("head", t)
        return logits

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        d = self.decoder
        groups = self._level_groups(0)  # the embedding part
        if groups[0][1] is None:
            return d.embeddings[groups[0][0]](input_ids)
        hidden = torch.empty(*input_ids.shape, d.config.hidden_size, device=input_ids.device,
                             dtype=d.embeddings[0].weight.dtype)
        for k, rows in groups:
            assert rows is not None  # several groups: each names its rows
            hidden[rows] = d.embeddings[k](input_ids.index_select(0, rows))
        return hidden

    def _head(self, hidden: torch.Tensor, keep: int) -> torch.Tensor:
        """float32 logits of the last ``keep`` positions (0: all), each row through its path's norm and head."""
        d = self.decoder
        logits = None
        for (h, e), rows in self._head_groups():
            x = d.norms[h](_take(hidden, rows))  # every position, as LlamaModel.forward, then the kept ones
            x = x if keep == 0 else x[:, -keep:]
            weight = d.embeddings[e].weight if d.tied else d.heads[h]
            assert weight is not None  # untied: every head module has its matrix
            chunk = nn.functional.linear(x, weight).to(dtype=torch.float32, copy=True)
            if rows is None:
                return chunk
            if logits is None:
                logits = chunk.new_empty((hidden.shape[0], *chunk.shape[1:]))
            logits.index_copy_(0, rows, chunk)
        assert logits is not None  # a batch has rows
        return logits

    # --- rows leaving and joining --------------------------------------------------------------
    def select(self, index: torch.Tensor) -> None:
        self.paths = [self.paths[i] for i in index.tolist()]
        self._groups.clear()
        self._layouts.clear()
        for cache in self.caches:
            cache.batch_select_indices(index)

    def cut_left(self, columns: int) -> None:
        for cache in self.caches:
            cut_cache_left(cache, columns)

    def append(self, other: ModuleBatchState, width: int) -> None:
        for mine, theirs in zip(self.caches, other.caches, strict=True):
            join_caches(mine, theirs, width)
        self.paths = self.paths + other.paths
        self._groups.clear()
        self._layouts.clear()
