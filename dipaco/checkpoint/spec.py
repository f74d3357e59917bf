"""The experiment spec: what a trained experiment *is*, written beside every checkpoint.

Everything after training (serving, export, evaluation) reads this file and never the training
config: it holds the model's shape, the topology, the tokenizer it was trained with, the sequence and
routing-prefix lengths, how its shards were drawn (and their sizes, so nothing derives them again),
the routing it trained on, and the precisions used. Training's build (:mod:`dipaco.build`) describes
it once from the resolved config (:func:`dipaco.checkpoint.migrate.describe_experiment`); the trainer
writes it as ``experiment.json`` into the experiment directory, which the readers read (as they read
its ``config.yaml`` before), and into every checkpoint, covered by the checkpoint's manifest, so a
checkpoint carried elsewhere still says what it is.

A run trained before the spec existed has only ``config.yaml``: the converter
(``dipaco.checkpoint.migrate.convert_experiment``, called by every CLI job that reads a trained
experiment) writes the experiment directory's ``experiment.json`` from it once.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple

from transformers import LlamaConfig

from dipaco.atomic import write_text
from dipaco.config import ModelConfig
from dipaco.errors import CheckpointError, DipacoError
from dipaco.json_text import dumps
from dipaco.model.llama import llama_config
from dipaco.model.topology import Topology

SPEC = "experiment.json"
SPEC_VERSION = 1


@dataclass(frozen=True)
class TokenizerRef:
    """The tokenizer of the run directory the experiment trained with, and the ids the model depends on."""

    dir: str  # relative to the run directory
    vocab_size: int  # len(tokenizer): the embedding's rows
    eos_token_id: int
    pad_token_id: int


@dataclass(frozen=True)
class ShardingRef:
    """How the training documents were split into the paths' shards, and how large each shard was."""

    rule: str  # train.sharding: iid | column | kmeans
    column: str  # train.shard_column (the column rule)
    seed: int  # run.seed (the iid rule draws with it)
    routing: str | None  # kmeans: the run's routing directory (relative to the run directory)
    docs: list[int] = field(default_factory=list)  # training documents whose first path is p, per path
    tokens: list[int] = field(default_factory=list)  # their tokens, per path


class Positions(NamedTuple):
    """How many positions a served request may fill (its prompt and new tokens together), and why."""

    limit: int
    source: str  # what set the limit, as the server's start-up line says it

    def check_fits(self, prompt_tokens: int, new_tokens: int, new_field: str = "max_new_tokens") -> None:
        """Refuses a prompt and new tokens that do not fit together, naming the limit and why it is that
        (``dipaco serve`` and ``dipaco generate`` say the same); ``new_field``: the caller's name of the new tokens."""
        if prompt_tokens + new_tokens > self.limit:
            raise DipacoError(f"{new_field}: the prompt's {prompt_tokens} tokens plus {new_tokens} new tokens do not "
                              f"fit the model's {self.limit} positions ({self.source})")


@dataclass(frozen=True)
class ExperimentSpec:
    """One trained experiment, as everything after training reads it."""

    name: str
    model: dict[str, Any]  # the model section (dipaco.config.ModelConfig), as trained
    topology: dict[str, Any]  # Topology.to_dict()
    tokenizer: TokenizerRef
    seq_len: int
    prefix_tokens: int
    sharding: ShardingRef
    precision: dict[str, str]  # job -> the precision setting it used: train, eval
    version: int = SPEC_VERSION

    @property
    def routed(self) -> bool:
        return self.sharding.rule == "kmeans"

    def build_topology(self) -> Topology:
        return Topology.from_dict(self.topology)

    def llama_config(self, use_cache: bool = False) -> LlamaConfig:
        """A path's HF config, exactly as training built it (``use_cache``: generation wants the KV cache)."""
        tok = self.tokenizer
        config = llama_config(ModelConfig(**self.model), tok.vocab_size, self.seq_len, tok.eos_token_id,
                              tok.pad_token_id)
        config.use_cache = use_cache
        return config

    @property
    def imported(self) -> bool:
        """Whether the run started from an open checkpoint (``model.init_from``); a spec older than the key was not."""
        return bool(self.model.get("init_from"))

    def served_positions(self) -> Positions:
        """The positions a served request may fill. An imported model keeps its own ``max_position_embeddings``:
        it was pretrained on them, and training on shorter windows after leaves them as they were. A model
        trained from scratch has ``data.seq_len``: no attention in its training spanned more, whatever
        ``model.max_positions`` says."""
        if self.imported:
            return Positions(int(self.llama_config().max_position_embeddings), "the checkpoint's max_position_embeddings")
        return Positions(self.seq_len, "data.seq_len: trained from scratch")

    def check_tokenizer(self, tokenizer: Any) -> None:
        """Refuses a tokenizer that is not the one the experiment trained with (the run's was replaced)."""
        got = (len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
        want = (self.tokenizer.vocab_size, self.tokenizer.eos_token_id, self.tokenizer.pad_token_id)
        if got != want:
            raise DipacoError(f"experiment {self.name} was trained with a tokenizer of (vocab, eos, pad) = {want}; "
                              f"the run's tokenizer has {got}: it was replaced after training")

    def to_json(self) -> str:
        return dumps(asdict(self), indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str = SPEC) -> ExperimentSpec:
        """Parses and checks a spec; a malformed one raises CheckpointError naming ``where``."""
        try:
            raw = json.loads(text)
            if not isinstance(raw, dict):
                raise TypeError("not a JSON object")
            if raw.get("version") != SPEC_VERSION:
                raise ValueError(f"version {raw.get('version')!r}, this dipaco reads version {SPEC_VERSION}")
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(raw) - known)
            if unknown:
                raise ValueError(f"unknown keys {unknown}")
            spec = cls(**{**raw, "tokenizer": TokenizerRef(**raw["tokenizer"]),
                          "sharding": ShardingRef(**raw["sharding"])})
            spec.llama_config()  # the model section and token ids make a model
            spec.build_topology()
        except (ValueError, TypeError, KeyError, DipacoError) as exc:
            raise CheckpointError(f"{where}: not a valid experiment spec ({exc})") from None
        return spec

    def write(self, directory: Path) -> Path:
        """Writes ``directory/experiment.json`` atomically."""
        path = Path(directory) / SPEC
        write_text(path, self.to_json())
        return path


def spec_file(exp_dir: Path) -> Path | None:
    """The experiment directory's spec, or None (an experiment trained before specs existed)."""
    path = Path(exp_dir) / SPEC
    return path if path.is_file() else None


def read_spec(exp_dir: Path) -> ExperimentSpec:
    """The experiment's spec; a run trained before specs existed is named with the fix."""
    path = spec_file(exp_dir)
    if path is None:
        raise DipacoError(f"{exp_dir}: no {SPEC}; the experiment was trained before dipaco wrote experiment specs. "
                          f"Convert it once with `dipaco convert-spec --run RUN --experiment {Path(exp_dir).name}` "
                          f"(every dipaco command that reads a trained experiment does this itself)")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read the experiment spec ({exc})") from None
    return ExperimentSpec.from_json(text, str(path))
