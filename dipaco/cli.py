"""The `dipaco` command: one subcommand per job, each taking ``--config FILE`` and ``key=value`` overrides.

    dipaco prepare  --config configs/demo.yaml            corpus -> tokenizer -> tokenized splits
    dipaco pretrain --config configs/demo.yaml            dense path-sized model (initialises modules)
    dipaco route    --config configs/demo.yaml            documents -> features -> k-means -> shards
    dipaco reroute  --config configs/demo.yaml            discriminative re-routing from a checkpoint
    dipaco train    --config configs/demo.yaml [--resume] rounds of inner steps + per-module outer step
    dipaco eval     --config configs/demo.yaml            per-path validation perplexity -> eval.json
    dipaco report   --config configs/demo.yaml            table of every evaluated model of the run

Problems with the user's input (config, data, checkpoints) print one ``error:`` line and exit 2.
"""

from __future__ import annotations

import argparse
import sys

from dipaco.config import Config, load_config
from dipaco.errors import DipacoError


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", help="YAML config file (see configs/); defaults apply when omitted")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotlist overrides, e.g. train.inner_steps=20 topology.preset=grid:2x2")


def _cmd_prepare(cfg: Config, args: argparse.Namespace) -> None:
    from dipaco.prepare import prepare

    prepare(cfg)


def _cmd_pretrain(cfg: Config, args: argparse.Namespace) -> None:
    from dipaco.pretrain import pretrain

    pretrain(cfg)


def _cmd_train(cfg: Config, args: argparse.Namespace) -> None:
    from dipaco.train import train

    train(cfg, resume=args.resume, resume_from=args.resume_from, until_round=args.until_round)


def _cmd_route(cfg: Config, args: argparse.Namespace) -> None:
    from dipaco.route import route

    route(cfg)


def _cmd_reroute(cfg: Config, args: argparse.Namespace) -> None:
    from dipaco.route import reroute

    reroute(cfg, checkpoint=args.checkpoint)


def _cmd_eval(cfg: Config, args: argparse.Namespace) -> None:
    from dipaco.evaluate import evaluate_experiment, evaluate_pretrained

    if args.pretrained:
        evaluate_pretrained(cfg)
    else:
        evaluate_experiment(cfg, checkpoint=args.checkpoint)


def _cmd_report(cfg: Config, args: argparse.Namespace) -> None:
    from dipaco.evaluate import comparison_table

    print(comparison_table(cfg.run.dir))


def _quiet_library_progress_bars() -> None:
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dipaco", description="Train DiPaCo (Distributed Path Composition) language models.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prepare", help="load the corpus, split it, train the tokenizer and tokenize")
    p.set_defaults(func=_cmd_prepare)
    p = sub.add_parser("pretrain", help="train the dense path-sized model that initialises every module")
    p.set_defaults(func=_cmd_pretrain)

    p = sub.add_parser("route", help="featurize documents, fit (balanced/product) k-means, write routed shards")
    p.set_defaults(func=_cmd_route)
    p = sub.add_parser("reroute", help="discriminative re-routing from the experiment's checkpoint (then train --resume)")
    p.add_argument("--checkpoint", metavar="CKPT_DIR", help="score paths from this checkpoint instead of the newest")
    p.set_defaults(func=_cmd_reroute)

    p = sub.add_parser("train", help="train the paths: inner AdamW rounds and per-module Nesterov outer steps")
    p.add_argument("--resume", action="store_true", help="continue from the experiment's newest checkpoint")
    p.add_argument("--resume-from", metavar="CKPT_DIR", help="continue from this checkpoint directory")
    p.add_argument("--until-round", type=int, metavar="N",
                   help="stop after round N (the LR schedule still spans train.rounds); continue later with --resume")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("eval", help="validation perplexity per path and overall, routing prefix excluded")
    p.add_argument("--checkpoint", metavar="CKPT_DIR", help="evaluate this checkpoint instead of the newest")
    p.add_argument("--pretrained", action="store_true", help="evaluate the pretrained dense model instead")
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser("report", help="print a table of every evaluated model in the run directory")
    p.set_defaults(func=_cmd_report)

    for name in ("prepare", "pretrain", "route", "reroute", "train", "eval", "report"):
        _add_config_args(sub.choices[name])
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if not cfg.run.progress:
            _quiet_library_progress_bars()
        args.func(cfg, args)
    except DipacoError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
