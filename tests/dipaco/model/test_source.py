"""model.init_from: a Llama checkpoint's shape, tokenizer and weights, exactly (dipaco.model.source)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from open_model import LLAMA3_ROPE, SAMPLE_TEXT, build_checkpoint, logits
from safetensors.torch import load_file, save_file
from tiny import subprocess_env

import dipaco.model.source as source_module
from dipaco.cli import main
from dipaco.config import ModelConfig, TokenizerConfig, merge_config
from dipaco.data.tokenizer import load_tokenizer
from dipaco.errors import CheckpointError, ConfigError, DataError
from dipaco.model.bank import ModuleBank
from dipaco.model.llama import build_model
from dipaco.model.pretrained import path_llama_config
from dipaco.model.source import check_weight_shapes, expected_shapes, import_weights, resolve_init_from
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


# --- issue 76: a hostile or damaged checkpoint is one error line, and nothing is written ---------------------------
@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A 2-layer d64 Llama-3-RoPE checkpoint, copied by each test that damages it."""
    out = tmp_path_factory.mktemp("open_model") / "llama"
    build_checkpoint(out, rope_scaling=LLAMA3_ROPE)
    return out


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory) -> Path:
    """A corpus prepare would tokenize: a refused checkpoint, not the data, is what stops it."""
    path = tmp_path_factory.mktemp("corpus") / "c.jsonl"
    sentences = SAMPLE_TEXT.split(". ")
    path.write_text("".join(json.dumps({"id": f"d{i}", "text": ". ".join(sentences[i % 5:] * 3)}) + "\n"
                            for i in range(30)))
    return path


def damaged(checkpoint: Path, tmp_path: Path, **fields) -> Path:
    """A copy of ``checkpoint`` whose config.json has ``fields`` (a value of None drops the field)."""
    copy = Path(shutil.copytree(checkpoint, tmp_path / "damaged"))
    config = {**json.loads((copy / "config.json").read_text()), **fields}
    (copy / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return copy


def refused_prepare(capsys, tmp_path: Path, corpus: Path, *args: str) -> str:
    """`dipaco prepare` as a user runs it: exit status 2, one `error:` line (returned), nothing written."""
    run = tmp_path / "run"
    capsys.readouterr()
    assert main(["prepare", f"run.dir={run}", f"data.corpus={corpus}", "data.seq_len=64", "data.prefix_tokens=16",
                 "topology.preset=dense", "run.progress=false", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0], err
    assert not run.exists()
    return err[0]


HOSTILE = {  # config.json fields -> what the error line says after the file's name
    "three_heads": (dict(num_attention_heads=3, num_key_value_heads=3),
                    "hidden_size=64 is not a multiple of num_attention_heads=3"),
    "hidden_size_string": (dict(hidden_size="64"), "hidden_size must be an integer > 0, got '64'"),
    "rope_parameters_string": (dict(rope_parameters="llama3"), "rope_parameters must be a mapping"),
    "rope_scaling_string": (dict(rope_parameters=None, rope_scaling="llama3"), "rope_scaling must be a mapping"),
    "llama3_without_factors": (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0}),
                               "rope_parameters: Missing required keys in `rope_parameters` for 'rope_type'='llama3'"),
    "unknown_rope_type": (dict(rope_parameters={"rope_type": "spiral", "rope_theta": 10000.0}),
                          "rope_parameters: rope_type 'spiral' is not one transformers"),
    "rope_factor_string": (dict(rope_parameters={**LLAMA3_ROPE, "factor": "8", "rope_theta": 10000.0}),
                           "rope_parameters: RoPE llama3 with"),
    "out_of_range_field": (dict(initializer_range=5.0), "initializer_range: Value must be greater or equal to 0.0"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_config_json_is_one_error_naming_the_file_and_the_field(tiny_checkpoint, small_corpus, tmp_path,
                                                                         capsys, case):
    fields, says = HOSTILE[case]
    source = damaged(tiny_checkpoint, tmp_path, **fields)
    line = refused_prepare(capsys, tmp_path, small_corpus, f"model.init_from={source}")
    assert line.startswith(f"error: {source / 'config.json'}: ") and says in line, line


def test_a_hostile_config_json_names_the_field_for_every_job(tiny_checkpoint, tmp_path):
    source = damaged(tiny_checkpoint, tmp_path, rope_parameters={"rope_type": "spiral", "rope_theta": 1e4})
    with pytest.raises(ConfigError, match=r"rope_type 'spiral' is not one transformers .* computes \(default, "):
        load_config(None, [f"model.init_from={source}"])


@pytest.mark.parametrize("rope, says", [
    ("{rope_type: spiral}", "model.rope_scaling: rope_type 'spiral' is not one transformers"),
    ("{rope_type: linear}", "model.rope_scaling: RoPE linear with {'rope_type': 'linear'} cannot be computed "
                            "(rope_parameters: Missing required keys in `rope_parameters` for 'rope_type'='linear'"),
])
def test_a_rope_scaling_of_the_config_is_computed_when_it_loads(rope, says):
    """Without a checkpoint too: pretrain's build_model raised KeyError on a rope_type transformers lacks."""
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"model.rope_scaling={rope}"])
    assert says in str(err.value)
    assert load_config(None, ["model.rope_scaling={rope_type: linear, factor: 2.0}"]).model.rope_scaling["factor"] == 2.0


