"""Quality benchmark: the DiPaCo paper's comparison table (Table 1) at a scale this machine runs.

Every row shares the tokenizer, the path architecture, the pretrained initialisation, the
prefix exclusion and the validation documents; only the topology, the sharding and the number of
steps differ. Rows (P = paths of the small grid, Q = paths of the large one):

    dense_1x            one path for as many steps as each DiPaCo path            compute 1x
    dense_Px            one path for P times the steps                             compute Px
    diloco_P            P replicas of the dense model on k-means shards            compute Px
    moe_P               P independent models on k-means shards (flat MoE)          compute Px
    moe_P_featurizer    flat MoE on the improved featurizer's shards               compute Px
    moe_P_doctopics     flat MoE on the doc_topics featurizer's shards             compute Px
    moe_P_iid           flat MoE on iid shards: the control of the three rows above compute Px
    dipaco_2x2_*        kmeans / improved featurizer / doc_topics / doc_topics with its shards
                        numbered so alike ones share modules (route.arrange=similar) or unlike
                        ones do (dissimilar, the control) / + top-2 overlapping shards /
                        product k-means / + discriminative re-routing once / EM re-sharding
                        (re-routing after several rounds) / + per-path early stopping /
                        iid shards (the control every routed 2x2 row is judged against)   compute Px
    dipaco_2x2_pathemb_*  featurizer / top-2 / iid with path-specific embedding and head (each
                        path owns them, as in the paper's 16x16 run); judged against
                        dipaco_2x2_pathemb_iid                                     compute Px
    dense_deep_Px       dense with DiPaCo 2x2's total parameter count (twice the layers,
                        its own pretraining), trained on as many tokens as DiPaCo  compute ~1.45Px
    diloco_Q, dipaco_4x4_*  (kmeans / product k-means / + early stopping / iid)    compute Qx

"kmeans" routing is `dipaco route`'s default featurizer (the pretrained model's mean last hidden
state over the prefix); "featurizer" is the improved one (TF-IDF + SVD of the same prefix text, cosine
k-means; see docs/notes/2026-11-23-what-routing-buys.md for the NMI study that chose it); "doctopics" reads the same prefix with
a naive Bayes word model of topics found in the whole training documents (`route.featurizer=doc_topics`). Each row
reports the NMI and purity of its training shards against the corpus labels, so what routing buys
is visible beside the routed row's perplexity and its iid control's.

Outputs (in --out-dir): results.json (every row, every round), a markdown table, and PNG plots of
validation perplexity against training tokens and of shard sizes. Rows repeated over seeds
(ROW@run.seed=N) get a table of their mean and spread, and the equal-compute comparison with DiLoCo
uses each configuration's mean over the seeds it ran.

    python scripts/bench_quality.py                 # default scale, ~2 h on 2 CPU cores
    python scripts/bench_quality.py --smoke         # ~1 min, for CI
    python scripts/bench_quality.py --scale 4       # wider model, more steps: for a GPU (run.device=auto)
    python scripts/bench_quality.py --resume        # keep the rows results.json already holds, run the rest
    python scripts/bench_quality.py --rows dipaco_2x2_featurizer@outer.rescale=sqrt_paths \
        dipaco_2x2_iid@outer.rescale=sqrt_paths      # ROW@key=value@...: a row with extra dipaco overrides,
                                                    # judged against its iid control with the same overrides
    python scripts/bench_quality.py --report RUN_A/results.json RUN_B/results.json
                                                    # train nothing: one table and the targets for rows that
                                                    # ran side by side in two out-dirs of one corpus and init
    timeout 590 python scripts/bench_quality.py --preset gpu --resume   # the GPU regime, 10-minute commands:
                                                    # repeat until it prints the table; a row cut off
                                                    # continues from its last round's checkpoint
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from omegaconf import OmegaConf  # noqa: E402

from dipaco import json_text  # noqa: E402
from dipaco.atomic import write_text  # noqa: E402
from dipaco.checkpoint.store import CheckpointManager  # noqa: E402
from dipaco.config import Config, config_diff  # noqa: E402
from dipaco.data.corpus import strip_header  # noqa: E402
from dipaco.metrics import echo  # noqa: E402
from dipaco.route.shards import assign_paths  # noqa: E402
from dipaco.run import (  # noqa: E402
    Run,  # noqa: E402
    apply_overrides,
    load_config,
)
from dipaco.run_dir import RunDir  # noqa: E402
from dipaco.runtime import quiet_library_progress_bars  # noqa: E402
from routing.quality import routing_report  # noqa: E402

SHARED = REPO.parent / "shared" / "data"
SOURCES = ("20news_bydate.jsonl.gz", "bbc_news.jsonl.gz", "brown_genres.jsonl.gz")
# --corpus: which shared corpora make the benchmark corpus (mix: all three, the default)
CORPORA = {"mix": SOURCES, "bbc": ("bbc_news.jsonl.gz",), "20ng": ("20news_bydate.jsonl.gz",),
           "brown": ("brown_genres.jsonl.gz",)}


@dataclass
class Row:
    name: str
    preset: str
    routing: str | None  # None = iid (one path: every doc), else a routing variant name
    rounds_factor: int = 1  # dense_Px trains P times the rounds
    reroutes: int = 0  # discriminative re-routings at evenly spaced rounds, by `dipaco train` itself (route.em_rounds;
    # 1: half-way; more: EM re-sharding)
    early_stopping: bool = False  # hold out train docs, score each path's best round
    model: list[str] = field(default_factory=list)  # another architecture: own run dir and pretraining
    overrides: list[str] = field(default_factory=list)

    @property
    def experiment(self) -> str:
        """The row's train.name: its name, made a plain directory name (ROW@key=value rows hold '=' and '.')."""
        return re.sub(r"[^A-Za-z0-9_.-]", "_", self.name)


