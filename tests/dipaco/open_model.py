"""A small open-model checkpoint, built here as a user's would be: a ``LlamaForCausalLM`` with random weights saved
by transformers' ``save_pretrained``, beside a byte-level BPE built with ``tokenizers`` that has no pad token
(as Llama's and SmolLM2's have none). Nothing is downloaded."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# The serving tests' imported checkpoint (tests/dipaco/serve/conftest.py's imported_run): more positions than the run
# trains on (data.seq_len=64), and as many as lm-eval's default max_length. Here, not in that conftest: `from conftest
# import` finds whichever conftest module pytest imported first.
IMPORTED_POSITIONS = 2048

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
               "original_max_position_embeddings": 64}
SAMPLE_TEXT = ("Shares in the bank rose after the results. The film won three awards at the ceremony. "
               "The minister said the election would be held in May. The striker scored twice in the final. "
               "The new phone has a faster chip and a larger screen. ") * 20


def build_tokenizer(out: Path, texts: Iterable[str], vocab_size: int = 400) -> transformers.PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(list(texts), trainer=trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")
    tokenizer.save_pretrained(str(out))
    return tokenizer


def build_checkpoint(out: Path, *, tied: bool = False, kv_heads: int = 2, rope_scaling: dict | None = None,
                     shard_bytes: int | None = None, texts: Iterable[str] = (SAMPLE_TEXT,), extra_rows: int = 8,
                     **config: Any) -> transformers.LlamaForCausalLM:
    """A Llama checkpoint in ``out`` (its tokenizer too); ``shard_bytes``: save as shards of at most this size
    with an index. Non-default settings that change the math: ``rms_norm_eps`` 1e-5, attention bias, rope theta."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, texts)
    settings = dict(vocab_size=len(tokenizer) + extra_rows, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=256, rms_norm_eps=1e-5,
                    rope_theta=50000.0, attention_bias=True, tie_word_embeddings=tied,
                    bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    settings.update(config)
    if rope_scaling is not None:
        settings["rope_scaling"] = dict(rope_scaling)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**settings)).eval()
    with torch.no_grad():  # random biases and norms, so a weight dropped or misplaced shows in the logits
        for name, param in model.named_parameters():
            if name.endswith(("bias", "norm.weight", "layernorm.weight")):
                param.normal_(1.0 if "norm" in name else 0.0, 0.1)
    kwargs = {"max_shard_size": shard_bytes} if shard_bytes else {}
    model.save_pretrained(str(out), **kwargs)
    return model


def logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def write_header_only(out: Path, config: dict[str, Any]) -> None:
    """A checkpoint directory for ``config`` (a config.json's fields) whose ``model.safetensors`` has the header
    of every tensor ``LlamaForCausalLM`` makes for it and a hole for their bytes (a sparse file): whatever reads
    only headers sees a full-size checkpoint that takes no disk and no time to write."""
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    header, offset = {}, 0
    for name, param in model.named_parameters():  # a tied lm_head is not listed, as save_pretrained leaves it out
        size = math.prod(param.shape) * 2
        header[name] = {"dtype": "BF16", "shape": list(param.shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + offset)
