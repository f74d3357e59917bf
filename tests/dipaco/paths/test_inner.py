"""The inner loop's speed options (precision, fused/foreach AdamW, activation checkpointing, state
offload) on CPU: what they must not change, and what they must."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dipaco.config import OptimConfig
from dipaco.paths.inner import InnerLoop, InnerOptions, build_adamw
from dipaco.paths.sampler import ShardSampler
from dipaco.precision import resolve_precision

OPTIM = OptimConfig(lr=3e-3, warmup_steps=2, batch_size=4)


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, max_position_embeddings=64, use_cache=False)
    return LlamaForCausalLM(cfg)


def sequences(n: int = 16, seq: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    base = torch.randint(0, 128, (n, seq // 4), generator=g)
    return base.repeat(1, 4)  # repeated patterns: learnable in a few steps


def make_loop(precision: str = "fp32", total: int = 40, model=None, **opts) -> InnerLoop:
    model = model or tiny_model()
    options = InnerOptions(resolve_precision(precision, "cpu"), **opts)
    return InnerLoop(model, ShardSampler(sequences(), OPTIM.batch_size, seed=3), OPTIM, total, "cpu", options)


def params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_adamw_uses_the_multi_tensor_kernel_on_cpu():
    opt = build_adamw(tiny_model(), OPTIM)
    assert opt.defaults["foreach"] is True and not opt.defaults["fused"]


def test_bf16_autocast_on_cpu_trains_a_tiny_model():
    loop = make_loop("bf16")
    first = loop.run(5).loss
    loop.run(25)
    last = loop.run(5).loss
    assert torch.isfinite(torch.tensor([first, last])).all()
    assert last < first - 0.5, (first, last)
    # master weights and AdamW state stay fp32
    assert all(p.dtype == torch.float32 for p in loop.model.parameters())
    assert all(v.dtype == torch.float32 for s in loop.optimizer.state.values() for k, v in s.items() if k != "step")


def test_bf16_differs_from_fp32():
    a, b = make_loop("fp32"), make_loop("bf16")
    a.run(3), b.run(3)
    diff = max((p - q).abs().max().item() for p, q in zip(a.model.parameters(), b.model.parameters()))
    assert diff > 0  # the option is not silently ignored


def test_fp16_resume_restores_the_loss_scale_exactly():
    whole = make_loop("fp16")
    whole.run(4)
    state = copy.deepcopy(whole.state_dict())  # as a checkpoint holds it: not the live tensors
    saved = params(whole.model)
    assert "grad_scaler" in state and state["grad_scaler"]["scale"] > 0
    whole.run(4)

    resumed = make_loop("fp16", model=tiny_model(seed=5))  # different init: everything comes from the state
    with torch.no_grad():
        for n, p in resumed.model.named_parameters():
            p.copy_(saved[n])
    resumed.load_state_dict(state)
    resumed.run(4)
    assert resumed.scaler.state_dict() == whole.scaler.state_dict()  # scale and growth tracker
    assert whole.scaler.state_dict()["_growth_tracker"] == 8
    for n, p in resumed.model.named_parameters():
        assert torch.equal(p, whole.model.get_parameter(n)), n


def test_fp16_resume_without_scaler_state_is_refused():
    fp32_state = make_loop("fp32").state_dict()
    with pytest.raises(ValueError, match="loss-scaler"):
        make_loop("fp16").load_state_dict(fp32_state)


def test_offloading_the_adamw_state_changes_nothing_but_where_it_lives():
    plain, offloaded = make_loop(), make_loop(offload_inactive=True)
    for _ in range(3):
        plain.run(2)
        stats = offloaded.run(2)
        assert offloaded.offload.on_host and stats.swap_seconds > 0
        host = {id(v) for v in offloaded.offload._buffers.values()}
        assert all(id(v) in host for s in offloaded.optimizer.state.values() for v in s.values())
    for n, p in plain.model.named_parameters():
        assert torch.equal(p, offloaded.model.get_parameter(n)), n


def test_activation_checkpointing_keeps_names_and_gradients():
    plain, checkpointed = make_loop(), make_loop(activation_checkpointing=True)
    assert [n for n, _ in plain.model.named_parameters()] == [n for n, _ in checkpointed.model.named_parameters()]
    plain.run(2), checkpointed.run(2)
    for n, p in plain.model.named_parameters():
        torch.testing.assert_close(p, checkpointed.model.get_parameter(n), rtol=1e-5, atol=1e-6)


def test_batches_reach_the_cpu_unchanged():
    from dipaco.paths.inner import PinnedCopy

    batch = torch.arange(12).reshape(3, 4)
    assert torch.equal(PinnedCopy(torch.device("cpu"))(batch), batch)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory and CUDA events need a GPU")
def test_batches_reach_the_gpu_from_pinned_buffers_without_a_pageable_copy():
    """Issue 48: a copy from pageable memory synced the stream every inner step (a profile shows it as
    'Memcpy HtoD (Pageable -> Device)'); the pinned buffers take turns, and a changed shape gets its own."""
    from torch.profiler import ProfilerActivity, profile

    from dipaco.paths.inner import PinnedCopy

    copy = PinnedCopy(torch.device("cuda"))
    batches = [torch.randint(0, 500, (4, 64)) for _ in range(5)] + [torch.randint(0, 500, (2, 64))]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = [copy(b) for b in batches]
        torch.cuda.synchronize()
    assert all(torch.equal(o.cpu(), b) for o, b in zip(out, batches))
    assert all(buffer.is_pinned() for buffer, _ in copy.slots) and len(copy.slots) == 2
    names = {e.key for e in prof.key_averages()}
    assert not any("Pageable" in name for name in names), sorted(n for n in names if "Memcpy" in n)


def _accumulating_loop(micro: int | None, batch: int = 8, model=None) -> InnerLoop:
    optim = OptimConfig(lr=3e-3, warmup_steps=2, batch_size=batch, micro_batch_size=micro)
    options = InnerOptions(resolve_precision("fp32", "cpu"))
    return InnerLoop(model or tiny_model(), ShardSampler(sequences(), batch, seed=3), optim, 40, "cpu", options)


@pytest.mark.parametrize("micro", [1, 2, 4])
def test_micro_batches_give_the_step_of_the_one_large_batch(micro):
    whole, parts = _accumulating_loop(None), _accumulating_loop(micro)
    a, b = whole.run(6), parts.run(6)
    assert b.tokens == a.tokens and parts.sampler.state_dict() == whole.sampler.state_dict()  # the same rows, in order
    assert abs(a.loss - b.loss) < 1e-5
    for (name, p), q in zip(whole.model.named_parameters(), parts.model.parameters()):
        assert torch.allclose(p, q, atol=2e-5, rtol=0), name
    # and accumulating changes the step at all: one micro-batch of the step alone gives another model
    alone = _accumulating_loop(None, batch=micro)
    alone.run(6)
    assert any(not torch.allclose(p, q, atol=2e-5) for p, q in zip(alone.model.parameters(), parts.model.parameters()))


def test_micro_batches_resume_bit_exactly():
    straight = _accumulating_loop(2)
    straight.run(8)
    first = _accumulating_loop(2)
    first.run(3)
    state = copy.deepcopy(first.state_dict())
    weights = params(first.model)
    second = _accumulating_loop(2, model=tiny_model(seed=5))
    with torch.no_grad():
        for name, p in second.model.named_parameters():
            p.copy_(weights[name])
    second.load_state_dict(state)
    second.run(5)
    for (name, p), q in zip(straight.model.named_parameters(), second.model.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("micro", [0, 3, 16])
def test_a_micro_batch_that_does_not_divide_the_batch_is_refused(micro):
    from dipaco.errors import ConfigError
    from dipaco.paths.inner import check_optim

    want = f"train.optim.micro_batch_size: must be > 0 and divide train.optim.batch_size=8, got {micro}"
    with pytest.raises(ConfigError, match=want):
        check_optim("train.optim", OptimConfig(batch_size=8, micro_batch_size=micro))
