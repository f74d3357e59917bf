"""The configuration schema: typed dataclasses, merged from YAML files and dotlist overrides by omegaconf.

This module is a leaf: it imports no component. The schema says what keys exist, their types and their
choices (``Literal``); omegaconf refuses unknown keys, wrong types and values outside a ``Literal``,
naming the full key. The checks a type cannot express (ranges, cross-field rules) belong to the
component that uses a section, which runs them when it is built; :func:`dipaco.run.load_config` runs
every component's check at once, so a bad config fails before any job starts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, get_args, get_type_hints

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dipaco.errors import ConfigError

PrecisionName = Literal["auto", "fp32", "bf16", "fp16"]  # auto: bf16 on CUDA, fp32 on CPU
PartSharing = Literal["shared", "path"]
CommDtype = Literal["fp32", "bf16", "fp16", "int8", "int4", "fp4"]


@dataclass
class RunConfig:
    dir: str = "runs/demo"  # holds the prepared data, the pretrained model and every experiment
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    deterministic: Optional[bool] = None  # null: on for CPU (bit-exact runs), off for CUDA (slower kernels)
    progress: bool = True  # tqdm bars


@dataclass
class DataConfig:
    corpus: str = "bbc"  # "bbc" (built in), a local file/dir/glob, or a hub dataset name
    format: Optional[Literal["json", "csv", "parquet", "text"]] = None  # null: inferred from the extension
    csv_columns: Optional[List[str]] = None  # headerless CSV: its column names, in order (e.g. [label, title, text])
    hub: bool = False  # a corpus name that is not builtin or local is loaded from the Hugging Face hub
    streaming: bool = False  # hub: stream the dataset into the run's Arrow files instead of downloading it whole
    hub_config: Optional[str] = None
    hub_split: Optional[str] = None
    text_field: str = "text"
    id_field: Optional[str] = "id"
    label_field: Optional[str] = "label"
    split_field: Optional[str] = "split"
    validation_fraction: float = 0.1
    max_docs: Optional[int] = None
    strip_headers: bool = False  # drop Usenet-style headers (everything before the first blank line)
    empty_docs: Literal["error", "skip"] = "error"
    seq_len: int = 128  # packed training sequence length and eval window length
    prefix_tokens: int = 32  # routing context; never scored at evaluation
    num_proc: Optional[int] = None  # prepare: tokenizer processes; null: 1 (its threads) up to 4 cores, else every core
    # prepare: keep each document's text beside its tokens. false: the prepared data shrinks to less than half (the
    # text is most of its bytes; docs/notes/2026-11-27-corpora-larger-than-memory.md); the doc_topics featurizer
    # then decodes whole documents from their tokens.
    keep_text: bool = True


@dataclass
class TokenizerConfig:
    path: Optional[str] = None  # an existing tokenizer directory; None trains a byte-level BPE
    vocab_size: int = 4096
    train_docs: Optional[int] = 20_000  # BPE trained on at most this many training documents (a fixed random sample); null = all


@dataclass
class ModelConfig:
    """Architecture of one path (every path is a LlamaForCausalLM of this shape).

    With ``init_from`` the shape keys (:data:`SHAPE_KEYS`) come from that checkpoint: a key left unset takes
    the checkpoint's value, and one given that contradicts it is an error (dipaco.model.source)."""

    # a Llama-architecture checkpoint (a local HF directory or a hub name): the run's dense init, tokenizer and shape
    init_from: Optional[str] = None
    num_layers: int = 4
    hidden_size: int = 128
    intermediate_size: int = 384
    num_heads: int = 4
    num_kv_heads: Optional[int] = None  # None = num_heads (no grouped-query attention)
    head_dim: Optional[int] = None  # None = hidden_size / num_heads
    vocab_size: Optional[int] = None  # the embedding's rows; None = the tokenizer's size
    max_positions: Optional[int] = None  # max_position_embeddings; None = data.seq_len
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    # rope_type and its parameters, as in a HF config (Llama 3.x: {rope_type: llama3, factor: 32.0, ...}); None = plain RoPE
    rope_scaling: Optional[Dict[str, Any]] = None
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    mlp_bias: bool = False
    init_std: float = 0.02
    attention: Literal["sdpa", "eager"] = "sdpa"  # sdpa: flash / memory-efficient kernels on CUDA
    activation_checkpointing: bool = False  # recompute each block in the backward pass: less memory, ~1/3 more compute


