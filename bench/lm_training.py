"""Training and evaluating one language-model row of a quality benchmark: a library of :mod:`bench`, not a benchmark.

``python -m bench quality`` (the paper's comparison table) and ``python -m bench path_scaling`` (perplexity against
the number of paths) train rows of the same kind: a topology, a sharding and some dipaco overrides on top of one
base config, all from one pretrained init on one corpus. What both do with a row lives here, once, so that neither
benchmark imports the other (import-linter's independence contract):

* the corpus: the shared corpora (``../shared/data`` beside the repository, or ``--data``) written as one jsonl;
* a row (:class:`Row`), its ``ROW@key=value`` variants (:func:`named_row`) and its seed (:func:`seed_group`);
* its run: the routing variant's run dir (:data:`ROUTINGS`), another architecture's own pretraining, the
  training (continued from its last checkpoint on ``--resume``) and the evaluation of its curve;
* its result in the results file (:func:`open_results`, :func:`finished`, :func:`put_row`): a
  :class:`bench.harness.Results` whose rows carry their :class:`Row` as settings, and whose base config must be
  the run's (rows of two base configs are not comparable).
"""

from __future__ import annotations

import gzip
import json
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from bench.harness import REPO, Results, RowSyntaxError, parse_row, safe_name
from dipaco import json_text
from dipaco.checkpoint.store import CheckpointManager
from dipaco.config import Config, config_diff, save_config
from dipaco.data.corpus import strip_header
from dipaco.metrics import echo
from dipaco.route.shards import assign_paths
from dipaco.run import Run, apply_overrides, load_config
from dipaco.run_dir import RunDir
from routing.quality import routing_report

SHARED = REPO.parent / "shared" / "data"
SOURCES = ("20news_bydate.jsonl.gz", "bbc_news.jsonl.gz", "brown_genres.jsonl.gz")
# --corpus: which shared corpora make the benchmark corpus (mix: all three, the default)
CORPORA = {"mix": SOURCES, "bbc": ("bbc_news.jsonl.gz",), "20ng": ("20news_bydate.jsonl.gz",),
           "brown": ("brown_genres.jsonl.gz",)}
SEED_KEY = "run.seed"


# ----------------------------------------------------------------------------- rows


@dataclass
class Row:
    """One trained configuration: a topology preset, its shards and its overrides on top of the base config."""

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
        return safe_name(self.name)


def named_row(name: str, known: dict[str, Row]) -> Row:
    """``ROW`` (a row of ``known``) or ``ROW@key=value@key=value``: that row with extra dipaco overrides on top of
    its own, under the full name. A name that does not parse, or whose row is unknown, raises KeyError(name)."""
    try:
        base, extra = parse_row(name)
    except RowSyntaxError:
        raise KeyError(name) from None
    if base not in known:
        raise KeyError(name)
    row = known[base]
    return replace(row, name=name, overrides=[*row.overrides, *extra]) if extra else row


def seed_group(name: str, default_seed: int) -> tuple[str, int]:
    """A row's name without its ``@run.seed=N`` override, and the seed it trained with (``default_seed``,
    the base config's, when the name has none). The rows of one group differ only in the training seed."""
    base, *extra = name.split("@")
    seeds = [o.partition("=")[2] for o in extra if o.startswith(f"{SEED_KEY}=")]
    return "@".join([base, *(o for o in extra if not o.startswith(f"{SEED_KEY}="))]), \
        int(seeds[-1]) if seeds else default_seed


def count_text(n: float) -> str:
    """A parameter or token count as a table shows it: 12.3k, 1.23M."""
    return f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n / 1e3:.1f}k"


# ----------------------------------------------------------------------------- routing variants

IMPROVED_SVD = 64  # TF-IDF SVD width of the improved featurizer


def improved_featurizer() -> list[str]:
    """The featurizer the NMI study (the routing benchmark's featurizers section,
    docs/notes/2026-11-23-what-routing-buys.md) found topical on the same 32-token prefix: TF-IDF + SVD of the
    prefix text, cosine k-means. No pooling, layer choice or whitening of the small path model's hidden states came
    near it."""
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
    # the path_scaling benchmark's DiPaCo and flat-MoE shards at 16 and 64 paths
    "doctopics16_similar": ("grid:4x4", "kmeans", [*doc_topics_featurizer(), "route.arrange=similar"]),
    "doctopics64_similar": ("grid:8x8", "kmeans", [*doc_topics_featurizer(), "route.arrange=similar"]),
    # Product cells are not fitted to the joint data: with the cap alone one 4x4 cell got 1 document.
    "product4x4": ("grid:4x4", "product", ["route.min_shard_fraction=0.5"]),
}


