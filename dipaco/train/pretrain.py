"""`dipaco pretrain`: the dense, path-sized model trained on all training data.

Its weights initialise every module of the bank (the DiPaCo paper pretrains 24k of 88k steps
this way). It is saved with ``save_pretrained`` (safetensors) together with the tokenizer, so the
directory is a standard HF model that routing can featurize with (:mod:`dipaco.model.pretrained`
loads it back).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from dipaco.atomic import replacing
from dipaco.config import ModelConfig, PretrainConfig, RunConfig
from dipaco.data.prepare import Prepared
from dipaco.errors import ConfigError
from dipaco.metrics import MetricsLogger, echo
from dipaco.model.llama import build_model
from dipaco.model.pretrained import path_llama_config
from dipaco.paths.factory import DENSE, LoopSettings, PathLoops
from dipaco.paths.inner import check_optim
from dipaco.route.shards import build_shards
from dipaco.run_dir import RunDir
from dipaco.runtime import resolve_device, seed_everything


def check_pretrain(section: PretrainConfig) -> None:
    if section.steps < 0:
        raise ConfigError(f"pretrain.steps: must be >= 0, got {section.steps}")
    check_optim("pretrain.optim", section.optim)


def pretrain(run: RunConfig, section: PretrainConfig, model_cfg: ModelConfig, prepared: Prepared, seq_len: int,
             log_every: int, config_yaml: str) -> None:
    """Trains the dense model on every training document and writes it to ``<run.dir>/pretrain``."""
    check_pretrain(section)
    device = resolve_device(run.device)
    seed_everything(run.seed, device, run.deterministic)
    run_dir = RunDir(run.dir)
    everything = np.zeros(len(prepared.train), dtype=np.int64)  # one shard: all training docs
    sequences = build_shards(prepared.train, everything, 1, seq_len, prepared.tokenizer.eos_token_id)[0]
    model = build_model(path_llama_config(model_cfg, prepared.tokenizer, seq_len), seed=run.seed, device=device)
    steps = section.steps
    settings = LoopSettings.from_config(section, model_cfg, steps, "pretrain")
    loop = PathLoops({DENSE: sequences}, settings, run.seed).build(DENSE, model, device)
    options = loop.options
    n_params = sum(p.numel() for p in model.parameters())
    echo(f"[pretrain] dense model {n_params:,} params, {sequences.shape[0]} sequences of {seq_len}, {steps} steps, "
         f"{options.precision.name} on {device}{', compiled' if options.compile else ''}")

    start = time.perf_counter()
    with replacing(run_dir.pretrain) as tmp:
        metrics = MetricsLogger(tmp)
        with tqdm(total=steps, desc="pretrain", disable=not run.progress, dynamic_ncols=True) as bar:
            stats = loop.run(steps, progress=bar, log_every=log_every)
        metrics.log("pretrain", step=steps, loss=stats.loss, tokens=stats.tokens, tokens_per_s=stats.tokens_per_s,
                    lr=stats.lr, inner_loss=list(stats.loss_curve), inner_loss_steps=list(stats.loss_curve_steps))
        metrics.close()
        model.save_pretrained(tmp)  # safetensors by default
        prepared.tokenizer.save_pretrained(tmp)
        Path(tmp / "run_config.yaml").write_text(config_yaml)
    echo(f"[pretrain] mean loss over the {steps} steps {stats.loss:.3f}, {stats.tokens_per_s:,.0f} tok/s, "
         f"{time.perf_counter() - start:.0f}s -> "
         f"{run_dir.pretrain}")