@dataclass
class LevelConfig:
    blocks: int = 1  # consecutive transformer blocks in this level
    modules: int = 1  # interchangeable modules at this level (K_l)
    path_specific: bool = False  # every path owns its copy (never shared); then modules must be 1


@dataclass
class TopologyConfig:
    # A preset replaces `levels`/`replicas`: dense | diloco:R | moe:P | grid:KxK[xK...]
    preset: Optional[str] = None
    levels: List[LevelConfig] = field(default_factory=lambda: [LevelConfig(blocks=4, modules=1)])
    replicas: int = 1  # paths per module tuple, each on its own shard (DiLoCo data parallelism)
    # null: the preset's choice (default_part_sharing): path for moe:P, shared otherwise
    embedding: Optional[PartSharing] = None
    head: Optional[PartSharing] = None  # final norm + LM head, as `embedding`


def default_part_sharing(preset: str | None) -> str:
    """What a null ``topology.embedding`` / ``topology.head`` means. A flat MoE (moe:P) is P independent
    models, so its embedding and head are path-specific; every other topology shares them."""
    return "path" if preset is not None and preset.partition(":")[0] == "moe" else "shared"


def resolved_part_sharing(topo: TopologyConfig) -> tuple[PartSharing, PartSharing]:
    """(embedding, head) sharing of a topology config, nulls resolved."""
    default: PartSharing = "path" if default_part_sharing(topo.preset) == "path" else "shared"
    return topo.embedding or default, topo.head or default


@dataclass
class OptimConfig:
    """Inner AdamW with linear warmup and cosine decay over the whole run."""

    lr: float = 1e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    grad_clip: float = 1.0  # 0 disables clipping
    batch_size: int = 16  # sequences per step
    # sequences per forward/backward pass: a step accumulates batch_size / micro_batch_size of them; None = batch_size
    micro_batch_size: Optional[int] = None


@dataclass
class PretrainConfig:
    steps: int = 200
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: PrecisionName = "auto"  # autocast of the forward pass; fp32 master weights
    compile: bool = False  # torch.compile the model's forward and backward
    checkpoint_every: int = 0  # steps between step checkpoints in pretrain.work/ (0: only when a signal stops it)


@dataclass
class StreamingConfig:
    """``outer.sync=streaming`` (Streaming DiLoCo, arXiv 2501.18512; dipaco.sync.streaming)."""

    num_fragments: Optional[int] = None  # F; null = one fragment per unit
    # the unit fragments are made of: level (a part) | module | blocks:K (K consecutive decoder blocks of a
    # module; the embedding and the head cut into pieces of at most K blocks' parameters)
    fragment: str = "module"
    pattern: Literal["strided", "sequential", "balanced"] = "strided"  # units to fragments
    overlap_steps: int = 0  # tau: a fragment's exchange runs during this many inner steps; < inner_steps / F
    mix_alpha: float = 0.0  # alpha: theta_path <- alpha * local + (1 - alpha) * global when a fragment lands


@dataclass
class DelayedConfig:
    """``outer.sync=delayed`` (DiLoCoX's one-step-delay overlap, arXiv 2506.21263; dipaco.sync.delayed)."""

    delay: int = 1  # rounds between a round's outer gradient and the round it is applied at; 0 = DiLoCo
    eager: bool = False  # each path keeps its own last delta at once; the average lands a round later (delay 1)
    # the outer step of this sync. lr: null = outer.lr. momentum: null = min(outer.momentum, 0.5) with a delay
    # (a round-late outer gradient under momentum 0.9 overshoots; measured in
    # docs/notes/2026-11-23-streaming-delay-codecs.md, run 4), outer.momentum at 0
    lr: Optional[float] = None
    momentum: Optional[float] = None