# ----------------------------------------------------------------------------- the corpus


def missing_corpora(data_dir: Path, sources: Sequence[str]) -> None:
    """Exits naming the shared corpora absent from ``data_dir`` (before anything is prepared)."""
    missing = [name for name in sources if not (data_dir / name).is_file()]
    if missing:
        sys.exit(f"error: the shared corpora are not at {data_dir} (missing {', '.join(missing)}); "
                 "name their folder with --data")


def write_corpus(path: Path, docs_per_source: int | None, sources: Sequence[str] = SOURCES,
                 data_dir: Path | None = None, max_chars: int | None = None) -> Path:
    """The shared corpora (in ``data_dir``, by default SHARED) as one jsonl, labels prefixed by source,
    20NG headers stripped, each text cut to ``max_chars`` when given."""
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
                    row = {"id": f"{doc['source']}/{doc['id']}", "label": f"{doc['source']}:{doc['label']}",
                           "text": text[:max_chars]}
                    out.write(json_text.dumps(row) + "\n")
                    n += 1
    echo(f"[bench] corpus: {n} documents from {', '.join(sources)}")
    return path


def out_dir_corpus(out_dir: Path, docs_per_source: int | None, sources: Sequence[str], data_dir: Path,
                   chosen_by: str) -> Path:
    """``out_dir``/corpus.jsonl, written afresh; an out-dir already prepared on another corpus is refused (its
    tokenizer, init and shards belong to that corpus), naming the options that chose it (``chosen_by``)."""
    corpus = out_dir / "corpus.jsonl"
    fresh = write_corpus(out_dir / "corpus.jsonl.new", docs_per_source, sources, data_dir)
    prepared = (out_dir / "base" / "pretrain" / "config.json").is_file()
    if prepared and corpus.is_file() and corpus.read_bytes() != fresh.read_bytes():
        fresh.unlink()
        sys.exit(f"error: {out_dir} was prepared on another corpus than {chosen_by}; use another --out-dir")
    fresh.replace(corpus)
    return corpus


# ----------------------------------------------------------------------------- a row's run


def prepare(cfg: Config) -> dict:
    """`dipaco prepare` (a name the tests replace to prove a row or corpus is refused before any work)."""
    return Run(cfg).prepare()


def pretrain(cfg: Config) -> None:
    """`dipaco pretrain`: the init every row of the base run starts from."""
    Run(cfg).pretrain()


def prepared_once(work: Path, overrides: Callable[[Path], list[str]], corpus: str | None, data_dir: Path,
                  docs_per_source: int) -> Path:
    """A benchmark's one prepared and pretrained run (``work/cfg.yaml``, its run dir in ``work``), made by the first
    invocation and reused by later ones: on ``corpus`` when given, else on ``docs_per_source`` documents of each
    shared corpus in ``data_dir`` (texts cut to 4,000 characters). ``overrides(corpus)``: the run's config."""
    cfg_file = work / "cfg.yaml"
    if cfg_file.is_file() and (work / "run" / "pretrain").is_dir():
        return cfg_file
    work.mkdir(parents=True, exist_ok=True)
    if corpus:
        source = Path(corpus)
    else:
        missing_corpora(data_dir, SOURCES)
        source = write_corpus(work / "corpus.jsonl", docs_per_source, data_dir=data_dir, max_chars=4000)
    cfg = load_config(None, overrides(source))
    prepare(cfg)
    pretrain(cfg)
    save_config(cfg, cfg_file)
    return cfg_file


def prepared_init(base: Config) -> float:
    """Prepares and pretrains the base run once (a later invocation reuses it); the pretrained init's validation
    perplexity."""
    if not (Path(base.run.dir) / "pretrain" / "config.json").is_file():
        prepare(base)
        pretrain(base)
    return Run(base).evaluate_pretrained()["overall"]["ppl"]


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


def architecture_run_dir(out_dir: Path, row: Row) -> Path:
    """The run dir of a row with its own architecture (``row.model``): its data, tokenizer and pretraining."""
    return out_dir / f"run_{row.experiment}"


def architecture_run(base: Config, row: Row, out_dir: Path) -> tuple[Config, float]:
    """A row with another model shape shares the data and tokenizer but needs its own pretraining;
    returns its config and the pretrained init's validation perplexity."""
    run_dir = architecture_run_dir(out_dir, row)
    cfg = apply_overrides(base, [f"run.dir={run_dir}", *row.model])
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


