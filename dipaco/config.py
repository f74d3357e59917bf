"""Typed configuration: dataclass schemas, YAML files and dotlist overrides via omegaconf.

A config file is merged onto the schema, then the CLI's ``key=value`` overrides onto that. Unknown
keys and wrong types are errors that name the full key; value checks that types cannot express
(choices, ranges, cross-field rules) live in :func:`validate`.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, List, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dipaco.errors import ConfigError
from dipaco.precision import PRECISIONS


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
    format: Optional[str] = None  # json | csv | parquet | text; inferred from the extension
    csv_columns: Optional[List[str]] = None  # headerless CSV: its column names, in order (e.g. [label, title, text])
    hub: bool = False  # a corpus name that is not builtin or local is loaded from the Hugging Face hub
    hub_config: Optional[str] = None
    hub_split: Optional[str] = None
    text_field: str = "text"
    id_field: Optional[str] = "id"
    label_field: Optional[str] = "label"
    split_field: Optional[str] = "split"
    validation_fraction: float = 0.1
    max_docs: Optional[int] = None
    strip_headers: bool = False  # drop Usenet-style headers (everything before the first blank line)
    empty_docs: str = "error"  # error | skip
    seq_len: int = 128  # packed training sequence length and eval window length
    prefix_tokens: int = 32  # routing context; never scored at evaluation


@dataclass
class TokenizerConfig:
    path: Optional[str] = None  # an existing tokenizer directory; None trains a byte-level BPE
    vocab_size: int = 4096


@dataclass
class ModelConfig:
    """Architecture of one path (every path is a LlamaForCausalLM of this shape)."""

    num_layers: int = 4
    hidden_size: int = 128
    intermediate_size: int = 384
    num_heads: int = 4
    num_kv_heads: Optional[int] = None  # None = num_heads (no grouped-query attention)
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    init_std: float = 0.02
    attention: str = "sdpa"  # sdpa (flash/memory-efficient kernels on CUDA) | eager
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
    # shared | path; null: the preset's choice (default_part_sharing): path for moe:P, shared otherwise
    embedding: Optional[str] = None
    head: Optional[str] = None  # final norm + LM head, as `embedding`


def default_part_sharing(preset: str | None) -> str:
    """What a null ``topology.embedding`` / ``topology.head`` means. A flat MoE (moe:P) is P independent
    models, so its embedding and head are path-specific; every other topology shares them."""
    return "path" if preset is not None and preset.partition(":")[0] == "moe" else "shared"


def resolved_part_sharing(topo: TopologyConfig) -> tuple[str, str]:
    """(embedding, head) sharing of a topology config, nulls resolved."""
    default = default_part_sharing(topo.preset)
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


@dataclass
class PretrainConfig:
    steps: int = 200
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | fp32 | bf16 | fp16 (autocast; fp32 master weights)
    compile: bool = False  # torch.compile the model's forward and backward


@dataclass
class StreamingConfig:
    """``outer.sync=streaming`` (Streaming DiLoCo, arXiv 2501.18512; dipaco.sync.streaming)."""

    num_fragments: Optional[int] = None  # F; null = one fragment per unit
    # the unit fragments are made of: level (a part) | module | blocks:K (K consecutive decoder blocks of a
    # module; the embedding and the head cut into pieces of at most K blocks' parameters)
    fragment: str = "module"
    pattern: str = "strided"  # units to fragments: strided (i mod F) | sequential (blocks of units) | balanced (by size)
    overlap_steps: int = 0  # tau: a fragment's exchange runs during this many inner steps; < inner_steps / F
    mix_alpha: float = 0.0  # alpha: theta_path <- alpha * local + (1 - alpha) * global when a fragment lands


@dataclass
class DelayedConfig:
    """``outer.sync=delayed`` (DiLoCoX's one-step-delay overlap, arXiv 2506.21263; dipaco.sync.delayed)."""

    delay: int = 1  # rounds between a round's outer gradient and the round it is applied at; 0 = DiLoCo
    eager: bool = False  # each path keeps its own last delta at once; the average lands a round later (delay 1)
    # the outer step of this sync. lr: null = outer.lr. momentum: null = min(outer.momentum, 0.5) with a delay
    # (a round-late outer gradient under momentum 0.9 overshoots; measured in docs/benchmarks.md), outer.momentum at 0
    lr: Optional[float] = None
    momentum: Optional[float] = None


@dataclass
class OuterConfig:
    """Per-module outer optimizer: SGD with Nesterov momentum on averaged path deltas (DiLoCo)."""

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    weighting: str = "tokens"  # tokens (w_p proportional to shard tokens) | uniform
    rescale: str = "none"  # none | sqrt_paths (x sqrt(n)) | inv_sqrt_paths (/ sqrt(n))
    # the embedding's and head's outer lr is this x the sync's lr (the levels' is the lr itself); a per-part
    # step, on top of rescale. DiLoCo and DiPaCo grids may want a larger step there (docs/benchmarks.md)
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
    init: str = "pretrained"  # pretrained (run `dipaco pretrain` first) | random
    sharding: str = "iid"  # iid | column | kmeans
    shard_column: str = "path"  # integer path column, for sharding=column
    optim: OptimConfig = field(default_factory=OptimConfig)
    keep_checkpoints: int = 2
    log_every: int = 10  # inner steps between progress-bar loss updates
    early_stopping_holdout: float = 0.0  # >0: hold out this fraction of train docs; keep each path's best params
    precision: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | fp32 | bf16 | fp16 (autocast; fp32 master weights)
    compile: bool = False  # torch.compile each path model (compiled once, shared by every path of the rank)
    offload_inactive: bool = False  # keep the AdamW states of paths not training right now in (pinned) CPU memory
    driver: str = "torchrun"  # torchrun (lock-step rounds, dipaco.train.loop) | ray (async task queue, dipaco.train.ray_driver)
    dynamic_local_steps: bool = False  # ray: each task takes floor(v / v_max * inner_steps) steps, v = its worker's tokens/s


@dataclass
class RouteConfig:
    """`dipaco route`: document features -> k-means -> one path per document (see routing/)."""

    # lm_prefix (the pretrained model's prefix states) | tfidf_svd (TF-IDF + SVD of the prefix) | encoder |
    # doc_topics (topics of the whole training documents, read from the prefix by a naive Bayes word model)
    featurizer: str = "lm_prefix"
    layers: List[int] = field(default_factory=lambda: [-1])  # lm_prefix/encoder: hidden states pooled (0 = embeddings)
    skip_tokens: int = 0  # lm_prefix/encoder: leave each document's first tokens out of the mean
    transform: str = "none"  # none | center_l2 | pca_l2 | whiten_l2: fitted on the train features, kept by the router
    transform_components: Optional[int] = None  # pca_l2/whiten_l2: principal axes kept (null = all)
    encoder: Optional[str] = None  # featurizer=encoder: a Hugging Face encoder's hub name or local directory
    encoder_max_tokens: int = 128  # featurizer=encoder: the encoder's tokens per routing context
    method: str = "kmeans"  # kmeans (P clusters) | product (one k-means per grid level)
    # kmeans on a grid: which cluster becomes which path (routing.arrange). similar: clusters with alike token
    # distributions on paths that share modules | none: k-means' own numbering | dissimilar: the worst (a control)
    arrange: str = "none"
    metric: str = "euclidean"  # euclidean | cosine
    balance_slack: Optional[float] = 0.1  # shards hold at most ceil(N/P * (1 + slack)) docs; null = unbalanced
    min_shard_fraction: float = 0.0  # with a slack: shards hold at least floor(N/P * this) docs
    n_init: int = 3
    max_iter: int = 100
    topk: int = 1  # >1: each train doc also trains its next-best paths (overlapping shards, `paths_topk`)
    svd_components: int = 128  # tfidf_svd: the features' width; doc_topics: the whole-document clustering's
    topics: int = 0  # doc_topics: topics found in the whole documents (the features' width); 0 = one per path
    topic_smoothing: float = 0.1  # doc_topics: additive smoothing of the word model's counts (> 0)
    batch_size: int = 64  # featurizer batch
    precision: str = "auto"  # the featurizer's forward pass: auto | fp32 | bf16 | fp16
    reroute_holdout: float = 0.05  # `dipaco reroute`: fraction of train docs scored by every path
    reroute_target: str = "uniform"  # uniform | current: shard sizes the re-routed classifier aims for
    # EM-style re-sharding in `dipaco train`: after each of these rounds, re-route every document on the
    # paths' losses (as `dipaco reroute`) and continue on the new shards; [] = off (dipaco.train.resharding)
    em_rounds: List[int] = field(default_factory=list)


@dataclass
class DistConfig:
    """Multi-worker training under torchrun (ignored by a single process): see dipaco.distributed, dipaco.comm."""

    backend: str = "auto"  # auto (nccl on CUDA, else gloo) | gloo | nccl
    timeout_s: float = 1800.0  # a collective waiting longer fails clearly (> the slowest rank's lag)
    comm_dtype: str = "fp32"  # outer-gradient payload: fp32 | bf16 | fp16 | int8 | int4 | fp4 (E2M1)
    chunk_size: int = 1024  # int8, int4, fp4: elements per absmax scale (even for the 4-bit codecs)
    adaptive: bool = False  # per-module codec from its outer-gradient statistics (dipaco.comm.adaptive)
    adaptive_tolerance: float = 0.12  # adaptive: the cheapest codec whose relative error is at most this
    adaptive_sample_chunks: int = 64  # adaptive: chunks per module the error is measured on (evenly spaced; 0 = all)
    error_feedback: bool = True  # lossy comm_dtype: carry each module's quantization residual to the next round
    check_replicas: bool = False  # debug: compare module checksums across holders every round


@dataclass
class RayConfig:
    """The asynchronous driver (train.driver=ray, dipaco.train.ray_driver): path tasks on Ray workers,
    one outer executor (a Ray actor) per module."""

    address: Optional[str] = None  # null: start an embedded local Ray; "auto" or host:port: join a running cluster
    num_cpus: Optional[int] = None  # CPUs of the embedded Ray (null: all of them); ignored with an address
    num_workers: Optional[int] = None  # path workers (null: len(simulate_speeds), else the number of paths)
    simulate_speeds: Optional[List[float]] = None  # per worker, in (0, 1]: a worker at 0.5 sleeps as long as it computes
    schedule: str = "async"  # async: a path's next task starts once its modules took its update | rounds: lock-step
    max_staleness: Optional[int] = None  # bound on updates a module takes while a task computes (null: unbounded)
    task_retries: int = 3  # re-queues of one task after its worker died, before the run fails
    checkpoint_every: Optional[int] = None  # completed tasks between run checkpoints (null: the number of paths)
    executor_checkpoint_every: int = 1  # updates between an executor's own checkpoints (1: none is ever lost)
    executors: Optional[int] = None  # outer executor actors, modules dealt round-robin (null: one per module)


@dataclass
class EvalConfig:
    batch_size: int = 16
    max_docs: Optional[int] = None  # evaluate on the first N validation docs only
    early_stopping: bool = False  # evaluate each path's best (early-stopped) parameters
    precision: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | fp32 | bf16 | fp16


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


_CHOICES = {
    "data.empty_docs": ("error", "skip"),
    "topology.embedding": (None, "shared", "path"),
    "topology.head": (None, "shared", "path"),
    "outer.weighting": ("tokens", "uniform"),
    "outer.rescale": ("none", "sqrt_paths", "inv_sqrt_paths"),
    "train.driver": ("torchrun", "ray"),
    "ray.schedule": ("async", "rounds"),
    "train.init": ("pretrained", "random"),
    "train.sharding": ("iid", "column", "kmeans"),
    "dist.backend": ("auto", "gloo", "nccl"),
    "dist.comm_dtype": ("fp32", "bf16", "fp16", "int8", "int4", "fp4"),
    "outer.streaming.pattern": ("strided", "sequential", "balanced"),
    "route.featurizer": ("lm_prefix", "tfidf_svd", "encoder", "doc_topics"),
    "route.transform": ("none", "center_l2", "pca_l2", "whiten_l2"),
    "route.method": ("kmeans", "product"),
    "route.arrange": ("none", "similar", "dissimilar"),
    "route.metric": ("euclidean", "cosine"),
    "route.reroute_target": ("uniform", "current"),
    "model.attention": ("sdpa", "eager"),
    "train.precision": PRECISIONS,
    "pretrain.precision": PRECISIONS,
    "eval.precision": PRECISIONS,
    "route.precision": PRECISIONS,
}

_POSITIVE = (
    "data.seq_len", "tokenizer.vocab_size", "model.num_layers", "model.hidden_size",
    "model.intermediate_size", "model.num_heads", "topology.replicas", "train.rounds",
    "train.inner_steps", "train.keep_checkpoints", "train.log_every", "train.optim.batch_size",
    "pretrain.optim.batch_size", "eval.batch_size", "route.n_init", "route.max_iter", "route.topk",
    "route.svd_components", "route.batch_size", "route.encoder_max_tokens", "dist.timeout_s", "dist.chunk_size",
    "ray.executor_checkpoint_every",
)


def _get(cfg: Config, dotted: str) -> Any:
    value: Any = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def validate(cfg: Config) -> Config:
    """Checks the rules a type annotation cannot; raises ConfigError naming the key."""
    from dipaco.sync import ASYNC_SYNCS, SYNCS  # the registry imports this module

    if cfg.outer.sync not in SYNCS and cfg.outer.sync not in ASYNC_SYNCS:
        raise ConfigError(f"outer.sync: {cfg.outer.sync!r} is not one of {', '.join([*SYNCS, *ASYNC_SYNCS])}")
    for key, choices in _CHOICES.items():
        if _get(cfg, key) not in choices:
            raise ConfigError(f"{key}: {_get(cfg, key)!r} is not one of {', '.join('null' if c is None else c for c in choices)}")
    for key in _POSITIVE:
        if _get(cfg, key) <= 0:
            raise ConfigError(f"{key}: must be > 0, got {_get(cfg, key)}")
    if not 0.0 < cfg.data.validation_fraction < 1.0:
        raise ConfigError(f"data.validation_fraction: must be in (0, 1), got {cfg.data.validation_fraction}")
    if not 0 <= cfg.data.prefix_tokens < cfg.data.seq_len:
        raise ConfigError(
            f"data.prefix_tokens: must be in [0, data.seq_len={cfg.data.seq_len}), got {cfg.data.prefix_tokens}"
        )
    if cfg.model.hidden_size % cfg.model.num_heads:
        raise ConfigError(
            f"model.hidden_size: {cfg.model.hidden_size} is not divisible by model.num_heads={cfg.model.num_heads}"
        )
    if cfg.route.balance_slack is not None and cfg.route.balance_slack < 0:
        raise ConfigError(f"route.balance_slack: must be >= 0 or null, got {cfg.route.balance_slack}")
    if not 0.0 <= cfg.route.min_shard_fraction <= 1.0:
        raise ConfigError(f"route.min_shard_fraction: must be in [0, 1], got {cfg.route.min_shard_fraction}")
    _validate_route_features(cfg)
    if not 0.0 < cfg.route.reroute_holdout < 1.0:
        raise ConfigError(f"route.reroute_holdout: must be in (0, 1), got {cfg.route.reroute_holdout}")
    _validate_em(cfg)
    if not 0.0 <= cfg.outer.drop_prob < 1.0:
        raise ConfigError(f"outer.drop_prob: must be in [0, 1), got {cfg.outer.drop_prob}")
    if not 0.0 <= cfg.train.early_stopping_holdout < 1.0:
        raise ConfigError(f"train.early_stopping_holdout: must be in [0, 1), got {cfg.train.early_stopping_holdout}")
    if cfg.pretrain.steps < 0:
        raise ConfigError(f"pretrain.steps: must be >= 0, got {cfg.pretrain.steps}")
    name = cfg.train.name
    if name in ("", ".", "..") or any(c in name for c in "/\\\0"):
        raise ConfigError(
            f"train.name: must be a plain directory name (no '/', not '.' or '..'; it names "
            f"<run.dir>/train/<name>), got {name!r}"
        )
    _validate_optimizers(cfg)
    _validate_comm(cfg)
    _validate_driver(cfg)
    if cfg.model.num_kv_heads is not None and (
        cfg.model.num_kv_heads <= 0 or cfg.model.num_heads % cfg.model.num_kv_heads
    ):
        raise ConfigError(
            f"model.num_kv_heads: must be > 0 and divide model.num_heads={cfg.model.num_heads}, "
            f"got {cfg.model.num_kv_heads}"
        )
    return cfg


def _validate_route_features(cfg: Config) -> None:
    route = cfg.route
    if not route.layers:
        raise ConfigError("route.layers: must name at least one hidden state, e.g. [-1]")
    if route.skip_tokens < 0 or (route.featurizer == "lm_prefix" and route.skip_tokens >= max(cfg.data.prefix_tokens, 1)):
        raise ConfigError(f"route.skip_tokens: must be in [0, data.prefix_tokens={cfg.data.prefix_tokens}), "
                          f"got {route.skip_tokens}")
    if route.transform_components is not None and route.transform_components <= 0:
        raise ConfigError(f"route.transform_components: must be > 0 or null, got {route.transform_components}")
    if route.topics < 0 or route.topics == 1:
        raise ConfigError(f"route.topics: must be 0 (one topic per path) or >= 2, got {route.topics}")
    if route.topic_smoothing <= 0:
        raise ConfigError(f"route.topic_smoothing: must be > 0, got {route.topic_smoothing}")
    if route.arrange != "none" and route.method != "kmeans":
        raise ConfigError(f"route.arrange={route.arrange}: needs route.method=kmeans (a product router's path is "
                          f"its per-level clusters; there is no numbering to choose)")
    if route.featurizer == "encoder" and not route.encoder:
        raise ConfigError("route.encoder: route.featurizer=encoder needs a Hugging Face encoder name or local directory")


def _validate_em(cfg: Config) -> None:
    """route.em_rounds: re-routing points inside the run, of routed shards, between lock-step rounds."""
    points = list(cfg.route.em_rounds)
    if not points:
        return
    key, rounds = "route.em_rounds", cfg.train.rounds
    outside = [r for r in points if not 0 < r < rounds]
    if outside:
        raise ConfigError(f"{key}: rounds after which to re-route must be in [1, train.rounds={rounds}) (the paths "
                          f"must train on the new shards afterwards), got {outside}")
    if points != sorted(set(points)):
        raise ConfigError(f"{key}: must be strictly increasing (each round once), got {points}")
    if cfg.train.sharding != "kmeans":
        raise ConfigError(f"{key}: re-routing re-shards routed data; needs train.sharding=kmeans (and `dipaco route` "
                          f"first), got train.sharding={cfg.train.sharding}")
    if cfg.train.driver != "torchrun":
        raise ConfigError(f"{key}: needs train.driver=torchrun (re-routing happens between lock-step rounds), "
                          f"got train.driver={cfg.train.driver}")
    if cfg.train.early_stopping_holdout > 0:
        raise ConfigError(f"{key}: cannot be combined with train.early_stopping_holdout (each path's held-out "
                          f"documents, which early stopping compares across rounds, change at every re-routing)")
    from dipaco.model.topology import topology_from_config  # imports only dipaco.errors

    if topology_from_config(cfg.topology, cfg.model.num_layers).num_paths == 1:
        raise ConfigError(f"{key}: the topology has one path, so there is nothing to re-route documents between")


def _check_range(key: str, value: float, low: float, high: float, *, high_open: bool = True) -> None:
    """``value`` must be a finite number in [low, high) (or [low, high] with ``high_open=False``)."""
    ok = math.isfinite(value) and low <= value and (value < high if high_open else value <= high)
    if not ok:
        bound = ")" if high_open else "]"
        where = f">= {low}" if math.isinf(high) else f"in [{low}, {high}{bound}"
        raise ConfigError(f"{key}: must be a finite number {where}, got {value}")


def _validate_optimizers(cfg: Config) -> None:
    """Every optimizer setting: the inner AdamW of pretraining and training, and the outer SGD."""
    inf = math.inf
    for section in ("pretrain.optim", "train.optim"):
        optim: OptimConfig = _get(cfg, section)
        _check_range(f"{section}.lr", optim.lr, 0.0, inf)
        _check_range(f"{section}.beta1", optim.beta1, 0.0, 1.0)
        _check_range(f"{section}.beta2", optim.beta2, 0.0, 1.0)
        _check_range(f"{section}.weight_decay", optim.weight_decay, 0.0, inf)
        _check_range(f"{section}.min_lr_ratio", optim.min_lr_ratio, 0.0, 1.0, high_open=False)
        _check_range(f"{section}.grad_clip", optim.grad_clip, 0.0, inf)
        if not (math.isfinite(optim.eps) and optim.eps > 0):
            raise ConfigError(f"{section}.eps: must be a finite number > 0, got {optim.eps}")
        if optim.warmup_steps < 0:
            raise ConfigError(f"{section}.warmup_steps: must be >= 0, got {optim.warmup_steps}")
    _check_range("outer.lr", cfg.outer.lr, 0.0, inf)
    _check_range("outer.momentum", cfg.outer.momentum, 0.0, inf)
    if not (math.isfinite(cfg.outer.embedding_head_lr_scale) and cfg.outer.embedding_head_lr_scale > 0):
        raise ConfigError(f"outer.embedding_head_lr_scale: must be a finite number > 0, "
                          f"got {cfg.outer.embedding_head_lr_scale}")


def _validate_comm(cfg: Config) -> None:
    """Codecs and the overlapping syncs; checks that need the topology live in the sync classes."""
    dist, stream = cfg.dist, cfg.outer.streaming
    if dist.comm_dtype in ("int4", "fp4") and dist.chunk_size % 2:
        raise ConfigError(f"dist.chunk_size: must be even for dist.comm_dtype={dist.comm_dtype} "
                          f"(two values per byte), got {dist.chunk_size}")
    if dist.adaptive:
        if dist.comm_dtype in ("fp32",):
            raise ConfigError("dist.adaptive: needs a lossy dist.comm_dtype (bf16, fp16, int8, int4, fp4) for "
                              "the first sync of each module, before it has statistics; got fp32")
        if dist.chunk_size % 2:
            raise ConfigError(f"dist.chunk_size: must be even with dist.adaptive=true (its 4-bit candidates), "
                              f"got {dist.chunk_size}")
    _check_range("dist.adaptive_tolerance", dist.adaptive_tolerance, 0.0, math.inf)
    if dist.adaptive_sample_chunks < 0:
        raise ConfigError(f"dist.adaptive_sample_chunks: must be >= 0 (0 = every chunk), got {dist.adaptive_sample_chunks}")
    if cfg.outer.delayed.delay < 0:
        raise ConfigError(f"outer.delayed.delay: must be >= 0, got {cfg.outer.delayed.delay}")
    if cfg.outer.delayed.lr is not None:
        _check_range("outer.delayed.lr", cfg.outer.delayed.lr, 0.0, math.inf)
    if cfg.outer.delayed.momentum is not None:
        _check_range("outer.delayed.momentum", cfg.outer.delayed.momentum, 0.0, 1.0)
    if cfg.outer.delayed.eager and cfg.outer.delayed.delay != 1:
        raise ConfigError(f"outer.delayed.eager: needs outer.delayed.delay=1 (a path's own delta is kept while "
                          f"exactly one exchange is in flight), got delay={cfg.outer.delayed.delay}")
    fragment_blocks(stream.fragment)
    if stream.num_fragments is not None and stream.num_fragments < 1:
        raise ConfigError(f"outer.streaming.num_fragments: must be >= 1 or null, got {stream.num_fragments}")
    if stream.overlap_steps < 0:
        raise ConfigError(f"outer.streaming.overlap_steps: must be >= 0, got {stream.overlap_steps}")
    _check_range("outer.streaming.mix_alpha", stream.mix_alpha, 0.0, 1.0)
    if cfg.outer.sync == "streaming" and stream.num_fragments is not None:
        check_streaming_schedule(cfg, stream.num_fragments)


def fragment_blocks(fragment: str) -> int | None:
    """K of ``outer.streaming.fragment=blocks:K`` (None for ``level`` and ``module``); checks the
    syntax. Whether K fits the topology (at most a module's blocks) is checked by the sync."""
    if fragment in ("level", "module"):
        return None
    match = re.fullmatch(r"blocks:([0-9]+)", fragment)
    if match and int(match.group(1)) >= 1:
        return int(match.group(1))
    raise ConfigError(f"outer.streaming.fragment: {fragment!r} is not one of level, module, blocks:K "
                      f"(K >= 1 decoder blocks, e.g. blocks:1)")


def check_streaming_schedule(cfg: Config, fragments: int) -> None:
    """F must divide H, and tau < H / F (each fragment lands before the next one leaves)."""
    h, tau = cfg.train.inner_steps, cfg.outer.streaming.overlap_steps
    if h % fragments:
        raise ConfigError(f"train.inner_steps: {h} is not a multiple of outer.streaming.num_fragments={fragments} "
                          f"(fragment f syncs at offset f * inner_steps / F)")
    if tau >= h // fragments:
        raise ConfigError(f"outer.streaming.overlap_steps: tau={tau} must be < train.inner_steps / "
                          f"outer.streaming.num_fragments = {h}/{fragments} = {h // fragments}")


def _validate_driver(cfg: Config) -> None:
    """train.driver, outer.sync and the ray.* keys fit together (the topology-dependent staleness
    bound is checked by the Ray driver, which builds the topology)."""
    from dipaco.sync import ASYNC_SYNCS

    is_async = cfg.outer.sync in ASYNC_SYNCS
    if cfg.train.driver == "ray" and not is_async:
        raise ConfigError(f"train.driver: ray runs outer.sync={', '.join(ASYNC_SYNCS)} "
                          f"(ray.schedule=rounds for lock-step rounds), got outer.sync={cfg.outer.sync!r}")
    if is_async and cfg.train.driver != "ray":
        raise ConfigError(f"outer.sync: {cfg.outer.sync} has no rounds to run under torchrun; set train.driver=ray")
    if cfg.outer.nesterov_delay is not None and cfg.outer.nesterov_delay < 1:
        raise ConfigError(f"outer.nesterov_delay: must be >= 1 or null (the paths through each module), "
                          f"got {cfg.outer.nesterov_delay}")
    ray = cfg.ray
    if ray.num_cpus is not None and ray.num_cpus <= 0:
        raise ConfigError(f"ray.num_cpus: must be > 0 or null, got {ray.num_cpus}")
    if ray.num_workers is not None and ray.num_workers <= 0:
        raise ConfigError(f"ray.num_workers: must be > 0 or null, got {ray.num_workers}")
    if ray.simulate_speeds is not None:
        if not ray.simulate_speeds:
            raise ConfigError("ray.simulate_speeds: must list one speed per worker, or be null")
        for i, v in enumerate(ray.simulate_speeds):
            if not (math.isfinite(v) and 0 < v <= 1):
                raise ConfigError(f"ray.simulate_speeds[{i}]: must be in (0, 1] (1 = full speed), got {v}")
        if ray.num_workers is not None and ray.num_workers != len(ray.simulate_speeds):
            raise ConfigError(f"ray.simulate_speeds: {len(ray.simulate_speeds)} speeds for "
                              f"ray.num_workers={ray.num_workers} workers")
    if ray.max_staleness is not None and ray.max_staleness < 0:
        raise ConfigError(f"ray.max_staleness: must be >= 0 or null, got {ray.max_staleness}")
    if ray.executors is not None and ray.executors <= 0:
        raise ConfigError(f"ray.executors: must be > 0 or null (one per module), got {ray.executors}")
    if ray.task_retries < 0:
        raise ConfigError(f"ray.task_retries: must be >= 0, got {ray.task_retries}")
    if ray.checkpoint_every is not None and ray.checkpoint_every <= 0:
        raise ConfigError(f"ray.checkpoint_every: must be > 0 or null, got {ray.checkpoint_every}")
    if cfg.train.dynamic_local_steps and cfg.train.driver != "ray":
        raise ConfigError("train.dynamic_local_steps: needs train.driver=ray (lock-step rounds give every path "
                          "train.inner_steps)")
    if cfg.train.driver == "ray":
        unsupported = {"train.early_stopping_holdout": cfg.train.early_stopping_holdout > 0,
                       "outer.drop_prob": cfg.outer.drop_prob > 0,
                       "dist.comm_dtype": cfg.dist.comm_dtype != "fp32", "outer.nesterov": not cfg.outer.nesterov}
        for key, used in unsupported.items():
            if used:
                raise ConfigError(f"{key}: {_get(cfg, key)!r} is not supported by train.driver=ray "
                                  f"(async_nesterov sends fp32 deltas to Nesterov executors); use its default")


def _merge(base: Any, path: str | Path | None, overrides: list[str] | None) -> Config:
    """base <- YAML file <- dotlist overrides, converted back to dataclasses and validated."""
    try:
        merged = OmegaConf.structured(base)
        if path is not None:
            if not Path(path).is_file():
                raise ConfigError(f"config file not found: {path}")
            merged = OmegaConf.merge(merged, OmegaConf.load(path))
        if overrides:
            bad = [o for o in overrides if "=" not in o]
            if bad:
                raise ConfigError(f"overrides must look like key=value, got: {' '.join(bad)}")
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(overrides))
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        where = f" (in {path})" if path else ""
        msg = (getattr(exc, "msg", None) or str(exc)).splitlines()[0]
        raise ConfigError(f"{key or 'config'}: {msg}{where}") from None
    return validate(cfg)  # type: ignore[arg-type]


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Schema defaults <- YAML file <- dotlist overrides, then validated."""
    return _merge(Config, path, overrides)


def apply_overrides(cfg: Config, overrides: list[str]) -> Config:
    """A copy of ``cfg`` with dotlist overrides applied and validated (for scripts and tests)."""
    return _merge(cfg, None, overrides)


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_config(cfg: Config, path: str | Path) -> None:
    """Writes the resolved config; every run directory gets one."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(to_yaml(cfg))