@pytest.mark.parametrize("fields, says", [
    (dict(vocab_size=10**9), "model.safetensors: lm_head.weight has shape (384, 64) in the file; {config} implies "
                             "(1000000000, 64)"),
    (dict(num_hidden_layers=100_000), "{config} has num_hidden_layers=100000, but the weights in {source} hold 2 "
                                      "decoder layers"),
    (dict(intermediate_size=128), "model.safetensors: model.layers.0.mlp.down_proj.weight has shape (64, 96) in the "
                                  "file; {config} implies (64, 128)"),
    (dict(num_hidden_layers=1), "model.safetensors: model.layers.1.input_layernorm.weight is in decoder layer 1, but "
                                "{config} has num_hidden_layers=1"),
], ids=["vocab", "layers", "intermediate", "fewer_layers"])
def test_shapes_config_json_implies_are_checked_against_the_weight_headers(tiny_checkpoint, small_corpus, tmp_path,
                                                                          capsys, fields, says):
    """A billion-row embedding or 100,000 layers in config.json: refused from the safetensors headers, before
    pretrain would allocate them (256 GB, 5.3B parameters)."""
    source = damaged(tiny_checkpoint, tmp_path, **fields)
    line = refused_prepare(capsys, tmp_path, small_corpus, f"model.init_from={source}")
    assert says.format(config=source / "config.json", source=source) in line, line