EARLY_STOP_HOLDOUT = "train.early_stopping_holdout=0.05"
PATH_EMBEDDING = ["topology.embedding=path", "topology.head=path"]  # the *_pathemb_* rows


EM_REROUTES = 3  # re-routings of the EM row: after rounds R/4, R/2, 3R/4 (every round when R = 4)



def prepare(cfg: Config) -> dict:
    """`dipaco prepare` (a name the tests replace to prove a row or corpus is refused before any work)."""
    return Run(cfg).prepare()


def pretrain(cfg: Config) -> None:
    Run(cfg).pretrain()


def rows(small: int, large: int, include_large: bool, num_layers: int) -> list[Row]:
    dense = ["outer.lr=1.0", "outer.momentum=0.0"]
    out = [
        Row("dense_1x", "dense", None, overrides=dense),
        Row(f"dense_{small}x", "dense", None, rounds_factor=small, overrides=dense),
        Row(f"diloco_{small}", f"diloco:{small}", f"kmeans{small}"),
        Row(f"moe_{small}", f"moe:{small}", f"kmeans{small}"),
        Row(f"moe_{small}_featurizer", f"moe:{small}", f"featurizer{small}"),
        Row(f"moe_{small}_doctopics", f"moe:{small}", f"doctopics{small}"),
        Row(f"moe_{small}_iid", f"moe:{small}", None),
        Row("dipaco_2x2_kmeans", "grid:2x2", f"kmeans{small}"),
        Row("dipaco_2x2_featurizer", "grid:2x2", f"featurizer{small}"),
        Row("dipaco_2x2_doctopics", "grid:2x2", f"doctopics{small}"),
        # The same shards, numbered as paths so that alike shards share modules (route.arrange), or unlike ones.
        Row("dipaco_2x2_doctopics_similar", "grid:2x2", f"doctopics{small}_similar"),
        Row("dipaco_2x2_doctopics_dissimilar", "grid:2x2", f"doctopics{small}_dissimilar"),
        Row("dipaco_2x2_top2", "grid:2x2", f"featurizer{small}", overrides=["route.topk=2"]),
        Row("dipaco_2x2_iid", "grid:2x2", None),
        Row("dipaco_2x2_product", "grid:2x2", "product2x2"),
        # Paths that share a level module get documents near each other in that level's feature half,
        # where flat k-means pairs its clusters onto the grid's cells in index order.
        Row("dipaco_2x2_product_featurizer", "grid:2x2", "featurizer_product2x2"),
        Row("dipaco_2x2_reroute", "grid:2x2", f"kmeans{small}", reroutes=1),
        Row("dipaco_2x2_em", "grid:2x2", f"featurizer{small}", reroutes=EM_REROUTES),
        Row("dipaco_2x2_early_stop", "grid:2x2", f"kmeans{small}", early_stopping=True, overrides=[EARLY_STOP_HOLDOUT]),
        # The paper's 16x16 run kept the embedding path-specific: a path's own embedding and head can
        # specialize on its shard's vocabulary, which a part shared by every path averages away.
        Row("dipaco_2x2_pathemb_featurizer", "grid:2x2", f"featurizer{small}", overrides=PATH_EMBEDDING),
        Row("dipaco_2x2_pathemb_top2", "grid:2x2", f"featurizer{small}", overrides=[*PATH_EMBEDDING, "route.topk=2"]),
        Row("dipaco_2x2_pathemb_iid", "grid:2x2", None, overrides=PATH_EMBEDDING),
        # A 2x2 grid holds two modules per level, so its total count is a dense model with twice the layers.
        Row(f"dense_deep_{small}x", "dense", None, rounds_factor=small, model=[f"model.num_layers={2 * num_layers}"],
            overrides=dense),
    ]
    if include_large:
        out += [
            Row(f"diloco_{large}", f"diloco:{large}", f"kmeans{large}"),
            Row("dipaco_4x4_kmeans", "grid:4x4", f"kmeans{large}"),
            Row("dipaco_4x4_product", "grid:4x4", "product4x4"),
            Row("dipaco_4x4_early_stop", "grid:4x4", f"kmeans{large}", early_stopping=True,
                overrides=[EARLY_STOP_HOLDOUT]),
            Row("dipaco_4x4_iid", "grid:4x4", None),
        ]
    return out


# The GPU regime's rows (issue 14): dense 1x and Px, DiLoCo-P, flat MoE-P, DiPaCo k-means / improved
# featurizer / top-2 overlap / iid control, and the MoE controls.
GPU_ROWS = ("dense_1x", "dense_{p}x", "diloco_{p}", "moe_{p}", "moe_{p}_featurizer", "moe_{p}_doctopics", "moe_{p}_iid",
            "dipaco_2x2_kmeans", "dipaco_2x2_featurizer", "dipaco_2x2_doctopics", "dipaco_2x2_doctopics_similar",
            "dipaco_2x2_top2", "dipaco_2x2_iid",
            "dipaco_2x2_pathemb_featurizer", "dipaco_2x2_pathemb_top2", "dipaco_2x2_pathemb_iid",
            "diloco_{q}", "dipaco_4x4_kmeans", "dipaco_4x4_iid")


IMPROVED_SVD = 64  # TF-IDF SVD width of the improved featurizer

