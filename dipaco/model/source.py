"""Starting from an open model: a Llama-architecture checkpoint as the run's dense init, tokenizer and shape.

``model.init_from=SOURCE`` names a local HF directory or a hub name (``HuggingFaceTB/SmolLM2-135M``). Hub names
go through the hub's own download and cache (``huggingface_hub.snapshot_download``), so every later job finds
them there; a local directory is read in place. What it gives the run:

* **Shape.** Every ``model.*`` key that changes the math (:data:`dipaco.config.SHAPE_KEYS`) is read from the
  checkpoint's ``config.json`` by :func:`resolve_init_from`, when the config is loaded. A key the config leaves
  unset takes the checkpoint's value; one it sets to another value is an error naming both. Nothing is ever
  silently overridden.
* **Tokenizer.** The checkpoint's own (``tokenizer.path`` defaults to SOURCE; no BPE is trained). One without a
  pad token pads with its EOS token: no id changes and the embedding never grows. The model config then has no
  ``pad_token_id``, so no embedding row is frozen (``nn.Embedding``'s ``padding_idx`` would freeze EOS's).
* **Weights.** ``dipaco pretrain`` copies them into the dense model (:func:`import_weights`), one tensor at a
  time from the memory-mapped safetensors files, so importing holds at most one tensor beyond the model itself.
  A sharded checkpoint (``model.safetensors.index.json``) works; pickled ``.bin`` weights are refused, since
  unpickling runs arbitrary code.

Supported: ``model_type`` ``llama`` (Llama 2 and 3.x, SmolLM/SmolLM2, TinyLlama), whose math ``LlamaForCausalLM``
is; any other architecture is refused with one error naming it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import LlamaConfig, PreTrainedModel

from dipaco.config import SHAPE_KEYS, ModelConfig, TokenizerConfig
from dipaco.errors import CheckpointError, ConfigError

SUPPORTED = {"llama": "Llama 2 and 3.x, SmolLM/SmolLM2, TinyLlama"}
WEIGHTS, SHARD_INDEX = "model.safetensors", "model.safetensors.index.json"
CONFIG_FILES = ("config.json",)
WEIGHT_FILES = ("config.json", "*.safetensors", "*.safetensors.index.json")
PICKLED = (".bin", ".pt", ".pth", ".ckpt")
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def source_dir(source: str, files: Sequence[str] = CONFIG_FILES) -> Path:
    """The local directory of ``source``: the directory itself, or the hub cache's snapshot of ``files`` (glob
    patterns) of the hub model of that name."""
    local = Path(source).expanduser()
    if local.is_dir():
        return local
    if local.exists() or not _HUB_NAME.match(source):
        raise ConfigError(f"model.init_from: {source} is not a checkpoint directory (nor a hub name like org/model)")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source, allow_patterns=list(files)))
    except Exception as exc:  # offline, unknown repo, gated model: the hub's own exception types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"model.init_from: {source} is not a local directory, and the hub did not give it ({first}); "
                          f"download it once (huggingface-cli download {source}) or pass its local directory") from None


def source_config(directory: Path) -> LlamaConfig:
    """The checkpoint's config, refused unless its ``model_type`` is a supported Llama."""
    path = directory / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"model.init_from: {directory} has no config.json (not a HF model directory)") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a readable model config ({exc})") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type not in SUPPORTED:
        supported = "; ".join(f"{k} ({v})" for k, v in SUPPORTED.items())
        raise ConfigError(f"model.init_from: {directory} is a {model_type!r} model; supported model_type: {supported}")
    config = LlamaConfig.from_pretrained(str(directory), local_files_only=True)
    if config.hidden_act != "silu":
        raise ConfigError(f"model.init_from: {directory} uses hidden_act={config.hidden_act!r}; a Llama path uses silu")
    return config


def _rope(config: LlamaConfig) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, the scaling parameters or None) of a config: transformers 5 keeps both in ``rope_parameters``,
    4.x in ``rope_theta`` and ``rope_scaling``."""
    params = getattr(config, "rope_parameters", None)
    if params:
        scaling = {k: v for k, v in dict(params).items() if k != "rope_theta"}
        theta = params["rope_theta"]
    else:
        scaling, theta = dict(getattr(config, "rope_scaling", None) or {}), config.rope_theta
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return float(theta), None
    return float(theta), scaling


def checkpoint_shape(config: LlamaConfig) -> dict[str, Any]:
    """The ``model.*`` values (every key of :data:`SHAPE_KEYS`) of a checkpoint's config."""
    theta, scaling = _rope(config)
    heads = config.num_attention_heads
    shape = {
        "num_layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_heads": heads,
        "num_kv_heads": config.num_key_value_heads or heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
        "vocab_size": config.vocab_size, "max_positions": config.max_position_embeddings,
        "tie_embeddings": bool(config.tie_word_embeddings), "rope_theta": theta, "rope_scaling": scaling,
        "rms_norm_eps": float(config.rms_norm_eps), "attention_bias": bool(config.attention_bias),
        "mlp_bias": bool(getattr(config, "mlp_bias", False)),
    }
    assert set(shape) == set(SHAPE_KEYS)
    return shape


