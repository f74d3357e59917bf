"""The path model: a plain HF ``LlamaForCausalLM``, and which of its parameters belong to which part.

Every path is an ordinary dense Llama, so it trains with any HF tooling, saves with
``save_pretrained`` and reloads with ``AutoModelForCausalLM``. DiPaCo structure lives outside the
model: :mod:`dipaco.model.topology` says which module fills each part, :mod:`dipaco.model.bank` holds the
modules' weights.
"""

from __future__ import annotations

import math

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dipaco.config import ModelConfig
from dipaco.errors import ConfigError
from dipaco.model.topology import EMBEDDING, HEAD, Part, Topology


def check_model(cfg: ModelConfig, seq_len: int | None = None) -> None:
    """The ``model`` section: a Llama these numbers can build (``seq_len``: data.seq_len, which must fit its positions)."""
    for key in ("num_layers", "hidden_size", "intermediate_size", "num_heads"):
        if getattr(cfg, key) <= 0:
            raise ConfigError(f"model.{key}: must be > 0, got {getattr(cfg, key)}")
    for key in ("head_dim", "vocab_size", "max_positions"):
        if getattr(cfg, key) is not None and getattr(cfg, key) <= 0:
            raise ConfigError(f"model.{key}: must be > 0 or null, got {getattr(cfg, key)}")
    if cfg.head_dim is None and cfg.hidden_size % cfg.num_heads:
        raise ConfigError(f"model.hidden_size: {cfg.hidden_size} is not divisible by model.num_heads={cfg.num_heads}")
    if cfg.num_kv_heads is not None and (cfg.num_kv_heads <= 0 or cfg.num_heads % cfg.num_kv_heads):
        raise ConfigError(f"model.num_kv_heads: must be > 0 and divide model.num_heads={cfg.num_heads}, "
                          f"got {cfg.num_kv_heads}")
    for key in ("rope_theta", "init_std", "rms_norm_eps"):
        value = getattr(cfg, key)
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"model.{key}: must be a finite number > 0, got {value}")
    if cfg.rope_scaling is not None and not isinstance(cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type")), str):
        raise ConfigError(f"model.rope_scaling: needs a rope_type (llama3, linear, dynamic, yarn, ...), got {cfg.rope_scaling}")
    if seq_len is not None and cfg.max_positions is not None and seq_len > cfg.max_positions:
        where = f" (the maximum positions of {cfg.init_from})" if cfg.init_from else ""
        raise ConfigError(f"data.seq_len: {seq_len} is above model.max_positions={cfg.max_positions}{where}")


def llama_config(cfg: ModelConfig, vocab_size: int, max_positions: int, eos_id: int, pad_id: int) -> LlamaConfig:
    """A path's HF config; ``vocab_size`` and ``max_positions`` (the tokenizer's size, data.seq_len) apply where
    ``model.vocab_size`` and ``model.max_positions`` are unset."""
    rope_scaling = dict(cfg.rope_scaling) if cfg.rope_scaling is not None else None
    return LlamaConfig(
        vocab_size=cfg.vocab_size or vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads or cfg.num_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_positions or max_positions,
        rope_theta=cfg.rope_theta,
        rope_scaling=rope_scaling,
        rms_norm_eps=cfg.rms_norm_eps,
        attention_bias=cfg.attention_bias,
        mlp_bias=cfg.mlp_bias,
        initializer_range=cfg.init_std,
        tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=None,
        eos_token_id=eos_id,
        # a tokenizer that pads with EOS (dipaco.data.tokenizer.load_tokenizer): no padding_idx, which would freeze EOS's row
        pad_token_id=None if pad_id == eos_id else pad_id,
        use_cache=False,
        attn_implementation=cfg.attention,  # sdpa: flash / memory-efficient attention kernels on CUDA
    )


def build_model(config: LlamaConfig, seed: int | None = None, device: str | torch.device = "cpu") -> LlamaForCausalLM:
    """A freshly initialised path-sized model; ``seed`` makes the initialisation reproducible."""
    if seed is not None:
        torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(device)


def enable_activation_checkpointing(model: LlamaForCausalLM) -> None:
    """Recomputes every decoder block in the backward pass instead of keeping its activations.

    Non-reentrant checkpointing: it works with frozen inputs and with torch.compile, and leaves
    the parameters (and so their names) untouched.
    """
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def part_parameter_names(model: LlamaForCausalLM, part: Part) -> list[str]:
    """Names of ``model``'s trainable parameters that belong to ``part``, in a fixed order.

    With tied embeddings the LM head *is* the embedding matrix, so it travels with the embedding
    part and the head part holds only the final norm.
    """
    names = [n for n, _ in model.named_parameters()]  # deduplicated: a tied lm_head is not listed
    if part.kind == EMBEDDING:
        return [n for n in names if n.startswith("model.embed_tokens.")]
    if part.kind == HEAD:
        return [n for n in names if n.startswith("model.norm.") or n.startswith("lm_head.")]
    prefixes = tuple(block_prefix(i) for i in part.layers)
    return [n for n in names if n.startswith(prefixes)]


def block_prefix(layer: int) -> str:
    """The name prefix of decoder block ``layer``'s parameters (a level part holds whole blocks)."""
    return f"model.layers.{layer}."


def check_covers_model(model: LlamaForCausalLM, topology: Topology) -> None:
    """Every trainable parameter must belong to exactly one part, or the bank would drop it."""
    owned = [n for part in topology.parts for n in part_parameter_names(model, part)]
    all_names = [n for n, _ in model.named_parameters()]
    if sorted(owned) != sorted(all_names):
        missing = sorted(set(all_names) - set(owned))
        raise ValueError(f"parameters not covered by the topology: {missing[:5]} (model has "
                         f"{model.config.num_hidden_layers} layers, topology {topology.num_layers})")