# Left out of --smoke to keep CI's time: the smoke run still has an iid control (dipaco_2x2_iid), and at
# its 2 rounds the EM row would re-route at the same single point as dipaco_2x2_reroute.
SMOKE_SKIP = ("moe_4_featurizer", "moe_4_doctopics", "moe_4_iid", "dipaco_2x2_em", "dipaco_2x2_pathemb_featurizer",
              "dipaco_2x2_doctopics_similar", "dipaco_2x2_doctopics_dissimilar",
              "dipaco_2x2_pathemb_top2", "dipaco_2x2_pathemb_iid", "dipaco_2x2_product_featurizer")

# A routed row's iid control is its family's "iid" row (same topology, embedding and head); the
# longest matching prefix wins.
CONTROL_FAMILIES = ("dipaco_2x2_pathemb_", "dipaco_2x2_", "dipaco_4x4_", "moe_4_")


def iid_control(name: str) -> str | None:
    """The iid control a routed row is judged against (None for rows without one). A ``ROW@key=value``
    row's control carries the same overrides: the sweep changes both sides of the comparison."""
    base, at, extra = name.partition("@")
    family = next((f for f in CONTROL_FAMILIES if f"{base}_".startswith(f)), None)
    return None if family is None or base == f"{family}iid" else f"{family}iid{at}{extra}"


SEED_KEY = "run.seed"


def seed_group(name: str, default_seed: int) -> tuple[str, int]:
    """A row's name without its ``@run.seed=N`` override, and the seed it trained with (``default_seed``,
    the base config's, when the name has none). The rows of one group differ only in the training seed."""
    base, *extra = name.split("@")
    seeds = [o.partition("=")[2] for o in extra if o.startswith(f"{SEED_KEY}=")]
    return "@".join([base, *(o for o in extra if not o.startswith(f"{SEED_KEY}="))]), \
        int(seeds[-1]) if seeds else default_seed


def seed_groups(results: list[dict], default_seed: int) -> dict[str, dict[int, float]]:
    """Validation perplexity by seed, for each group of rows that differ only in ``run.seed``."""
    groups: dict[str, dict[int, float]] = {}
    for r in results:
        group, seed = seed_group(r["name"], default_seed)
        groups.setdefault(group, {})[seed] = r["ppl"]
    return groups


def _seeds(seeds) -> str:
    return ",".join(map(str, sorted(seeds)))


def named_row(name: str, known: dict[str, Row]) -> Row:
    """``ROW`` (a row of :func:`rows`) or ``ROW@key=value@key=value``: that row with extra dipaco overrides
    on top of its own, under the full name."""
    base, *extra = name.split("@")
    if base not in known or any("=" not in o for o in extra):
        raise KeyError(name)
    row = known[base]
    return replace(row, name=name, overrides=[*row.overrides, *extra]) if extra else row


def improved_featurizer() -> list[str]:
    """The featurizer the NMI study (scripts/bench_routing.py --sections featurizers, docs/notes/2026-11-23-what-routing-buys.md)
    found topical on the same 32-token prefix: TF-IDF + SVD of the prefix text, cosine k-means. No pooling,
    layer choice or whitening of the small path model's hidden states came near it."""
    return ["route.featurizer=tfidf_svd", f"route.svd_components={IMPROVED_SVD}", "route.metric=cosine",
            "route.topk=2"]  # topk: the top-2 row's overlapping shards; the other rows train with route.topk=1


def doc_topics_featurizer() -> list[str]:
    """Topics of the whole training documents (TF-IDF + SVD(64), cosine k-means, one per path) read from the
    same prefix by a naive Bayes word model (the NMI study in docs/notes/2026-11-23-what-routing-buys.md, "Topics from
    whole documents"); the router then clusters the prefixes' topic posteriors, cosine."""
    return ["route.featurizer=doc_topics", f"route.svd_components={IMPROVED_SVD}", "route.metric=cosine", "route.topk=2"]


ROUTINGS = {  # variant -> (topology used to fit it, route.method, other route settings)
    "kmeans4": ("grid:2x2", "kmeans", []),
    "featurizer4": ("grid:2x2", "kmeans", None),  # None: improved_featurizer()
    "doctopics4": ("grid:2x2", "kmeans", doc_topics_featurizer()),
    "doctopics4_similar": ("grid:2x2", "kmeans", [*doc_topics_featurizer(), "route.arrange=similar"]),
    "doctopics4_dissimilar": ("grid:2x2", "kmeans", [*doc_topics_featurizer(), "route.arrange=dissimilar"]),
    "product2x2": ("grid:2x2", "product", []),
    "featurizer_product2x2": ("grid:2x2", "product", [o for o in improved_featurizer() if o != "route.topk=2"]),
    "kmeans16": ("grid:4x4", "kmeans", []),
    # scripts/bench_scaling.py's DiPaCo and flat-MoE shards at 16 and 64 paths
    "doctopics16_similar": ("grid:4x4", "kmeans", [*doc_topics_featurizer(), "route.arrange=similar"]),
    "doctopics64_similar": ("grid:8x8", "kmeans", [*doc_topics_featurizer(), "route.arrange=similar"]),
    # Product cells are not fitted to the joint data: with the cap alone one 4x4 cell got 1 document.
    "product4x4": ("grid:4x4", "product", ["route.min_shard_fraction=0.5"]),
}


