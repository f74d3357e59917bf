"""The `dipaco` command: one subcommand per job, each taking ``--config FILE`` and ``key=value`` overrides.

    dipaco prepare  --config configs/demo.yaml            corpus -> tokenizer -> tokenized splits
    dipaco pretrain --config configs/demo.yaml            dense path-sized model (initialises modules)
    dipaco route    --config configs/demo.yaml            documents -> features -> k-means -> shards
    dipaco reroute  --config configs/demo.yaml            discriminative re-routing from a checkpoint
    dipaco train    --config configs/demo.yaml [--resume] rounds of inner steps + per-module outer step
    dipaco eval     --config configs/demo.yaml            per-path validation perplexity -> eval.json
    dipaco report   --config configs/demo.yaml            table of every evaluated model of the run
    dipaco pipeline --config configs/demo.yaml --baseline every job above in one process (what `make demo` runs)
    dipaco eval     --config ... --reroute-every 128,64,32 test-time re-routing every W tokens
    dipaco eval     --config ... --corpus news.jsonl      per-path perplexity on any corpus -> eval_news.json
    dipaco generate --run runs/demo "prompt"             route the prompt, run its one path
    dipaco export   --run runs/demo --path 3 --out DIR    a path as a standalone HF model directory
    dipaco serve    --run runs/demo --port 8000           HTTP API: /v1/generate, /v1/completions (OpenAI), /v1/paths
    dipaco convert-spec --run runs/demo                   experiment.json for a run trained before specs
    dipaco compare  CKPT_A CKPT_B                         tensor by tensor: were two runs bit-identical?
    dipaco config show [--config FILE] [key=value ...]    every key of the config and its value

The inference commands take ``--run RUN_DIR`` instead: they read the experiment's spec
(``experiment.json``, :mod:`dipaco.checkpoint.spec`), converted once from its stored config for a
run trained before specs existed.

Problems with the user's input (config, data, checkpoints) print one ``error:`` line and exit 2.
Nothing heavy is imported before the arguments are parsed, so ``dipaco --help`` answers at once.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from dipaco.errors import DipacoError

PRECISIONS = ("auto", "fp32", "bf16", "fp16")  # dipaco.config.PrecisionName, without importing the schema here

if TYPE_CHECKING:
    from dipaco.run import Run


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", help="YAML config file (see configs/); defaults apply when omitted")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotlist overrides, before or after the flags (the last wins), e.g. train.inner_steps=20 "
                             "topology.preset=grid:2x2")


def _cmd_prepare(run: Run, args: argparse.Namespace) -> None:
    run.prepare()


def _cmd_pretrain(run: Run, args: argparse.Namespace) -> None:
    run.pretrain(resume=args.resume)


def _cmd_train(run: Run, args: argparse.Namespace) -> None:
    run.train(resume=args.resume, resume_from=args.resume_from, until_round=args.until_round)


def _cmd_route(run: Run, args: argparse.Namespace) -> None:
    run.route()


def _cmd_reroute(run: Run, args: argparse.Namespace) -> None:
    run.reroute(checkpoint=args.checkpoint)


def _cmd_eval(run: Run, args: argparse.Namespace) -> None:
    if args.corpus is not None:
        if args.pretrained or args.reroute_every:
            raise DipacoError("--corpus scores an experiment's routed paths; drop --pretrained and --reroute-every")
        run.evaluate_corpus(args.corpus, checkpoint=args.checkpoint)
    elif args.reroute_every:
        from dipaco.eval.reroute_eval import parse_every

        if args.pretrained:
            raise DipacoError("--reroute-every evaluates an experiment's paths; drop --pretrained")
        run.reroute_evaluate(parse_every(args.reroute_every), checkpoint=args.checkpoint)
    elif args.pretrained:
        run.evaluate_pretrained()
    else:
        run.evaluate(checkpoint=args.checkpoint)


# The dense baseline of `dipaco pipeline --baseline` (the demo's table): one path, every part shared, trained for as
# many steps as each DiPaCo path. With outer lr 1 and no momentum the outer step hands the path's weights back
# unchanged, so this is plain continued training.
DENSE_BASELINE = ("train.name=dense_1x", "topology.preset=dense", "outer.lr=1.0", "outer.momentum=0.0",
                  "train.sharding=iid")


def _cmd_pipeline(run: Run, args: argparse.Namespace) -> None:
    """Every job of the run in one process, each the function its own command calls, so the files and
    perplexities are those of the commands one by one; torch and transformers are imported once."""
    from dipaco.run import Run, apply_overrides

    steps: list[tuple[str, Callable[[], object]]] = [
        ("prepare", run.prepare), ("pretrain", run.pretrain), ("eval --pretrained", run.evaluate_pretrained)]
    if run.cfg.train.sharding == "kmeans":
        steps.append(("route", run.route))
    steps += [("train", run.train), ("eval", run.evaluate)]
    if args.baseline:
        dense = Run(apply_overrides(run.cfg, list(DENSE_BASELINE)))  # a baseline that does not fit fails first
        steps += [(f"train {' '.join(DENSE_BASELINE)}", dense.train),
                  (f"eval train.name={dense.cfg.train.name}", dense.evaluate)]
    for name, job in steps:
        print(f"== dipaco {name} ==", flush=True)
        job()
    print("== dipaco report: validation perplexity (routing prefix excluded) ==")
    print(run.report())


def _cmd_report(args: argparse.Namespace) -> None:
    from dipaco.config import merge_config
    from dipaco.eval.report import comparison_table  # JSON only: the table answers without loading torch

    print(comparison_table(merge_config(args.config, args.overrides).run.dir))


def _cmd_generate(args: argparse.Namespace) -> None:
    from dipaco.serve.pipeline import Pipeline

    _spec_of_old_run(args)
    pipe = Pipeline.from_run(args.run, experiment=args.experiment, checkpoint=args.checkpoint, device=args.device,
                             precision=args.precision)
    # the server's rule: a model trained on data.seq_len positions (or imported with its own) has no more
    pipe.spec.served_positions().check_fits(len(pipe.encode(args.prompt)), args.max_new_tokens, "--max-new-tokens")
    out = pipe.generate(args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                        top_p=args.top_p, top_k=args.top_k, seed=args.seed, path=args.path)
    modules = " ".join(pipe.loaded.module_names(out.path))
    how = "chosen with --path" if out.scores is None else "routed"
    print(f"path: {out.path} ({modules}), {how}")
    if out.scores is not None:
        scores = out.scores
        best_first = sorted(range(len(scores)), key=lambda p: -scores[p])
        print("scores: " + "  ".join(f"{p}:{scores[p]:.4g}" for p in best_first))
    print(f"tokens: {out.prompt_tokens} prompt + {out.completion_tokens} generated ({out.finish_reason}), "
          f"{out.latency_ms:.0f} ms" + (f", seed {out.seed}" if out.seed is not None else ""))
    print(f"text: {args.prompt}{out.text}")
    print(f"completion: {out.text}")  # what /v1/generate returns as "text"


def _cmd_export(args: argparse.Namespace) -> None:
    from dipaco.serve.export import export

    _spec_of_old_run(args)
    export(args.run, args.out, path=args.path, all_paths=args.all, experiment=args.experiment, checkpoint=args.checkpoint)


def _cmd_serve(args: argparse.Namespace) -> None:
    from dipaco.serve.auth import resolve_token
    from dipaco.serve.http import AppOptions, ServeOptions, serve
    from dipaco.serve.router_passes import RouterOptions, router_cpus

    _spec_of_old_run(args)
    app = AppOptions(max_prompt_tokens=args.max_prompt_tokens, max_new_tokens_cap=args.max_new_tokens_cap,
                     max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout_s, max_batch=args.max_batch,
                     batch_wait_ms=args.batch_wait_ms, decode_workers=args.decode_workers, max_prompts=args.max_prompts,
                     batching=args.batching, heap_trim_s=args.heap_trim_s)
    serve(args.run, ServeOptions(host=args.host, port=args.port, experiment=args.experiment, checkpoint=args.checkpoint,
                                 cache_size=args.cache_size, device=args.device, precision=args.precision,
                                 token=resolve_token(args.token), allow_unauthenticated=args.allow_unauthenticated,
                                 header_timeout_s=args.header_timeout_s, max_connections=args.max_connections,
                                 router=RouterOptions(in_child=args.router_process, batch=args.router_batch,
                                                      cpus=router_cpus(args.router_cpus, args.router_process)),
                                 app=app))


def _spec_of_old_run(args: argparse.Namespace) -> None:
    """An experiment trained before experiment specs gets one, once, from its stored config (dipaco.checkpoint.migrate)."""
    from dipaco.checkpoint.migrate import convert_experiment
    from dipaco.run_dir import RunDir
    from dipaco.serve.pipeline import resolve_experiment

    try:
        exp_dir = resolve_experiment(RunDir(args.run), args.experiment)
    except DipacoError:
        return  # no such run or experiment: the job's own loading names the problem
    convert_experiment(args.run, exp_dir.name)


def _cmd_convert_spec(args: argparse.Namespace) -> None:
    from dipaco.checkpoint.migrate import convert_experiment
    from dipaco.run_dir import RunDir
    from dipaco.serve.pipeline import resolve_experiment

    print(convert_experiment(args.run, resolve_experiment(RunDir(args.run), args.experiment).name))


def _cmd_compare(args: argparse.Namespace) -> None:
    from dipaco.checkpoint.compare import compare_checkpoints, newest_checkpoint

    if args.experiments and not args.names:
        raise DipacoError("--experiments needs the experiment names to compare (e.g. one tr2_int8)")
    if args.names and not args.experiments:
        raise DipacoError("experiment names are compared with --experiments (A and B are then run directories)")
    pairs = ([(newest_checkpoint(args.a, n), newest_checkpoint(args.b, n)) for n in args.names]
             if args.experiments else [(args.a, args.b)])
    failed = False
    for a, b in pairs:
        count, problems = compare_checkpoints(a, b, tuple(args.ignore))
        label = f"{a.parent.parent.name}/{a.name}" if args.experiments else str(a)
        print(f"{label}: {f'{len(problems)} differences' if problems else 'identical'} ({count} tensors)")
        for line in problems[:20]:
            print(f"  {line}")
        failed |= bool(problems)
    if failed:
        raise SystemExit(1)


def _add_run_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, metavar="RUN_DIR", help="run directory (e.g. runs/demo)")
    parser.add_argument("--experiment", metavar="NAME", help="experiment under RUN_DIR/train (needed when there are several)")
    parser.add_argument("--checkpoint", metavar="CKPT_DIR", help="use this checkpoint instead of the newest")
    parser.set_defaults(uses_config=False)


def _command(sub, name: str, summary: str) -> argparse.ArgumentParser:  # noqa: ANN001 (argparse's private subparsers type)
    """A subcommand whose help shows its one-line summary and every option's default."""
    return sub.add_parser(name, help=summary, description=summary[:1].upper() + summary[1:] + ".",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port (0..65535)")
    return port


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dipaco", description="Train DiPaCo (Distributed Path Composition) language models.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = _command(sub, "prepare", "load the corpus, split it, train the tokenizer and tokenize")
    p.set_defaults(func=_cmd_prepare)
    p = _command(sub, "pretrain", "train the dense path-sized model that initialises every module")
    p.add_argument("--resume", action="store_true",
                   help="continue a pretraining that a signal stopped (its step checkpoint in RUN/pretrain.work)")
    p.set_defaults(func=_cmd_pretrain)

    p = _command(sub, "route", "featurize documents, fit (balanced/product) k-means, write routed shards")
    p.set_defaults(func=_cmd_route)
    p = _command(sub, "reroute", "discriminative re-routing from the experiment's checkpoint (then train --resume)")
    p.add_argument("--checkpoint", metavar="CKPT_DIR", help="score paths from this checkpoint instead of the newest")
    p.set_defaults(func=_cmd_reroute)

    p = _command(sub, "train", "train the paths: inner AdamW rounds and per-module Nesterov outer steps")
    p.add_argument("--resume", action="store_true", help="continue from the experiment's newest checkpoint")
    p.add_argument("--resume-from", metavar="CKPT_DIR", help="continue from this checkpoint directory")
    p.add_argument("--until-round", type=int, metavar="N",
                   help="stop after round N (the LR schedule still spans train.rounds); continue later with --resume")
    p.set_defaults(func=_cmd_train)

    p = _command(sub, "eval", "validation perplexity per path and overall, routing prefix excluded")
    p.add_argument("--checkpoint", metavar="CKPT_DIR", help="evaluate this checkpoint instead of the newest")
    p.add_argument("--pretrained", action="store_true", help="evaluate the pretrained dense model instead")
    p.add_argument("--reroute-every", metavar="W[,W...]",
                   help="test-time re-routing: perplexity with the path re-chosen every W tokens (e.g. 128,64,32), "
                        "next to once-per-document routing -> reroute_eval.json")
    p.add_argument("--corpus", metavar="SOURCE",
                   help="score this corpus instead of the validation split: a file, directory or glob that "
                        "data.corpus could name, read with the run's data keys, routed by the run's router "
                        "-> train/<name>/eval_<corpus name>.json")
    p.set_defaults(func=_cmd_eval)

    p = _command(sub, "report", "print a table of every evaluated model in the run directory")
    p.set_defaults(func=_cmd_report)

    p = _command(sub, "pipeline", "run every job in one process: prepare, pretrain, eval --pretrained, route "
                                  "(train.sharding=kmeans), train, eval, then the report (the imports load once)")
    p.add_argument("--baseline", action="store_true",
                   help="also train and evaluate the dense baseline: train.name=dense_1x, one path, as many steps "
                        "per path (what make demo compares with)")
    p.set_defaults(func=_cmd_pipeline)

    for name in ("prepare", "pretrain", "route", "reroute", "train", "eval", "report", "pipeline"):
        _add_config_args(sub.choices[name])

    p = _command(sub, "generate", "route a prompt to its path and continue it with that path alone")
    _add_run_args(p)
    p.add_argument("prompt", help="the text to continue")
    p.add_argument("--path", type=int, help="use this path instead of routing (required without a router)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy decoding (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, help="sampling seed")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | auto")
    p.add_argument("--precision", default="auto", choices=PRECISIONS,
                   help="forward-pass precision: auto (bf16 on CUDA, fp32 on CPU) | fp32 | bf16 | fp16")
    p.set_defaults(func=_cmd_generate)

    p = _command(sub, "export", "write a path (or every path) as a standalone Hugging Face model directory")
    _add_run_args(p)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--path", type=int, help="the path to export")
    which.add_argument("--all", action="store_true", help="every path, into OUT/path_NNN")
    p.add_argument("--out", required=True, metavar="DIR")
    p.set_defaults(func=_cmd_export)

    p = _command(sub, "convert-spec", "write the experiment spec of an experiment trained before dipaco wrote one")
    _add_run_args(p)
    p.set_defaults(func=_cmd_convert_spec)

    p = _command(sub, "compare", "compare two checkpoints tensor by tensor: were two runs bit-identical? "
                                 "(exit status 1 when a tensor differs or is missing)")
    p.add_argument("a", type=Path, metavar="A", help="a checkpoint directory (with --experiments: a run directory)")
    p.add_argument("b", type=Path, metavar="B", help="the checkpoint (or run directory) to compare it with")
    p.add_argument("names", nargs="*", metavar="NAME", help="with --experiments: the experiments to compare")
    p.add_argument("--experiments", action="store_true",
                   help="A and B are run directories: compare each NAME's newest checkpoint")
    p.add_argument("--ignore", action="append", default=[], metavar="SUBSTRING",
                   help="leave out differences whose key contains this (e.g. trainer_state.pt)")
    p.set_defaults(func=_cmd_compare, uses_config=False)

    p = _command(sub, "serve", "HTTP API (FastAPI): /healthz, /v1/paths, /v1/route, /v1/generate, OpenAI's "
                               "/v1/completions and /v1/models, /metrics")
    _add_run_args(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="listening address; one that is not loopback needs --token (or --allow-unauthenticated)")
    p.add_argument("--port", type=_port, default=8000, help="TCP port (0: any free one)")
    p.add_argument("--token", default=None,
                   help="every endpoint but /healthz requires 'Authorization: Bearer TOKEN' (401 otherwise); "
                        "default: the DIPACO_SERVE_TOKEN environment variable (which other users cannot see in ps)")
    p.add_argument("--allow-unauthenticated", action="store_true",
                   help="serve a non-loopback --host without a token")
    p.add_argument("--batching", choices=("module", "path"), default="module",
                   help="module (default): requests of any paths decode together, each level's modules running once "
                        "per step on the rows through them; path: only requests of one path together")
    p.add_argument("--router-process", action=argparse.BooleanOptionalAction, default=True,
                   help="an LM-prefix router runs its forward pass in a process of its own (default), beside "
                        "decoding instead of taking turns with it for Python's interpreter lock; "
                        "--no-router-process: in the server's process")
    p.add_argument("--router-cpus", default="auto", metavar="LIST",
                   help="run an LM-prefix router's process on these CPUs only (as taskset -c takes them: 1, or 2-3,5) "
                        "and the server off them, with no more torch threads than CPUs, so that routing does not take "
                        "the decoding thread's CPU; auto (default): the last CPU, when the server may use two or more; "
                        "none: wherever the OS puts them")
    p.add_argument("--router-batch", type=int, default=16,
                   help="prompts one router pass scores at most (those waiting when the router frees up; "
                        "prompts of one length share a forward)")
    p.add_argument("--max-batch", type=int, default=16,
                   help="requests decoded together at most (1: no batching)")
    p.add_argument("--max-prompts", type=int, default=16,
                   help="prompts in one /v1/completions request at most (a list of prompts; each is one row)")
    p.add_argument("--batch-wait-ms", type=float, default=5.0,
                   help="how long a path's first waiting request waits for others to join its batch")
    p.add_argument("--decode-workers", type=int, default=1,
                   help="threads decoding batches (of different paths) at once")
    p.add_argument("--heap-trim-s", type=float, default=10.0,
                   help="hand the C allocator's free memory back to the OS (glibc's malloc_trim) every this many "
                        "seconds: under varied traffic freed tensors otherwise stay with the process; 0: never")
    p.add_argument("--header-timeout-s", type=float, default=5.0,
                   help="a connection that has not sent a complete request's headers this many seconds after "
                        "opening (or after its last answer) is closed")
    p.add_argument("--max-connections", type=int, default=None,
                   help="open connections at most; at the limit a new one closes the longest-idle one. "
                        "Default: what the file descriptor limit (ulimit -n) leaves, less 64")
    p.add_argument("--body-timeout-s", type=float, default=10.0,
                   help="a request body not fully received this many seconds after the request started is a 408")
    p.add_argument("--cache-size", type=int, default=4,
                   help="composed path models kept in memory (LRU)")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="longer prompts are refused (422); default: the experiment's data.seq_len, and larger "
                        "values are lowered to it (prompt + new tokens must fit data.seq_len)")
    p.add_argument("--max-new-tokens-cap", type=int, default=None,
                   help="larger max_new_tokens are refused (422); default and ceiling: the experiment's data.seq_len")
    p.add_argument("--max-body-bytes", type=int, default=None,
                   help="larger request bodies are refused (413) before they are read; default: the largest "
                        "valid request (prompt cap x longest token x 6 JSON bytes + 16 KiB)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | auto")
    p.add_argument("--precision", default="auto", choices=PRECISIONS,
                   help="forward-pass precision: auto (bf16 on CUDA, fp32 on CPU) | fp32 | bf16 | fp16")
    p.set_defaults(func=_cmd_serve)

    p = _command(sub, "config", "print the resolved config: every key, with its default unless the file or an override sets it")
    p.add_argument("action", choices=["show"])
    _add_config_args(p)
    p.set_defaults(func=_cmd_config, uses_config=False)
    return parser