@dataclass
class OuterConfig:
    """Per-module outer optimizer: SGD with Nesterov momentum on averaged path deltas (DiLoCo)."""

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    weighting: Literal["tokens", "uniform"] = "tokens"  # tokens: w_p proportional to shard tokens
    rescale: Literal["none", "sqrt_paths", "inv_sqrt_paths"] = "none"  # x sqrt(n) | / sqrt(n) for n paths
    # the embedding's and head's outer lr is this x the sync's lr (the levels' is the lr itself); a per-part
    # step, on top of rescale. DiLoCo and DiPaCo grids may want a larger step there
    # (docs/notes/2026-11-23-what-routing-buys.md)
    embedding_head_lr_scale: float = 1.0
    drop_prob: float = 0.0  # each path's contribution is dropped with this probability per round (seeded)
    sync: str = "diloco"  # the outer-sync algorithm: a name in dipaco.sync.SYNCS (or async_nesterov, train.driver=ray)
    streaming: StreamingConfig = field(default_factory=StreamingConfig)
    delayed: DelayedConfig = field(default_factory=DelayedConfig)
    nesterov_delay: Optional[int] = None  # async_nesterov: arrivals per momentum step (null: paths through the module; 1: plain)


@dataclass
class TrainConfig:
    name: str = "dipaco"  # experiment directory: <run.dir>/train/<name>
    rounds: int = 4
    inner_steps: int = 50
    init: Literal["pretrained", "random"] = "pretrained"  # pretrained: run `dipaco pretrain` first
    sharding: Literal["iid", "column", "kmeans"] = "iid"
    shard_column: str = "path"  # integer path column, for sharding=column
    optim: OptimConfig = field(default_factory=OptimConfig)
    keep_checkpoints: int = 2
    checkpoint_every: int = 1  # checkpoint every N rounds (Ray: N of its ray.checkpoint_every points); the last always
    checkpoint_background: bool = True  # write checkpoints in a background thread while the next round trains
    log_every: int = 10  # inner steps between progress-bar loss updates
    early_stopping_holdout: float = 0.0  # >0: hold out this fraction of train docs; keep each path's best params
    precision: PrecisionName = "auto"  # autocast of the forward pass; fp32 master weights
    compile: bool = False  # torch.compile each path model (compiled once, shared by every path of the rank)
    offload_inactive: bool = False  # keep the AdamW states of paths not training right now in (pinned) CPU memory
    # torchrun: lock-step rounds (dipaco.train.rounds) | ray: the asynchronous task queue (dipaco.train.tasks)
    driver: Literal["torchrun", "ray"] = "torchrun"
    dynamic_local_steps: bool = False  # ray: each task takes floor(v / v_max * inner_steps) steps, v = its worker's tokens/s
    # log, every round, each module's mean pairwise cosine between its paths' changes and their mean norm
    # (metrics.jsonl, event "outer": path_cosine, path_delta_norm); one more pass over the deltas; torchrun driver
    diagnostics: bool = False


