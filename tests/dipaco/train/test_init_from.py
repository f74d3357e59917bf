"""A new user's journey from an open model (issue 58), through the CLI as a user runs it: import a local Llama
checkpoint, pretrain on it, route with `lm_prefix` on its states, train a 2x2, eval, export a path and load it in
plain transformers, generate. And each bad input: one `error:` line, exit 2, nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from open_model import LLAMA3_ROPE, build_checkpoint
from tiny import corpus_source_missing, write_corpus_slice
from transformers import AutoModelForCausalLM, AutoTokenizer

from dipaco.cli import main
from dipaco.model.llama import build_model
from dipaco.serve.pipeline import load_experiment

pytestmark = pytest.mark.slow

STEPS = ["data.seq_len=64", "data.prefix_tokens=16", "topology.preset=grid:2x2", "pretrain.steps=4",
         "pretrain.optim.batch_size=4", "pretrain.optim.micro_batch_size=2", "pretrain.optim.warmup_steps=1",
         "train.optim.batch_size=4", "train.optim.micro_batch_size=2", "train.optim.warmup_steps=1", "train.rounds=1",
         "train.inner_steps=3", "train.sharding=kmeans", "route.featurizer=lm_prefix", "route.n_init=1",
         "run.progress=false", "run.device=cpu", "eval.batch_size=16", "eval.max_docs=20"]
TEXT = "The minister told reporters that the new rules would take effect next year."


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    missing = corpus_source_missing()
    if missing:
        pytest.skip(missing)
    return write_corpus_slice(tmp_path_factory.mktemp("corpus") / "corpus.jsonl", per_label=12)


@pytest.fixture(scope="module")
def checkpoint(corpus, tmp_path_factory) -> Path:
    """An untied, grouped-query, Llama-3-RoPE checkpoint whose BPE was trained on the corpus."""
    out = tmp_path_factory.mktemp("open_model") / "llama"
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    build_checkpoint(out, tied=False, kv_heads=2, rope_scaling=LLAMA3_ROPE, texts=texts)
    return out


def test_a_new_users_journey_from_a_local_checkpoint(checkpoint, corpus, tmp_path, capsys):
    run = tmp_path / "run"
    args = [f"model.init_from={checkpoint}", f"data.corpus={corpus}", f"run.dir={run}", *STEPS]
    for job in ("prepare", "pretrain", "route", "train", "eval"):
        assert main([job, *args]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert f"initialised from {checkpoint}" in out
    # the checkpoint's tokenizer, not a trained BPE
    theirs = AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    ours = AutoTokenizer.from_pretrained(run / "tokenizer", local_files_only=True)
    assert ours.get_vocab() == theirs.get_vocab() and ours.pad_token == ours.eos_token == "</s>"
    assert json.loads((run / "train" / "dipaco" / "eval.json").read_text())["overall"]["ppl"] > 1

    assert main(["export", "--run", str(run), "--path", "3", "--out", str(tmp_path / "path3")]) == 0
    exported = json.loads((tmp_path / "path3" / "config.json").read_text())
    source = json.loads((checkpoint / "config.json").read_text())
    for key in ("rms_norm_eps", "attention_bias", "mlp_bias", "num_key_value_heads", "head_dim", "vocab_size",
                "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert exported[key] == source[key], key
    assert exported["rope_parameters"] == source["rope_parameters"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "path3", local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "path3", local_files_only=True)
    ids = torch.tensor([tokenizer(TEXT)["input_ids"]])
    loaded = load_experiment(run)
    composed = loaded.bank.compose(3, build_model(loaded.llama_config(), seed=0)).eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, composed(ids).logits)
    capsys.readouterr()
    assert main(["generate", "--run", str(run), "Shares in the bank rose", "--max-new-tokens", "6"]) == 0
    printed = capsys.readouterr().out
    assert "routed" in printed and "6 generated" in printed


def _refused(capsys, run: Path, *args: str, match: str) -> None:
    assert main(["prepare", f"run.dir={run}", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and match in err[0], err
    assert not run.exists()


def test_bad_open_models_are_one_error_line_and_write_nothing(checkpoint, corpus, tmp_path, capsys):
    base = [f"data.corpus={corpus}", *STEPS]

    def copy(name: str) -> Path:
        import shutil

        return Path(shutil.copytree(checkpoint, tmp_path / name))

    gpt2 = copy("gpt2")
    (gpt2 / "config.json").write_text(json.dumps({**json.loads((gpt2 / "config.json").read_text()), "model_type": "gpt2"}))
    _refused(capsys, tmp_path / "r1", f"model.init_from={gpt2}", *base, match="'gpt2' model; supported model_type: llama")

    pickled = copy("pickled")
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    _refused(capsys, tmp_path / "r2", f"model.init_from={pickled}", *base, match="only pickled weights (pytorch_model.bin)")

    _refused(capsys, tmp_path / "r3", f"model.init_from={checkpoint}", *base, "model.num_kv_heads=4",
             match="model.num_kv_heads=4 but the checkpoint has 2")
    _refused(capsys, tmp_path / "r4", f"model.init_from={checkpoint}", *base, "data.seq_len=512",
             match="data.seq_len: 512 is above model.max_positions=256")

    small = tmp_path / "small"  # an embedding with fewer rows than its tokenizer has tokens
    build_checkpoint(small, extra_rows=-10)
    capsys.readouterr()  # save_pretrained's progress bar
    rows = json.loads((small / "config.json").read_text())["vocab_size"]
    _refused(capsys, tmp_path / "r5", f"model.init_from={small}", *base, match=f"more than the {rows} rows of the embedding")
    misshapen = copy("misshapen")  # config.json's vocab_size is not the weights'
    config = json.loads((misshapen / "config.json").read_text())
    (misshapen / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))
    _refused(capsys, tmp_path / "r8", f"model.init_from={misshapen}", *base,
             match=f"has shape ({config['vocab_size']}, 64) in the file; {misshapen / 'config.json'} implies (100, 64)")

    sharded = tmp_path / "sharded"
    build_checkpoint(sharded, shard_bytes=40_000)
    shard = sorted(sharded.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:1000])
    _refused(capsys, tmp_path / "r6", f"model.init_from={sharded}", *base, match=f"{shard.name}: not a readable safetensors")
    shard.unlink()
    _refused(capsys, tmp_path / "r7", f"model.init_from={sharded}", *base, match=f"lists {shard.name}, missing from")