def _cmd_config(args: argparse.Namespace) -> None:
    from dipaco.config import merge_config, to_yaml

    print(to_yaml(merge_config(args.config, args.overrides)), end="")


def _close_progress_bars() -> None:
    """Closes the live tqdm bars, so a last line printed after them starts a line of its own."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def parse_command_line(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed command line. ``key=value`` overrides may come before and after the flags
    (``train run.dir=x --resume train.inner_steps=20``), later ones winning; argparse's own
    ``parse_intermixed_args`` cannot, as it refuses subcommands."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    overrides = [e for e in extra if "=" in e and not e.startswith("-")]
    if overrides and hasattr(args, "overrides"):
        args.overrides = [*args.overrides, *overrides]
        extra = [e for e in extra if e not in overrides]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    command = None
    try:  # the imports below are inside: a Ctrl-C while they load is one line too
        args = parse_command_line(argv)
        command = args.command
        if args.func in (_cmd_config, _cmd_report):  # the schema and JSON alone: they answer without loading torch
            args.func(args)
            return 0
        from dipaco.runtime import quiet_library_progress_bars, sigint_stops_training

        with sigint_stops_training():
            if not getattr(args, "uses_config", True):  # generate / export / serve: the run's stored config
                quiet_library_progress_bars()
                args.func(args)
                return 0
            from dipaco.run import Run, load_config

            cfg = load_config(args.config, args.overrides)
            run = Run(cfg)
            run.topology()  # levels that do not hold model.num_layers are refused by every job, not by train alone
            if not cfg.run.progress:
                quiet_library_progress_bars()
            args.func(run, args)
    except DipacoError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: one line, no traceback; 128 + the signal, as shells report it
        if "tqdm" in sys.modules:
            _close_progress_bars()
        hint = "; continue with --resume" if command in ("train", "pretrain") else ""
        terminated = isinstance(exc, getattr(sys.modules.get("dipaco.runtime"), "Terminated", ()))
        what = "terminated (SIGTERM)" if terminated else "interrupted"
        print(f"{what}: dipaco{f' {command}' if command else ''} stopped{hint}", file=sys.stderr)
        return 143 if terminated else 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