@dataclass
class RouteConfig:
    """`dipaco route`: document features -> k-means -> one path per document (see routing/)."""

    # lm_prefix (the pretrained model's prefix states) | tfidf_svd (TF-IDF + SVD of the prefix) | encoder |
    # doc_topics (topics of the whole training documents, read from the prefix by a naive Bayes word model)
    featurizer: Literal["lm_prefix", "tfidf_svd", "encoder", "doc_topics"] = "lm_prefix"
    layers: List[int] = field(default_factory=lambda: [-1])  # lm_prefix/encoder: hidden states pooled (0 = embeddings)
    skip_tokens: int = 0  # lm_prefix/encoder: leave each document's first tokens out of the mean
    # fitted on the train features, kept by the router
    transform: Literal["none", "center_l2", "pca_l2", "whiten_l2"] = "none"
    transform_components: Optional[int] = None  # pca_l2/whiten_l2: principal axes kept (null = all)
    encoder: Optional[str] = None  # featurizer=encoder: a Hugging Face encoder's hub name or local directory
    encoder_max_tokens: int = 128  # featurizer=encoder: the encoder's tokens per routing context
    method: Literal["kmeans", "product"] = "kmeans"  # kmeans: P clusters | product: one k-means per grid level
    # kmeans on a grid: which cluster becomes which path (routing.arrange). similar: clusters with alike token
    # distributions on paths that share modules | none: k-means' own numbering | dissimilar: the worst (a control)
    arrange: Literal["none", "similar", "dissimilar"] = "none"
    metric: Literal["euclidean", "cosine"] = "euclidean"
    balance_slack: Optional[float] = 0.1  # shards hold at most ceil(N/P * (1 + slack)) docs; null = unbalanced
    min_shard_fraction: float = 0.0  # with a slack: shards hold at least floor(N/P * this) docs
    n_init: int = 3
    max_iter: int = 100
    topk: int = 1  # >1: each train doc also trains its next-best paths (overlapping shards, `paths_topk`)
    svd_components: int = 128  # tfidf_svd: the features' width; doc_topics: the whole-document clustering's
    topics: int = 0  # doc_topics: topics found in the whole documents (the features' width); 0 = one per path
    topic_smoothing: float = 0.1  # doc_topics: additive smoothing of the word model's counts (> 0)
    batch_size: int = 64  # featurizer batch
    precision: PrecisionName = "auto"  # the featurizer's forward pass
    reroute_holdout: float = 0.05  # `dipaco reroute`: fraction of train docs scored by every path
    reroute_target: Literal["uniform", "current"] = "uniform"  # shard sizes the re-routed classifier aims for
    # EM-style re-sharding in `dipaco train`: after each of these rounds, re-route every document on the
    # paths' losses (as `dipaco reroute`) and continue on the new shards; [] = off (dipaco.train.resharding)
    em_rounds: List[int] = field(default_factory=list)
    # k-means is fitted on at most this many training documents (a seeded sample); every document is then
    # assigned in chunks under the same capacity bounds; null = fit on all
    fit_docs: Optional[int] = 50_000
    # when fitted on a sample: Lloyd rounds over every training document before the final assignment,
    # each one pass over the features (Router.refine_chunked); one-level k-means only
    refine_rounds: int = 2
    chunk_docs: int = 65_536  # documents featurized and assigned per chunk (bounds routing's memory)


@dataclass
class DistConfig:
    """Multi-worker training under torchrun (ignored by a single process): see dipaco.comm."""

    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: nccl on CUDA, else gloo
    timeout_s: float = 1800.0  # start-up and each attempt's first round: a collective waiting longer fails clearly
    round_timeout_factor: float = 3.0  # later rounds: x the slowest round so far (0: always timeout_s)
    round_timeout_min_s: float = 60.0  # ... but at least this (dipaco.comm.liveness)
    comm_dtype: CommDtype = "fp32"  # outer-gradient payload; fp4 is E2M1
    chunk_size: int = 1024  # int8, int4, fp4: elements per absmax scale (even for the 4-bit codecs)
    adaptive: bool = False  # per-module codec from its outer-gradient statistics (dipaco.comm.adaptive)
    adaptive_tolerance: float = 0.12  # adaptive: the cheapest codec whose relative error is at most this
    adaptive_sample_chunks: int = 64  # adaptive: chunks per module the error is measured on (evenly spaced; 0 = all)
    error_feedback: bool = True  # lossy comm_dtype: carry each module's quantization residual to the next round
    check_replicas: bool = False  # debug: compare module checksums across holders every round


