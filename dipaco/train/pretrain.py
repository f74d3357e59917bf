"""`dipaco pretrain`: the dense, path-sized model trained on all training data.

Its weights initialise every module of the bank (the DiPaCo paper pretrains 24k of 88k steps
this way). It is saved with ``save_pretrained`` (safetensors) together with the tokenizer, so the
directory is a standard HF model that routing can featurize with.
"""

from __future__ import annotations

import time

import numpy as np
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from dipaco.atomic import replacing
from dipaco.config import Config, save_config
from dipaco.data.prepare import Prepared, load_prepared
from dipaco.errors import DataError
from dipaco.metrics import MetricsLogger, echo
from dipaco.model.llama import build_model, llama_config
from dipaco.route.shards import build_shards
from dipaco.run_dir import RunDir
from dipaco.runtime import resolve_device, seed_everything
from dipaco.train.inner import InnerLoop, InnerOptions
from dipaco.train.sampler import ShardSampler


def path_llama_config(cfg: Config, prepared: Prepared) -> LlamaConfig:
    tok = prepared.tokenizer
    return llama_config(cfg.model, len(tok), cfg.data.seq_len, tok.eos_token_id, tok.pad_token_id)


def load_pretrained(cfg: Config, prepared: Prepared) -> LlamaForCausalLM:
    """The model ``dipaco pretrain`` saved, checked to have this config's architecture."""
    run = RunDir(cfg.run.dir)
    if not (run.pretrain / "config.json").is_file():
        raise DataError(f"{run.pretrain}: no pretrained model; run `dipaco pretrain` first, or set train.init=random")
    model = LlamaForCausalLM.from_pretrained(run.pretrain)
    want = path_llama_config(cfg, prepared).to_diff_dict()
    have = model.config.to_diff_dict()
    diff = sorted(k for k in want if k not in ("transformers_version", "architectures") and want[k] != have.get(k))
    if diff:
        raise DataError(f"{run.pretrain} has a different architecture than model.* in this config (differs: {diff})")
    return model


def pretrain(cfg: Config) -> None:
    device = resolve_device(cfg.run.device)
    seed_everything(cfg.run.seed, device, cfg.run.deterministic)
    run = RunDir(cfg.run.dir)
    prepared = load_prepared(cfg, routed=False)  # pretraining comes before routing
    everything = np.zeros(len(prepared.train), dtype=np.int64)  # one shard: all training docs
    sequences = build_shards(prepared.train, everything, 1, cfg.data.seq_len, prepared.tokenizer.eos_token_id)[0]
    model = build_model(path_llama_config(cfg, prepared), seed=cfg.run.seed, device=device)
    steps = cfg.pretrain.steps
    options = InnerOptions.from_config(cfg.pretrain, cfg.model, device, "pretrain")
    loop = InnerLoop(model, ShardSampler(sequences, cfg.pretrain.optim.batch_size, cfg.run.seed), cfg.pretrain.optim,
                     steps, device, options)
    n_params = sum(p.numel() for p in model.parameters())
    echo(f"[pretrain] dense model {n_params:,} params, {sequences.shape[0]} sequences of {cfg.data.seq_len}, {steps} steps, "
         f"{options.precision.name} on {device}{', compiled' if options.compile else ''}")

    start = time.perf_counter()
    with replacing(run.pretrain) as tmp:
        metrics = MetricsLogger(tmp)
        with tqdm(total=steps, desc="pretrain", disable=not cfg.run.progress, dynamic_ncols=True) as bar:
            stats = loop.run(steps, progress=bar, log_every=cfg.train.log_every)
        metrics.log("pretrain", step=steps, loss=stats.loss, tokens=stats.tokens, tokens_per_s=stats.tokens_per_s,
                    lr=stats.lr)
        metrics.close()
        model.save_pretrained(tmp)  # safetensors by default
        prepared.tokenizer.save_pretrained(tmp)
        save_config(cfg, tmp / "run_config.yaml")
    echo(f"[pretrain] loss {stats.loss:.3f}, {stats.tokens_per_s:,.0f} tok/s, {time.perf_counter() - start:.0f}s -> {run.pretrain}")
