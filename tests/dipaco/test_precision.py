import pytest
import torch

from dipaco.errors import ConfigError
from dipaco.precision import resolve_precision
from dipaco.run import load_config


def test_auto_is_fp32_on_cpu_and_bf16_on_cuda():
    assert resolve_precision("auto", "cpu").name == "fp32"
    assert resolve_precision("auto", torch.device("cuda")).name == "bf16"
    assert resolve_precision("fp16", "cpu").dtype == torch.float16


def test_fp32_has_no_autocast_and_no_scaler():
    p = resolve_precision("fp32", "cpu")
    with p.autocast():
        assert not torch.is_autocast_enabled("cpu")
    assert p.grad_scaler() is None
    with resolve_precision("bf16", "cpu").autocast():
        assert torch.is_autocast_enabled("cpu")
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    assert isinstance(resolve_precision("fp16", "cpu").grad_scaler(), torch.amp.GradScaler)


def test_unknown_precision_names_the_key():
    with pytest.raises(ConfigError, match="eval.precision: 'fp8'"):
        resolve_precision("fp8", "cpu", "eval.precision")


@pytest.mark.parametrize("key", ["train.precision", "pretrain.precision", "eval.precision", "route.precision"])
def test_config_validates_every_precision_key(key):
    assert load_config(None, [f"{key}=bf16"])
    with pytest.raises(ConfigError, match=key.replace(".", r"\.") + ": 'int3'"):
        load_config(None, [f"{key}=int3"])


def test_config_attention_choices():
    with pytest.raises(ConfigError, match="model.attention"):
        load_config(None, ["model.attention=flash9"])