@dataclass
class RayConfig:
    """The asynchronous task queue (train.driver=ray, dipaco.train.tasks): path tasks on Ray workers,
    one outer executor (a Ray actor) per module."""

    address: Optional[str] = None  # null: start an embedded local Ray; "auto" or host:port: join a running cluster
    num_cpus: Optional[int] = None  # CPUs of the embedded Ray (null: all of them); ignored with an address
    num_workers: Optional[int] = None  # path workers (null: len(simulate_speeds), else the number of paths)
    simulate_speeds: Optional[List[float]] = None  # per worker, in (0, 1]: a worker at 0.5 sleeps as long as it computes
    # async: a path's next task starts once its modules took its update | rounds: lock-step
    schedule: Literal["async", "rounds"] = "async"
    max_staleness: Optional[int] = None  # bound on updates a module takes while a task computes (null: unbounded)
    task_retries: int = 3  # re-queues of one task after its worker died, before the run fails
    checkpoint_every: Optional[int] = None  # completed tasks between run checkpoints (null: the number of paths)
    executor_checkpoint_every: int = 1  # updates between an executor's own checkpoints (1: none is ever lost)
    executors: Optional[int] = None  # outer executor actors, modules dealt round-robin (null: one per module)
    # CPUs each path worker takes (null: the cluster's CPUs at start, shared by the workers). A number makes the
    # workers follow the cluster: those it cannot place yet start on a node that joins later
    worker_cpus: Optional[float] = None
    # the driver fetches a path's AdamW state after every N of its tasks (1: after each, so checkpoints hold the
    # newest); between, the state stays on the node of the worker that made it, and that worker takes the path again
    state_sync_every: int = 1


@dataclass
class EvalConfig:
    batch_size: int = 16
    max_docs: Optional[int] = None  # evaluate on the first N validation docs only
    early_stopping: bool = False  # evaluate each path's best (early-stopped) parameters
    precision: PrecisionName = "auto"
    every: int = 0  # during `dipaco train`: each path's validation perplexity every N rounds (0: off)


@dataclass
class MetricsConfig:
    """Where metrics go besides ``metrics.jsonl`` (and TensorBoard, when installed); checked in ``dipaco.metrics``."""

    wandb: bool = False  # also log every metrics.jsonl record to Weights & Biases (pip install 'dipaco[wandb]')
    wandb_project: str = "dipaco"
    wandb_run_name: Optional[str] = None  # null: <job>/<experiment>, e.g. train/dipaco_2x2
    wandb_tags: List[str] = field(default_factory=list)
    wandb_mode: Optional[Literal["online", "offline", "disabled"]] = None  # null: W&B's own (WANDB_MODE, else online)


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    route: RouteConfig = field(default_factory=RouteConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)


PRECISIONS: tuple[str, ...] = get_args(PrecisionName)
# The model keys that change a path's math: an imported checkpoint (model.init_from) sets every one of them.
SHAPE_KEYS = ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
              "max_positions", "tie_embeddings", "rope_theta", "rope_scaling", "rms_norm_eps", "attention_bias", "mlp_bias")


def given_keys(path: str | Path | None, overrides: list[str] | None, section: str) -> set[str]:
    """The keys of ``section`` that the YAML file or the dotlist overrides set (whatever their values): what a
    user asked for, as opposed to the schema's defaults."""
    given: set[str] = set()
    if path is not None:
        doc = _read_yaml(Path(path))
        part = doc.get(section)
        if isinstance(part, DictConfig):
            given |= {str(k) for k in part.keys()}
    for item in overrides or []:
        key, _, value = item.partition("=")
        key = key.strip()
        if key.startswith(section + "."):
            name = key[len(section) + 1:]
            if _is_null(value) and "." not in name:  # key=null unsets it: not asked for
                given.discard(name)
            else:
                given.add(name.split(".", 1)[0])
    return given


