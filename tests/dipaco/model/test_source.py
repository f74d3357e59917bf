"""model.init_from: a Llama checkpoint's shape, tokenizer and weights, exactly (dipaco.model.source)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from open_model import LLAMA3_ROPE, build_checkpoint, logits

from dipaco.config import ModelConfig, TokenizerConfig, merge_config
from dipaco.data.tokenizer import load_tokenizer
from dipaco.errors import CheckpointError, ConfigError, DataError
from dipaco.model.bank import ModuleBank
from dipaco.model.llama import build_model
from dipaco.model.pretrained import path_llama_config
from dipaco.model.source import import_weights, resolve_init_from
from dipaco.model.topology import topology_from_config
from dipaco.run import load_config

VARIANTS = {
    "untied_gqa": dict(tied=False, kv_heads=2),
    "tied_mha": dict(tied=True, kv_heads=4),
    "llama3_rope": dict(tied=True, kv_heads=1, rope_scaling=LLAMA3_ROPE),
    "sharded": dict(tied=False, kv_heads=2, shard_bytes=40_000),
}


def _resolved(source: Path, *overrides: str) -> tuple[ModelConfig, TokenizerConfig]:
    cfg = merge_config(None, [f"model.init_from={source}", *overrides])
    given = {o.split("=")[0].split(".")[1] for o in overrides if o.startswith("model.")}
    return resolve_init_from(cfg.model, cfg.tokenizer, given)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_path_of_an_imported_checkpoint_gives_its_logits(tmp_path, variant):
    source = build_checkpoint(tmp_path / "ckpt", **VARIANTS[variant])
    if variant == "sharded":
        assert (tmp_path / "ckpt" / "model.safetensors.index.json").is_file()
        assert len(list((tmp_path / "ckpt").glob("model-*.safetensors"))) > 1
    model_cfg, tok_cfg = _resolved(tmp_path / "ckpt", "model.attention=eager")
    tokenizer = load_tokenizer(tok_cfg.path)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id  # no pad token in the checkpoint: EOS pads, no id added
    assert len(tokenizer) == source.config.vocab_size - 8
    config = path_llama_config(model_cfg, tokenizer, seq_len=64)
    imported = build_model(config, seed=1)
    import_weights(imported, str(tmp_path / "ckpt"))
    ids = tokenizer("The striker scored twice in the final, said the minister.")["input_ids"][:40]
    want = logits(source, ids)
    assert (logits(imported, ids) - want).abs().max() <= 1e-5
    # every path composed from a bank that the imported model initialised
    topology = topology_from_config(merge_config(None, ["topology.preset=grid:2x2"]).topology, model_cfg.num_layers)
    bank = ModuleBank(topology, imported)
    for path in range(topology.num_paths):
        composed = bank.compose(path, build_model(config, seed=2 + path))
        assert (logits(composed, ids) - want).abs().max() <= 1e-5, f"path {path}"


def test_the_shape_comes_from_the_checkpoint_and_unset_keys_take_it(tmp_path):
    build_checkpoint(tmp_path / "ckpt", tied=True, kv_heads=1, rope_scaling=LLAMA3_ROPE)
    model, tokenizer = _resolved(tmp_path / "ckpt")
    assert (model.num_layers, model.hidden_size, model.intermediate_size, model.num_heads, model.num_kv_heads,
            model.head_dim) == (2, 64, 96, 4, 1, 16)
    assert model.rms_norm_eps == 1e-5 and model.rope_theta == 50000.0 and model.attention_bias and not model.mlp_bias
    assert model.tie_embeddings and model.max_positions == 256
    assert model.rope_scaling is not None and model.rope_scaling["rope_type"] == "llama3"
    assert model.rope_scaling["factor"] == 8.0
    assert tokenizer.path == str(tmp_path / "ckpt")
    # a value given equal to the checkpoint's is fine
    assert _resolved(tmp_path / "ckpt", "model.num_layers=2")[0].num_layers == 2


def test_a_contradicting_model_key_names_both_values(tmp_path):
    build_checkpoint(tmp_path / "ckpt")
    with pytest.raises(ConfigError) as err:
        _resolved(tmp_path / "ckpt", "model.hidden_size=128", "model.rms_norm_eps=1e-6")
    text = str(err.value)
    assert "model.hidden_size=128 but the checkpoint has 64" in text
    assert "model.rms_norm_eps=1e-06 but the checkpoint has 1e-05" in text


def test_a_yaml_file_counts_as_given(tmp_path):
    build_checkpoint(tmp_path / "ckpt")
    (tmp_path / "c.yaml").write_text(f"model:\n  init_from: {tmp_path / 'ckpt'}\n  num_heads: 8\n")
    with pytest.raises(ConfigError, match="model.num_heads=8 but the checkpoint has 4"):
        load_config(tmp_path / "c.yaml", [])


def test_a_non_llama_model_is_refused_naming_its_type(tmp_path):
    build_checkpoint(tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ConfigError, match=r"'gpt2' model; supported model_type: llama \(Llama 2 and 3.x"):
        _resolved(tmp_path / "ckpt")


def test_pickled_weights_are_refused_with_the_reason(tmp_path):
    build_checkpoint(tmp_path / "ckpt")
    weights = tmp_path / "ckpt" / "model.safetensors"
    torch.save({"x": torch.zeros(1)}, tmp_path / "ckpt" / "pytorch_model.bin")
    weights.unlink()
    with pytest.raises(CheckpointError, match="only pickled weights .pytorch_model.bin.*arbitrary code"):
        _resolved(tmp_path / "ckpt")


def test_a_missing_or_truncated_shard_is_named(tmp_path):
    build_checkpoint(tmp_path / "ckpt", shard_bytes=40_000)
    shards = sorted((tmp_path / "ckpt").glob("model-*.safetensors"))
    data = shards[1].read_bytes()
    shards[1].write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=f"{shards[1].name}: not a readable safetensors file"):
        _resolved(tmp_path / "ckpt")
    shards[1].unlink()
    with pytest.raises(CheckpointError, match=f"lists {shards[1].name}, missing from"):
        _resolved(tmp_path / "ckpt")


def test_seq_len_above_the_checkpoints_positions_is_an_error(tmp_path):
    build_checkpoint(tmp_path / "ckpt")
    with pytest.raises(ConfigError, match=r"data.seq_len: 512 is above model.max_positions=256 \(the maximum positions of"):
        load_config(None, [f"model.init_from={tmp_path / 'ckpt'}", "data.seq_len=512"])


def test_a_tokenizer_larger_than_the_embedding_is_an_error(tmp_path):
    build_checkpoint(tmp_path / "ckpt", extra_rows=-10)
    model, tok = _resolved(tmp_path / "ckpt")
    with pytest.raises(DataError, match="more than the .* rows of the embedding"):
        path_llama_config(model, load_tokenizer(tok.path), 64)


def test_another_tokenizer_path_beside_init_from_is_refused(tmp_path):
    build_checkpoint(tmp_path / "ckpt")
    with pytest.raises(ConfigError, match="tokenizer.path: .* the run uses the checkpoint's own tokenizer"):
        _resolved(tmp_path / "ckpt", f"tokenizer.path={tmp_path}")


def test_an_unknown_source_is_one_clear_error_without_the_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="not a checkpoint directory"):
        _resolved(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="no_such_org/no_such_model is not a local directory, and the hub did not give it"):
        resolve_init_from(ModelConfig(init_from="no_such_org/no_such_model"), TokenizerConfig(), set())
