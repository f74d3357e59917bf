"""`dipaco pretrain`: the dense, path-sized model trained on all training data.

With ``model.init_from`` it starts from that checkpoint's weights (:mod:`dipaco.model.source`) and continues
its training on the corpus for ``pretrain.steps`` steps (0: the checkpoint as it is). Before the model is built,
the checkpoint's tensor shapes are checked against its config.json and its parameter count against the
available memory.

Its weights initialise every module of the bank (the DiPaCo paper pretrains 24k of 88k steps
this way). It is saved with ``save_pretrained`` (safetensors) together with the tokenizer, so the
directory is a standard HF model that routing can featurize with (:mod:`dipaco.model.pretrained`
loads it back).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from dipaco.atomic import recover, remove_tree, replacing
from dipaco.config import ModelConfig, PretrainConfig, RunConfig
from dipaco.data.prepare import Prepared
from dipaco.errors import ConfigError
from dipaco.metrics import MetricsLogger, echo
from dipaco.model.llama import build_model
from dipaco.model.pretrained import path_llama_config
from dipaco.model.source import check_import, import_weights
from dipaco.paths.factory import DENSE, LoopSettings, PathLoops
from dipaco.paths.inner import InnerLoop, InnerStats, check_optim
from dipaco.route.shards import build_shards
from dipaco.run_dir import RunDir
from dipaco.runtime import finish_the_step, resolve_device, rng_state, seed_everything, set_rng_state
from dipaco.tensor_io import copy_params, load_state, load_tensors, save_state, save_tensors


def check_pretrain(section: PretrainConfig) -> None:
    if section.steps < 0:
        raise ConfigError(f"pretrain.steps: must be >= 0, got {section.steps}")
    if section.checkpoint_every < 0:
        raise ConfigError(f"pretrain.checkpoint_every: must be >= 0 (0: only when a signal stops it), "
                          f"got {section.checkpoint_every}")
    check_optim("pretrain.optim", section.optim)


STOPPED = "stopped"  # pretrain.work/stopped: the step checkpoint of a stopped pretraining
RESUME_KEYS = ("pretrain.", "model.", "data.", "tokenizer.", "run.seed", "run.deterministic", "train.log_every")


@dataclass(frozen=True)
class PretrainJob:
    """What `dipaco pretrain` reads: its section, the model's, and the few values of others it needs."""

    run: RunConfig
    section: PretrainConfig
    model: ModelConfig
    seq_len: int
    log_every: int  # train.log_every: inner steps per loss window
    config_yaml: str  # the resolved config, kept with the weights and with a step checkpoint
    resume: bool = False  # continue the stopped pretraining in pretrain.work


def stopped_config(run_dir: str | Path) -> Path | None:
    """The config of a stopped pretraining (its step checkpoint's), or None when there is none."""
    path = recover(RunDir(run_dir).pretrain_work / STOPPED) / "config.yaml"
    return path if path.is_file() else None