def _same(mine: Any, theirs: Any) -> bool:
    if isinstance(mine, (int, float)) and isinstance(theirs, (int, float)) and not isinstance(mine, bool):
        return math.isclose(float(mine), float(theirs), rel_tol=1e-12, abs_tol=0.0)
    return bool(mine == theirs)


def resolve_init_from(model: ModelConfig, tokenizer: TokenizerConfig,
                      given: set[str]) -> tuple[ModelConfig, TokenizerConfig]:
    """The ``model`` and ``tokenizer`` sections with ``model.init_from``'s shape and tokenizer filled in.

    ``given``: the ``model`` keys the config file or the command line set. A given shape key whose value is not
    the checkpoint's is an error naming both; a local checkpoint's weights are checked to be readable safetensors
    here, before any job writes anything."""
    if model.init_from is None:
        return model, tokenizer
    source = model.init_from
    directory = source_dir(source)
    shape = checkpoint_shape(source_config(directory))
    differ = [f"model.{key}={getattr(model, key)!r} but the checkpoint has {value!r}" for key, value in shape.items()
              if key in given and getattr(model, key) is not None and not _same(getattr(model, key), value)]
    if differ:
        raise ConfigError(f"model.init_from={source}: the config contradicts the checkpoint: {'; '.join(differ)}. "
                          f"Leave these keys unset: they take the checkpoint's values")
    if tokenizer.path is not None and tokenizer.path != source:
        raise ConfigError(f"tokenizer.path: {tokenizer.path} given with model.init_from={source}; the run uses the "
                          f"checkpoint's own tokenizer (leave tokenizer.path unset)")
    if Path(source).expanduser().is_dir():
        weight_files(directory)  # a hub model's weights are fetched by `dipaco pretrain`
    return replace(model, **shape), replace(tokenizer, path=source)


def weight_files(directory: Path) -> list[Path]:
    """The checkpoint's safetensors files, each checked to be whole (its header read): ``model.safetensors``,
    or the shards its index lists. Pickled weights alone are refused."""
    if (directory / WEIGHTS).is_file():
        files = [directory / WEIGHTS]
    elif (directory / SHARD_INDEX).is_file():
        index = directory / SHARD_INDEX
        try:
            names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index}: not a readable shard index ({exc})") from None
        files = [directory / Path(name).name for name in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} lists {', '.join(missing)}, missing from {directory}")
    else:
        pickled = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLED)
        if pickled:
            raise CheckpointError(f"{directory}: only pickled weights ({', '.join(pickled)}); dipaco never unpickles "
                                  f"weights, since loading a pickle can run arbitrary code. Convert them once with "
                                  f"transformers (from_pretrained, then save_pretrained, which writes safetensors)")
        raise CheckpointError(f"{directory}: no {WEIGHTS} and no {SHARD_INDEX}")
    for file in files:
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except Exception as exc:  # safetensors' own error type: a truncated file's header does not cover it
            raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from None
    return files


def _skipped(name: str, tied: bool) -> bool:
    """Tensors a checkpoint may hold that are not parameters of the path: old RoPE buffers, and a tied head
    (the embedding matrix, saved a second time by some exporters)."""
    return name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight")


@torch.no_grad()
def import_weights(model: PreTrainedModel, source: str) -> None:
    """Copies the checkpoint ``source``'s weights into ``model`` (built from the resolved ``model`` section), in
    place, one tensor at a time; every parameter must be in the checkpoint with its shape."""
    directory = source_dir(source, WEIGHT_FILES)
    params = dict(model.named_parameters())
    tied = bool(model.config.tie_word_embeddings)
    seen: set[str] = set()
    for file in weight_files(directory):
        with safe_open(str(file), framework="pt") as tensors:
            for name in tensors.keys():
                if _skipped(name, tied):
                    continue
                if name not in params:
                    raise CheckpointError(f"{file}: {name} is not a parameter of the Llama path model")
                value = tensors.get_tensor(name)
                if value.shape != params[name].shape:
                    raise CheckpointError(f"{file}: {name} has shape {tuple(value.shape)}, the path model's is "
                                          f"{tuple(params[name].shape)}")
                params[name].copy_(value)
                seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        raise CheckpointError(f"{directory}: the checkpoint lacks {len(missing)} parameters of the model, e.g. {missing[:3]}")
