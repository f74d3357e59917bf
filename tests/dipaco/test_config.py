from pathlib import Path

import pytest

from dipaco.config import Config, config_diff, given_keys, merge_config, parse_config, save_config, to_yaml
from dipaco.errors import ConfigError
from dipaco.run import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


# SmolLM2-135M's config.json as its model card ships it: its shipped config resolves against these numbers here,
# where nothing downloads (the weights are a header-only safetensors file: resolving reads only headers).
SMOLLM2_135M = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": 576,
                "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000, "rope_scaling": None,
                "tie_word_embeddings": True, "vocab_size": 49152, "attention_bias": False, "bos_token_id": 0,
                "eos_token_id": 0}
HUB_CONFIGS = {"HuggingFaceTB/SmolLM2-135M": SMOLLM2_135M}


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_shipped_configs_load(name, tmp_path):
    from open_model import write_header_only

    from dipaco.config import merge_config

    source = merge_config(CONFIGS / name).model.init_from
    overrides = []
    if source is not None:
        write_header_only(tmp_path, HUB_CONFIGS[source])
        overrides = [f"model.init_from={tmp_path}"]
    cfg = load_config(CONFIGS / name, overrides)
    assert isinstance(cfg, Config)
    if source == "HuggingFaceTB/SmolLM2-135M":
        assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_kv_heads, cfg.model.head_dim) == (30, 576, 3, 64)
        assert cfg.model.tie_embeddings and cfg.model.rms_norm_eps == 1e-5 and cfg.model.vocab_size == 49152
        assert cfg.train.optim.batch_size * cfg.data.seq_len == 512 * 1024  # the paper's path step, by accumulation
        assert cfg.train.optim.batch_size // cfg.train.optim.micro_batch_size == 16


def test_overrides_apply():
    cfg = load_config(CONFIGS / "demo.yaml", ["train.inner_steps=20", "topology.preset=grid:4x4"])
    assert cfg.train.inner_steps == 20 and cfg.topology.preset == "grid:4x4"


@pytest.mark.parametrize(
    "override,key",
    [
        ("train.inner_stepz=3", "train.inner_stepz"),
        ("bogus.key=1", "bogus"),
        ("train.rounds=many", "train.rounds"),
        ("outer.lr=[1,2]", "outer.lr"),
        ("train.sharding=random", "train.sharding"),
        ("data.prefix_tokens=500", "data.prefix_tokens"),
        ("model.num_heads=3", "model.hidden_size"),
        ("train.rounds=0", "train.rounds"),
        ("route.min_shard_fraction=1.5", "route.min_shard_fraction"),
    ],
)
def test_bad_overrides_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_unknown_key_in_file_names_key_and_file(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("train:\n  rounds: 2\n  inner_stpes: 4\n")
    with pytest.raises(ConfigError, match=r"train\.inner_stpes.*bad\.yaml"):
        load_config(f)


def test_missing_file_and_malformed_override():
    with pytest.raises(ConfigError, match="not found"):
        load_config("nope.yaml")
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["train.rounds"])


def test_saved_config_reloads_identically(tmp_path):
    cfg = load_config(CONFIGS / "demo.yaml", ["topology.preset=null",
                                              "topology.levels=[{blocks: 1, modules: 3}, {blocks: 1, modules: 1}]"])
    save_config(cfg, tmp_path / "c.yaml")
    again = load_config(tmp_path / "c.yaml")
    assert again == cfg
    assert config_diff(cfg, again) == []
    changed = load_config(tmp_path / "c.yaml", ["outer.lr=0.5", "train.log_every=3"])
    assert config_diff(cfg, changed) == ["outer.lr: 0.7 -> 0.5"]


