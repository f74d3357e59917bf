"""dipaco.serve.module_batch: rows of different paths decode together, each level's modules once per pass.

Exactness (issue 61): every row's tokens equal its path's alone (the composed ``LlamaForCausalLM``, a batch of
one row), greedy and same-seed sampled, 200 of 200, on a 2x2, a 4x4 and a grid with path-owned embedding and
head, with rows of different lengths joining and leaving the running batch. The banks are random and every
module differs from the others, so a row run through another path's module would give other tokens.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from dipaco.errors import DipacoError
from dipaco.model.bank import ModuleBank
from dipaco.model.topology import Topology
from dipaco.serve.decode import CACHE_KWARG, DecodeRow, decode_batch, left_padded, sampling_processors
from dipaco.serve.grouped_level import GroupedLevel, GroupLayout, kernel_layout, stack
from dipaco.serve.module_batch import MASK_CACHE_KWARG, ModuleBatchedDecoder, create_causal_mask

EOS, PAD = 1, 0
GRIDS = {
    "2x2": dict(layers=2, shape=[2, 2], part="shared", tied=True),
    "4x4": dict(layers=2, shape=[4, 4], part="shared", tied=False),
    "path_owned": dict(layers=2, shape=[2, 2], part="path", tied=True),
}


def random_bank(layers: int, shape: list[int], part: str, tied: bool, seed: int = 0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=tied, use_cache=True, pad_token_id=PAD, eos_token_id=EOS)
    template = LlamaForCausalLM(config).eval()
    topology = Topology.grid(layers, shape, embedding=part, head=part)
    bank = ModuleBank(topology, template)
    with torch.no_grad():
        for param in bank.params:  # every module its own weights
            param.add_(torch.randn_like(param) * 0.1)
    return config, template, bank


def composed(template, bank: ModuleBank, path: int) -> LlamaForCausalLM:
    model = copy.deepcopy(template)
    bank.load_path(path, model)
    return model


def make_rows(n: int, num_paths: int, sampled: bool, seed: int = 0) -> list[DecodeRow]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        prompt = [rng.randrange(2, 101) for _ in range(rng.randint(1, 24))]
        processors = sampling_processors(rng.choice([0.7, 1.0, 1.3]), rng.choice([1.0, 0.9]), rng.choice([0, 20]),
                                         seed=1000 + i, device="cpu") if sampled else None
        rows.append(DecodeRow(prompt, rng.randint(1, 10), processors, path=rng.randrange(num_paths)))
    return rows


@pytest.fixture(scope="module", params=list(GRIDS))
def grid(request):
    config, template, bank = random_bank(**GRIDS[request.param])
    models = {p: composed(template, bank, p) for p in range(bank.topology.num_paths)}
    return request.param, config, bank, models, ModuleBatchedDecoder(bank, config)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_every_row_of_a_module_batch_gives_its_paths_tokens_alone(grid, sampled):
    name, _, bank, models, decoder = grid
    alone = make_rows(200, bank.topology.num_paths, sampled)
    for row in alone:
        decode_batch(models[row.path], [row], EOS, PAD)
    batched = make_rows(200, bank.topology.num_paths, sampled)  # the same requests, their samplers seeded alike
    assert [(r.prompt_ids, r.path) for r in batched] == [(r.prompt_ids, r.path) for r in alone]
    waiting = list(batched[16:])

    def admit(decoding: int) -> list[DecodeRow]:  # the next rows join as others end, as the server's batcher does
        joining = waiting[:16 - decoding]
        del waiting[:len(joining)]
        return joining

    decode_batch(decoder, batched[:16], EOS, PAD, admit=admit)
    assert not waiting
    equal = sum(a.tokens == b.tokens and a.finish_reason == b.finish_reason for a, b in zip(alone, batched))
    assert equal == 200, f"{name}: {equal}/200 rows equal"
    assert max(r.batch_size for r in batched) > 8  # rows of many paths ran together
    assert len({r.path for r in batched[:16]}) > 1


def test_a_row_alone_is_bitwise_its_composed_path(grid):
    _, _, bank, models, decoder = grid
    prompt = torch.tensor([[5, 9, 33, 2, 71, 14]])
    mask, positions = torch.ones_like(prompt), torch.arange(prompt.shape[1])[None]
    with torch.inference_mode():
        for path, model in models.items():
            state = decoder.new_state([DecodeRow([5], 1, path=path)])
            want = model(input_ids=prompt, position_ids=positions).logits.float()
            assert torch.equal(state.forward(prompt, mask, positions, 0), want)


def test_a_4x4_level_module_runs_on_the_rows_of_its_four_paths():
    config, _, bank = random_bank(**GRIDS["4x4"])
    decoder = ModuleBatchedDecoder(bank, config)
    rows = [DecodeRow([3, 4, 5], 1, path=p) for p in range(16)]
    decode_batch(decoder, rows, EOS, PAD)
    stats = decoder.stats
    # one prefill: 2 levels x 4 modules, each on the 4 rows whose path goes through it (per-path batching: 1 row)
    assert stats.passes == 1 and stats.module_calls == 8 and stats.rows_per_module() == 4.0
    assert set(stats.as_dict()["seconds"]) == {"embed", "mask", "layout", "blocks", "head"}


def test_every_weight_is_the_banks_memory_but_the_levels_kernel_copy():
    config, _, bank = random_bank(**GRIDS["path_owned"])
    before = {k: v.clone() for k, v in bank.state_dict().items()}
    decoder = ModuleBatchedDecoder(bank, config)
    storages = {p.untyped_storage().data_ptr() for p in bank.params}
    weights = [w for level in decoder.levels for module in level.modules for w in module.parameters()]
    projections = {"qkv", "o", "gate_up", "down"}
    weights += [t for level in decoder.levels for b in level.blocks for k, t in vars(b).items()
                if t is not None and k not in projections]
    weights += [e.weight for e in decoder.embeddings] + [n.weight for n in decoder.norms]
    assert weights and all(w.untyped_storage().data_ptr() in storages for w in weights)  # views: no second copy
    # on a CPU each level's projections are held once more, [K, in, out] as bmm reads them fastest
    for level in decoder.levels:
        for j, block in enumerate(level.blocks):
            assert block.qkv.is_contiguous() and block.qkv.untyped_storage().data_ptr() not in storages
            for k, module in enumerate(level.modules):
                assert torch.equal(block.down[k], module[j].mlp.down_proj.weight.t())
    after = bank.state_dict()  # the bank moved its level modules, not their values
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())


def test_the_kernel_layout_copies_on_a_cpu_and_views_elsewhere():
    weights = torch.arange(24.0).view(2, 4, 3)
    on_cpu = kernel_layout(weights)
    assert on_cpu.shape == (2, 3, 4) and on_cpu.is_contiguous() and torch.equal(on_cpu, weights.transpose(1, 2))
    assert on_cpu.untyped_storage().data_ptr() != weights.untyped_storage().data_ptr()
    elsewhere = kernel_layout(torch.empty(2, 4, 3, device="meta"))
    assert elsewhere.shape == (2, 3, 4) and not elsewhere.is_contiguous()  # the view


def test_stacking_is_a_view_of_colocated_modules_and_a_copy_otherwise():
    rows = torch.arange(24.0).view(2, 12)  # two modules' flat vectors, as ModuleBank.colocate keeps them
    parts = [[row[:4].view(2, 2), row[4:8].view(2, 2)] for row in rows]  # e.g. q and k of each module
    view = stack(parts)
    assert view.shape == (2, 4, 2) and view.untyped_storage().data_ptr() == rows.untyped_storage().data_ptr()
    assert torch.equal(view, torch.stack([torch.cat(p) for p in parts]))
    apart = [[row[:4].view(2, 2), row[8:12].view(2, 2)] for row in rows]  # not end to end: copied
    copied = stack(apart)
    assert copied.untyped_storage().data_ptr() != rows.untyped_storage().data_ptr()
    assert torch.equal(copied, torch.stack([torch.cat(p) for p in apart]))


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "packed"])
@pytest.mark.parametrize("bias", [False, True], ids=["llama", "biased"])
@pytest.mark.parametrize("members", [[[0, 3], [1], [2, 4, 5]], [[1, 2], [], [0], []]], ids=["every_module", "some"])
def test_a_grouped_level_computes_what_each_modules_blocks_do(bias, members, padded):
    """The stacked-weight level against each module's transformers blocks on its own rows: rows padded and
    masked, a prefill then a decoding step, every module or a selection of them, with biases or without, the
    groups padded to one width or packed end to end."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, attention_bias=bias, mlp_bias=bias, use_cache=True)
    states = [{k: torch.randn_like(v) * 0.2 for k, v in LlamaForCausalLM(config).state_dict().items()}
              for _ in members]
    level = GroupedLevel(config, states, range(2))
    rows = sorted(r for group in members for r in group)
    groups = [(k, torch.tensor(g)) for k, g in enumerate(members) if g]
    layout = GroupLayout.of(groups, torch.device("cpu"), padded)
    rotary = LlamaRotaryEmbedding(config)
    mask = torch.ones(len(rows), 7, dtype=torch.long)
    mask[0, :3] = 0  # a left-padded row
    cache, alone = DynamicCache(), {k: DynamicCache() for k, _ in groups}
    for step in (slice(0, 6), slice(6, 7)):
        hidden = torch.randn(len(rows), step.stop - step.start, 32)
        positions = (mask[:, :step.stop].cumsum(-1) - 1).clamp(min=0)[:, step]
        embeddings = rotary(hidden, positions)
        causal = create_causal_mask(config=config, inputs_embeds=hidden, attention_mask=mask[:, :step.stop],
                                    position_ids=positions, **{MASK_CACHE_KWARG: cache})
        got = level.forward(hidden, layout, level.weights_for(layout), cache, causal, embeddings)
        for k, index in groups:
            x, part_mask = hidden[index], mask[index, :step.stop]
            group_causal = create_causal_mask(config=config, inputs_embeds=x, attention_mask=part_mask,
                                              position_ids=positions[index], **{MASK_CACHE_KWARG: alone[k]})
            for block in level.modules[k]:
                x = block(x, attention_mask=group_causal, position_ids=positions[index], use_cache=True,
                          position_embeddings=tuple(e[index] for e in embeddings), **{CACHE_KWARG: alone[k]})
            torch.testing.assert_close(got[index], x, rtol=1e-5, atol=1e-5)