def section_hash(cfg: Config, *sections: str) -> str:
    """A short stable hash of some config sections, to detect runs that do not match their inputs."""
    payload = json.dumps({s: asdict(_get(cfg, s)) for s in sections}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


# Keys a resumed run may change without changing what it computes. ``run.dir`` only says where the
# run lives: the same run spelled relatively instead of absolutely, or moved, resumes.
RESUME_MUTABLE = (
    "run.dir", "run.progress", "run.device", "train.keep_checkpoints", "train.log_every", "eval.",
    "route.",  # re-routing between rounds is the point of `dipaco reroute`
    "dist.backend", "dist.timeout_s", "dist.check_replicas",  # how ranks talk, not what they compute
    "train.compile", "train.offload_inactive", "model.activation_checkpointing",  # how fast, not what
    "ray.address", "ray.num_cpus",  # where the Ray workers run, not what they compute
)


# Keys under a mutable prefix that still change what a resumed run computes: route.topk decides how
# many paths each training document trains (the shards), not only where documents are routed;
# route.em_rounds decides when the run re-routes itself.
RESUME_FIXED = ("route.topk", "route.em_rounds")
# With route.em_rounds set, the run's own later re-routings also depend on these.
RESUME_FIXED_EM = ("route.reroute_holdout", "route.reroute_target")


def _with_resolved_parts(cfg: Config) -> Config:
    """A null embedding/head and the value it resolves to compute the same run (a run dir written
    before the null existed holds "shared")."""
    embedding, head = resolved_part_sharing(cfg.topology)
    return replace(cfg, topology=replace(cfg.topology, embedding=embedding, head=head))


def config_diff(old: Config, new: Config, ignore: tuple[str, ...] = RESUME_MUTABLE,
                keep: tuple[str, ...] | None = None) -> list[str]:
    """Keys whose values differ, as ``key: old -> new``, skipping keys that start with ``ignore``
    unless they are in ``keep`` (default: RESUME_FIXED, and RESUME_FIXED_EM when either config re-routes
    itself with route.em_rounds)."""
    if keep is None:
        keep = RESUME_FIXED + (RESUME_FIXED_EM if old.route.em_rounds or new.route.em_rounds else ())
    a, b = (_flatten(asdict(_with_resolved_parts(c))) for c in (old, new))
    return [
        f"{k}: {a.get(k)!r} -> {b.get(k)!r}"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k) and (k in keep or not k.startswith(ignore))
    ]