@pytest.mark.parametrize(
    "override,key",
    [
        ("train.optim.lr=-0.001", "train.optim.lr"),
        ("train.optim.lr=nan", "train.optim.lr"),
        ("pretrain.optim.lr=-1", "pretrain.optim.lr"),
        ("pretrain.optim.lr=inf", "pretrain.optim.lr"),
        ("outer.lr=nan", "outer.lr"),
        ("outer.lr=-0.7", "outer.lr"),
        ("train.optim.beta1=1.0", "train.optim.beta1"),
        ("train.optim.beta2=-0.1", "train.optim.beta2"),
        ("pretrain.optim.beta2=1.5", "pretrain.optim.beta2"),
        ("outer.momentum=-0.9", "outer.momentum"),
        ("outer.momentum=nan", "outer.momentum"),
        ("outer.embedding_head_lr_scale=0", "outer.embedding_head_lr_scale"),
        ("outer.embedding_head_lr_scale=-2", "outer.embedding_head_lr_scale"),
        ("outer.embedding_head_lr_scale=inf", "outer.embedding_head_lr_scale"),
        ("train.optim.warmup_steps=-5", "train.optim.warmup_steps"),
        ("pretrain.optim.warmup_steps=-1", "pretrain.optim.warmup_steps"),
        ("train.optim.eps=0", "train.optim.eps"),
        ("train.optim.weight_decay=-0.1", "train.optim.weight_decay"),
        ("model.num_kv_heads=3", "model.num_kv_heads"),
        ("model.num_kv_heads=0", "model.num_kv_heads"),
        ("train.name=..", "train.name"),
        ("train.name=.", "train.name"),
        ("train.name=a/../../b", "train.name"),
        ("train.name=''", "train.name"),
        # values the schema's types accept and the components refuse (issue 34)
        ("outer.momentum=5", "outer.momentum"),
        ("model.rope_theta=nan", "model.rope_theta"),
        ("model.init_std=-1", "model.init_std"),
        ("dist.timeout_s=nan", "dist.timeout_s"),
        ("route.balance_slack=nan", "route.balance_slack"),
        ("route.topic_smoothing=nan", "route.topic_smoothing"),
        ("run.seed=-1", "run.seed"),
        ("run.seed=4294967296", "run.seed"),
        ("run.device=foo", "run.device"),
        ("train.name=" + "x" * 300, "train.name"),
    ],
)
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match="^" + key.replace(".", r"\.") + ":"):
        load_config(None, [override])


def test_good_edge_values_are_accepted():
    cfg = load_config(None, ["model.num_kv_heads=2", "outer.momentum=0", "train.optim.beta1=0",
                             "train.optim.warmup_steps=0", "train.name=my-run.v2"])
    assert cfg.model.num_kv_heads == 2 and cfg.train.name == "my-run.v2"


def test_route_keys_may_change_on_resume_but_not_route_topk():
    """Re-routing between rounds changes route.* freely; route.topk changes the training shards."""
    cfg = load_config(None, [])
    assert config_diff(cfg, load_config(None, ["route.n_init=7"])) == []
    assert config_diff(cfg, load_config(None, ["route.topk=2"])) == ["route.topk: 1 -> 2"]


EM = ["train.sharding=kmeans", "topology.preset=grid:2x2", "train.rounds=6"]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["route.em_rounds=[0, 2]"], r"rounds after which to re-route must be in \[1, train.rounds=6\).*got \[0\]"),
        (["route.em_rounds=[2, 6]"], r"rounds after which to re-route must be in \[1, train.rounds=6\).*got \[6\]"),
        (["route.em_rounds=[-1]"], r"rounds after .*got \[-1\]"),
        (["route.em_rounds=[4, 2]"], r"must be strictly increasing \(each round once\), got \[4, 2\]"),
        (["route.em_rounds=[2, 2]"], r"must be strictly increasing"),
        (["route.em_rounds=[2]", "train.sharding=iid"],
         r"re-routing re-shards routed data; needs train.sharding=kmeans .*got train.sharding=iid"),
        (["route.em_rounds=[2]", "topology.preset=dense"], r"the topology has one path"),
        (["route.em_rounds=[2]", "topology.preset=diloco:1"], r"the topology has one path"),
        (["route.em_rounds=[2]", "train.driver=ray", "outer.sync=async_nesterov"], r"needs train.driver=torchrun"),
        (["route.em_rounds=[2]", "train.early_stopping_holdout=0.05"], r"cannot be combined with "
                                                                       r"train.early_stopping_holdout"),
    ],
)
def test_em_rounds_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=r"^route\.em_rounds: " + message):
        load_config(None, [*EM, *overrides])


def test_em_rounds_default_off_and_a_valid_schedule_loads():
    assert load_config(None, []).route.em_rounds == []
    assert load_config(None, [*EM, "route.em_rounds=[1,3,5]"]).route.em_rounds == [1, 3, 5]
    assert load_config(None, ["train.sharding=iid", "route.em_rounds=[]"]).route.em_rounds == []


