"""Per-path early stopping keeps each path's best parameters on its held-out docs."""

import json
from dataclasses import replace

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dipaco.metrics import read_metrics
from dipaco.model.bank import ModuleBank
from dipaco.model.scoring import Scoring
from dipaco.model.topology import Topology
from dipaco.paths.early_stopping import PathEarlyStopping, early_stopping_holdout, load_best_path
from dipaco.run import Run


def tiny() -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=20, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(cfg)


def test_keeps_best_parameters_and_ignores_a_worse_round(tmp_path):
    torch.manual_seed(0)
    topo = Topology.grid(2, [2, 1])
    bank = ModuleBank(topo, tiny())
    docs = {p: [[(i * 3 + p) % 20 for i in range(12)] for _ in range(3)] for p in range(2)}
    stopper = PathEarlyStopping(tmp_path, docs, Scoring(seq_len=16, prefix_tokens=2, batch_size=4, pad_id=0),
                                scratch_model=tiny())
    first = stopper.update(bank, round_index=1)
    saved = {p: load_best_path(tmp_path, p, tiny()).state_dict() for p in range(2)}
    with torch.no_grad():
        for param in bank.params:
            param.add_(torch.randn_like(param) * 5)  # a much worse round
    worse = stopper.update(bank, round_index=2)
    assert all(worse[p] > first[p] for p in range(2))
    state = {p: json.loads((tmp_path / f"path_{p:03d}.json").read_text()) for p in range(2)}
    assert {s["round"] for s in state.values()} == {1}
    for p in range(2):
        again = load_best_path(tmp_path, p, tiny()).state_dict()
        assert all(torch.equal(again[k], saved[p][k]) for k in saved[p])
    # A restarted run reads the record and still compares against round 1.
    assert PathEarlyStopping(tmp_path, docs, Scoring(16, 2, 4, 0), tiny()).best == state


def test_holdout_mask_is_stable_and_near_the_fraction():
    ids = [f"doc{i}" for i in range(4000)]
    a, b = early_stopping_holdout(ids, 0.1, seed=0), early_stopping_holdout(ids, 0.1, seed=0)
    assert (a == b).all() and 0.08 < a.mean() < 0.12


def test_training_with_early_stopping_evaluates_best_paths(run_cfg):
    cfg = replace(run_cfg, train=replace(run_cfg.train, early_stopping_holdout=0.25, name="es"))
    exp = Run(cfg).train()
    logged = read_metrics(exp.dir / "metrics.jsonl", "early_stopping")
    assert len(logged) == cfg.train.rounds and set(logged[0]["heldout_ppl"]) == {"0", "1", "2", "3"}
    report = Run(replace(cfg, eval=replace(cfg.eval, early_stopping=True))).evaluate()
    assert "early-stopped" in report["checkpoint"] and report["overall"]["scored_tokens"] > 0
