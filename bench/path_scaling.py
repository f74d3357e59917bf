"""Path-count scaling (issues 36 and 49): validation perplexity against the number of paths P at a fixed path size.

The DiPaCo paper's headline (its Table 1 on C4) is that more paths of the same size keep lowering the perplexity
while inference still runs one path. This benchmark measures that curve on the mixed shared corpus (20 Newsgroups,
BBC News, Brown) at each P, at equal compute (P paths x the same steps, or one model for P times the steps), for:

    dipaco_P         a DiPaCo grid (P=4: 2x2, 16: 4x4) on doc_topics shards (route.arrange=similar); each path owns
                     its embedding and head (topology.embedding=path, head=path: the paper's 16x16 setting)
    dipaco_shared_P  the same grid with the embedding and head shared by every path
    diloco_P         P replicas of the dense path (DiLoCo) on iid shards
    moe_P            P independent paths (flat MoE) on the same doc_topics shards as dipaco_P
    dense_Px         one dense path for P times the steps (plain AdamW: outer lr 1, no momentum)
    dense_1x         P = 1 of dense: one path, plain AdamW (its tuning-seed row is also the sweep's first)
    diloco_1         P = 1 of every family with an outer step: one path with the outer Nesterov step on its own
                     change (a 1x1 grid, DiLoCo-1 and MoE-1 are this model)
    dense_big_16x    (upper reference) a dense model with about DiPaCo-16's total parameters, trained with DiPaCo-16's
                     compute (forward-backward FLOPs), on its own pretrained init

Every family runs one path per input at inference, of the same size (dense_big_16x excepted). Each family's outer
step is searched at each P over a small grid (GRIDS) on the tuning seed (run.seed of the base config, 0); its best
setting then runs on ``--seeds`` fresh seeds (1, 2, ...), whose mean the curve, the tables and the targets use, so the
seed that chose a setting does not also judge it. Every row logs the diagnostics of
docs/notes/2026-11-27-path-count-scaling.md ("Where more paths pay"): each module's outer-gradient norm and the mean
pairwise cosine between its paths' changes (train.diagnostics), per-path validation perplexity, shard NMI and size
spread, and the bank's parameters against one path's.

Presets (--preset): ``cpu`` (the default: byte-level, where a path's non-embedding parameters are its majority, 82.6
tokens per non-embedding parameter per path, 32 rounds), ``bpe`` (issue 36's BPE-2048 path and 8 rounds with today's
families and default outer steps: issue 36's DiPaCo row is ``dipaco_shared_P`` here and its DiLoCo row
``diloco_P@outer.lr=1.2``), ``gpu`` (DiPaCo and DiLoCo at P = 4 and 16 with the cpu preset's chosen outer steps, a
wider path, 6 minutes of one H100); ``--smoke`` shrinks any of them (tiny, for CI).

    timeout 590 python -m bench path_scaling --resume        # the cpu sweep, in chunks under 10 minutes: repeat
                                                            # until it prints the table (a row cut off continues
                                                            # from its last round's checkpoint)
    python -m bench path_scaling --smoke                    # tiny model and steps, for CI (about a minute)
    python -m bench path_scaling --preset gpu --resume run.device=cuda   # on one GPU
    python -m bench path_scaling --resume --rows dipaco_16@route.topk=2  # a row beside the sweep
    python -m bench path_scaling --report                   # train nothing: the tables of --out-dir's results

Outputs in --out-dir (default runs/bench_scaling[_<preset>][_smoke], the names of the results recorded before the
benchmark moved here): results.json (every row, rewritten after each), scaling.md (the tables, diagnostics and
targets) and scaling_ppl_vs_paths.png. ``--resume`` keeps a row results.json holds with the same settings and runs
again one whose settings changed; another base config's results are refused.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench import lm_training as lm
from bench.harness import REPO, Cell, Column, Results, argument_parser, command_line, environment, markdown_table, unknown_rows
from bench.lm_training import Row, count_text, seed_group
from dipaco.atomic import write_text
from dipaco.config import Config, ModelConfig
from dipaco.metrics import echo, read_metrics
from dipaco.model.llama import build_model, llama_config
from dipaco.route.shards import assign_paths
from dipaco.run import Run, apply_overrides, load_config
from dipaco.run_dir import RunDir
from dipaco.runtime import quiet_library_progress_bars

GRID_PRESETS = {4: "grid:2x2", 16: "grid:4x4", 64: "grid:8x8"}
FAMILIES = ("dipaco", "dipaco_shared", "diloco", "moe", "dense")
LABELS = {"dipaco": "DiPaCo grid, path-specific embedding + head", "dipaco_shared": "DiPaCo grid, shared embedding + head",
          "diloco": "DiLoCo-P", "moe": "flat MoE-P", "dense": "dense, P x steps"}
PLAIN = ("outer.lr=1.0", "outer.momentum=0.0")  # the dense rows: plain AdamW, cut into rounds
PATH_PARTS = ("topology.embedding=path", "topology.head=path")
SHARED_PARTS = ("topology.embedding=shared", "topology.head=shared")
# Each family's outer step: the default (the row without @) and the grid searched on the tuning seed at every P,
# centred on the best of the cpu preset's pilot rows (docs/notes/2026-11-27-path-count-scaling.md, "Where more paths
# pay"). Flat MoE steps each path on its own change (quality.yaml's 0.7, momentum 0.9); its grid holds independent paths
# (no outer step), the control of what the outer step on a path's own change is worth.
DEFAULT_OUTER = {"dipaco": ("outer.lr=1.0",), "dipaco_shared": ("outer.lr=1.0", "outer.embedding_head_lr_scale=1.4"),
                 "diloco": ("outer.lr=1.0",), "moe": (), "dense": PLAIN}
GRIDS: dict[str, tuple[tuple[str, ...], ...]] = {
    "dipaco": (("outer.embedding_head_lr_scale=0.7",), ("outer.lr=0.85",), ("outer.lr=0.7",)),
    "dipaco_shared": (("outer.embedding_head_lr_scale=1.0",), ("outer.lr=0.85",),
                      ("outer.lr=0.7", "outer.embedding_head_lr_scale=1.0", "outer.rescale=sqrt_paths")),
    "diloco": (("outer.lr=0.7",), ("outer.lr=0.85",), ("outer.lr=1.2",)),
    "moe": (("outer.lr=1.0",), ("outer.lr=1.0", "outer.momentum=0.0")),  # the latter: independent paths
    "dense": (),
}
# P = 1 of each family: plain AdamW for dense; one path with its outer step (DiLoCo-1, which a 1x1 grid and MoE-1 are)
# for the others: the outer Nesterov step on a path's own change is worth having even alone (the same note).
START = {"dense": "dense", "dipaco": "diloco", "dipaco_shared": "diloco", "diloco": "diloco", "moe": "diloco"}
TARGET_RATIO = 0.95  # DiPaCo-16 <= 0.95 x DiLoCo-16
TARGET_FALL = 0.05  # DiPaCo at P = 16 at least 5% below P = 4


@dataclass(frozen=True)
class Preset:
    """A regime: the path and its schedule (dotlist overrides of configs/bench/quality.yaml) and what it runs."""

    overrides: tuple[str, ...]
    paths: tuple[int, ...]
    families: tuple[str, ...]
    tune: bool  # run the outer-step grids (else every family runs its default)
    big_dense: bool  # the dense_big_16x upper reference
    extras: bool  # dipaco_16's top-2 overlapping shards
    outer: dict[str, tuple[str, ...]] | None = None  # per family, replacing DEFAULT_OUTER (the gpu preset)


SMALL_PATH = ("model.num_layers=2", "model.hidden_size=32", "model.intermediate_size=64", "model.num_heads=2")
BYTE_PATH = ("tokenizer.vocab_size=258", *SMALL_PATH)
SCHEDULE = ("pretrain.steps=200", "pretrain.optim.warmup_steps=20", "pretrain.optim.batch_size=16", "train.inner_steps=26",
            "train.optim.batch_size=16", "train.optim.warmup_steps=20")  # the cpu and bpe presets'
PRESETS = {
    # The byte-level regime of issue 49 (the note gives its arithmetic): the 96-byte routing prefix holds about as much
    # text as issue 36's 32 BPE tokens; AdamW at 3e-3, as at quality.yaml's 1e-3 the outer step made up for a slow inner
    # loop, and 1e-2 was worse (the note's pilot rows).
    "cpu": Preset((*BYTE_PATH, "data.seq_len=128", "data.prefix_tokens=96", *SCHEDULE, "train.rounds=32",
                   "pretrain.optim.lr=3e-3", "train.optim.lr=3e-3"),
                  paths=(1, 4, 16), families=FAMILIES, tune=True, big_dense=True, extras=True),
    # Issue 36's regime: BPE-2048, whose embedding and head are 86% of the path; 8 rounds (20.6 tokens per
    # non-embedding parameter per path).
    "bpe": Preset((*SMALL_PATH, "tokenizer.vocab_size=2048", "data.seq_len=128", "data.prefix_tokens=32", *SCHEDULE,
                   "train.rounds=8"),
                  paths=(1, 4, 16), families=FAMILIES, tune=False, big_dense=False, extras=False),
    # One short GPU run with the outer steps the cpu sweep's tuning seed chose (DiPaCo's embedding/head at 0.7 won at
    # P = 4 and 16; DiLoCo's 1.0 won at 16, within 0.2% of 0.85 at 4). On these corpora the GPU buys width, not tokens
    # (at most 1.4 passes over a 16-path shard); a small path's step is bound by launch overhead, so the 40 paths x 224
    # steps fit 6 minutes of one H100 with prepare, pretrain, routing and evaluation (the note gives the arithmetic).
    "gpu": Preset(("tokenizer.vocab_size=258", "model.num_layers=4", "model.hidden_size=64",
                   "model.intermediate_size=128", "model.num_heads=4", "data.seq_len=256", "data.prefix_tokens=96",
                   "pretrain.steps=150", "pretrain.optim.warmup_steps=15", "pretrain.optim.batch_size=32",
                   "train.rounds=32", "train.inner_steps=7", "train.optim.batch_size=32",
                   "train.optim.warmup_steps=20", "eval.batch_size=64", "run.device=auto"),
                  paths=(4, 16), families=("dipaco", "diloco"), tune=False, big_dense=False, extras=False,
                  outer={"dipaco": (*DEFAULT_OUTER["dipaco"], "outer.embedding_head_lr_scale=0.7"),
                         "diloco": DEFAULT_OUTER["diloco"]}),
}
# --smoke: any preset's rows at a tiny size on 450 documents (CI): one round, so the outer step, the checkpoint,
# the diagnostics and the evaluation of every row still run once. The grids keep one alternative for DiPaCo and
# DiLoCo (the search and the fresh seeds still run), and one fresh seed.
SMOKE = (*BYTE_PATH, "data.seq_len=64", "data.prefix_tokens=16", "pretrain.steps=20", "pretrain.optim.warmup_steps=2",
         "pretrain.optim.batch_size=8", "train.rounds=1", "train.inner_steps=3", "train.optim.batch_size=8",
         "train.optim.warmup_steps=2", "route.n_init=1", "eval.batch_size=32")
SMOKE_DOCS = 450
SMOKE_GRIDS = {"dipaco": GRIDS["dipaco"][:1], "diloco": GRIDS["diloco"][:1]}


# --- rows -------------------------------------------------------------------------------------------------------------

def family_of(name: str) -> tuple[str, int]:
    """A row's family and P: ``dipaco_shared_16@outer.lr=0.7@run.seed=1`` -> ("dipaco_shared", 16). ValueError for
    a name of another form (``dipaco_16_top2``, a row of the script before this benchmark)."""
    head, _, size = name.split("@")[0].rpartition("_")
    return head, int(size.rstrip("x"))


def family_row(family: str, paths: int, extra: Sequence[str] = (), seed: int | None = None,
               outer: dict[str, tuple[str, ...]] | None = None) -> Row:
    """The row of ``family`` at P = ``paths`` with the grid point ``extra`` on top of its default outer step, at
    ``seed`` (None: the base config's)."""
    seeded = [*extra, *([] if seed is None else [f"{lm.SEED_KEY}={seed}"])]
    name = "@".join([f"dense_{paths}x" if family == "dense" else f"{family}_{paths}", *seeded])
    overrides = [*(outer or DEFAULT_OUTER).get(family, DEFAULT_OUTER[family]), *seeded]
    shards = f"doctopics{paths}_similar"
    if family == "dense":
        return Row(name, "dense", None, rounds_factor=paths, overrides=overrides)
    if family in ("diloco", "moe"):
        return Row(name, f"{family}:{paths}", None if family == "diloco" else shards, overrides=overrides)
    return Row(name, GRID_PRESETS[paths], shards, overrides=[*(PATH_PARTS if family == "dipaco" else SHARED_PARTS), *overrides])


def rank(ppl: float | None) -> float:
    """A perplexity to choose the lowest by: a diverged row's (NaN; null in results.json) is never chosen."""
    return math.inf if ppl is None or math.isnan(ppl) else ppl


@dataclass(frozen=True)
class Plan:
    """What one invocation runs: the preset, its sizes, the fresh seeds, and the grids searched."""

    preset: Preset
    paths: tuple[int, ...]
    seeds: int
    grids: dict[str, tuple[tuple[str, ...], ...]]
    big: BigDense | None = None

    @property
    def families(self) -> list[str]:
        """The preset's families, in the order of the tables and the plot."""
        return [f for f in FAMILIES if f in self.preset.families]

    def grid_points(self, family: str) -> list[tuple[str, ...]]:
        """The outer-step settings ``family`` tries on the tuning seed, its default first; none without tuning (the
        family runs its default on the fresh seeds) and none for dense (no outer step)."""
        return [(), *self.grids.get(family, ())] if self.preset.tune and family != "dense" else []

    def best_setting(self, family: str, paths: int, done: dict[str, dict]) -> tuple[str, ...] | None:
        """The grid point with the lowest tuning-seed perplexity once every point of the grid has run (None before);
        the default when there is no grid."""
        points = self.grid_points(family)
        names = [family_row(family, paths, extra).name for extra in points]
        if any(name not in done for name in names):
            return None
        return min(zip(points, names), key=lambda pn: rank(done[pn[1]]["ppl"]))[0] if points else ()

    def rows(self, done: dict[str, dict]) -> list[Row]:
        """Every row the sweep runs given the rows ``done``: the grids, then each family's best setting on the fresh
        seeds (known once its grid finished), the 16-path extras, and the big dense reference. Cheapest P first."""
        out: list[Row] = []
        seeds, outer = range(1, self.seeds + 1), self.preset.outer
        for p in sorted(self.paths):
            if p == 1:  # plain AdamW, and one path with the outer step: the start of every outer-step family
                out += [family_row("dense", 1), *(family_row(f, 1, seed=s) for f in ("dense", "diloco") for s in seeds)]
                continue
            out += [family_row(f, p, extra, outer=outer) for f in self.preset.families for extra in self.grid_points(f)]
            for family in self.preset.families:
                if (best := self.best_setting(family, p, done)) is not None:
                    out += [family_row(family, p, best, seed=s, outer=outer) for s in seeds]
            if p == 16 and self.preset.extras and (best := self.best_setting("dipaco", 16, done)) is not None:
                out.append(family_row("dipaco", 16, (*best, "route.topk=2"), outer=outer))
        return out + ([self.big.row()] if self.big is not None and 16 in self.paths else [])


def known_rows(preset: Preset) -> dict[str, Row]:
    """Every row a ``--rows ROW@key=value`` may start from: each family at each P at its default outer step."""
    rows = [family_row("dense", 1), *(family_row(f, p, outer=preset.outer) for p in GRID_PRESETS for f in FAMILIES)]
    return {row.name: row for row in rows}


# --- the upper reference: dense with DiPaCo-16's parameters at its compute ---------------------------------------------

def count_params(model: ModelConfig, vocab: int) -> tuple[int, int, int]:
    """(non-embedding, LM head, total) parameters of a path of this shape."""
    net = build_model(llama_config(model, vocab_size=vocab, max_positions=8, eos_id=0, pad_id=1), seed=0)
    params = dict(net.named_parameters())
    head = sum(p.numel() for n, p in params.items() if "lm_head" in n)
    nonemb = sum(p.numel() for n, p in params.items() if "embed_tokens" not in n and "lm_head" not in n)
    return nonemb, head, sum(p.numel() for p in params.values())


def non_embedding_params(model: ModelConfig) -> int:
    """Parameters outside the input embedding and the LM head (what the tokens-per-parameter rule counts)."""
    return count_params(model, 8)[0]


def flops_per_token(model: ModelConfig, vocab: int, seq_len: int) -> float:
    """Forward + backward FLOPs of one training token (Kaplan et al. 2020): 6 x (non-embedding + LM head
    parameters) + 6 x layers x context x width for attention; the embedding is a lookup."""
    nonemb, head, _ = count_params(model, vocab)
    return 6.0 * (nonemb + head) + 6.0 * model.num_layers * seq_len * model.hidden_size


@dataclass(frozen=True)
class BigDense:
    """dense_big_16x: its shape, its rounds, and the arithmetic that chose them."""

    model: ModelConfig
    rounds: int
    params: int
    dipaco_16_bank_params: int
    path_flops_per_token: float
    big_flops_per_token: float

    def row(self) -> Row:
        shape = [f"model.{k}={getattr(self.model, k)}" for k in ("num_layers", "hidden_size", "intermediate_size", "num_heads")]
        return Row("dense_big_16x", "dense", None, model=shape, overrides=[*PLAIN, f"train.rounds={self.rounds}"])


def plan_big_dense(base: Config, vocab: int) -> BigDense:
    """dense_big_16x: the 4-layer path (SwiGLU width 2d, heads of 16) whose parameters are closest to the sweep's
    dipaco_16 bank, for rounds of dipaco_16's FLOPs (16 paths x steps per path x a path's FLOPs per token)."""
    topo = Run(apply_overrides(base, [f"topology.preset={GRID_PRESETS[16]}", *PATH_PARTS])).topology()
    nonemb, head, total = count_params(base.model, vocab)
    per_block = (nonemb - base.model.hidden_size) // base.model.num_layers  # the final norm goes with the head
    bank = sum(part.num_modules * (total - nonemb - head if part.kind == "embedding" else head + base.model.hidden_size
                                   if part.kind == "head" else per_block * len(part.layers)) for part in topo.parts)
    model = min((ModelConfig(num_layers=4, hidden_size=d, intermediate_size=2 * d, num_heads=max(d // 16, 1))
                 for d in range(32, 513, 16)), key=lambda m: abs(count_params(m, vocab)[2] - bank))
    path_flops, big_flops = (flops_per_token(m, vocab, base.data.seq_len) for m in (base.model, model))
    steps = base.train.rounds * base.train.inner_steps
    rounds = max(1, round(16 * steps * path_flops / big_flops / base.train.inner_steps))
    return BigDense(model, rounds, count_params(model, vocab)[2], bank, path_flops, big_flops)


# --- diagnostics --------------------------------------------------------------------------------------------------------

def finite_mean(values: Iterable[float | None]) -> float | None:
    kept = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.fmean(kept) if kept else None


def outer_diagnostics(records: list[dict]) -> dict:
    """Per part kind (embedding, levels, head): the outer-gradient norm, the mean pairwise cosine between the
    changes of the paths through a module and their mean norm, averaged over modules and rounds; and the cosine of
    the first and the last round."""
    def per_round(key: str, kind: str) -> list[float | None]:
        return [finite_mean(v for n, v in r.get(key, {}).items()
                            if ("levels" if n.startswith("level") else n.split(".")[0]) == kind) for r in records]

    out: dict[str, dict] = {}
    for kind in ("embedding", "levels", "head"):
        cosines = per_round("path_cosine", kind)
        out[kind] = {"outer_grad_norm": finite_mean(per_round("outer_grad_norm", kind)),
                     "path_cosine": finite_mean(cosines), "path_delta_norm": finite_mean(per_round("path_delta_norm", kind)),
                     "path_cosine_first": cosines[0] if cosines else None, "path_cosine_last": cosines[-1] if cosines else None}
    return out


def shard_spread(cfg: Config, paths: int) -> dict:
    """Training tokens per path of a row's shards: the smallest, the largest and their coefficient of variation."""
    prepared = Run(cfg).prepared(routed=cfg.train.sharding == "kmeans")
    where = assign_paths(prepared.train, paths, cfg.train.sharding, cfg.run.seed, cfg.train.shard_column)
    tokens = np.bincount(np.asarray(where), weights=np.asarray(prepared.train["num_tokens"], dtype=np.float64),
                         minlength=paths).astype(np.int64).tolist()
    mean = statistics.fmean(tokens)
    return {"tokens_min": min(tokens), "tokens_max": max(tokens),
            "tokens_cv": statistics.pstdev(tokens) / mean if mean else None}


def row_diagnostics(row: Row, result: dict, base: Config, out_dir: Path) -> dict:
    """What a finished row's metrics, shards and per-path perplexities say (added to its result)."""
    cfg = lm.row_config(row, base, out_dir)
    metrics = RunDir(cfg.run.dir).experiment(row.experiment) / "metrics.jsonl"
    finite = sorted(v for v in result.get("per_path_ppl") or [] if v is not None and math.isfinite(v))
    return {"bank_over_path": result["params_total"] / result["params_per_path"],
            "outer": outer_diagnostics(read_metrics(metrics, "outer")) if metrics.is_file() else None,
            "shards": shard_spread(cfg, result["paths"]) if result["paths"] > 1 else None,
            "per_path_ppl": {"min": finite[0], "median": statistics.median(finite), "max": finite[-1]} if finite else None}


# --- the curve, the tables and the targets ------------------------------------------------------------------------------

def is_grid_point(group: str) -> bool:
    """Whether a row name without its seed is a family at its default or one of its grid's outer steps (not a row
    beside the sweep, such as top-2 shards or another schedule). At P = 1 only dense_1x and diloco_1 exist."""
    try:
        family, p = family_of(group)
    except ValueError:
        return False
    if p == 1:
        return group in ("dense_1x", "diloco_1")
    return family in FAMILIES and tuple(group.split("@")[1:]) in ((), *GRIDS[family])


def grid_rows(results: Iterable[Mapping[str, Any]], default_seed: int) -> Iterator[tuple[str, int, str, int, float]]:
    """(family, P, name without the seed, seed, perplexity) of each row at a grid point; a diverged row's
    perplexity (null in results.json) as NaN."""
    for r in results:
        group, seed = seed_group(r["name"], default_seed)
        if is_grid_point(group):
            yield *family_of(group), group, seed, math.nan if r["ppl"] is None else r["ppl"]


def fresh_seed_rows(results: list[dict], default_seed: int = 0) -> dict[tuple[str, int], dict[int, float]]:
    """Perplexity by fresh seed of each (family, P) at its best setting: the rows run with ``@run.seed=N``, N !=
    the tuning seed, not extras (top-2). At P = 1: dense_1x for dense, diloco_1 for every family with an outer step."""
    out: dict[tuple[str, int], dict[int, float]] = {}
    for family, p, _, seed, ppl in grid_rows(results, default_seed):
        if seed == default_seed:
            continue
        for f in [g for g in FAMILIES if START[g] == family] if p == 1 else [family]:
            out.setdefault((f, p), {})[seed] = ppl
    return out


def mean_std(values: Iterable[float]) -> tuple[float, float | None]:
    """Mean and sample std over seeds; no std of one seed, nor with a diverged one (NaN or infinite)."""
    kept = list(values)
    return statistics.fmean(kept), statistics.stdev(kept) if len(kept) > 1 and all(map(math.isfinite, kept)) else None


def fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def seeds_cell(by_seed: Mapping[int, float] | None) -> str:
    """A family's perplexity at one P: the fresh seeds' mean ± std (their number)."""
    if not by_seed:
        return "-"
    mean, std = mean_std(by_seed.values())
    return f"{mean:.3f}" if std is None else f"{mean:.3f} ± {std:.3f} ({len(by_seed)})"


def bits_per_byte(ppl: float | None, bytes_per_token: float | None) -> float | None:
    return None if not bytes_per_token or ppl is None else math.log2(ppl) / bytes_per_token


def dig(value: Any, *keys: str) -> Any:
    """``value[k1][k2]...``, None from the first level missing (a row written before the diagnostics has none)."""
    for key in keys:
        value = value.get(key) if isinstance(value, Mapping) else None
    return value


def scaling_table(results: list[dict], paths: Sequence[int], default_seed: int = 0,
                  families: Sequence[str] = FAMILIES) -> str:
    """Validation perplexity by family (rows) and P (columns): mean ± std over the fresh seeds (number of seeds)."""
    main = fresh_seed_rows(results, default_seed)

    def at(p: int) -> Cell:
        return lambda r: seeds_cell(main.get((r["family"], p)))

    columns: list[Column] = [("family (inference: one path)", lambda r: LABELS[r["family"]])]
    return markdown_table([{"family": f} for f in families], columns + [(f"P = {p}", at(p)) for p in paths])


def grid_table(results: list[dict], default_seed: int = 0) -> str:
    """The outer-step search: every grid point's tuning-seed perplexity, the chosen one in bold."""
    points: dict[tuple[int, str], dict[str, float]] = {}
    for family, p, group, seed, ppl in grid_rows(results, default_seed):
        if seed == default_seed and p > 1:
            points.setdefault((p, family), {})[group] = ppl
    lines = []
    for (p, family), ppls in sorted(points.items()):
        best = min(ppls, key=lambda group: rank(ppls[group]))
        lines += [{"family": family, "P": p, "ppl": f"**{ppl:.3f}**" if group == best and len(ppls) > 1 else f"{ppl:.3f}",
                   "setting": "@".join(group.split("@")[1:]) or f"default ({', '.join(DEFAULT_OUTER[family])})"}
                  for group, ppl in ppls.items()]
    return markdown_table(lines, [("family", "family"), ("P", "P"),
                                  ("outer step (on top of the family's default)", "setting"), ("tuning-seed ppl", "ppl")])


def rows_table(results: list[dict], nonemb: int, tokens_per_step: int, bytes_per_token: float | None) -> str:
    """Every row: its size, tokens per path and per non-embedding parameter, shards, wall time and perplexity."""
    def shards(r: Mapping[str, Any]) -> str:
        s = dig(r, "diagnostics", "shards")
        return "-" if not s else f"{count_text(s['tokens_min'])}-{count_text(s['tokens_max'])} ({s['tokens_cv']:.2f})"

    return markdown_table(results, [
        ("row", "name"), ("paths", "paths"), ("params/path", lambda r: count_text(r["params_per_path"])),
        ("params total", lambda r: count_text(r["params_total"])),
        ("bank / path", lambda r: f"{r['params_total'] / r['params_per_path']:.1f}"),
        ("tokens/path", lambda r: count_text(int(r["steps_per_path"] * tokens_per_step))),
        ("tokens per non-emb param", lambda r: f"{int(r['steps_per_path'] * tokens_per_step) / nonemb:.1f}"),
        ("shard NMI", lambda r: fmt(r.get("nmi"))), ("shard tokens min-max (CV)", shards),
        ("wall", lambda r: f"{r['wall_time_s'] / 60:.1f} min{' (resumed)' if r.get('resumed') else ''}"),
        ("val ppl", lambda r: fmt(r["ppl"])), ("bits/byte", lambda r: fmt(bits_per_byte(r["ppl"], bytes_per_token), ".4f")),
    ])


def diagnostics_table(results: list[dict], default_seed: int = 0) -> str:
    """One line per (family, P) at its first fresh seed: what the outer step and the paths did."""
    def outer(key: str, spec: str, *kinds: str) -> Cell:
        return lambda r: ", ".join(fmt(dig(r, "diagnostics", "outer", kind, key), spec) for kind in kinds)

    def per_path(r: Mapping[str, Any]) -> str:
        ppl = dig(r, "diagnostics", "per_path_ppl")
        return "-" if not ppl else f"{ppl['min']:.2f} / {ppl['median']:.2f} / {ppl['max']:.2f}"

    def levels_cosine(r: Mapping[str, Any]) -> str:
        mean, first, last = (outer(key, ".3f", "levels")(r) for key in ("path_cosine", "path_cosine_first", "path_cosine_last"))
        return f"{mean} ({first} -> {last})"

    def first_fresh_seed(r: Mapping[str, Any]) -> bool:
        group, seed = seed_group(r["name"], default_seed)
        return seed == default_seed + 1 and is_grid_point(group)

    return markdown_table([r for r in results if first_fresh_seed(r)], [
        ("row", "name"), ("per-path ppl min / median / max", per_path),
        ("outer-grad norm: levels, emb, head", outer("outer_grad_norm", ".4f", "levels", "embedding", "head")),
        ("path cosine: levels (first -> last round)", levels_cosine),
        ("path cosine: emb, head", outer("path_cosine", ".3f", "embedding", "head")),
        ("path change norm: levels", outer("path_delta_norm", ".4f", "levels")),
    ])


def targets(results: list[dict], default_seed: int = 0) -> list[str]:
    """The issue's targets on the fresh seeds' means of each family's best setting, and what explains them."""
    main = fresh_seed_rows(results, default_seed)
    mean = {key: statistics.fmean(by_seed.values()) for key, by_seed in main.items() if by_seed}
    out: list[str] = []

    def check(label: str, ok: bool, detail: str | None) -> None:  # detail None: its rows have not run
        out.append(f"- {label}: {'not run' if detail is None else 'met' if ok else 'MISSED'} ({detail or 'not run'})")

    d4, d16, l16 = mean.get(("dipaco", 4)), mean.get(("dipaco", 16)), mean.get(("diloco", 16))
    ratio = None if d16 is None or l16 is None else d16 / l16
    check(f"DiPaCo-16 <= {TARGET_RATIO} x DiLoCo-16 (fresh-seed means)", ratio is not None and ratio <= TARGET_RATIO,
          None if ratio is None else f"{d16:.3f} vs {l16:.3f}: ratio {ratio:.4f}")
    dp4, dp16, dl4, dl16 = (main.get((f, p), {}) for f in ("dipaco", "diloco") for p in (4, 16))
    per_seed = [(s, dp4[s] / dl4[s], dp16[s] / dl16[s]) for s in sorted(set(dp4) & set(dp16) & set(dl4) & set(dl16))]
    check("the DiPaCo/DiLoCo ratio at P = 16 is below the one at P = 4 in every seed", all(b < a for _, a, b in per_seed),
          "; ".join(f"seed {s}: P=4 {a:.4f}, P=16 {b:.4f}" for s, a, b in per_seed) or None)
    fall = None if d4 is None or d16 is None else 1 - d16 / d4
    check(f"DiPaCo at P = 16 at least {TARGET_FALL:.0%} below P = 4", fall is not None and fall >= TARGET_FALL,
          None if fall is None else f"{d4:.3f} -> {d16:.3f}: {-fall:+.2%}")
    for p in (4, 16):
        if cells := [f"{f} {mean[(f, p)]:.3f}" for f in FAMILIES if (f, p) in mean]:
            out.append(f"- (info) P = {p}: " + ", ".join(cells))
    for p in (4, 16):
        for other, text in (("dipaco_shared", "path-specific embedding + head {:.3f} vs shared {:.3f}"),
                            ("moe", "DiPaCo {:.3f} vs flat MoE (nothing shared) {:.3f}")):
            if (ours := mean.get(("dipaco", p))) is not None and (theirs := mean.get((other, p))) is not None:
                out.append(f"- (info) P = {p}: {text.format(ours, theirs)}: {1 - ours / theirs:+.2%}")
    big = next((r for r in results if r["name"] == "dense_big_16x"), None)
    if big is not None and d16 is not None:
        out.append(f"- (info) dense_big_16x ({count_text(big['params_total'])} parameters, DiPaCo-16's compute): "
                   f"{fmt(big['ppl'])} vs DiPaCo-16 {d16:.3f}")
    return out + [f"- (info) {r['name']} (top-2 overlapping shards, tuning seed): {fmt(r['ppl'])}"
                  for r in results if "route.topk=2" in r["name"]]


def plot(results: list[dict], paths: Sequence[int], path: Path, default_seed: int = 0,
         families: Sequence[str] = FAMILIES) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        echo("[bench] matplotlib not installed (pip install -e '.[bench]'): no plot")
        return None
    main = fresh_seed_rows(results, default_seed)
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for fam, marker in zip(families, "osD^v"):
        if points := [(p, *mean_std(main[(fam, p)].values())) for p in paths if (fam, p) in main]:
            ax.errorbar([x for x, _, _ in points], [m for _, m, _ in points], yerr=[s or 0 for _, _, s in points],
                        marker=marker, capsize=3, label=f"{LABELS[fam]} (inference: 1 path)")
    if big := next((r for r in results if r["name"] == "dense_big_16x"), None):
        ax.plot([16], [big["ppl"]], marker="*", markersize=11, linestyle="none", color="black",
                label=f"dense with DiPaCo-16's parameters ({count_text(big['params_total'])}), same compute")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(paths), [str(p) for p in paths])
    ax.set(xlabel="paths P (equal compute: P x one path's steps)", ylabel="validation perplexity (mean of the fresh seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --- the summary ----------------------------------------------------------------------------------------------------------

def scored_bytes_per_token(cfg: Config) -> float | None:
    """UTF-8 bytes per scored validation token (the tokens after each document's routing prefix), for bits per byte:
    bits/byte = log2(ppl) / this. None when the tokenizer's pieces are not byte-level."""
    from tokenizers.pre_tokenizers import ByteLevel

    prepared = Run(cfg).prepared(routed=False)
    tok = prepared.tokenizer
    special, alphabet = set(tok.all_special_ids), set(ByteLevel.alphabet())  # the alphabet: one character per byte
    pieces = tok.convert_ids_to_tokens(list(range(len(tok))))
    if any(i not in special and not set(piece) <= alphabet for i, piece in enumerate(pieces)):
        return None
    nbytes = [0 if i in special else len(piece) for i, piece in enumerate(pieces)]
    prefix = max(cfg.data.prefix_tokens, 1)
    scored = [ids[prefix:] for ids in prepared.validation["input_ids"] if len(ids) > prefix]
    tokens = sum(len(ids) for ids in scored)
    return sum(nbytes[i] for ids in scored for i in ids) / tokens if tokens else None


def shard_passes(out_dir: Path, paths: int, tokens_per_path: int) -> dict | None:
    """How many times the doc_topics shards at ``paths`` are read: tokens per path / shard tokens."""
    report = out_dir / f"run_doctopics{paths}_similar" / "routing" / "routing_report.json"
    if not report.is_file():
        return None
    shard = json.loads(report.read_text())["train"]["tokens_per_path"]
    return {"shard_tokens_min": min(shard), "shard_tokens_mean": statistics.fmean(shard),
            "passes_max": tokens_per_path / max(min(shard), 1), "passes_mean": tokens_per_path / statistics.fmean(shard)}


def regime(base: Config) -> tuple[int, int, int]:
    """A path's non-embedding parameters, and the tokens of one step and of one path's training."""
    tokens_per_step = base.train.optim.batch_size * base.data.seq_len
    return non_embedding_params(base.model), tokens_per_step, base.train.rounds * base.train.inner_steps * tokens_per_step


def summary(results: list[dict], plan: Plan, base: Config, out_dir: Path,
            recorded: Mapping[str, Any]) -> tuple[str, float | None, dict]:
    """The tables, diagnostics and targets, with the bytes per scored token and the shard passes they show: those
    ``recorded`` in results.json where it has them (a sweep still running has written only its rows and config)."""
    nonemb, tokens_per_step, tokens_per_path = regime(base)
    bytes_per_token = recorded.get("scored_bytes_per_token")
    if bytes_per_token is None and (Path(base.run.dir) / "tokenizer").is_dir():
        bytes_per_token = scored_bytes_per_token(base)
    passes = recorded.get("shard_passes") or {p: shard_passes(out_dir, p, tokens_per_path) for p in plan.paths if p > 1}
    seed = base.run.seed
    text = "\n\n".join(t for t in [
        scaling_table(results, plan.paths, seed, plan.families), grid_table(results, seed),
        rows_table(results, nonemb, tokens_per_step, bytes_per_token), diagnostics_table(results, seed),
        "\n".join(f"- P={p}: doc_topics shards of {s['shard_tokens_min']:,} tokens (smallest), {s['shard_tokens_mean']:,.0f} "
                  f"(mean); each path reads its shard {s['passes_mean']:.2f} times on average, {s['passes_max']:.2f} at most"
                  for p, s in passes.items() if s),
        "\n".join(targets(results, seed)),
    ] if t)
    return text, bytes_per_token, passes


# --- running ------------------------------------------------------------------------------------------------------------

def parse_paths(text: str) -> list[int]:
    try:
        paths = sorted({int(x) for x in text.split(",")})
    except ValueError:
        raise SystemExit(f"error: --paths: a comma-separated list of 1, 4, 16, 64, got {text!r}") from None
    if unknown := [p for p in paths if p != 1 and p not in GRID_PRESETS]:
        raise SystemExit(f"error: --paths: {unknown} not among 1, 4, 16, 64 (the square grids of two levels)")
    return paths


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The flags; ``--families`` becomes a tuple of the preset's families (an unknown one is refused, named)."""
    p = argument_parser("path_scaling", __doc__)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu", help="the regime (default cpu; see above)")
    p.add_argument("--smoke", action="store_true", help="the preset's rows at a tiny size on 450 documents (CI)")
    p.add_argument("--paths", default=None, help="comma-separated P among 1, 4, 16, 64 (default: the preset's)")
    p.add_argument("--seeds", type=int, default=None,
                   help="fresh seeds of each family's best setting (default 2; 1 with --smoke or the gpu preset)")
    p.add_argument("--families", default=None,
                   help=f"comma-separated subset of the preset's families ({', '.join(FAMILIES)}); default: all of them")
    p.add_argument("--corpus", choices=sorted(lm.CORPORA), default="mix",
                   help="the shared corpora: mix (all three, the default) or one of them")
    p.add_argument("--out-dir", default=None,
                   help="default runs/bench_scaling_<preset>[_smoke] (runs/bench_scaling for the cpu preset)")
    p.add_argument("--resume", action="store_true", help="keep the rows results.json already holds (same base config "
                   "and row settings); a row cut off continues from its last round's checkpoint")
    p.add_argument("--report", action="store_true", help="train nothing: the tables and targets of --out-dir's rows")
    p.add_argument("--data", type=Path, default=None,
                   help="the folder holding the shared corpora (default: shared/data beside the repository)")
    p.add_argument("--rows", nargs="*", default=[], metavar="ROW@key=value", help="more rows after the sweep's: a family "
                   "row with extra overrides, e.g. dipaco_16@route.topk=2 (give them after the key=value overrides)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dipaco overrides on top of the preset's")
    args = p.parse_args(argv)
    if args.seeds is not None and args.seeds < 1:
        p.error("--seeds must be >= 1")
    if args.families is not None:
        args.families = tuple(f.strip() for f in args.families.split(",") if f.strip())
        if (unknown := [f for f in args.families if f not in PRESETS[args.preset].families]) or not args.families:
            p.error(f"--families: {unknown or 'none given'} not among the {args.preset} preset's "
                    f"{', '.join(PRESETS[args.preset].families)}")
    return args


def make_plan(args: argparse.Namespace) -> Plan:
    preset = PRESETS[args.preset] if args.families is None else replace(PRESETS[args.preset], families=args.families)
    paths = tuple(parse_paths(args.paths)) if args.paths else preset.paths
    seeds = args.seeds if args.seeds is not None else 1 if args.smoke or args.preset == "gpu" else 2
    return Plan(preset, paths, seeds, SMOKE_GRIDS if args.smoke else GRIDS)


def base_config(args: argparse.Namespace, out_dir: Path) -> Config:
    """Every row's base config, its corpus written into ``out_dir`` (a missing corpus is named before anything)."""
    sources = lm.CORPORA[args.corpus]
    data_dir = (lm.SHARED if args.data is None else args.data).resolve()
    lm.missing_corpora(data_dir, sources)
    quiet_library_progress_bars()
    out_dir.mkdir(parents=True, exist_ok=True)
    corpus = lm.out_dir_corpus(out_dir, SMOKE_DOCS // len(sources) if args.smoke else None, sources, data_dir,
                               "this one (--corpus, --smoke)")
    return load_config(REPO / "configs/bench/quality.yaml",
                       [*PRESETS[args.preset].overrides, *(SMOKE if args.smoke else ()), "train.diagnostics=true",
                        f"run.dir={out_dir / 'base'}", f"data.corpus={corpus}", *args.overrides])


def run_sweep(results: Results, plan: Plan, asked: list[Row], base: Config, out_dir: Path, resume: bool,
              started: float) -> None:
    """Runs every planned row results.json lacks, writing it after each (a grid that finishes plans its best
    setting's fresh seeds), and keeps the rows in the plan's order."""
    def planned() -> list[Row]:
        rows = plan.rows({r["name"]: r for r in results.rows})
        return rows + [r for r in asked if r.name not in {x.name for x in rows}]

    def in_plan_order() -> None:
        order = {r.name: i for i, r in enumerate(planned())}
        results.sort(key=lambda r: order.get(r["name"], len(order)))

    while todo := [r for r in planned() if not lm.finished(results, r)]:
        row = todo[0]
        echo(f"[bench] === {row.name} ({row.preset}, shards {row.routing or 'iid'}); {len(todo)} rows to go, more "
             f"once a grid finishes ===")
        # A row cut off mid-way (not in results.json) continues from its checkpoint; one whose settings changed
        # trains again from scratch.
        result = lm.run_row(row, base, out_dir, resume=resume and results.get(row.name) is None, curve_at=lambda last: [last])
        result["diagnostics"] = row_diagnostics(row, result, base, out_dir)
        lm.put_row(results, row, result)
        echo(f"[bench] {row.name}: ppl {result['ppl']:.3f} in {result['wall_time_s']:.0f}s "
             f"({time.perf_counter() - started:.0f}s into this invocation)")
        in_plan_order()
        results.write()
    in_plan_order()


def main(argv: list[str] | None = None) -> None:
    """Runs the sweep until every planned row is in results.json (or, with --report, reads it), then prints the
    tables, diagnostics and targets."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    plan = make_plan(args)
    known = known_rows(plan.preset)
    if unknown := unknown_rows(args.rows, known):
        sys.exit(f"error: unknown row {unknown[0]!r} (FAMILY_P or FAMILY_P@key=value@...); known: {', '.join(known)}")
    asked = [lm.named_row(row, known) for row in args.rows]
    name = "bench_scaling" + ("" if args.preset == "cpu" else f"_{args.preset}") + ("_smoke" if args.smoke else "")
    out_dir = Path(args.out_dir or f"runs/{name}").resolve()
    if args.report:
        return report(out_dir, plan)
    base = base_config(args, out_dir)
    nonemb, _, tokens_per_path = regime(base)
    echo(f"[bench] preset {args.preset}{' (smoke)' if args.smoke else ''}: path of {nonemb:,} non-embedding parameters; "
         f"{tokens_per_path:,} training tokens per path ({tokens_per_path / nonemb:.1f} per non-embedding parameter)")

    started = time.perf_counter()
    init_ppl = lm.prepared_init(base)
    if plan.preset.big_dense and 16 in plan.paths:
        plan = replace(plan, big=plan_big_dense(base, len(Run(base).prepared(routed=False).tokenizer)))
    results = lm.open_results(out_dir / "results.json", "path_scaling", base, args.resume)
    results.meta["pretrained_ppl"] = init_ppl
    if not args.resume and results.path.is_file():
        echo(f"[bench] starting over: {results.path} will be replaced (--resume keeps its rows)")
    run_sweep(results, plan, asked, base, out_dir, args.resume, started)
    done = results.rows
    text, bytes_per_token, passes = summary(done, plan, base, out_dir, results.meta)
    png = plot(done, plan.paths, out_dir / "scaling_ppl_vs_paths.png", base.run.seed, plan.families)
    total = time.perf_counter() - started
    results.meta.update(invocation_wall_time_s=total, rows_wall_time_s=sum(r["wall_time_s"] for r in done),
                        command=command_line("path_scaling", argv), preset=args.preset, smoke=args.smoke,
                        targets="\n".join(targets(done, base.run.seed)), non_embedding_params=nonemb,
                        tokens_per_path=tokens_per_path, shard_passes=passes, scored_bytes_per_token=bytes_per_token,
                        big_dense=None if plan.big is None else {**asdict(plan.big), "model": asdict(plan.big.model)},
                        environment=environment(None if base.run.device == "auto" else base.run.device))
    results.write()
    write_text(out_dir / "scaling.md", text + "\n")
    print(f"\npreset {args.preset}; pretrained init: val ppl {init_ppl:.3f}; path: {nonemb:,} non-embedding parameters, "
          f"{tokens_per_path:,} tokens per path ({tokens_per_path / nonemb:.1f} per non-embedding parameter); "
          f"{fmt(bytes_per_token)} bytes per scored token\n\n{text}")
    print(f"\n{len(done)} rows (training {sum(r['wall_time_s'] for r in done) / 60:.1f} min); this invocation "
          f"took {total / 60:.1f} min; results in {out_dir}; plot: {png or 'none'}")
    if any(r["ppl"] is None or not math.isfinite(r["ppl"]) for r in done):
        sys.exit("error: a row's validation perplexity is not finite")


def report(out_dir: Path, plan: Plan) -> None:
    """The tables and targets of the rows results.json holds, without training. Reads the files written before
    the benchmark moved here (scripts/bench_scaling.py's) too."""
    path = out_dir / "results.json"
    if not path.is_file():
        sys.exit(f"error: --report: no {path}")
    results = Results.load(path, "path_scaling", resume=True)
    if "base_config" not in results.meta:
        sys.exit(f"error: --report: {path} records no base config")
    print(summary(results.rows, plan, lm.recorded_base_config(results.meta["base_config"]), out_dir, results.meta)[0])