def scale_overrides(args: argparse.Namespace) -> list[str]:
    if args.preset == "gpu":
        # Sized for one H100 within a session's 30 minutes of device time (the P = 4 rows; --large adds
        # P = 16): the --scale 4 model, 16 rounds (4x today's outer steps) x 50 inner steps of 32 sequences,
        # i.e. 3.3M tokens per path (2x --scale 4's 1.6M).
        return [
            "model.hidden_size=512", "model.intermediate_size=1536", "model.num_heads=16", "pretrain.steps=1600",
            "pretrain.optim.batch_size=32", "train.rounds=16", "train.inner_steps=50", "train.optim.batch_size=32",
            "run.device=auto",
        ]
    if args.smoke:
        return [
            "model.num_layers=2", "model.hidden_size=32", "model.intermediate_size=64", "model.num_heads=2",
            "data.seq_len=64", "data.prefix_tokens=16", "tokenizer.vocab_size=512", "pretrain.steps=20",
            "pretrain.optim.batch_size=8", "train.optim.batch_size=8", "train.rounds=2", "train.inner_steps=3",
            "train.optim.warmup_steps=2", "pretrain.optim.warmup_steps=2", "route.n_init=1",
        ]
    s = args.scale
    if s == 1:
        return []
    return [
        f"model.hidden_size={128 * s}", f"model.intermediate_size={384 * s}", f"model.num_heads={4 * s}",
        f"pretrain.steps={400 * s}", f"train.inner_steps={50 * s}", "run.device=auto",
    ]


def write_corpus(path: Path, docs_per_source: int | None, sources: tuple[str, ...] = SOURCES,
                 data_dir: Path | None = None) -> Path:
    """The shared corpora (in ``data_dir``, by default SHARED) as one jsonl, labels prefixed by source,
    20NG headers stripped."""
    data_dir = SHARED if data_dir is None else data_dir
    n = 0
    with path.open("w", encoding="utf-8") as out:
        for name in sources:
            with gzip.open(data_dir / name, "rt", encoding="utf-8") as f:
                for i, line in enumerate(f):
                    if docs_per_source is not None and i >= docs_per_source:
                        break
                    doc = json.loads(line)
                    text = strip_header(doc["text"]) if doc["source"].startswith("20news") else doc["text"]
                    row = {"id": f"{doc['source']}/{doc['id']}", "label": f"{doc['source']}:{doc['label']}", "text": text}
                    out.write(json_text.dumps(row) + "\n")
                    n += 1
    echo(f"[bench] corpus: {n} documents from {', '.join(sources)}")
    return path


def new_run_dir(base: Config, run_dir: Path, parts: tuple[str, ...]) -> None:
    """`run_dir` afresh, holding copies of these parts of the base run (data, tokenizer, ...)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    for sub in parts:
        shutil.copytree(Path(base.run.dir) / sub, run_dir / sub)


def variant_run(base: Config, variant: str | None, out_dir: Path, private: str | None = None,
                keep: bool = False) -> Config:
    """Each routing variant gets its own run dir holding copies of the shared data and init. A row
    that re-routes gets a private copy: re-routing rewrites its run's routing, which the other rows of
    the variant must keep. With ``keep``, a private copy whose row has a checkpoint is kept as it is
    (the row continues there, on the routing its re-routings left)."""
    if variant is None:
        return base
    run_dir = out_dir / f"run_{variant}"
    if not (run_dir / "routing").exists():
        new_run_dir(base, run_dir, ("data", "tokenizer", "pretrain"))
        preset, method, settings = ROUTINGS[variant]
        settings = improved_featurizer() if settings is None else settings
        Run(apply_overrides(base, [f"run.dir={run_dir}", f"topology.preset={preset}",
                                     "train.sharding=kmeans", f"route.method={method}", *settings])).route()
    if private is not None:
        shared, run_dir = run_dir, out_dir / f"run_{variant}_{private}"
        if not (keep and CheckpointManager(RunDir(str(run_dir)).experiment(private) / "checkpoints").latest()):
            shutil.rmtree(run_dir, ignore_errors=True)  # the row starts over, so does its routing
            # Not the variant's experiments (top-level train/); routing/data/train is the routed split.
            shutil.copytree(shared, run_dir, ignore=lambda d, names: ["train"] if Path(d) == shared else [])
    return apply_overrides(base, [f"run.dir={run_dir}", "train.sharding=kmeans"])


def architecture_run(base: Config, name: str, model_overrides: list[str], out_dir: Path) -> tuple[Config, float]:
    """A row with another model shape shares the data and tokenizer but needs its own pretraining;
    returns its config and the pretrained init's validation perplexity."""
    run_dir = out_dir / f"run_{name}"
    cfg = apply_overrides(base, [f"run.dir={run_dir}", *model_overrides])
    if not (run_dir / "pretrain" / "config.json").is_file():
        new_run_dir(base, run_dir, ("data", "tokenizer"))
        pretrain(cfg)
    return cfg, Run(cfg).evaluate_pretrained()["overall"]["ppl"]


def curve_rounds(last: int) -> list[int]:
    """Rounds 1, 2, 4, 8, ... and the last: evenly spaced on the plot's log axis, and a full
    validation pass per point instead of one per round (each pass scores every validation token)."""
    return sorted({2**k for k in range(last.bit_length()) if 2**k <= last} | {last})


def reroute_rounds(rounds: int, reroutes: int) -> list[int]:
    """Rounds after which to re-route: ``reroutes`` evenly spaced points inside (0, rounds)."""
    if rounds < 2:
        return []
    return sorted({max(1, min(rounds - 1, round(rounds * i / (reroutes + 1)))) for i in range(1, reroutes + 1)})


def train_row(row: Row, cfg: Config, resume: bool) -> tuple:
    """Trains the row; a re-routing row re-routes inside `dipaco train` (route.em_rounds, see
    :func:`row_overrides`). With ``resume``, a row continues from its last round's checkpoint (a command
    cut off by a time limit loses at most one round; a re-routing row keeps the re-routings it did)."""
    exp_dir = RunDir(cfg.run.dir).experiment(row.experiment)
    latest = CheckpointManager(exp_dir / "checkpoints").latest()
    if resume and latest is not None:
        echo(f"[bench] {row.name}: continuing from {latest.name}")
        return Run(cfg).train(resume=True), True
    shutil.rmtree(exp_dir, ignore_errors=True)
    return Run(cfg).train(), False


