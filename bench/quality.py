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

    python -m bench quality                 # default scale, ~2 h on 2 CPU cores
    python -m bench quality --smoke         # ~1 min, for CI
    python -m bench quality --scale 4       # wider model, more steps: for a GPU (run.device=auto)
    python -m bench quality --resume        # keep the rows results.json already holds, run the rest
    python -m bench quality --rows dipaco_2x2_featurizer@outer.rescale=sqrt_paths \\
        dipaco_2x2_iid@outer.rescale=sqrt_paths     # ROW@key=value@...: a row with extra dipaco overrides,
                                                    # judged against its iid control with the same overrides
    python -m bench quality --report RUN_A/results.json RUN_B/results.json
                                                    # train nothing: one table and the targets for rows that
                                                    # ran side by side in two out-dirs of one corpus and init
    timeout 590 python -m bench quality --preset gpu --resume   # the GPU regime, 10-minute commands:
                                                    # repeat until it prints the table; a row cut off
                                                    # continues from its last round's checkpoint
    python -m bench quality --plot docs/plot.png \\
        --panel "BBC=runs/bbc/results.json" --panel "mix=runs/mix/a/results.json,runs/mix/b/results.json" \\
        --rows diloco_4@train.rounds=16 dipaco_2x2_iid@outer.rescale=sqrt_paths@train.rounds=16
                                                    # train nothing: those rows' perplexity against tokens,
                                                    # one panel per corpus (a row missing from a panel's
                                                    # files is an error: a plot never drops a row silently)

``--resume`` keeps a row that results.json holds with the same settings (:class:`bench.harness.Results`) and
runs again one whose settings changed; a results.json of another base config is refused, naming the keys.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.harness import REPO, argument_parser, command_line, environment, markdown_table, unknown_rows, write_json
from bench.lm_training import (
    CORPORA,
    SHARED,
    Row,
    count_text,
    finished,
    missing_corpora,
    named_row,
    open_results,
    out_dir_corpus,
    prepared_init,
    put_row,
    recorded_base_config,
    run_row,
    seed_group,
)
from dipaco.metrics import echo
from dipaco.run import load_config
from dipaco.runtime import quiet_library_progress_bars

EARLY_STOP_HOLDOUT = "train.early_stopping_holdout=0.05"
PATH_EMBEDDING = ["topology.embedding=path", "topology.head=path"]  # the *_pathemb_* rows
EM_REROUTES = 3  # re-routings of the EM row: after rounds R/4, R/2, 3R/4 (every round when R = 4)


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


def seed_groups(results: list[dict], default_seed: int) -> dict[str, dict[int, float]]:
    """Validation perplexity by seed, for each group of rows that differ only in ``run.seed``."""
    groups: dict[str, dict[int, float]] = {}
    for r in results:
        group, seed = seed_group(r["name"], default_seed)
        groups.setdefault(group, {})[seed] = r["ppl"]
    return groups


def _seeds(seeds) -> str:
    return ",".join(map(str, sorted(seeds)))


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


def _score(value: float | None) -> str | None:
    return None if value is None else f"{value:.3f}"


def results_table(results: list[dict], dense_steps: int) -> str:
    """Compute is relative to dense_1x: paths x steps x params per path (forward+backward FLOPs scale
    with parameters x tokens at this sequence length). NMI and purity: the training shards against the
    corpus labels (an iid row's are chance level: its control)."""
    ref_params = min(r["params_per_path"] for r in results)

    def compute(r: Mapping[str, Any]) -> str:
        return f"{r['paths'] * r['steps_per_path'] * r['params_per_path'] / (dense_steps * ref_params):.3g}x"

    return markdown_table(results, [
        ("model", "name"), ("paths", "paths"),
        ("params/path", lambda r: count_text(r["params_per_path"])),
        ("params total", lambda r: count_text(r["params_total"])),
        ("steps/path", "steps_per_path"), ("compute", compute),
        ("tokens seen", lambda r: count_text(r["tokens_seen"])),
        ("NMI", lambda r: _score(r.get("nmi"))), ("purity", lambda r: _score(r.get("purity"))),
        ("wall time", lambda r: f"{r['wall_time_s'] / 60:.1f} min{' (resumed)' if r.get('resumed') else ''}"),
        ("val ppl", lambda r: f"{r['ppl']:.2f}"),
    ])


