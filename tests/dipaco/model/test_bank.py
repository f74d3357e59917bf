"""Composing a path from the bank gives an ordinary HF model, with the right modules in it."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from dipaco.errors import CheckpointError
from dipaco.model.bank import ModuleBank
from dipaco.model.topology import Topology


def template(tie: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=tie)
    return LlamaForCausalLM(cfg)


def distinct_bank(topology: Topology, model: LlamaForCausalLM) -> ModuleBank:
    """A bank whose modules all differ, so composing the wrong one would show."""
    bank = ModuleBank(topology, model)
    with torch.no_grad():
        for m in topology.modules:
            bank.params[m.id].add_(0.01 * (m.id + 1))
    return bank


@pytest.mark.parametrize("tie", [False, True])
def test_compose_save_pretrained_reload_identical_logits(tmp_path, tie):
    topo = Topology.grid(4, [2, 2], embedding="path")
    bank = distinct_bank(topo, template(tie))
    path = bank.compose(3, template(tie))
    path.save_pretrained(tmp_path / "p3")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "p3")
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    path.eval(), reloaded.eval()
    with torch.no_grad():
        assert torch.equal(path(ids).logits, reloaded(ids).logits)


def test_compose_picks_the_modules_of_the_path():
    topo = Topology.grid(4, [2, 2])
    bank = distinct_bank(topo, template())
    model = bank.compose(2, template())  # path 2 = level0 module 1, level1 module 0
    level0_1 = next(m for m in topo.modules if m.name == "level0.1")
    level1_0 = next(m for m in topo.modules if m.name == "level1.0")
    flat = lambda part: bank.path_vector(model, part)  # noqa: E731
    assert torch.equal(flat(topo.parts[1]), bank.params[level0_1.id])
    assert torch.equal(flat(topo.parts[2]), bank.params[level1_0.id])
    # Layers 0-1 come from level 0, layers 2-3 from level 1.
    assert topo.parts[1].layers == range(0, 2) and topo.parts[2].layers == range(2, 4)


def test_compose_writes_in_place_so_optimizer_state_stays_attached():
    topo = Topology.grid(4, [2, 2])
    bank = distinct_bank(topo, template())
    model = template()
    before = [p.data_ptr() for p in model.parameters()]
    bank.compose(1, model)
    assert [p.data_ptr() for p in model.parameters()] == before


def test_state_dict_round_trip_and_mismatch_errors():
    topo = Topology.grid(4, [2, 2])
    bank = distinct_bank(topo, template())
    state = {k: v.clone() for k, v in bank.state_dict().items()}
    assert "level0.1/model.layers.0.mlp.up_proj.weight" in state
    other = ModuleBank(topo, template())
    other.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(other.params, bank.params))
    with pytest.raises(CheckpointError, match="missing"):
        other.load_state_dict({k: v for k, v in state.items() if not k.startswith("head")})


def test_colocate_moves_a_parts_modules_into_one_tensor_and_keeps_every_path():
    topo = Topology.grid(4, [2, 2])
    bank = distinct_bank(topo, template())
    level = [m.id for m in topo.modules if m.part.name == "level0"]
    composed = [bank.compose(p, template()).state_dict() for p in range(topo.num_paths)]
    rows = bank.colocate(level)
    assert rows.shape == (2, bank.params[level[0]].numel())
    assert all(bank.params[m].untyped_storage().data_ptr() == rows.untyped_storage().data_ptr() for m in level)
    for p in range(topo.num_paths):  # the same paths, composed from the moved modules
        again = bank.compose(p, template()).state_dict()
        assert all(torch.equal(again[k], v) for k, v in composed[p].items())
    with pytest.raises(ValueError, match="held modules of one size"):
        bank.colocate([0, level[0]])  # the embedding and a level module