def row_overrides(row: Row, base: Config) -> list[str]:
    """The row's settings on top of its run's config: topology, name, rounds and, for a re-routing row,
    the rounds after which `dipaco train` re-routes (route.em_rounds). A ``train.rounds=N`` among the
    row's overrides (``ROW@train.rounds=N``) replaces the base schedule that both are derived from."""
    schedule = [o for o in row.overrides if o.startswith("train.rounds=")]
    rounds = (int(schedule[-1].partition("=")[2]) if schedule else base.train.rounds) * row.rounds_factor
    points = reroute_rounds(rounds, row.reroutes) if row.reroutes else []
    em = [f"route.em_rounds=[{','.join(map(str, points))}]"] if points else []
    rest = [o for o in row.overrides if o not in schedule]
    return [f"topology.preset={row.preset}", f"train.name={row.experiment}", f"train.rounds={rounds}", *em, *rest]


def routing_quality(cfg: Config, num_paths: int) -> dict:
    """NMI and purity of the training shards the row used (each document's own path) against the labels."""
    if num_paths == 1:
        return {"nmi": None, "purity": None}
    prepared = Run(cfg).prepared(routed=cfg.train.sharding == "kmeans")
    if "label" not in prepared.train.column_names:
        return {"nmi": None, "purity": None}
    paths = assign_paths(prepared.train, num_paths, cfg.train.sharding, cfg.run.seed, cfg.train.shard_column)
    report = routing_report(paths, num_paths, labels=prepared.train["label"])
    return {"nmi": report["nmi"], "purity": report["purity"]}


def run_row(row: Row, base: Config, out_dir: Path, resume: bool = False,
            curve_at: Callable[[int], list[int]] = curve_rounds) -> dict:
    """Trains and evaluates one row; ``curve_at(last round)``: the rounds whose checkpoints are evaluated for
    the perplexity-vs-tokens curve (its last point is the row's result unless the row early-stops)."""
    init_ppl = None
    if row.model:
        assert row.routing is None, "rows with their own architecture are dense (no routing)"
        base, init_ppl = architecture_run(base, row.experiment, row.model, out_dir)
    run = variant_run(base, row.routing, out_dir, private=row.experiment if row.reroutes else None, keep=resume)
    cfg = apply_overrides(run, row_overrides(row, base))
    start = time.perf_counter()
    exp, resumed = train_row(row, cfg, resume)
    wall = time.perf_counter() - start
    curve = []
    tokens_per_round = exp.topology.num_paths * cfg.train.inner_steps * cfg.train.optim.batch_size * cfg.data.seq_len
    checkpoints = {int(c.name.split("_")[-1]): c for c in CheckpointManager(exp.dir / "checkpoints").checkpoints()}
    for rnd in curve_at(max(checkpoints)):
        report = Run(cfg).evaluate(checkpoint=str(checkpoints[rnd]))
        curve.append({"round": rnd, "tokens": rnd * tokens_per_round, "ppl": report["overall"]["ppl"]})
    final_ppl, best_rounds = curve[-1]["ppl"], None
    if row.early_stopping:
        # The curve shows each round's parameters; the row's result is each path's best round.
        report = Run(apply_overrides(cfg, ["eval.early_stopping=true"])).evaluate()
        final_ppl = report["overall"]["ppl"]
        best_rounds = [json.loads(f.read_text())["round"] for f in sorted((exp.dir / "early_stopping").glob("path_*.json"))]
    return {
        "name": row.name, "topology": report["topology"], "paths": exp.topology.num_paths,
        "params_per_path": report["params_per_path"], "params_total": report["params_total"],
        "steps_per_path": cfg.train.rounds * cfg.train.inner_steps,
        "tokens_seen": curve[-1]["tokens"], "wall_time_s": wall, "ppl": final_ppl,
        "per_path_ppl": [p["ppl"] for p in report["paths"]], "curve": curve, "routing": row.routing,
        "init_ppl": init_ppl, "early_stopping_best_rounds": best_rounds, "resumed": resumed,
        "overlap_topk": cfg.route.topk, **routing_quality(cfg, exp.topology.num_paths),
    }


def _count(n: float) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n / 1e3:.1f}k"


