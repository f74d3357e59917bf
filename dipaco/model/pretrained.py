"""The dense pretrained model (`dipaco pretrain`) as later jobs load it, and the shape of a path model.

Every module of the bank starts from it (DiPaCo pretrains 24k of 88k steps this way), the LM-prefix
router featurizes with it, and ``dipaco eval --pretrained`` scores it. It is a plain HF directory
(``save_pretrained``, safetensors), checked on load to have the architecture this run expects.
"""

from __future__ import annotations

from pathlib import Path

from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from dipaco.config import ModelConfig
from dipaco.errors import DataError
from dipaco.model.llama import llama_config


def path_llama_config(model: ModelConfig, tokenizer: PreTrainedTokenizerBase, seq_len: int) -> LlamaConfig:
    """The ``LlamaConfig`` of every path: ``model.*`` with the run's vocabulary and sequence length."""
    return llama_config(model, len(tokenizer), seq_len, tokenizer.eos_token_id, tokenizer.pad_token_id)


def load_pretrained(directory: str | Path, want: LlamaConfig) -> LlamaForCausalLM:
    """The model ``dipaco pretrain`` saved in ``directory``, checked to have the architecture ``want``."""
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise DataError(f"{directory}: no pretrained model; run `dipaco pretrain` first, or set train.init=random")
    model = LlamaForCausalLM.from_pretrained(directory)
    expected = want.to_diff_dict()
    have = model.config.to_diff_dict()
    diff = sorted(k for k in expected if k not in ("transformers_version", "architectures")
                  and expected[k] != have.get(k))
    if diff:
        raise DataError(f"{directory} has a different architecture than model.* in this config (differs: {diff})")
    return model