def merge_config(path: str | Path | None = None, overrides: list[str] | None = None,
                 base: Any = Config) -> Config:
    """Schema (or ``base``) <- YAML file <- dotlist overrides. Unknown keys, wrong types and values
    outside a ``Literal`` raise :class:`ConfigError` naming the full key; values are not checked
    further here (:func:`dipaco.run.load_config` does that)."""
    where = None
    unset: list[str] = []
    try:
        merged = OmegaConf.structured(base)
        if path is not None:
            where = f"in {path}"
            merged = OmegaConf.merge(merged, _read_yaml(Path(path)))
        if overrides:
            where = "on the command line"
            bad = [o for o in overrides if "=" not in o]
            if bad:
                raise ConfigError(f"overrides must look like key=value, got: {' '.join(bad)}")
            overrides, unset = _unsets(overrides)
            for key in unset:
                OmegaConf.update(merged, key, _schema_default(key), merge=False)
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(overrides))
        cfg: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        raise ConfigError(_omegaconf_message(exc, where)) from None
    if unset and cfg.model.init_from is None:
        raise ConfigError(f"{unset[0]}=null (on the command line): null unsets a shape key for model.init_from's "
                          f"checkpoint to fill in; without model.init_from give a value (the default is "
                          f"{_schema_default(unset[0])!r})")
    return cfg


_NULLS = ("null", "Null", "NULL", "~")  # YAML's spellings of null, as omegaconf reads a dotlist value
_UNSETTABLE = tuple(f"model.{key}" for key in SHAPE_KEYS)  # with model.init_from, the checkpoint gives them


def _is_null(value: str) -> bool:
    return value.strip() in _NULLS


def _unsets(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(the overrides for omegaconf, the keys they unset). An empty value is refused (an empty shell variable
    would otherwise pass as null); ``key=null`` on a key the schema types Optional sets None, as omegaconf
    does; on a shape key of ``model`` it unsets the key, back to the schema's default, for model.init_from's
    checkpoint to fill in; on any other key it is refused. The last value of a key wins."""
    parsed = [(key.strip(), value) for key, _, value in (o.partition("=") for o in overrides)]
    last = {key: i for i, (key, _) in enumerate(parsed)}
    unset: list[str] = []
    for i, (key, value) in enumerate(parsed):
        hint = _schema_hint(key)
        if not value.strip():
            nullable = hint is not None and type(None) in get_args(hint)
            raise ConfigError(f"{key}: no value after '=' (on the command line); give a value"
                              f"{', or null to unset it' if nullable else ''}")
        if not _is_null(value) or hint is None or type(None) in get_args(hint) or last[key] != i:
            continue
        if key not in _UNSETTABLE:
            raise ConfigError(f"{key}: cannot be null (on the command line); give a value, or leave the key out "
                              f"for its default {_schema_default(key)!r}")
        unset.append(key)
    return [o for o, (key, _) in zip(overrides, parsed) if key not in unset], unset


def parse_config(text: str, where: str) -> Config:
    """A config from its YAML text (as :func:`to_yaml` writes it) over the schema's defaults; ``where`` names
    the text in an error."""
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.create(text)))  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        raise ConfigError(_omegaconf_message(exc, f"in {where}")) from None


def _read_yaml(path: Path) -> Any:
    """A config file's mapping; a missing file, bytes that are not UTF-8, YAML that does not parse or
    a document that is not a mapping of sections are a ConfigError naming the file."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); a config is a YAML file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    try:
        doc = OmegaConf.create(text)  # omegaconf's YAML loader: 1e-3 is a float, as in every other config path
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path}: not valid YAML{at}: {problem}") from None
    if not isinstance(doc, DictConfig):
        raise ConfigError(f"{path}: a config is a mapping of sections (run:, data:, train:, ...), not a list")
    return doc


def _omegaconf_message(exc: OmegaConfBaseException, where: str | None) -> str:
    key = getattr(exc, "full_key", None) or "config"
    where = f" ({where})" if where else ""
    msg = (getattr(exc, "msg", None) or str(exc)).splitlines()[0]
    choices = _literal_choices(msg)
    if choices is not None:  # "Invalid value 'x', expected one of ['a', 'b']" -> "'x' is not one of a, b"
        value, options = choices
        nullable = _accepts_none(key)
        msg = f"{value} is not one of {', '.join((['null'] if nullable else []) + options)}"
    return f"{key}: {msg}{where}"