def _score(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def markdown_table(results: list[dict], dense_steps: int) -> str:
    """Compute is relative to dense_1x: paths x steps x params per path (forward+backward FLOPs scale
    with parameters x tokens at this sequence length). NMI and purity: the training shards against the
    corpus labels (an iid row's are chance level: its control)."""
    ref_params = min(r["params_per_path"] for r in results)
    lines = [
        "| model | paths | params/path | params total | steps/path | compute | tokens seen | NMI | purity "
        "| wall time | val ppl |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        compute = r["paths"] * r["steps_per_path"] * r["params_per_path"] / (dense_steps * ref_params)
        lines.append(
            f"| {r['name']} | {r['paths']} | {_count(r['params_per_path'])} | {_count(r['params_total'])} | "
            f"{r['steps_per_path']} | {compute:.3g}x | {_count(r['tokens_seen'])} | {_score(r.get('nmi'))} | "
            f"{_score(r.get('purity'))} | {r['wall_time_s'] / 60:.1f} min{' (resumed)' if r.get('resumed') else ''} "
            f"| {r['ppl']:.2f} |"
        )
    return "\n".join(lines)


def seed_table(results: list[dict], default_seed: int) -> str:
    """Mean and spread over seeds of every row repeated with ``@run.seed=N`` ("" when none is)."""
    repeated = {g: by_seed for g, by_seed in seed_groups(results, default_seed).items() if len(by_seed) > 1}
    if not repeated:
        return ""
    lines = ["| row | seeds | mean val ppl | std | min | max |", "|---|---|---|---|---|---|"]
    for group, by_seed in repeated.items():
        ppl = list(by_seed.values())
        lines.append(f"| {group} | {_seeds(by_seed)} | {statistics.fmean(ppl):.2f} | {statistics.stdev(ppl):.2f} | "
                     f"{min(ppl):.2f} | {max(ppl):.2f} |")
    return "\n".join(lines)


def targets(results: list[dict], default_seed: int = 0) -> list[str]:
    by = {r["name"]: r["ppl"] for r in results}
    steps = {r["name"]: r["paths"] * r["steps_per_path"] for r in results}  # compute, for rows of one path size
    groups = seed_groups(results, default_seed)
    out = []

    def check(label: str, ok: bool | None, detail: str) -> None:
        out.append(f"- {label}: {'met' if ok else 'MISSED' if ok is not None else 'not run'} ({detail})")

    # Issue 14: what routing buys, against iid controls of the same topology and compute (and seed).
    for name in by:
        control = iid_control(name)
        if control in by:
            gain = 1 - by[name] / by[control]
            check(f"{name} beats its iid control ({control}) by >= 3%", gain >= 0.03,
                  f"{by[name]:.2f} vs {by[control]:.2f}: {gain:+.1%}")
    # A row repeated over seeds is also judged on its mean, against its control's mean over the same seeds.
    for group, by_seed in groups.items():
        control = groups.get(iid_control(group) or "")
        if len(by_seed) > 1 and control is not None and control.keys() == by_seed.keys():
            mean, control_mean = statistics.fmean(by_seed.values()), statistics.fmean(control.values())
            gain = 1 - mean / control_mean
            check(f"{group} beats its iid control ({iid_control(group)}) by >= 3%, mean of seeds "
                  f"{_seeds(by_seed)}", gain >= 0.03, f"{mean:.2f} vs {control_mean:.2f}: {gain:+.1%}")
    # Equal compute: a ROW@train.rounds=... row is judged against the DiLoCo-4 rows that trained as long,
    # the best of each side (a DiLoCo-4 row with other overrides is an alternative a user could run too).
    # Each side is a configuration's mean over the seeds it ran: the minimum over seeds would favour the side
    # that ran more of them.
    mean = {g: statistics.fmean(by_seed.values()) for g, by_seed in groups.items()}
    group_steps = {seed_group(name, default_seed)[0]: n for name, n in steps.items()}

    def described(group: str) -> str:
        seeds = groups[group]
        return group if len(seeds) == 1 else f"{group} (mean of seeds {_seeds(seeds)})"

    routed_2x2 = {g for g in mean if g.startswith("dipaco_2x2_") and iid_control(g) is not None}
    diloco_4 = {g for g in mean if g.split("@")[0] == "diloco_4"}
    for compute in sorted({group_steps[g] for g in routed_2x2} & {group_steps[g] for g in diloco_4}):
        best = min((g for g in routed_2x2 if group_steps[g] == compute), key=mean.get)
        rival = min((g for g in diloco_4 if group_steps[g] == compute), key=mean.get)
        label = "DiPaCo 2x2 beats DiLoCo-4 at equal compute"
        if rival != "diloco_4":
            label += f" ({compute // 4} steps per path)"
        rival_name = "" if rival == "diloco_4" and len(groups[rival]) == 1 else f"{described(rival)} "
        check(label, mean[best] < mean[rival],
              f"best 2x2 row {described(best)} {mean[best]:.2f} vs {rival_name}{mean[rival]:.2f}")
    if "dense_1x" in by and "dipaco_2x2_kmeans" in by:
        gain = 1 - by["dipaco_2x2_kmeans"] / by["dense_1x"]
        check("DiPaCo 2x2 beats dense 1x by >= 5%", gain >= 0.05, f"{gain:+.1%}")
    if "dipaco_4x4_kmeans" in by and "diloco_16" in by:
        check("DiPaCo 4x4 beats DiLoCo-16", by["dipaco_4x4_kmeans"] < by["diloco_16"],
              f"{by['dipaco_4x4_kmeans']:.2f} vs {by['diloco_16']:.2f}")
    for grid in ("2x2", "4x4"):
        plain = by.get(f"dipaco_{grid}_kmeans")
        alt = {k: v for k, v in by.items() if k in (f"dipaco_{grid}_product", f"dipaco_{grid}_reroute")}
        if plain and alt:
            best = min(alt, key=alt.get)
            check(f"product or discriminative routing at or below plain k-means ({grid})",
                  alt[best] <= plain, f"{best} {alt[best]:.2f} vs kmeans {plain:.2f}")
    # Not targets of the issue, but the comparisons a reader looks for next.
    for grid in ("2x2", "4x4"):
        plain, stopped = by.get(f"dipaco_{grid}_kmeans"), by.get(f"dipaco_{grid}_early_stop")
        if plain and stopped:
            out.append(f"- (info) per-path early stopping, {grid}: {stopped:.2f} vs {plain:.2f} without")
    deep = next((k for k in by if k.startswith("dense_deep_")), None)
    if deep and "dipaco_2x2_kmeans" in by:
        out.append(f"- (info) dense with DiPaCo 2x2's total parameters ({deep}): {by[deep]:.2f} vs DiPaCo 2x2 "
                   f"{by['dipaco_2x2_kmeans']:.2f}")
    return out


def plots(results: list[dict], out_dir: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        echo("[bench] matplotlib not installed (pip install -e '.[bench]'): no plots")
        return []
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.cm.tab20.colors  # 13 rows: the default 10-colour cycle would repeat
    for i, r in enumerate(results):
        ax.plot([c["tokens"] / 1e6 for c in r["curve"]], [c["ppl"] for c in r["curve"]], marker="osD^v"[i % 5],
                color=colors[(2 * i) % 20 + (2 * i) // 20], label=r["name"])
    ax.set_xlabel("training tokens, all paths (M)")
    ax.set_ylabel("validation perplexity (prefix excluded)")
    ax.set_xscale("log")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    curve_png = out_dir / "quality_ppl_vs_tokens.png"
    fig.tight_layout(), fig.savefig(curve_png, dpi=120), plt.close(fig)

    variants = sorted(p for p in out_dir.glob("run_*/routing/routing_report.json"))
    fig, axes = plt.subplots(1, max(len(variants), 1), figsize=(4 * max(len(variants), 1), 3.5), squeeze=False)
    for ax, path in zip(axes[0], variants):
        sizes = json.loads(path.read_text())["train"]["docs_per_path"]
        ax.bar(range(len(sizes)), sizes)
        ax.set_title(path.parts[-3].removeprefix("run_"))
        ax.set_xlabel("path")
        ax.set_ylabel("train docs")
    shards_png = out_dir / "quality_shard_sizes.png"
    fig.tight_layout(), fig.savefig(shards_png, dpi=120), plt.close(fig)
    return [curve_png, shards_png]


def write_results(path: Path, base: Config, init: dict, results: list[dict], **extra) -> None:
    """Rewritten after every row, so an interrupted run loses at most the row in progress."""
    payload = {"base_config": OmegaConf.to_container(OmegaConf.structured(base)),
               "pretrained_ppl": init["overall"]["ppl"], "rows": results, **extra}
    write_text(path, json_text.dumps(payload, indent=2))


def finished_rows(path: Path, base: Config) -> dict[str, dict]:
    """Rows of an earlier run of the same base config, by name."""
    if not path.is_file():
        return {}
    earlier = json.loads(path.read_text())
    if "base_config" in earlier:
        diff = config_diff(OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), earlier["base_config"])),
                           base, ignore=())
        if diff:
            sys.exit(f"error: --resume: {path} was made with another base config: {'; '.join(diff)}")
    else:
        echo(f"[bench] warning: {path} records no base config (older script); its rows are kept as they are")
    return {r["name"]: r for r in earlier["rows"]}


def table_order(num_layers: int):
    """Sort key of row names: the order of :func:`rows`, a ``ROW@...`` row after its row."""
    position = {r.name: i for i, r in enumerate(rows(4, 16, True, num_layers))}
    return lambda name: (position.get(name.split("@")[0], len(position)), name)


def merge_results(paths: list[Path]) -> dict:
    """One results payload from several results files of one pretrained init and seed (out-dirs of one
    corpus that ran side by side), with the first file's base config. A row in two files must have the
    same result in both; rows from different inits are not comparable, so those are refused."""
    merged: dict | None = None
    by_name: dict[str, tuple[Path, dict]] = {}
    for path in paths:
        try:
            payload = json.loads(path.read_text())
            payload_rows, pretrained = payload["rows"], float(payload["pretrained_ppl"])
            seed = int((payload.get("base_config") or {}).get("run", {}).get("seed", 0))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise SystemExit(f"error: {path}: not a bench_quality results file ({err!r})") from None
        if merged is None:
            merged = {"base_config": payload.get("base_config") or {}, "pretrained_ppl": pretrained,
                      "seed": seed, "merged_from": [str(p) for p in paths]}
        elif round(pretrained, 2) != round(merged["pretrained_ppl"], 2):
            raise SystemExit(f"error: {path} was trained from another pretrained init (val ppl {pretrained:.2f}) "
                             f"than {paths[0]} ({merged['pretrained_ppl']:.2f}); its rows are not comparable")
        elif seed != merged["seed"]:
            raise SystemExit(f"error: {path}'s base config has run.seed={seed}, {paths[0]}'s {merged['seed']}: "
                             "their rows without @run.seed would not be told apart")
        for row in payload_rows:
            first = by_name.setdefault(row["name"], (path, row))
            if first[1]["ppl"] != row["ppl"]:
                raise SystemExit(f"error: row {row['name']} is in {first[0]} (ppl {first[1]['ppl']:.2f}) and in "
                                 f"{path} (ppl {row['ppl']:.2f}); keep one of them")
    if not by_name:
        raise SystemExit(f"error: no rows in {', '.join(map(str, paths))}")
    base = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), merged["base_config"]))
    order = table_order(base.model.num_layers)
    merged["rows"] = [by_name[name][1] for name in sorted(by_name, key=order)]
    merged["dense_steps"] = base.train.rounds * base.train.inner_steps
    return merged