def pretrain(job: PretrainJob, prepared: Prepared) -> None:
    """Trains the dense model on every training document and writes it to ``<run.dir>/pretrain``.

    A SIGINT or SIGTERM lets the step in progress finish, writes a step checkpoint to ``pretrain.work``
    (the weights, AdamW, the LR schedule, the data cursor, the RNG) and stops; ``--resume`` continues it
    bit-exactly. ``pretrain.checkpoint_every`` writes that checkpoint every N steps as well, for a kill no
    signal announces."""
    section, run = job.section, job.run
    check_pretrain(section)
    device = resolve_device(run.device)
    seed_everything(run.seed, device, run.deterministic)
    run_dir = RunDir(run.dir)
    everything = np.zeros(len(prepared.train), dtype=np.int64)  # one shard: all training docs
    sequences = build_shards(prepared.train, everything, 1, job.seq_len, prepared.tokenizer.eos_token_id)[0]
    steps = section.steps
    llama = path_llama_config(job.model, prepared.tokenizer, job.seq_len)
    if job.model.init_from is not None:  # before the model is built: the checkpoint's shapes, and the memory they need
        check_import(job.model, training_on_cpu=steps > 0 and device.type == "cpu")
    model = build_model(llama, seed=run.seed, device=device)
    if job.model.init_from is not None:  # continue the open model's training on this corpus, as the paper does
        import_weights(model, job.model.init_from)
        echo(f"[pretrain] initialised from {job.model.init_from}")
    settings = LoopSettings.from_config(section, job.model, steps, "pretrain")
    loop = PathLoops({DENSE: sequences}, settings, run.seed).build(DENSE, model, device)
    options = loop.options
    n_params = sum(p.numel() for p in model.parameters())
    echo(f"[pretrain] dense model {n_params:,} params, {sequences.shape[0]} sequences of {job.seq_len}, {steps} steps, "
         f"{options.precision.name} on {device}{', compiled' if options.compile else ''}")
    _restore(job, run_dir.pretrain_work, loop)

    start = time.perf_counter()
    parts = []
    with finish_the_step(), tqdm(total=steps, initial=loop.step, desc="pretrain", disable=not run.progress,
                                 dynamic_ncols=True) as bar:
        try:
            while loop.step < steps:
                chunk = min(section.checkpoint_every or steps, steps - loop.step)
                parts.append(loop.run(chunk, progress=bar, log_every=job.log_every))
                if loop.step < steps:
                    _save(run_dir.pretrain_work, loop, job.config_yaml)
        except KeyboardInterrupt:
            _save(run_dir.pretrain_work, loop, job.config_yaml)
            echo(f"[pretrain] stopped after step {loop.step} of {steps}: the step checkpoint is in "
                 f"{run_dir.pretrain_work}; continue with `dipaco pretrain --resume`")
            raise
    stats = InnerStats.combine(parts) if parts else loop.run(0, log_every=job.log_every)
    with replacing(run_dir.pretrain) as tmp:
        metrics = MetricsLogger(tmp)
        metrics.log("pretrain", step=steps, loss=stats.loss, tokens=stats.tokens, tokens_per_s=stats.tokens_per_s,
                    lr=stats.lr, inner_loss=list(stats.loss_curve), inner_loss_steps=list(stats.loss_curve_steps),
                    resumed_at_step=steps - stats.steps)
        metrics.close()
        model.save_pretrained(tmp)  # safetensors by default
        prepared.tokenizer.save_pretrained(tmp)
        Path(tmp / "run_config.yaml").write_text(job.config_yaml)
    remove_tree(run_dir.pretrain_work)
    if steps == 0:  # nothing trained, so no loss to report
        kept = f"the checkpoint {job.model.init_from} as it is" if job.model.init_from else "the initialised model"
        echo(f"[pretrain] pretrain.steps=0: kept {kept} -> {run_dir.pretrain}")
        return
    echo(f"[pretrain] mean loss over the {stats.steps} steps {stats.loss:.3f}, {stats.tokens_per_s:,.0f} tok/s, "
         f"{time.perf_counter() - start:.0f}s -> "
         f"{run_dir.pretrain}")


def _save(work: Path, loop: InnerLoop, config_yaml: str) -> None:
    """The step checkpoint: written beside the old one and swapped in whole (a kill leaves one or the other)."""
    work.mkdir(parents=True, exist_ok=True)
    with replacing(work / STOPPED) as tmp:
        tmp.mkdir()
        save_tensors(dict(loop.model.named_parameters()), tmp / "model.safetensors")
        save_state(loop.state_dict(), tmp / "inner.pt")
        save_state({"rng": rng_state()}, tmp / "state.pt")
        (tmp / "config.yaml").write_text(config_yaml)


def _restore(job: PretrainJob, work: Path, loop: InnerLoop) -> None:
    saved = recover(work / STOPPED)  # a kill between the two renames of a swap left the previous one aside
    if not saved.is_dir():
        if job.resume:
            raise ConfigError(f"no stopped pretraining to resume in {work}; run `dipaco pretrain` without --resume")
        return
    if not job.resume:
        raise ConfigError(f"{work} holds a pretraining stopped part-way: continue it with `dipaco pretrain --resume`, "
                          f"or delete {work} to start over")
    copy_params(loop.model, load_tensors(saved / "model.safetensors", loop.device), saved / "model.safetensors")
    loop.load_state_dict(load_state(saved / "inner.pt"))
    set_rng_state(load_state(saved / "state.pt")["rng"])
    echo(f"[pretrain] resuming from step {loop.step} of {job.section.steps} ({saved})")