def seed_table(results: list[dict], default_seed: int) -> str:
    """Mean and spread over seeds of every row repeated with ``@run.seed=N`` ("" when none is)."""
    repeated = [{"group": g, "ppl": list(by_seed.values()), "seeds": by_seed}
                for g, by_seed in seed_groups(results, default_seed).items() if len(by_seed) > 1]
    if not repeated:
        return ""
    return markdown_table(repeated, [
        ("row", "group"), ("seeds", lambda r: _seeds(r["seeds"])),
        ("mean val ppl", lambda r: f"{statistics.fmean(r['ppl']):.2f}"),
        ("std", lambda r: f"{statistics.stdev(r['ppl']):.2f}"),
        ("min", lambda r: f"{min(r['ppl']):.2f}"), ("max", lambda r: f"{max(r['ppl']):.2f}"),
    ])


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
        control_seeds = groups.get(iid_control(group) or "")
        if len(by_seed) > 1 and control_seeds is not None and control_seeds.keys() == by_seed.keys():
            group_mean, control_mean = statistics.fmean(by_seed.values()), statistics.fmean(control_seeds.values())
            gain = 1 - group_mean / control_mean
            check(f"{group} beats its iid control ({iid_control(group)}) by >= 3%, mean of seeds "
                  f"{_seeds(by_seed)}", gain >= 0.03, f"{group_mean:.2f} vs {control_mean:.2f}: {gain:+.1%}")
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
        best = min((g for g in routed_2x2 if group_steps[g] == compute), key=mean.__getitem__)
        rival = min((g for g in diloco_4 if group_steps[g] == compute), key=mean.__getitem__)
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
            best = min(alt, key=alt.__getitem__)
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


def pyplot() -> Any:
    """matplotlib's pyplot, drawing to files only (no display on a benchmark machine)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path) -> Path:
    """Writes the figure to ``path`` (its folder created) and frees it."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return path


def plot_curve(ax: Any, row: Mapping[str, Any], **style: Any) -> None:
    """A row's validation perplexity against its training tokens (millions, all paths)."""
    ax.plot([c["tokens"] / 1e6 for c in row["curve"]], [c["ppl"] for c in row["curve"]], **style)
    ax.set_xlabel("training tokens, all paths (M)")
    ax.set_xscale("log")