def report(paths: list[Path], merged_path: Path | None) -> None:
    """Print the tables and targets of finished rows, without training (``--report``)."""
    merged = merge_results(paths)
    results, seed = merged["rows"], merged["seed"]
    print("\n\n".join(t for t in (markdown_table(results, merged["dense_steps"]), seed_table(results, seed)) if t))
    print("\n" + "\n".join(targets(results, seed)))
    if merged_path is not None:
        write_text(merged_path, json_text.dumps(merged, indent=2))
        echo(f"[bench] wrote the {len(results)} rows to {merged_path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model and steps (about a minute)")
    p.add_argument("--scale", type=int, default=1, help="multiply width and steps (for a GPU)")
    p.add_argument("--preset", choices=("cpu", "gpu"), default="cpu",
                   help="gpu: the GPU regime (16 rounds, more tokens per path, its rows; see scale_overrides)")
    p.add_argument("--large", action="store_true", help="with --preset gpu: also the 16-path rows")
    p.add_argument("--out-dir", default="runs/bench_quality")
    p.add_argument("--no-large", action="store_true", help="skip the 16-path rows")
    p.add_argument("--rows", nargs="*", help="run only these rows (with --resume: run them again, keep the others)")
    p.add_argument("--resume", action="store_true",
                   help="keep the rows results.json already holds (same base config), run the missing ones")
    p.add_argument("--corpus", choices=sorted(CORPORA), default="mix",
                   help="the shared corpora to train and route on: mix (all three) or one of them")
    p.add_argument("--data", type=Path, default=None,
                   help="the folder holding the shared corpora (default: shared/data beside the repository; "
                        "name it where the repository travels without that folder, e.g. to a GPU machine)")
    p.add_argument("--report", type=Path, nargs="+", metavar="results.json",
                   help="train nothing: print the table and targets of these results files' rows together "
                        "(out-dirs of one corpus and init that ran side by side)")
    p.add_argument("--merged", type=Path, help="with --report: also write the rows to this results file")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_args()
    if args.merged and not args.report:
        p.error("--merged goes with --report")
    if args.report:
        return report(args.report, args.merged)
    data_dir = (SHARED if args.data is None else args.data).resolve()
    missing = [name for name in CORPORA[args.corpus] if not (data_dir / name).is_file()]
    if missing:
        sys.exit(f"error: the shared corpora are not at {data_dir} (missing {', '.join(missing)}); "
                 "name their folder with --data")

    quiet_library_progress_bars()
    out_dir = Path(args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    corpus = out_dir / "corpus.jsonl"
    fresh = write_corpus(out_dir / "corpus.jsonl.new", 150 if args.smoke else None, CORPORA[args.corpus], data_dir)
    prepared = (out_dir / "base" / "pretrain" / "config.json").is_file()
    if prepared and corpus.is_file() and corpus.read_bytes() != fresh.read_bytes():
        fresh.unlink()
        sys.exit(f"error: {out_dir} was prepared on another corpus than --corpus {args.corpus}"
                 f"{' --smoke' if args.smoke else ''}; use another --out-dir")
    fresh.replace(corpus)
    base = load_config(REPO / "configs/bench/quality.yaml",
                       [*scale_overrides(args), f"run.dir={out_dir / 'base'}", f"data.corpus={corpus}", *args.overrides])
    # The smoke corpus is too small for 16 shards; the smoke run covers the 4-path rows.
    every_row = rows(4, 16, True, base.model.num_layers)
    every = {r.name: r for r in every_row}
    try:  # before any preparation: a misspelt row fails at once
        asked = [named_row(name, every) for name in args.rows or ()]
    except KeyError as err:
        sys.exit(f"error: unknown row {err.args[0]!r} (ROW or ROW@key=value@...); known: {', '.join(every)}")
    include_large = not (args.no_large or args.smoke or (args.preset == "gpu" and not args.large))
    in_scope = {r.name for r in rows(4, 16, include_large, base.model.num_layers)}
    if args.preset == "gpu":
        in_scope &= {n.format(p=4, q=16) for n in GPU_ROWS}
    order = table_order(base.model.num_layers)
    selected = sorted((r for r in asked or every_row if r.name.split("@")[0] in in_scope
                       and not (args.smoke and not args.rows and r.name in SMOKE_SKIP)),
                      key=lambda r: order(r.name))

    started = time.perf_counter()
    if not (Path(base.run.dir) / "pretrain" / "config.json").is_file():
        prepare(base)
        pretrain(base)
    init = Run(base).evaluate_pretrained()

    by_name = finished_rows(out_dir / "results.json", base) if args.resume else {}
    if not args.resume and (out_dir / "results.json").is_file():
        echo(f"[bench] starting over: {out_dir / 'results.json'} will be replaced (--resume keeps its rows)")

    def ordered() -> list[dict]:  # kept and new rows, in the table's order
        return [by_name[name] for name in sorted(by_name, key=order)]

    for row in selected:
        if row.name in by_name and row.name not in (args.rows or ()):
            echo(f"[bench] {row.name}: kept from results.json (ppl {by_name[row.name]['ppl']:.2f})")
            continue
        echo(f"[bench] === {row.name} ({row.preset}, routing {row.routing or 'none'}) ===")
        # A row cut off mid-way (not in results.json) continues from its checkpoint; a row named with --rows
        # whose result is kept trains again from scratch.
        by_name[row.name] = run_row(row, base, out_dir, resume=args.resume and row.name not in by_name)
        echo(f"[bench] {row.name}: ppl {by_name[row.name]['ppl']:.2f} in {by_name[row.name]['wall_time_s']:.0f}s")
        write_results(out_dir / "results.json", base, init, ordered())
    results = ordered()

    dense_steps = base.train.rounds * base.train.inner_steps
    table = "\n\n".join(t for t in (markdown_table(results, dense_steps),
                                     seed_table(results, base.run.seed)) if t)
    summary = "\n".join(targets(results, base.run.seed))
    pngs = plots(results, out_dir)
    total = time.perf_counter() - started
    training = sum(r["wall_time_s"] for r in results)
    write_results(out_dir / "results.json", base, init, results, invocation_wall_time_s=total,
                  rows_wall_time_s=training, command=" ".join(sys.argv), targets=summary)
    (out_dir / "table.md").write_text(table + "\n\n" + summary + "\n")
    print(f"\npretrained init: val ppl {init['overall']['ppl']:.2f}\n")
    print(table)
    print("\n" + summary)
    print(f"\n{len(results)} rows (training {training / 60:.1f} min); this invocation "
          f"took {total / 60:.1f} min; results in {out_dir}; plots: {', '.join(map(str, pngs)) or 'none'}")


if __name__ == "__main__":
    main()