def test_a_group_layout_pads_each_module_to_the_largest_and_gathers_back():
    groups = [(0, torch.tensor([1, 3])), (2, torch.tensor([0, 2, 4]))]
    layout = GroupLayout.of(groups, torch.device("cpu"))
    assert layout.width == 3 and layout.modules.tolist() == [0, 2] and layout.spans == ((0, 3), (3, 6))
    assert layout.order.tolist() == [1, 3, 1, 0, 2, 4]  # module 0's rows, one pad (its first row), module 2's
    assert layout.slot_modules.tolist() == [0, 0, 0, 2, 2, 2]
    rows = torch.arange(5.0)
    assert torch.equal(rows[layout.order][layout.inverse], rows)


def test_a_packed_group_layout_lays_the_groups_end_to_end():
    groups = [(0, torch.tensor([1, 3])), (2, torch.tensor([0, 2, 4]))]
    layout = GroupLayout.of(groups, torch.device("cpu"), padded=False)
    assert layout.width == 0 and layout.order.tolist() == [1, 3, 0, 2, 4] and layout.spans == ((0, 2), (2, 5))
    assert layout.slot_modules.tolist() == [0, 0, 2, 2, 2]
    rows = torch.arange(5.0)
    assert torch.equal(rows[layout.order][layout.inverse], rows)


