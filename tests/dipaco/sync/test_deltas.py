"""Per-module deltas: the paths' agreement that `train.diagnostics` logs, against an explicit cosine matrix."""

import itertools

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dipaco.model.bank import ModuleBank
from dipaco.model.topology import Level, Topology
from dipaco.sync.deltas import path_agreement


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=7, hidden_size=4, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=8)
    return LlamaForCausalLM(cfg)


def moved(bank: ModuleBank, path: int, seed: int, zero_parts: tuple[str, ...] = ()) -> LlamaForCausalLM:
    """Path ``path`` composed from the bank, every part moved by a seeded random change except ``zero_parts``."""
    model = bank.compose(path, tiny_model())
    generator = torch.Generator().manual_seed(seed)
    for part in bank.topology.parts:
        if part.name not in zero_parts:
            bank.add_to_path(model, part, torch.randn(bank.numel(part), generator=generator))
    return model


def expected(bank: ModuleBank, part, paths: dict[int, LlamaForCausalLM]) -> dict[int, tuple[int, float | None, float]]:
    """Per module: (paths, mean pairwise cosine from the explicit matrix, mean |delta|)."""
    by_module: dict[int, list[torch.Tensor]] = {}
    for p in sorted(paths):
        m = part.first_module + bank.topology.module_index(part, p)
        by_module.setdefault(m, []).append(bank.params[m] - bank.path_vector(paths[p], part))
    out = {}
    for m, deltas in by_module.items():
        cos = [torch.nn.functional.cosine_similarity(a, b, dim=0).item() if a.norm() > 0 and b.norm() > 0 else 0.0
               for a, b in itertools.permutations(deltas, 2)]
        out[m] = (len(deltas), sum(cos) / len(cos) if cos else None, sum(d.norm().item() for d in deltas) / len(deltas))
    return out


def test_mean_pairwise_cosine_matches_the_explicit_matrix():
    topo = Topology([Level(1, 2)], replicas=3)  # level0.0: paths 0, 1, 2; level0.1: paths 3, 4, 5
    bank = ModuleBank(topo, tiny_model())
    paths = {p: moved(bank, p, seed=p) for p in range(6)}
    for part in topo.parts:
        got = path_agreement(bank, part, paths)
        want = expected(bank, part, paths)
        assert set(got) == set(want)
        for m, (n, cosine, norm) in want.items():
            assert got[m].paths == n
            assert got[m].cosine == pytest.approx(cosine, abs=1e-5)
            assert got[m].delta_norm == pytest.approx(norm, rel=1e-5)


def test_identical_changes_agree_fully_and_opposite_ones_cancel():
    topo = Topology([Level(1, 1)], replicas=2)
    bank = ModuleBank(topo, tiny_model())
    level = topo.parts[1]
    change = torch.randn(bank.numel(level), generator=torch.Generator().manual_seed(3))
    same, opposite = bank.compose(0, tiny_model()), bank.compose(1, tiny_model())
    bank.add_to_path(same, level, change)
    bank.add_to_path(opposite, level, change)
    assert path_agreement(bank, level, {0: same, 1: opposite})[level.first_module].cosine == pytest.approx(1.0, abs=1e-5)
    bank.add_to_path(opposite, level, change, alpha=-2.0)
    assert path_agreement(bank, level, {0: same, 1: opposite})[level.first_module].cosine == pytest.approx(-1.0, abs=1e-5)


def test_one_path_has_no_cosine_and_an_unmoved_path_counts_as_orthogonal():
    topo = Topology([Level(1, 1)], replicas=2, embedding="path", head="path")
    bank = ModuleBank(topo, tiny_model())
    paths = {0: moved(bank, 0, seed=1), 1: moved(bank, 1, seed=2, zero_parts=("level0",))}
    embedding, level = topo.parts[0], topo.parts[1]
    private = path_agreement(bank, embedding, paths)
    assert [a.paths for a in private.values()] == [1, 1] and all(a.cosine is None for a in private.values())
    shared = path_agreement(bank, level, paths)[level.first_module]
    assert shared.paths == 2 and shared.cosine == pytest.approx(0.0, abs=1e-6)