def _literal_choices(msg: str) -> tuple[str, list[str]] | None:
    prefix, marker = "Invalid value ", ", expected one of ["
    if not msg.startswith(prefix) or marker not in msg:
        return None
    value, options = msg[len(prefix):].split(marker, 1)
    return value, [o.strip().strip("'\"") for o in options.rstrip("]").split(",") if o.strip()]


def _accepts_none(dotted: str) -> bool:
    """Whether the schema key ``dotted`` (e.g. ``topology.embedding``) is Optional."""
    return type(None) in get_args(_schema_hint(dotted))


def _schema_hint(dotted: str) -> Any:
    """The type the schema gives the key ``dotted``; None when the schema has no such key."""
    owner: Any = Config
    hint: Any = None
    for part in dotted.split("."):
        hints = get_type_hints(owner) if isinstance(owner, type) else {}
        if part not in hints:
            return None
        hint = hints[part]
        owner = next((a for a in get_args(hint) if isinstance(a, type)), hint)
    return hint


def _schema_default(dotted: str) -> Any:
    """The schema's default value of the key ``dotted``."""
    value: Any = Config()
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def to_yaml(cfg: Any) -> str:
    """A config (or one of its sections) as YAML."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_config(cfg: Any, path: str | Path) -> None:
    """Writes the resolved config; every run directory gets one."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(to_yaml(cfg))


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"train.rounds": 4, ...}`` from a config (or section) as nested dicts or dataclasses."""
    if hasattr(tree, "__dataclass_fields__"):
        tree = asdict(tree)
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


# Keys a resumed run may change without changing what it computes. ``run.dir`` only says where the
# run lives: the same run spelled relatively instead of absolutely, or moved, resumes.
RESUME_MUTABLE = (
    "run.dir", "run.progress", "run.device", "train.keep_checkpoints", "train.checkpoint_every",
    "train.checkpoint_background", "train.log_every", "pretrain.checkpoint_every", "eval.",
    "route.",  # re-routing between rounds is the point of `dipaco reroute`
    "dist.backend", "dist.timeout_s", "dist.round_timeout_", "dist.check_replicas",  # how ranks talk, not what they compute
    "train.compile", "train.offload_inactive", "model.activation_checkpointing",  # how fast, not what
    "train.diagnostics",  # what is logged, not what is computed
    "ray.address", "ray.num_cpus",  # where the Ray workers run, not what they compute
    "metrics.",  # where metrics are logged, not what is computed
)


# Keys under a mutable prefix that still change what a resumed run computes: route.topk decides how
# many paths each training document trains (the shards), not only where documents are routed;
# route.em_rounds decides when the run re-routes itself.
RESUME_FIXED = ("route.topk", "route.em_rounds")
# With route.em_rounds set, the run's own later re-routings also depend on these.
RESUME_FIXED_EM = ("route.reroute_holdout", "route.reroute_target")


def config_diff(old: Config, new: Config, ignore: tuple[str, ...] = RESUME_MUTABLE,
                keep: tuple[str, ...] | None = None) -> list[str]:
    """Keys whose values differ, as ``key: old -> new``, skipping keys that start with ``ignore``
    unless they are in ``keep`` (default: RESUME_FIXED, and RESUME_FIXED_EM when either config re-routes
    itself with route.em_rounds)."""
    if keep is None:
        keep = RESUME_FIXED + (RESUME_FIXED_EM if old.route.em_rounds or new.route.em_rounds else ())
    a, b = flatten(old), flatten(new)
    for flat, cfg in ((a, old), (b, new)):  # a null embedding/head computes the run of the value it resolves to
        flat["topology.embedding"], flat["topology.head"] = resolved_part_sharing(cfg.topology)
    return [
        f"{k}: {a.get(k)!r} -> {b.get(k)!r}"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k) and (k in keep or not k.startswith(ignore))
    ]
