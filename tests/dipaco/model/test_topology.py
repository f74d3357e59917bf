import pytest

from dipaco.errors import ConfigError
from dipaco.model.topology import Level, Topology, mixed_radix_decode, mixed_radix_encode, topology_from_config
from dipaco.run import load_config


def test_mixed_radix_round_trip():
    radices = (3, 4, 2)
    seen = set()
    for i in range(24):
        digits = mixed_radix_decode(i, radices)
        assert mixed_radix_encode(digits, radices) == i
        seen.add(digits)
    assert len(seen) == 24
    assert mixed_radix_decode(5, radices) == (0, 2, 1)  # 0*8 + 2*2 + 1
    with pytest.raises(ValueError):
        mixed_radix_decode(24, radices)


def test_grid_2x2_paths_and_membership():
    t = Topology.grid(4, [2, 2])
    assert t.num_paths == 4
    assert [lv.blocks for lv in t.levels] == [2, 2]
    assert [p.name for p in t.parts] == ["embedding", "level0", "level1", "head"]
    assert len(t.modules) == 1 + 2 + 2 + 1
    # path 2 = (level0 module 1, level1 module 0): level 0 is the most significant digit
    assert t.path_digits(2) == (1, 0, 0)
    assert [t.modules[m].name for m in t.path_modules(2)] == ["embedding.0", "level0.1", "level1.0", "head.0"]
    level0 = t.parts[1]
    assert t.paths_through(level0.first_module + 0) == (0, 1)
    assert t.paths_through(level0.first_module + 1) == (2, 3)
    level1 = t.parts[2]
    assert t.paths_through(level1.first_module + 1) == (1, 3)
    assert t.paths_through(0) == (0, 1, 2, 3)  # the shared embedding


def test_every_module_membership_matches_path_modules():
    t = Topology([Level(1, 3), Level(2, 1), Level(1, 2)], replicas=2, embedding="path")
    assert t.num_paths == 3 * 2 * 2
    for m in range(len(t.modules)):
        for p in range(t.num_paths):
            assert (m in t.path_modules(p)) == (p in t.paths_through(m))


def test_path_specific_parts_have_one_module_per_path():
    t = Topology([Level(1, path_specific=True), Level(2, 4), Level(1, path_specific=True)], embedding="path", head="path")
    assert t.num_paths == 4
    for part in t.parts:
        if part.name != "level1":
            assert part.num_modules == 4
            for p in range(4):
                assert t.paths_through(part.first_module + p) == (p,)
    assert t.radices == (4, 1)


def test_shared_blocks_counts_the_blocks_two_paths_both_go_through():
    assert Topology.grid(4, [2, 2]).shared_blocks() == [[4, 2, 2, 0], [2, 4, 0, 2], [2, 0, 4, 2], [0, 2, 2, 4]]
    assert Topology.from_preset("moe:3", 2).shared_blocks() == [[2, 0, 0], [0, 2, 0], [0, 0, 2]]
    assert Topology.from_preset("diloco:2", 2).shared_blocks() == [[2, 2], [2, 2]]
    # A path-specific block is never shared; the 2-block shared level is shared by all.
    t = Topology([Level(1, path_specific=True), Level(2, 1), Level(3, 2)])
    assert t.shared_blocks() == [[6, 2], [2, 6]]


def test_presets():
    assert Topology.from_preset("dense", 4).num_paths == 1
    diloco = Topology.from_preset("diloco:8", 4)
    assert diloco.num_paths == 8 and len(diloco.modules) == 3  # embedding, one level, head: all shared
    assert all(diloco.paths_through(m) == tuple(range(8)) for m in range(3))
    moe = Topology.from_preset("moe:8", 4)
    assert moe.num_paths == 8 and moe.parts[1].num_modules == 8 and moe.parts[1].layers == range(0, 4)
    grid = Topology.from_preset("grid:4x4", 5)
    assert grid.num_paths == 16 and [lv.blocks for lv in grid.levels] == [3, 2]


@pytest.mark.parametrize("preset", ["grid", "grid:2y2", "moe", "diloco:x", "sparse:4"])
def test_bad_presets_name_the_key(preset):
    with pytest.raises(ConfigError, match="topology.preset"):
        Topology.from_preset(preset, 4)


def test_bad_levels():
    with pytest.raises(ConfigError, match="path_specific"):
        Topology([Level(2, 3, path_specific=True)])
    with pytest.raises(ConfigError, match="at least 3 layers"):
        Topology.grid(2, [2, 2, 2])
    with pytest.raises(IndexError):
        Topology.grid(4, [2, 2]).path_modules(4)


def test_a_flat_moe_from_config_is_independent_models():
    """moe:P is P independent models: with embedding/head left null, no module is shared by two paths."""
    cfg = load_config(None, ["topology.preset=moe:4"])
    moe = topology_from_config(cfg.topology, cfg.model.num_layers)
    assert moe.num_paths == 4
    assert all(len(moe.paths_through(m.id)) == 1 for m in moe.modules)


@pytest.mark.parametrize("preset", ["dense", "diloco:2", "grid:2x2"])
def test_other_presets_share_embedding_and_head_by_default(preset):
    cfg = load_config(None, [f"topology.preset={preset}"])
    topo = topology_from_config(cfg.topology, cfg.model.num_layers)
    for part in (topo.parts[0], topo.parts[-1]):
        assert part.num_modules == 1 and not part.path_specific


def test_explicit_embedding_and_head_override_the_preset():
    cfg = load_config(None, ["topology.preset=moe:4", "topology.head=shared"])
    moe = topology_from_config(cfg.topology, cfg.model.num_layers)
    assert moe.parts[0].path_specific and moe.parts[-1].num_modules == 1
    cfg = load_config(None, ["topology.preset=grid:2x2", "topology.embedding=path"])
    grid = topology_from_config(cfg.topology, cfg.model.num_layers)
    assert grid.parts[0].num_modules == 4 and grid.parts[-1].num_modules == 1