@pytest.mark.parametrize("variant", sorted(VARIANTS) + ["biases_and_head_dim"])
def test_the_shapes_checked_are_the_models(tmp_path, variant):
    """expected_shapes is LlamaForCausalLM's own list of tensors, for every shape the import supports."""
    settings = VARIANTS.get(variant, dict(kv_heads=2, mlp_bias=True, head_dim=32, tied=True))
    build_checkpoint(tmp_path / "ckpt", **settings)
    model_cfg, tok_cfg = _resolved(tmp_path / "ckpt")
    outside, block = expected_shapes(model_cfg)
    names = {**outside, **{f"model.layers.{i}.{k}": v for i in range(model_cfg.num_layers) for k, v in block.items()}}
    model = build_model(path_llama_config(model_cfg, load_tokenizer(tok_cfg.path), 64))
    assert names == {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert check_weight_shapes(tmp_path / "ckpt", model_cfg) == sum(p.numel() for p in model.parameters())


def test_non_finite_weights_are_refused_at_import_naming_the_tensor(tiny_checkpoint, tmp_path):
    source = Path(shutil.copytree(tiny_checkpoint, tmp_path / "nan"))
    tensors = load_file(str(source / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"][3, :2] = torch.tensor([float("nan"), float("inf")])
    save_file(tensors, str(source / "model.safetensors"), metadata={"format": "pt"})
    model_cfg, _ = _resolved(source)  # the headers are whole: the values are checked as they are copied
    model = build_model(path_llama_config(model_cfg, load_tokenizer(str(source)), 64))
    with pytest.raises(CheckpointError, match=r"model.safetensors: model.layers.1.mlp.up_proj.weight holds 2 "
                                              r"non-finite values \(NaN or inf\) of 6,144"):
        import_weights(model, str(source))


def test_a_checkpoint_larger_than_the_available_memory_is_refused_with_both_figures(monkeypatch):
    monkeypatch.setattr(source_module, "available_memory", lambda: 3 * 2**30)
    source_module.check_memory(700_000_000, training=False, source="org/big")  # 2.6 GiB of fp32 weights fit
    with pytest.raises(CheckpointError, match=r"model.init_from=org/big: its 700,000,000 parameters need at least "
                                              r"10.4 GiB to train \(fp32 weights, gradients and AdamW's two moments\), "
                                              r"and this machine has 3.0 GiB available \(MemAvailable"):
        source_module.check_memory(700_000_000, training=True, source="org/big")
    with pytest.raises(CheckpointError, match=r"its 1,000,000,000 parameters need at least 3.7 GiB for their fp32 "
                                              r"weights, and this machine has 3.0 GiB"):
        source_module.check_memory(1_000_000_000, training=False, source="org/big")


def test_the_available_memory_is_read_from_proc_meminfo():
    if not Path("/proc/meminfo").is_file():
        pytest.skip("no /proc/meminfo here")
    have = source_module.available_memory()
    assert have is not None and 0 < have <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_an_empty_init_from_is_an_error_not_a_bpe_from_scratch(small_corpus, tmp_path, capsys):
    line = refused_prepare(capsys, tmp_path, small_corpus, "model.init_from=")
    assert line == "error: model.init_from: no value after '=' (on the command line); give a value, or null to unset it"
    line = refused_prepare(capsys, tmp_path, small_corpus, "model.init_from=''")
    assert "model.init_from: empty; give a checkpoint directory or a hub name" in line


def test_a_config_with_shape_keys_takes_init_from_once_they_are_unset(tiny_checkpoint):
    """configs/demo.yaml sets the model's shape: `model.<key>=null` unsets those keys for the checkpoint's values,
    without editing the file."""
    demo = Path(__file__).resolve().parents[3] / "configs" / "demo.yaml"
    with pytest.raises(ConfigError, match="model.intermediate_size=192 but the checkpoint has 96"):
        load_config(demo, [f"model.init_from={tiny_checkpoint}"])
    unset = [f"model.{key}=null" for key in ("num_layers", "hidden_size", "intermediate_size", "num_heads")]
    cfg = load_config(demo, [f"model.init_from={tiny_checkpoint}", *unset])
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.intermediate_size, cfg.model.num_heads) == (2, 64, 96, 4)


# `dipaco ARGS` with HF_ENDPOINT at a socket of the same process that accepts every connection and never answers
HANGING_HUB = """
import os, socket, sys, threading, time
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen(16)
held = []
def accept_and_hold():
    while True:
        held.append(server.accept())
threading.Thread(target=accept_and_hold, daemon=True).start()
os.environ["HF_ENDPOINT"] = f"http://127.0.0.1:{server.getsockname()[1]}"  # before huggingface_hub reads it
from dipaco.cli import main
# imported before the clock starts: the seconds are the hub's requests, not a loaded machine's imports
import dipaco.model.source, dipaco.run, huggingface_hub, torch, transformers  # noqa: E401, F401
start = time.monotonic()
code = main(sys.argv[1:])
print(f"seconds={time.monotonic() - start:.1f} code={code} endpoint={os.environ['HF_ENDPOINT']}")
"""


def test_a_hub_that_never_answers_is_one_error_line_within_its_timeout(small_corpus, tmp_path):
    """huggingface_hub's client has no timeout of its own: a hub that accepts the connection and never answers
    hung `dipaco prepare` for ever. HF_HUB_ETAG_TIMEOUT now bounds every request."""
    env = {k: v for k, v in subprocess_env(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_ETAG_TIMEOUT="1",
                                                HF_HUB_DOWNLOAD_TIMEOUT="5").items()
           if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT")}
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", HANGING_HUB, "prepare", "model.init_from=some_org/some_model",
                           f"run.dir={run}", f"data.corpus={small_corpus}"], env=env, capture_output=True, text=True,
                          timeout=240)
    summary = proc.stdout.strip().splitlines()[-1]
    seconds = float(summary.split()[0].split("=")[1])
    endpoint = summary.split("endpoint=")[1]
    err = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert "code=2" in summary and len(err) == 1, proc.stderr
    assert err[0] == (f"error: model.init_from: the hub at {endpoint} did not answer for some_org/some_model "
                      f"(HF_HUB_ETAG_TIMEOUT=1 s for a request, HF_HUB_DOWNLOAD_TIMEOUT=5 s for a file's bytes; "
                      f"raise them for a slow connection, or pass a local directory)")
    assert seconds < 30  # a few 1 s timeouts and the hub's retries, not for ever
    assert not run.exists()