def train_row(row: Row, cfg: Config, resume: bool) -> tuple[Any, bool]:
    """Trains the row; a re-routing row re-routes inside `dipaco train` (route.em_rounds, see
    :func:`row_overrides`). With ``resume``, a row continues from its last round's checkpoint (a command
    cut off by a time limit loses at most one round; a re-routing row keeps the re-routings it did).
    Returns the trained experiment and whether it continued."""
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


def row_config(row: Row, base: Config, out_dir: Path) -> Config:
    """The config a row trained with, without preparing anything: for reading a finished row's metrics and shards."""
    if row.model:
        run = apply_overrides(base, [f"run.dir={architecture_run_dir(out_dir, row)}", *row.model])
    else:
        run = variant_run(base, row.routing, out_dir)
    return apply_overrides(run, row_overrides(row, base))


def routing_quality(cfg: Config, num_paths: int) -> dict[str, float | None]:
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
            curve_at: Callable[[int], list[int]] = curve_rounds) -> dict[str, Any]:
    """Trains and evaluates one row; ``curve_at(last round)``: the rounds whose checkpoints are evaluated for
    the perplexity-vs-tokens curve (its last point is the row's result unless the row early-stops). The record
    holds no name: the results file stores it with the row (:func:`put_row`)."""
    init_ppl = None
    if row.model:
        assert row.routing is None, "rows with their own architecture are dense (no routing)"
        base, init_ppl = architecture_run(base, row, out_dir)
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
        "topology": report["topology"], "paths": exp.topology.num_paths,
        "params_per_path": report["params_per_path"], "params_total": report["params_total"],
        "steps_per_path": cfg.train.rounds * cfg.train.inner_steps,
        "tokens_seen": curve[-1]["tokens"], "wall_time_s": wall, "ppl": final_ppl,
        "per_path_ppl": [p["ppl"] for p in report["paths"]], "curve": curve, "routing": row.routing,
        "init_ppl": init_ppl, "early_stopping_best_rounds": best_rounds, "resumed": resumed,
        "overlap_topk": cfg.route.topk, **routing_quality(cfg, exp.topology.num_paths),
    }


# ----------------------------------------------------------------------------- the results file


def base_config_payload(base: Config) -> dict[str, Any]:
    """The base config as the results file records it (``base_config``: what ``--resume`` and ``--report`` read)."""
    payload = OmegaConf.to_container(OmegaConf.structured(base))
    assert isinstance(payload, dict)
    return {str(k): v for k, v in payload.items()}


def recorded_base_config(payload: dict[str, Any]) -> Config:
    """The base config a results file records, over today's defaults (a key added since reads as its default)."""
    merged = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), payload))
    assert isinstance(merged, Config)
    return merged


def open_results(path: Path, benchmark: str, base: Config, resume: bool) -> Results:
    """The results file of a run of ``base``: with ``resume``, the rows it already holds, once its base config is
    checked to be ``base``'s (a row of another base config is not comparable: refused, naming the keys that
    differ, the file left as it is); without, an empty one that replaces it at the first write. Its top-level
    fields start as the base config alone: the last invocation's totals and targets are rewritten at its end."""
    results = Results.load(path, benchmark, resume)
    recorded = results.meta.get("base_config")
    if recorded is not None:
        diff = config_diff(recorded_base_config(recorded), base, ignore=())
        if diff:
            sys.exit(f"error: --resume: {path} was made with another base config: {'; '.join(diff)}")
    elif results.rows:
        echo(f"[bench] warning: {path} records no base config (older script); its rows are kept as they are")
    results.meta = {"base_config": base_config_payload(base)}
    return results


def row_settings(row: Row) -> dict[str, Any]:
    """What a row trains with on top of the base config: a stored row with other settings is run again."""
    settings = asdict(row)
    del settings["name"]
    return settings


def finished(results: Results, row: Row) -> bool:
    """Whether ``row`` is in the results with the settings it has today. A row written before the harness
    (scripts/bench_quality.py and bench_scaling.py recorded no settings) is taken as finished with them, as those
    scripts' ``--resume`` took it, and is recorded so."""
    stored = results.get(row.name)
    if stored is not None and "settings_key" not in stored:
        results.put(row.name, row_settings(row), {k: v for k, v in stored.items() if k not in ("name", "settings")})
    return results.has(row.name, row_settings(row))


def put_row(results: Results, row: Row, record: dict[str, Any]) -> dict[str, Any]:
    """Stores a finished row (its record from :func:`run_row`) with its settings; returns the stored row."""
    return results.put(row.name, row_settings(row), record)