def test_em_schedule_and_its_rerouting_settings_are_fixed_on_resume():
    """route.em_rounds decides when the run re-routes itself; with it set, the settings of those
    re-routings are fixed too. Without it, they stay free (a manual `dipaco reroute` reads its own)."""
    em = load_config(None, [*EM, "route.em_rounds=[2,4]"])
    assert config_diff(em, load_config(None, [*EM, "route.em_rounds=[2]"])) == ["route.em_rounds: [2, 4] -> [2]"]
    assert config_diff(em, load_config(None, [*EM, "route.em_rounds=[2,4]", "route.reroute_holdout=0.2"])) == [
        "route.reroute_holdout: 0.05 -> 0.2"]
    assert config_diff(em, load_config(None, [*EM, "route.em_rounds=[2,4]", "route.reroute_target=current"])) == [
        "route.reroute_target: 'uniform' -> 'current'"]
    plain = load_config(None, EM)
    assert config_diff(plain, load_config(None, [*EM, "route.reroute_holdout=0.2"])) == []


def test_a_null_embedding_resumes_a_run_dir_that_spelled_out_its_default():
    """Run dirs written before topology.embedding/head could be null hold "shared": the same run for
    a grid, another run (its embedding and head were shared) for a flat MoE."""
    grid = ["topology.preset=grid:2x2"]
    old = load_config(None, [*grid, "topology.embedding=shared", "topology.head=shared"])
    assert config_diff(old, load_config(None, grid)) == []
    moe = ["topology.preset=moe:4"]
    old = load_config(None, [*moe, "topology.embedding=shared", "topology.head=shared"])
    assert config_diff(old, load_config(None, moe)) == [
        "topology.embedding: 'shared' -> 'path'", "topology.head: 'shared' -> 'path'"]


def test_a_bad_embedding_sharing_names_the_key_and_the_choices():
    with pytest.raises(ConfigError, match=r"topology.embedding: 'expert' is not one of null, shared, path"):
        load_config(None, ["topology.embedding=expert"])


def test_a_config_read_back_from_its_text_is_the_same_config():
    cfg = load_config(None, ["train.rounds=7", "model.hidden_size=48", "metrics.wandb_tags=[a,b]", "model.init_from=null"])
    assert config_diff(parse_config(to_yaml(cfg), "x"), cfg, ignore=()) == []
    with pytest.raises(ConfigError, match=r"train\.no_such_key.*in the saved config"):
        parse_config("train:\n  no_such_key: 1\n", "the saved config")


# --- issue 76: key=null and key= on the command line --------------------------------------------------------------
def test_null_sets_an_optional_key_and_is_refused_by_one_that_has_no_null():
    assert merge_config(CONFIGS / "demo.yaml", ["model.head_dim=null", "data.hub_config=null"]).model.head_dim is None
    with pytest.raises(ConfigError) as err:
        merge_config(CONFIGS / "demo.yaml", ["train.rounds=null"])
    assert str(err.value) == ("train.rounds: cannot be null (on the command line); give a value, or leave the key "
                              "out for its default 4")


def test_null_unsets_a_shape_key_for_init_from_and_is_not_given():
    demo = CONFIGS / "demo.yaml"  # sets model.num_layers: 2
    cfg = merge_config(demo, ["model.init_from=somewhere", "model.num_layers=null"])
    assert cfg.model.num_layers == Config().model.num_layers and cfg.model.hidden_size == 64  # the schema's default
    assert given_keys(demo, ["model.init_from=somewhere", "model.num_layers=null"], "model") == {
        "init_from", "hidden_size", "intermediate_size", "num_heads"}
    # the last value of a key wins, as everywhere on the command line
    assert merge_config(demo, ["model.num_layers=null", "model.num_layers=3"]).model.num_layers == 3
    assert merge_config(demo, ["model.num_layers=3", "model.init_from=x", "model.num_layers=null"]).model.num_layers == 4
    with pytest.raises(ConfigError, match=r"model.num_layers=null \(on the command line\): null unsets a shape key "
                                          r"for model.init_from's checkpoint to fill in; without model.init_from give "
                                          r"a value \(the default is 4\)"):
        merge_config(demo, ["model.num_layers=null"])


@pytest.mark.parametrize("override, message", [
    ("model.init_from=", "model.init_from: no value after '=' (on the command line); give a value, or null to unset it"),
    ("train.rounds=", "train.rounds: no value after '=' (on the command line); give a value"),
])
def test_an_empty_value_on_the_command_line_is_refused(override, message):
    """`model.init_from=$MODEL` with MODEL unset was taken as null: a BPE was trained from scratch without a word."""
    with pytest.raises(ConfigError) as err:
        merge_config(None, [override])
    assert str(err.value) == message
