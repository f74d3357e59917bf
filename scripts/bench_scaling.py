"""Path-count scaling (issue 36): validation perplexity against the number of paths P, at a fixed path size.

The DiPaCo paper's headline (its Table 1 on C4) is that more paths of the same size keep lowering the
perplexity while inference still runs one path. This benchmark measures that curve in a regime a 2-core CPU
reaches: one small path architecture for every row, trained to about 20 tokens per non-embedding parameter
per path, on the mixed shared corpus (20 Newsgroups, BBC News, Brown). At each P, at equal compute
(P paths x the same steps, or one model for P times the steps):

    dipaco_P     a DiPaCo grid (P=4: 2x2, 16: 4x4, 64: 8x8) on doc_topics shards, route.arrange=similar
    diloco_P     P replicas of the dense path (DiLoCo) on iid shards
    moe_P        P independent paths (flat MoE) on the same doc_topics shards as dipaco_P
    dense_Px     one dense path for P times the steps (plain AdamW: outer lr 1, no momentum)
    dense_1x     P = 1, the point every family starts from (a 1x1 grid, DiLoCo-1 and MoE-1 are this model)

and at P = 16 the paper's extras on dipaco_16: top-2 overlapping shards (dipaco_16_top2), per-path early
stopping (dipaco_16_early_stop) and test-time re-routing every W tokens (an evaluation of dipaco_16).
Every family runs one path per input at inference: the table's inference column is the same for all.

Outer steps (the settings docs/benchmarks.md found best on this corpus at P = 4, held for every P):
DiPaCo steps its level modules at 1.0 and the shared embedding and head at 1.4 (what `outer.rescale=sqrt_paths`
at `outer.lr` 0.7 gives a 2x2 grid; the rescale itself would step a 4x4 grid's shared parts at 2.8, past the
1.4 where DiLoCo-4 already diverged); DiLoCo-P steps at 1.2 (the best of 0.7, 1.0, 1.2, 1.4 at P = 4), and
at P = 16 also at 1.0 (`diloco_16@outer.lr=1.0`): the comparison uses each side's best row.

    python scripts/bench_scaling.py --resume                # the whole sweep, about an hour on 2 cores
    timeout 590 python scripts/bench_scaling.py --resume    # in chunks under 10 minutes: repeat until it
                                                            # prints the table (a row cut off continues from
                                                            # its last round's checkpoint)
    python scripts/bench_scaling.py --smoke                 # tiny model and steps, for CI (under a minute)
    python scripts/bench_scaling.py --paths 1,4,16,64       # also P = 64 (8x8; about an hour more)

Outputs in --out-dir: results.json (every row), scaling.md (the tables and targets) and scaling_ppl_vs_paths.png.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import bench_quality as bq  # noqa: E402

from dipaco.atomic import write_text  # noqa: E402
from dipaco.config import Config, ModelConfig  # noqa: E402
from dipaco.metrics import echo  # noqa: E402
from dipaco.model.llama import build_model, llama_config  # noqa: E402
from dipaco.run import Run, apply_overrides, load_config  # noqa: E402
from dipaco.runtime import quiet_library_progress_bars  # noqa: E402

GRIDS = {4: "grid:2x2", 16: "grid:4x4", 64: "grid:8x8"}
FAMILIES = ("dipaco", "diloco", "moe", "dense")
PLAIN = ["outer.lr=1.0", "outer.momentum=0.0"]  # the dense rows: plain AdamW, cut into rounds
DIPACO_OUTER = ["outer.lr=1.0", "outer.embedding_head_lr_scale=1.4"]
DILOCO_OUTER = ["outer.lr=1.2"]
DILOCO_ALT_LR = "outer.lr=1.0"  # the second DiLoCo step, at P = 16
REROUTE_EVERY = (64, 32)
TARGET_GAIN = 0.03

# The path every row trains: 2 layers, d = 32, 20.6k non-embedding parameters. 8 rounds x 26 inner steps of
# 16 x 128 tokens = 426k tokens per path, 20.7 per non-embedding parameter (the docs give the arithmetic).
FULL = [
    "model.num_layers=2", "model.hidden_size=32", "model.intermediate_size=64", "model.num_heads=2",
    "tokenizer.vocab_size=2048", "data.seq_len=128", "data.prefix_tokens=32",
    "pretrain.steps=200", "pretrain.optim.warmup_steps=20", "pretrain.optim.batch_size=16",
    "train.rounds=8", "train.inner_steps=26", "train.optim.batch_size=16", "train.optim.warmup_steps=20",
]
SMOKE = [
    "model.num_layers=2", "model.hidden_size=32", "model.intermediate_size=64", "model.num_heads=2",
    "tokenizer.vocab_size=512", "data.seq_len=64", "data.prefix_tokens=16",
    "pretrain.steps=20", "pretrain.optim.warmup_steps=2", "pretrain.optim.batch_size=8",
    "train.rounds=1", "train.inner_steps=3", "train.optim.batch_size=8", "train.optim.warmup_steps=2",
    "route.n_init=1",
]  # one round: the outer step, checkpoint and evaluation of every row still run once (CI's time is short)
SMOKE_DOCS_PER_SOURCE = 150


def seeds_at(paths: int, seeds: int, smoke: bool = False) -> list[int]:
    """The seeds a size runs: ``seeds`` at P = 4 and 16 (the issue's rows with a spread), one elsewhere; the
    smoke run repeats P = 4 only (it checks the bookkeeping of seeds, not their spread)."""
    return list(range(seeds)) if paths == 4 or (paths == 16 and not smoke) else [0]


def seeded(name: str, seed: int) -> str:
    return name if seed == 0 else f"{name}@{bq.SEED_KEY}={seed}"


def scaling_rows(paths: list[int], seeds: int, smoke: bool = False) -> list[bq.Row]:
    """Every row of the sweep, cheapest size first (a chunked run finishes the small sizes early)."""
    # The smoke corpus's 16 shards hold 15 to 30 training documents: 5% would hold none out of some.
    holdout = "train.early_stopping_holdout=0.2" if smoke else bq.EARLY_STOP_HOLDOUT
    out: list[bq.Row] = []
    for p in sorted(paths):
        if p == 1:
            out.append(bq.Row("dense_1x", "dense", None, overrides=PLAIN))
            continue
        shards = f"doctopics{p}_similar"
        for seed in seeds_at(p, seeds, smoke):
            extra = [] if seed == 0 else [f"{bq.SEED_KEY}={seed}"]
            out += [
                bq.Row(seeded(f"dipaco_{p}", seed), GRIDS[p], shards, overrides=[*DIPACO_OUTER, *extra]),
                bq.Row(seeded(f"diloco_{p}", seed), f"diloco:{p}", None, overrides=[*DILOCO_OUTER, *extra]),
                bq.Row(seeded(f"dense_{p}x", seed), "dense", None, rounds_factor=p, overrides=[*PLAIN, *extra]),
            ]
            if seed == 0 or (p == 4 and not smoke):  # flat MoE: one seed at P = 16 (no target is judged on it)
                out.append(bq.Row(seeded(f"moe_{p}", seed), f"moe:{p}", shards, overrides=extra))
        if p == 16:
            if not smoke:  # the second DiLoCo step: a tuning row, not a code path of its own
                out.append(bq.Row(f"diloco_{p}@{DILOCO_ALT_LR}", f"diloco:{p}", None,
                                  overrides=[*DILOCO_OUTER, DILOCO_ALT_LR]))
            out += [
                bq.Row(f"dipaco_{p}_top2", GRIDS[p], shards, overrides=[*DIPACO_OUTER, "route.topk=2"]),
                bq.Row(f"dipaco_{p}_early_stop", GRIDS[p], shards, early_stopping=True,
                       overrides=[*DIPACO_OUTER, holdout]),
            ]
    return out


def family(group: str) -> tuple[str, int]:
    """A main row's family and P: ``dipaco_16`` -> ("dipaco", 16), ``dense_16x`` -> ("dense", 16)."""
    head, _, size = group.split("@")[0].partition("_")
    return head, int(size.rstrip("x"))


def main_family_rows(results: list[dict], default_seed: int = 0) -> dict[tuple[str, int], dict[int, float]]:
    """Perplexity by seed of the main row of each (family, P): no extras, no other outer step. ``dense_1x`` is
    every family's P = 1."""
    out: dict[tuple[str, int], dict[int, float]] = {}
    for r in results:
        group, seed = bq.seed_group(r["name"], default_seed)
        if "@" in group or group.count("_") > 1:
            continue
        fam, p = family(group)
        if fam not in FAMILIES:
            continue
        for f in (FAMILIES if p == 1 else (fam,)):
            out.setdefault((f, p), {})[seed] = r["ppl"]
    return out


def best_group(results: list[dict], prefix: str, compute: int, default_seed: int = 0) -> tuple[str, dict[int, float]] | None:
    """The configuration (over seeds) with the lowest mean among rows named ``prefix`` or ``prefix@...`` that
    trained with ``compute`` (paths x steps per path): another outer step competes, another schedule does not."""
    same = {bq.seed_group(r["name"], default_seed)[0] for r in results if r["paths"] * r["steps_per_path"] == compute}
    groups = {g: s for g, s in bq.seed_groups(results, default_seed).items()
              if g.split("@")[0] == prefix and g in same}
    if not groups:
        return None
    best = min(groups, key=lambda g: statistics.fmean(groups[g].values()))
    return best, groups[best]


def non_embedding_params(model: ModelConfig) -> int:
    """Parameters outside the input embedding and the LM head (what the tokens-per-parameter rule counts)."""
    net = build_model(llama_config(model, vocab_size=8, max_positions=8, eos_id=0, pad_id=1), seed=0)
    return sum(p.numel() for n, p in net.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)


def shard_passes(out_dir: Path, paths: int, tokens_per_path: int) -> dict | None:
    """How many times the doc_topics shards at ``paths`` are read: tokens per path / shard tokens."""
    report = out_dir / f"run_doctopics{paths}_similar" / "routing" / "routing_report.json"
    if not report.is_file():
        return None
    shard = json.loads(report.read_text())["train"]["tokens_per_path"]
    return {"shard_tokens_min": min(shard), "shard_tokens_mean": statistics.fmean(shard),
            "passes_max": tokens_per_path / max(min(shard), 1), "passes_mean": tokens_per_path / statistics.fmean(shard)}


def _mean_std(by_seed: dict[int, float]) -> tuple[float, float | None]:
    values = list(by_seed.values())
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def _cell(by_seed: dict[int, float] | None) -> str:
    if not by_seed:
        return "-"
    mean, std = _mean_std(by_seed)
    return f"{mean:.2f}" if std is None else f"{mean:.2f} ± {std:.2f} ({len(by_seed)})"


def scaling_table(results: list[dict], paths: list[int], default_seed: int = 0) -> str:
    """Validation perplexity by family (rows) and P (columns): mean ± std over seeds (number of seeds)."""
    main = main_family_rows(results, default_seed)
    lines = ["| family (inference: one path) | " + " | ".join(f"P = {p}" for p in paths) + " |",
             "|---|" + "---|" * len(paths)]
    labels = {"dipaco": "DiPaCo grid (1x1, 2x2, 4x4, 8x8)", "diloco": "DiLoCo-P", "moe": "flat MoE-P",
              "dense": "dense, P x steps"}
    for fam in FAMILIES:
        lines.append(f"| {labels[fam]} | " + " | ".join(_cell(main.get((fam, p))) for p in paths) + " |")
    return "\n".join(lines)


def rows_table(results: list[dict], nonemb: int, tokens_per_step: int) -> str:
    lines = ["| row | paths | params/path (inference) | params total | non-emb/path | tokens/path | tokens per "
             "non-emb param per path | wall (its last invocation) | val ppl |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        per_path = r["steps_per_path"] * tokens_per_step
        lines.append(f"| {r['name']} | {r['paths']} | {bq._count(r['params_per_path'])} | {bq._count(r['params_total'])} "
                     f"| {bq._count(nonemb)} | {bq._count(per_path)} | {per_path / nonemb:.1f} | "
                     f"{r['wall_time_s'] / 60:.1f} min{' (resumed)' if r.get('resumed') else ''} | {r['ppl']:.2f} |")
    return "\n".join(lines)


def targets(results: list[dict], paths: list[int], default_seed: int = 0) -> list[str]:
    """The issue's three targets, each on seed means; DiLoCo-P is its best outer step at that P."""
    main = main_family_rows(results, default_seed)
    out: list[str] = []

    def check(label: str, ok: bool | None, detail: str) -> None:
        out.append(f"- {label}: {'met' if ok else 'MISSED' if ok is not None else 'not run'} ({detail})")

    dipaco = [(p, statistics.fmean(main[("dipaco", p)].values())) for p in paths if ("dipaco", p) in main]
    falls = all(b < a for (_, a), (_, b) in zip(dipaco, dipaco[1:]))
    check("DiPaCo's perplexity falls strictly as P grows", falls if len(dipaco) > 1 else None,
          ", ".join(f"P={p}: {v:.2f}" for p, v in dipaco))

    compute = {r["name"]: r["paths"] * r["steps_per_path"] for r in results}

    def gap(p: int, rival: str) -> tuple[float, str] | None:
        ours = main.get(("dipaco", p))
        if not ours or f"dipaco_{p}" not in compute:
            return None
        theirs = best_group(results, rival, compute[f"dipaco_{p}"], default_seed)
        if theirs is None:
            return None
        mine, their = statistics.fmean(ours.values()), statistics.fmean(theirs[1].values())
        return 1 - mine / their, f"{mine:.2f} vs {theirs[0]} {their:.2f}: {1 - mine / their:+.1%}"

    for rival in ("diloco_16", "dense_16x"):
        g = gap(16, rival)
        check(f"P=16: DiPaCo beats {rival} by >= 3%", None if g is None else g[0] >= TARGET_GAIN,
              "not run" if g is None else g[1])
    g4, g16 = gap(4, "diloco_4"), gap(16, "diloco_16")
    check("the DiPaCo-vs-DiLoCo gap widens from P=4 to P=16", None if g4 is None or g16 is None else g16[0] > g4[0],
          "not run" if g4 is None or g16 is None else f"P=4 {g4[0]:+.1%}, P=16 {g16[0]:+.1%}")
    by = {r["name"]: r for r in results}
    base16 = by.get("dipaco_16")
    for extra in ("dipaco_16_top2", "dipaco_16_early_stop"):
        if base16 and extra in by:
            out.append(f"- (info) {extra}: {by[extra]['ppl']:.2f} vs dipaco_16 {base16['ppl']:.2f} (seed 0)")
    if base16 and base16.get("reroute"):
        cells = ", ".join(f"{'once per doc' if x['reroute_every'] is None else 'every ' + str(x['reroute_every'])} "
                          f"{x['ppl']:.2f}" for x in base16["reroute"])
        out.append(f"- (info) dipaco_16 test-time re-routing: {cells}")
    return out


def crossover(results: list[dict], default_seed: int = 0) -> list[str]:
    """Rows run with another schedule (``dipaco_P@train.rounds=R``, with ``--rows``): DiPaCo against DiLoCo-P on
    the same schedule and against the dense row of the same compute (paths x steps per path), on seed means."""
    groups = bq.seed_groups(results, default_seed)
    mean = {g: statistics.fmean(s.values()) for g, s in groups.items()}
    compute = {bq.seed_group(r["name"], default_seed)[0]: r["paths"] * r["steps_per_path"] for r in results}
    steps = {bq.seed_group(r["name"], default_seed)[0]: r["steps_per_path"] for r in results}
    out = []
    for g in sorted(groups):
        if not (g.startswith("dipaco_") and "@train.rounds=" in g):
            continue
        cells = [f"{g} ({steps[g]} steps per path, seeds {bq._seeds(groups[g])}) {mean[g]:.2f}"]
        rival = "diloco_" + g.removeprefix("dipaco_")
        dense = [d for d in groups if d.startswith("dense_") and "@" not in d and compute[d] == compute[g]]
        for other in ([rival] if rival in mean else []) + dense:
            cells.append(f"{other} {mean[other]:.2f}: {1 - mean[g] / mean[other]:+.1%}")
        out.append("- (info) crossover: " + "; vs ".join(cells))
    return out


def plot(results: list[dict], paths: list[int], path: Path, default_seed: int = 0) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        echo("[bench] matplotlib not installed (pip install -e '.[bench]'): no plot")
        return None
    main = main_family_rows(results, default_seed)
    labels = {"dipaco": "DiPaCo grid", "diloco": "DiLoCo-P", "moe": "flat MoE-P", "dense": "dense, P x steps"}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for fam, marker in zip(FAMILIES, "osD^"):
        points = [(p, *_mean_std(main[(fam, p)])) for p in paths if (fam, p) in main]
        if points:
            ax.errorbar([x for x, _, _ in points], [m for _, m, _ in points], yerr=[s or 0 for _, _, s in points],
                        marker=marker, capsize=3, label=f"{labels[fam]} (inference: 1 path)")
    by = {r["name"]: r for r in results}
    for name, marker in (("dipaco_16_top2", "x"), ("dipaco_16_early_stop", "+")):
        if name in by:
            ax.plot([16], [by[name]["ppl"]], marker=marker, linestyle="none", color="black", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(paths, [str(p) for p in paths])
    ax.set_xlabel("paths P (equal compute: P x one path's steps)")
    ax.set_ylabel("validation perplexity")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def reroute(row: bq.Row, base: Config, out_dir: Path) -> list[dict]:
    """Test-time re-routing of a trained DiPaCo row (its final checkpoint)."""
    run = bq.variant_run(base, row.routing, out_dir)
    cfg = apply_overrides(run, bq.row_overrides(row, base))
    return Run(cfg).reroute_evaluate(REROUTE_EVERY)["results"]


def parse_paths(text: str) -> list[int]:
    try:
        paths = sorted({int(x) for x in text.split(",")})
    except ValueError:
        raise SystemExit(f"error: --paths: a comma-separated list of 1, 4, 16, 64, got {text!r}") from None
    unknown = [p for p in paths if p != 1 and p not in GRIDS]
    if unknown:
        raise SystemExit(f"error: --paths: {unknown} not among 1, 4, 16, 64 (the square grids of two levels)")
    return paths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model and steps, 150 documents per corpus (CI)")
    p.add_argument("--paths", default="1,4,16", help="comma-separated P among 1, 4, 16, 64 (default 1,4,16)")
    p.add_argument("--seeds", type=int, default=2, help="seeds of the P = 4 and P = 16 rows (default 2)")
    p.add_argument("--out-dir", default="runs/bench_scaling")
    p.add_argument("--resume", action="store_true",
                   help="keep the rows results.json already holds (same base config); a row cut off continues "
                        "from its last round's checkpoint")
    p.add_argument("--data", type=Path, default=None, help="the folder holding the shared corpora "
                   "(default: shared/data beside the repository)")
    p.add_argument("--rows", nargs="*", default=[], metavar="ROW@key=value",
                   help="more rows after the sweep's: a sweep row with extra overrides, e.g. dipaco_4@train.rounds=32 "
                        "(the crossover rows in docs/benchmarks.md); judged beside the sweep, not in its curve")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dipaco overrides on top of the sweep's")
    args = p.parse_args()
    paths = parse_paths(args.paths)
    if args.seeds < 1:
        p.error("--seeds must be >= 1")
    rows = scaling_rows(paths, args.seeds, args.smoke)
    known = {r.name: r for r in scaling_rows(sorted(GRIDS) + [1], args.seeds, args.smoke)}
    try:
        rows += [bq.named_row(name, known) for name in args.rows if name not in {r.name for r in rows}]
    except KeyError as err:
        sys.exit(f"error: unknown row {err.args[0]!r} (a sweep row, or ROW@key=value@...); known: {', '.join(known)}")
    data_dir = (bq.SHARED if args.data is None else args.data).resolve()
    missing = [name for name in bq.SOURCES if not (data_dir / name).is_file()]
    if missing:
        sys.exit(f"error: the shared corpora are not at {data_dir} (missing {', '.join(missing)}); name their folder "
                 "with --data")

    quiet_library_progress_bars()
    out_dir = Path(args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    corpus = out_dir / "corpus.jsonl"
    fresh = bq.write_corpus(out_dir / "corpus.jsonl.new", SMOKE_DOCS_PER_SOURCE if args.smoke else None,
                            bq.SOURCES, data_dir)
    if (out_dir / "base" / "pretrain" / "config.json").is_file() and corpus.is_file() \
            and corpus.read_bytes() != fresh.read_bytes():
        fresh.unlink()
        sys.exit(f"error: {out_dir} was prepared on another corpus{' (not --smoke)' if args.smoke else ''}; "
                 "use another --out-dir")
    fresh.replace(corpus)
    base = load_config(REPO / "configs/bench/quality.yaml",
                       [*(SMOKE if args.smoke else FULL), f"run.dir={out_dir / 'base'}", f"data.corpus={corpus}",
                        *args.overrides])
    nonemb = non_embedding_params(base.model)
    tokens_per_step = base.train.optim.batch_size * base.data.seq_len
    tokens_per_path = base.train.rounds * base.train.inner_steps * tokens_per_step
    echo(f"[bench] path: {nonemb:,} non-embedding parameters; {tokens_per_path:,} training tokens per path "
         f"({tokens_per_path / nonemb:.1f} per non-embedding parameter)")

    started = time.perf_counter()
    if not (Path(base.run.dir) / "pretrain" / "config.json").is_file():
        bq.prepare(base)
        bq.pretrain(base)
    init = Run(base).evaluate_pretrained()
    by_name = bq.finished_rows(out_dir / "results.json", base) if args.resume else {}
    if not args.resume and (out_dir / "results.json").is_file():
        echo(f"[bench] starting over: {out_dir / 'results.json'} will be replaced (--resume keeps its rows)")
    order = {r.name: i for i, r in enumerate(rows)}

    def ordered() -> list[dict]:
        return [by_name[n] for n in sorted(by_name, key=lambda n: order.get(n, len(order)))]

    def last_only(last: int) -> list[int]:  # one full validation pass per row: the plot is against P
        return [last]

    for i, row in enumerate(rows, 1):
        if row.name in by_name:
            echo(f"[bench] {row.name}: kept from results.json (ppl {by_name[row.name]['ppl']:.2f})")
            continue
        echo(f"[bench] === {i}/{len(rows)} {row.name} ({row.preset}, shards {row.routing or 'iid'}) ===")
        result = bq.run_row(row, base, out_dir, resume=args.resume, curve_at=last_only)
        if row.name == "dipaco_16":
            result["reroute"] = reroute(row, base, out_dir)
        by_name[row.name] = result
        echo(f"[bench] {row.name}: ppl {result['ppl']:.2f} in {result['wall_time_s']:.0f}s "
             f"({time.perf_counter() - started:.0f}s into this invocation)")
        bq.write_results(out_dir / "results.json", base, init, ordered())
    results = ordered()

    passes = {p: shard_passes(out_dir, p, tokens_per_path) for p in paths if p > 1}
    summary = "\n".join(targets(results, paths, base.run.seed) + crossover(results, base.run.seed))
    text = "\n\n".join([
        scaling_table(results, paths, base.run.seed),
        rows_table(results, nonemb, tokens_per_step),
        "\n".join(f"- P={p}: doc_topics shards of {s['shard_tokens_min']:,} tokens (smallest), "
                  f"{s['shard_tokens_mean']:,.0f} (mean); each path reads its shard {s['passes_mean']:.2f} times on average, "
                  f"{s['passes_max']:.2f} at most" for p, s in passes.items() if s),
        summary,
    ])
    png = plot(results, paths, out_dir / "scaling_ppl_vs_paths.png", base.run.seed)
    total = time.perf_counter() - started
    bq.write_results(out_dir / "results.json", base, init, results, invocation_wall_time_s=total,
                     rows_wall_time_s=sum(r["wall_time_s"] for r in results), command=" ".join(sys.argv),
                     targets=summary, non_embedding_params=nonemb, tokens_per_path=tokens_per_path,
                     shard_passes=passes)
    write_text(out_dir / "scaling.md", text + "\n")
    print(f"\npretrained init: val ppl {init['overall']['ppl']:.2f}; path: {nonemb:,} non-embedding parameters, "
          f"{tokens_per_path:,} tokens per path ({tokens_per_path / nonemb:.1f} per non-embedding parameter)\n")
    print(text)
    print(f"\n{len(results)} rows (training {sum(r['wall_time_s'] for r in results) / 60:.1f} min); this invocation "
          f"took {total / 60:.1f} min; results in {out_dir}; plot: {png or 'none'}")
    if any(not math.isfinite(r["ppl"]) for r in results):
        sys.exit("error: a row's validation perplexity is not finite")


if __name__ == "__main__":
    main()
