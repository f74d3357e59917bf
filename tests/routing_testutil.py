"""Helpers shared by the routing tests and the routing benchmark's (tests/bench/test_routing.py): imported directly,
from tests/ (on sys.path for every test); the routing tests' fixtures live in tests/routing/conftest.py."""

from __future__ import annotations

import torch


def make_blobs(
    n_per: int, k: int, dim: int, spread: float = 0.2, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """k well-separated Gaussian blobs of n_per points each, shuffled; returns (x, labels)."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(k, dim, generator=g) * 3.0
    labels = torch.arange(k).repeat_interleave(n_per)
    x = centers[labels] + spread * torch.randn(k * n_per, dim, generator=g)
    perm = torch.randperm(k * n_per, generator=g)
    return x[perm], labels[perm]


WORDS = (
    "the cat sat on a mat dog ran in park red blue green sun moon star river tree "
    "house car road city music song dance food bread milk water fire stone"
).split()


def tiny_tokenizer():
    """A PreTrainedTokenizerFast, word-level over WORDS (plus [PAD] and [UNK]), whitespace pre-tokenized."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")


def tiny_llama(tokenizer):
    """A random one-layer LlamaForCausalLM of width 32 over ``tokenizer``'s vocabulary (:func:`tiny_tokenizer`),
    seeded, in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()
