"""The dense pretrained model (`dipaco pretrain`) as later jobs load it, and the shape of a path model.

Every module of the bank starts from it (DiPaCo pretrains 24k of 88k steps this way), the LM-prefix
router featurizes with it, and ``dipaco eval --pretrained`` scores it. It is a plain HF directory
(``save_pretrained``: ``config.json`` and ``model.safetensors``). It is loaded strictly, through
safetensors only: its architecture must be this run's, and its tensors exactly the model's, or the
job stops with one error naming the file (no partly random model, and no pickle is ever read).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from dipaco.config import ModelConfig
from dipaco.errors import CheckpointError, DataError
from dipaco.model.llama import build_model, llama_config
from dipaco.tensor_io import copy_params, load_tensors

WEIGHTS, SHARD_INDEX = "model.safetensors", "model.safetensors.index.json"


def path_llama_config(model: ModelConfig, tokenizer: PreTrainedTokenizerBase, seq_len: int) -> LlamaConfig:
    """The ``LlamaConfig`` of every path: ``model.*`` with the run's vocabulary and sequence length."""
    check_vocabulary(len(tokenizer), model)
    return llama_config(model, len(tokenizer), seq_len, tokenizer.eos_token_id, tokenizer.pad_token_id)


def check_vocabulary(tokens: int, model: ModelConfig) -> None:
    """A tokenizer of ``tokens`` ids must fit the embedding (``model.vocab_size`` rows, where set)."""
    if model.vocab_size is not None and tokens > model.vocab_size:
        source = f" of {model.init_from}" if model.init_from else ""
        raise DataError(f"the tokenizer has {tokens:,} tokens, more than the {model.vocab_size:,} rows of the "
                        f"embedding{source} (model.vocab_size): ids past the embedding have no vector")


def load_pretrained(directory: str | Path, want: LlamaConfig, hint: str = "run `dipaco pretrain` first") -> LlamaForCausalLM:
    """The model ``dipaco pretrain`` saved in ``directory``, checked to have the architecture ``want`` and
    exactly its tensors; ``hint``: what to do when there is none."""
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise DataError(f"{directory}: no pretrained model; {hint}")
    try:
        have = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{directory / 'config.json'}: not a readable model config ({exc})") from None
    if not isinstance(have, dict):
        raise CheckpointError(f"{directory / 'config.json'}: not a model config (a JSON object)")
    expected = want.to_diff_dict()
    diff = sorted(k for k in expected if k not in ("transformers_version", "architectures", "dtype", "torch_dtype")
                  and expected[k] != have.get(k))
    if diff:
        raise DataError(f"{directory} has a different architecture than model.* in this config (differs: {diff})")
    with torch.random.fork_rng(devices=[]):  # every weight is overwritten: leave the run's RNG as it was
        model = build_model(want, seed=0)
    with torch.no_grad():
        copy_params(model, _weights(directory), directory / WEIGHTS)
    return model.eval()


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the saved model, from its safetensors file (or the shards its index lists)."""
    if (directory / WEIGHTS).is_file():
        return load_tensors(directory / WEIGHTS)
    if (directory / SHARD_INDEX).is_file():
        try:
            shards = sorted(set(json.loads((directory / SHARD_INDEX).read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{directory / SHARD_INDEX}: not a readable shard index ({exc})") from None
        out: dict[str, torch.Tensor] = {}
        for shard in shards:
            out.update(load_tensors(directory / Path(shard).name))
        return out
    found = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    other = f" ({', '.join(found)} found: pickled weights are never loaded)" if found else ""
    raise CheckpointError(f"{directory}: no {WEIGHTS}{other}; run `dipaco pretrain` again")