def plots(results: list[dict], out_dir: Path) -> list[Path]:
    try:
        plt = pyplot()
    except ImportError:
        echo("[bench] matplotlib not installed (pip install -e '.[bench]'): no plots")
        return []
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.get_cmap("tab20")  # 13 rows: the default 10-colour cycle would repeat
    for i, r in enumerate(results):
        plot_curve(ax, r, marker="osD^v"[i % 5], color=colors((2 * i) % 20 + (2 * i) // 20), label=r["name"])
    ax.set_ylabel("validation perplexity (prefix excluded)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    curve_png = save(fig, out_dir / "quality_ppl_vs_tokens.png")

    variants = sorted(p for p in out_dir.glob("run_*/routing/routing_report.json"))
    fig, axes = plt.subplots(1, max(len(variants), 1), figsize=(4 * max(len(variants), 1), 3.5), squeeze=False)
    for ax, path in zip(axes[0], variants):
        sizes = json.loads(path.read_text())["train"]["docs_per_path"]
        ax.bar(range(len(sizes)), sizes)
        ax.set_title(path.parts[-3].removeprefix("run_"))
        ax.set_xlabel("path")
        ax.set_ylabel("train docs")
    return [curve_png, save(fig, out_dir / "quality_shard_sizes.png")]


def table_order(num_layers: int) -> Callable[[str], tuple[int, str]]:
    """Sort key of row names: the order of :func:`rows`, a ``ROW@...`` row after its row."""
    position = {r.name: i for i, r in enumerate(rows(4, 16, True, num_layers))}
    return lambda name: (position.get(name.split("@")[0], len(position)), name)


NOT_RESULTS = "not a results file of the quality benchmark"


def merge_results(paths: list[Path]) -> dict[str, Any]:
    """One results payload from several results files of one pretrained init and seed (out-dirs of one
    corpus that ran side by side), with the first file's base config. A row in two files must have the
    same result in both; rows from different inits are not comparable, so those are refused. Reads the
    files of scripts/bench_quality.py (before the harness) as well."""
    merged: dict[str, Any] | None = None
    by_name: dict[str, tuple[Path, dict]] = {}
    for path in paths:
        try:
            payload = json.loads(path.read_text())
            payload_rows, pretrained = payload["rows"], float(payload["pretrained_ppl"])
            seed = int((payload.get("base_config") or {}).get("run", {}).get("seed", 0))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise SystemExit(f"error: {path}: {NOT_RESULTS} ({err!r})") from None
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
    if merged is None or not by_name:
        raise SystemExit(f"error: no rows in {', '.join(map(str, paths))}")
    base = recorded_base_config(merged["base_config"])
    order = table_order(base.model.num_layers)
    merged["rows"] = [by_name[name][1] for name in sorted(by_name, key=order)]
    merged["dense_steps"] = base.train.rounds * base.train.inner_steps
    return merged


def report(paths: list[Path], merged_path: Path | None) -> None:
    """Print the tables and targets of finished rows, without training (``--report``)."""
    merged = merge_results(paths)
    results, seed = merged["rows"], merged["seed"]
    print("\n\n".join(t for t in (results_table(results, merged["dense_steps"]), seed_table(results, seed)) if t))
    print("\n" + "\n".join(targets(results, seed)))
    if merged_path is not None:
        write_json(merged_path, merged, indent=2)
        echo(f"[bench] wrote the {len(results)} rows to {merged_path}")


# ----------------------------------------------------------------------------- --plot: chosen rows of results files


def panel_rows(files: list[Path], names: list[str]) -> list[dict]:
    """The named rows, in the order named, from the first of ``files`` that holds each. A row named but found
    in none of them is an error, so a plot never silently drops a row."""
    found: dict[str, dict] = {}
    for path in files:
        try:
            file_rows = json.loads(path.read_text())["rows"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise SystemExit(f"error: {path}: {NOT_RESULTS} ({err})") from None
        for row in file_rows:
            found.setdefault(row["name"], row)
    missing = [name for name in names if name not in found]
    if missing:
        raise SystemExit(f"error: rows not in {', '.join(map(str, files))}: {', '.join(missing)}")
    return [found[name] for name in names]


def parse_panel(spec: str) -> tuple[str, list[Path]]:
    """``TITLE=A.json[,B.json]``: a panel's title and the results files its rows come from (rows of one corpus
    are often split across out-dirs that ran side by side)."""
    title, sep, files = spec.partition("=")
    if not sep or not title or not files:
        raise SystemExit(f"error: --panel {spec!r}: expected TITLE=results.json[,more.json]")
    return title, [Path(f) for f in files.split(",")]


def plot_panels(panels: list[tuple[str, list[dict]]], out: Path) -> None:
    """Validation perplexity against training tokens, one panel per ``(title, rows)``, written to ``out``."""
    fig, axes = pyplot().subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (title, panel) in zip(axes[0], panels):
        for i, row in enumerate(panel):
            plot_curve(ax, row, marker="osD^v<>"[i % 7], label=f"{row['name']} ({row['ppl']:.2f})")
        ax.set_title(title)
        ax.set_ylabel("validation perplexity")
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    save(fig, out)


def plot_rows(out: Path, panel_specs: list[str], names: list[str]) -> None:
    """``--plot``: the named rows of each ``--panel``'s results files, one panel each, without training."""
    panels = [(title, panel_rows(files, names)) for title, files in map(parse_panel, panel_specs)]
    plot_panels(panels, out)
    print(f"wrote {out}", file=sys.stderr)


# ----------------------------------------------------------------------------- running


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The flags; the modes that train nothing (``--report``, ``--plot``) are checked against the rest here."""
    p = argument_parser("quality", __doc__)
    p.add_argument("--smoke", action="store_true", help="tiny model and steps (about a minute)")
    p.add_argument("--scale", type=int, default=1, help="multiply width and steps (for a GPU)")
    p.add_argument("--preset", choices=("cpu", "gpu"), default="cpu",
                   help="gpu: the GPU regime (16 rounds, more tokens per path, its rows; see scale_overrides)")
    p.add_argument("--large", action="store_true", help="with --preset gpu: also the 16-path rows")
    p.add_argument("--out-dir", default="runs/bench_quality")
    p.add_argument("--no-large", action="store_true", help="skip the 16-path rows")
    p.add_argument("--rows", nargs="*", help="run only these rows (with --resume: run them again, keep the others); "
                                             "with --plot: the rows to plot")
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
    p.add_argument("--plot", type=Path, metavar="PNG",
                   help="train nothing: plot validation perplexity against training tokens of the --rows of each "
                        "--panel into this PNG")
    p.add_argument("--panel", action="append", metavar="TITLE=results.json[,more.json]",
                   help="with --plot: one panel, its rows from the first of these results files that holds each")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_args(argv)
    for wrong, message in ((args.merged and not args.report, "--merged goes with --report"),
                           (bool(args.plot) != bool(args.panel), "--plot and --panel go together"),
                           (args.plot and not args.rows, "--plot needs the --rows to plot"),
                           (args.plot and args.report, "--plot and --report are two modes: give one")):
        if wrong:
            p.error(message)
    return args


def select_rows(args: argparse.Namespace, num_layers: int) -> list[Row]:
    """The rows this invocation runs, in the table's order: ``--rows`` (each checked before any preparation: a
    misspelt row fails at once) or every row, less what the preset and ``--smoke`` leave out."""
    every_row = rows(4, 16, True, num_layers)
    every = {r.name: r for r in every_row}
    unknown = unknown_rows(args.rows or (), every)
    if unknown:
        sys.exit(f"error: unknown row {unknown[0]!r} (ROW or ROW@key=value@...); known: {', '.join(every)}")
    asked = [named_row(name, every) for name in args.rows or ()]
    # The smoke corpus is too small for 16 shards; the smoke run covers the 4-path rows.
    include_large = not (args.no_large or args.smoke or (args.preset == "gpu" and not args.large))
    in_scope = {r.name for r in rows(4, 16, include_large, num_layers)}
    if args.preset == "gpu":
        in_scope &= {n.format(p=4, q=16) for n in GPU_ROWS}
    order = table_order(num_layers)
    return sorted((r for r in asked or every_row if r.name.split("@")[0] in in_scope
                   and not (args.smoke and not args.rows and r.name in SMOKE_SKIP)),
                  key=lambda r: order(r.name))


def main(argv: list[str] | None = None) -> None:
    """Trains the rows (or, with --report / --plot, reads finished ones) and prints the tables and targets."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.report:
        return report(args.report, args.merged)
    if args.plot:
        return plot_rows(args.plot, args.panel, args.rows)
    data_dir = (SHARED if args.data is None else args.data).resolve()
    missing_corpora(data_dir, CORPORA[args.corpus])

    quiet_library_progress_bars()
    out_dir = Path(args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    corpus = out_dir_corpus(out_dir, 150 if args.smoke else None, CORPORA[args.corpus], data_dir,
                            f"--corpus {args.corpus}{' --smoke' if args.smoke else ''}")
    base = load_config(REPO / "configs/bench/quality.yaml",
                       [*scale_overrides(args), f"run.dir={out_dir / 'base'}", f"data.corpus={corpus}", *args.overrides])
    selected = select_rows(args, base.model.num_layers)
    order = table_order(base.model.num_layers)

    started = time.perf_counter()
    init_ppl = prepared_init(base)
    path = out_dir / "results.json"
    results = open_results(path, "quality", base, args.resume)
    results.meta["pretrained_ppl"] = init_ppl
    if not args.resume and path.is_file():
        echo(f"[bench] starting over: {path} will be replaced (--resume keeps its rows)")

    for row in selected:
        kept = results.get(row.name) if finished(results, row) and row.name not in (args.rows or ()) else None
        if kept is not None:
            echo(f"[bench] {row.name}: kept from results.json (ppl {kept['ppl']:.2f})")
            continue
        echo(f"[bench] === {row.name} ({row.preset}, routing {row.routing or 'none'}) ===")
        # A row cut off mid-way (not in results.json) continues from its checkpoint; a row named with --rows
        # whose result is kept, or whose settings changed, trains again from scratch.
        stored = put_row(results, row, run_row(row, base, out_dir, resume=args.resume and results.get(row.name) is None))
        echo(f"[bench] {row.name}: ppl {stored['ppl']:.2f} in {stored['wall_time_s']:.0f}s")
        results.sort(key=lambda r: order(r["name"]))  # kept and new rows, in the table's order
        results.write()
    results.sort(key=lambda r: order(r["name"]))
    done = results.rows

    dense_steps = base.train.rounds * base.train.inner_steps
    table = "\n\n".join(t for t in (results_table(done, dense_steps), seed_table(done, base.run.seed)) if t)
    summary = "\n".join(targets(done, base.run.seed))
    pngs = plots(done, out_dir)
    total = time.perf_counter() - started
    training = sum(r["wall_time_s"] for r in done)
    results.meta.update(invocation_wall_time_s=total, rows_wall_time_s=training, command=command_line("quality", argv),
                        targets=summary, environment=environment(None if base.run.device == "auto" else base.run.device))
    results.write()
    (out_dir / "table.md").write_text(table + "\n\n" + summary + "\n")
    print(f"\npretrained init: val ppl {init_ppl:.2f}\n")
    print(table)
    print("\n" + summary)
    print(f"\n{len(done)} rows (training {training / 60:.1f} min); this invocation "
          f"took {total / 60:.1f} min; results in {out_dir}; plots: {', '.join(map(str, pngs)) or 'none'}")