def test_a_prefill_packs_its_rows_and_a_step_pads_them():
    config, _, bank = random_bank(**GRIDS["4x4"])
    decoder = ModuleBatchedDecoder(bank, config)
    rows = [DecodeRow([3, 4, 5], 2, path=p) for p in (0, 1, 5, 6, 7)]  # level 0: modules 0 and 1, unevenly
    ids, mask, positions = left_padded(rows, PAD, "cpu")
    state = decoder.new_state(rows)
    with torch.inference_mode():
        state.forward(ids, mask, positions, 1)
        assert {padded for _, padded in state._layouts} == {False}
        state.forward(ids[:, -1:], torch.cat([mask, mask[:, -1:]], 1), positions[:, -1:] + 1, 1)
    assert {padded for _, padded in state._layouts} == {False, True}
    for (_, padded), (layout, _) in state._layouts.items():  # packed: each row once; padded: groups of one width
        assert len(layout.order) == (layout.width * len(layout.spans) if padded else len(rows))
        assert (layout.width > 1) == padded


def test_a_path_outside_the_bank_is_refused():
    config, _, bank = random_bank(**GRIDS["2x2"])
    decoder = ModuleBatchedDecoder(bank, config)
    with pytest.raises(DipacoError, match="path 4 is not a path of this bank"):
        decode_batch(decoder, [DecodeRow([3], 1, path=4)], EOS, PAD)
