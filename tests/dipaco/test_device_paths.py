"""dipaco's device code paths, one test each: on CUDA with ``pytest --device cuda`` (the GPU check runs them so,
at the demo and 125M paths' sizes), else in their CPU form at a tiny size, as the suite runs them.

Where torch has a CPU form the same code runs (bf16 autocast, fp16 with ``GradScaler("cpu")``, torch's fused
AdamW kernel for CPU, a single-rank gloo group for NCCL); what each test measures on the way (swap times,
tokens/s, compile counts) goes into the JUnit XML as properties (``record_property``), where the GPU check
reads it.
"""

from __future__ import annotations

import importlib.util
import math
import os
import statistics
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any
from unittest import mock

import pytest
import torch

from bench import throughput
from bench.harness import free_port
from dipaco.checkpoint.store import CheckpointManager, SavedCheckpoint
from dipaco.config import Config, ModelConfig, OptimConfig, TokenizerConfig
from dipaco.model.llama import build_model, llama_config
from dipaco.paths.inner import InnerLoop, InnerOptions, build_adamw
from dipaco.paths.sampler import ShardSampler
from dipaco.precision import resolve_precision
from dipaco.runtime import configure_backends

# cuBLAS is bit-reproducible only with a fixed workspace, set before its first call (the fp16 resume test runs
# deterministically); the size is what torch uses on Hopper anyway.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
TINY = throughput.Size(layers=2, hidden=32, intermediate=64, heads=2, vocab=512, seq_len=64, batch=4)


@pytest.fixture(scope="module")
def device(request: pytest.FixtureRequest) -> torch.device:
    device = torch.device(request.config.getoption("--device"))
    if device.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("--device cuda: no CUDA device here")
    if device.type == "cuda" and device.index is None:  # torch.cuda.set_device (the NCCL test) needs an index
        device = torch.device("cuda", torch.cuda.current_device())
    return device


@pytest.fixture(scope="module")
def check_size(device: torch.device) -> throughput.Size:
    """The cheap tests' path: the demo size on a GPU."""
    return throughput.SIZES["demo"] if device.type == "cuda" else TINY


@pytest.fixture(scope="module")
def round_size(device: torch.device) -> throughput.Size:
    """The offload and open-model tests' path: the 125M path on a GPU."""
    return throughput.SIZES["125m"] if device.type == "cuda" else TINY


def backend_for(device: torch.device) -> str:
    """inductor on CUDA; on CPU ``eager`` (:func:`bench.throughput.compile_backend`)."""
    return "inductor" if device.type == "cuda" else "eager"


def llama_for(size: throughput.Size) -> Any:
    return throughput.llama_config(throughput.model_config(size), size.vocab, size.seq_len, eos_id=0, pad_id=1)


def new_model(size: throughput.Size, device: torch.device) -> Any:
    return build_model(llama_for(size), seed=0, device=device)


def random_tokens(size: throughput.Size, sequences: int, seed: int) -> torch.Tensor:
    return torch.randint(0, size.vocab, (sequences, size.seq_len), generator=torch.Generator().manual_seed(seed))


def inner_loop(model: Any, tokens: torch.Tensor, cfg: OptimConfig, steps: int, device: torch.device,
               precision: str = "auto", **options: Any) -> InnerLoop:
    """dipaco's InnerLoop over ``tokens``, as ``dipaco train`` builds a path's."""
    return InnerLoop(model, ShardSampler(tokens, cfg.batch_size, seed=0), cfg, steps, device,
                     InnerOptions(resolve_precision(precision, device), **options))


def rel_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """max |a - b| over max |a|, over every pair of tensors."""
    scale = max(float(x.detach().abs().max()) for x in a) or 1.0
    return max(float((x - y).detach().abs().max()) for x, y in zip(a, b)) / scale


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Keys at which two nested state dicts differ (tensors bit for bit)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        same = torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and a.dtype == b.dtype \
            and torch.equal(a.cpu(), b.cpu())
        return [] if same else [where or "<tensor>"]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(map(str, a.keys() ^ b.keys()))}"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: lengths {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


def grid_differences(a: throughput.Grid, b: throughput.Grid) -> list[str]:
    """Where two grids' bank, paths' inner-loop state and parameters differ, bit for bit."""
    diff = differences(a.bank.state_dict(), b.bank.state_dict(), "bank")
    for p in a.loops:
        diff += differences(a.loops[p].state_dict(), b.loops[p].state_dict(), f"path{p}")
        diff += differences(dict(a.loops[p].model.named_parameters()), dict(b.loops[p].model.named_parameters()),
                            f"path{p}/params")
    return diff


def test_the_inner_loop_steps_with_fused_adamw_on_cuda_as_the_other_kernel_does(device, check_size, record_property):
    """On CPU build_adamw picks the foreach kernel (fused is its CUDA choice), checked against torch's fused AdamW
    kernel for CPU."""
    size, cfg = check_size, OptimConfig(lr=1e-3, warmup_steps=2, batch_size=check_size.batch)
    loop = inner_loop(new_model(size, device), random_tokens(size, 4 * size.batch, 0), cfg, 10, device)
    defaults = loop.optimizer.defaults
    kernel = "fused" if defaults.get("fused") else "foreach" if defaults.get("foreach") else "for-loop"
    assert kernel == ("fused" if device.type == "cuda" else "foreach")
    assert math.isfinite(loop.run(2).loss)
    a, b = new_model(size, device), new_model(size, device)
    opt_a = build_adamw(a, cfg)
    groups = [{"params": [p for p in b.parameters() if p.ndim >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in b.parameters() if p.ndim < 2], "weight_decay": 0.0}]
    other = {"foreach": True} if device.type == "cuda" else {"fused": True}
    opt_b = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **other)
    batch = random_tokens(size, size.batch, 1).to(device)
    for _ in range(3):
        a(input_ids=batch, labels=batch).loss.backward()
        for pa, pb in zip(a.parameters(), b.parameters()):
            pb.grad = pa.grad.clone()
        opt_a.step(), opt_b.step()
        opt_a.zero_grad(set_to_none=True), opt_b.zero_grad(set_to_none=True)
    diff = rel_diff(list(a.parameters()), list(b.parameters()))
    record_property("kernel", kernel)
    record_property("max_rel_diff_vs_other_kernel", diff)
    assert diff <= 1e-5


def test_bf16_autocast_trains(device, check_size, record_property):
    """The head's output is bf16 and the loss falls by over 10% on a few repeated sequences."""
    size, steps = check_size, 30 if device.type == "cuda" else 12
    model = new_model(size, device)
    dtypes: list[torch.dtype] = []
    hook = model.lm_head.register_forward_hook(lambda mod, inp, out: dtypes.append(out.dtype))
    loop = inner_loop(model, random_tokens(size, 2 * size.batch, 2), OptimConfig(lr=1e-2, warmup_steps=2,
                      batch_size=size.batch), steps, device, "bf16")
    losses = [loop.run(1).loss for _ in range(steps)]
    hook.remove()
    first, last = statistics.fmean(losses[:3]), statistics.fmean(losses[-3:])
    record_property("first_loss", first)
    record_property("last_loss", last)
    assert all(map(math.isfinite, losses)) and dtypes[0] == torch.bfloat16 and last < 0.9 * first


def test_activation_checkpointing_recomputes_the_blocks_with_the_same_gradients(device, check_size, record_property):
    size = check_size
    tokens = random_tokens(size, size.batch, 3)
    loops = {flag: inner_loop(new_model(size, device), tokens, OptimConfig(warmup_steps=2, batch_size=size.batch), 1,
                              device, "fp32", activation_checkpointing=flag) for flag in (False, True)}
    calls = {False: 0, True: 0}
    batch = tokens.to(device)
    for flag, loop in loops.items():
        # A pre-hook inside the block: a recomputed block enters its MLP again in the backward pass (a forward
        # hook would not tell: torch stops the recomputation once the last saved tensor is back, inside the MLP).
        loop.model.model.layers[0].mlp.register_forward_pre_hook(lambda *_, f=flag: calls.__setitem__(f, calls[f] + 1))
        loop.model.train()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        loop.forward(input_ids=batch, labels=batch).loss.backward()
        throughput.sync(device)
        if device.type == "cuda":
            record_property(f"peak_mib_{'checkpointed' if flag else 'plain'}", torch.cuda.max_memory_allocated(device) / 2**20)
    diff = rel_diff(*([p.grad for p in loop.model.parameters()] for loop in loops.values()))
    record_property("max_rel_grad_diff", diff)
    assert calls == {False: 1, True: 2} and diff <= 1e-5


def test_an_fp16_run_with_gradscaler_resumes_bit_exactly(device, check_size, tmp_path, record_property):
    """A 2x2 fp16 run, checkpointed after round 1 in the trainer's format and restored into fresh components, ends
    round 2 bit for bit where the uninterrupted run does (deterministic kernels, as run.deterministic=true). The
    loss scale is made to move (growth every 2 steps). On CPU: GradScaler('cpu')."""
    fp16 = resolve_precision("fp16", device)

    def grid() -> throughput.Grid:
        g = throughput.build_grid(check_size, device, fp16, False, 3, rounds=2)
        for loop in g.loops.values():
            loop.scaler.load_state_dict({**loop.scaler.state_dict(), "growth_interval": 2})
        return g

    def uninterrupted(checkpoints: CheckpointManager | None) -> tuple[throughput.Grid, list[float]]:
        torch.manual_seed(0)
        g = grid()
        first = g.scheduler.run_round(0)
        if checkpoints is not None:
            g.save_checkpoint(checkpoints, 1, [first])
        scales = [g.loops[0].scaler.get_scale()]
        g.scheduler.run_round(1)
        return g, [*scales, g.loops[0].scaler.get_scale()]

    configure_backends(device, True)
    try:
        checkpoints = CheckpointManager(tmp_path / "checkpoints", keep=2)
        whole, scales = uninterrupted(checkpoints)
        resumed = grid()
        resumed.state.restore(SavedCheckpoint(checkpoints.latest(), 0, device))
        resumed.scheduler.run_round(1)
        diff = grid_differences(whole, resumed)
        # Not exact: is an uninterrupted rerun exact? If not, the kernels are not deterministic, whatever resume does.
        rerun = grid_differences(whole, uninterrupted(None)[0]) if diff else []
    finally:
        configure_backends(device, None)
    record_property("loss_scale_path0", scales)
    assert all(s > 0 and math.isfinite(s) for s in scales)
    if device.type == "cpu":  # the scale moved, and resumed with it (on CUDA an overflow may move it back)
        assert scales[0] != scales[1]
    assert not diff, f"{len(diff)} differences, first {diff[:3]}; an uninterrupted rerun differs in {len(rerun)}"


def test_offload_keeps_each_paths_adamw_state_on_the_host_between_its_steps(device, round_size, record_property):
    """train.offload_inactive: the AdamW state goes to host memory after a path's steps and comes back before its
    next ones; the swap time per path is recorded. On CPU the state moves between CPU buffers."""
    grid = throughput.build_grid(round_size, device, resolve_precision("auto", device), False, 2, rounds=2,
                                 extra=["train.offload_inactive=true"])
    grid.scheduler.run_round(0)  # AdamW's state is created in the first step, then goes to the host
    report = grid.scheduler.run_round(1)  # back home, 2 steps, to the host again
    swaps = {rec["path"]: rec["swap_seconds"] for rec in report["paths"]}
    states = [[v for s in loop.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
              for loop in grid.loops.values()]
    record_property("swap_s_per_path", swaps)
    record_property("state_bytes_per_path", sum(v.numel() * v.element_size() for v in states[0]))
    if device.type == "cuda":
        record_property("pinned", sum(v.is_pinned() for s in states for v in s))
    assert all(loop.offload is not None and loop.offload.on_host for loop in grid.loops.values())
    assert all(v.device.type == "cpu" for s in states for v in s)
    assert len(swaps) == 4 and all(v > 0 for v in swaps.values())


def test_a_single_rank_group_initialises_on_dipacos_store_and_reduces(device, record_property):
    """dist.backend=nccl on CUDA; on CPU nccl is refused as designed and gloo runs through the same store and World."""
    import torch.distributed as dist

    from dipaco.comm.world import DistEnv, World, _attempt_store, resolve_backend
    from dipaco.errors import ConfigError

    if device.type == "cuda":
        backend = resolve_backend("nccl", device)
        torch.cuda.set_device(device)
    else:
        with pytest.raises(ConfigError, match="nccl needs CUDA"):
            resolve_backend("nccl", device)
        backend = resolve_backend("gloo", device)
    world = World(env=DistEnv(), backend=backend, device=device)
    start = time.perf_counter()
    # dipaco's store reads MASTER_ADDR/PORT (what torchrun sets): a free local port, for this block only.
    with mock.patch.dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())):
        store = _attempt_store(world.env, timedelta(seconds=60))
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timedelta(seconds=60))
        try:
            x = torch.arange(4, dtype=torch.float32, device=world.comm_device)
            with world.collective("single-rank all-reduce"):
                dist.all_reduce(x)
                dist.broadcast(x, src=0)
            throughput.sync(device)
            got, size, name = x.cpu().tolist(), dist.get_world_size(), dist.get_backend()
        finally:
            dist.destroy_process_group()
    record_property("backend", name)
    record_property("init_s", time.perf_counter() - start)
    assert got == [0.0, 1.0, 2.0, 3.0] and size == 1 and name == backend


def test_compile_does_not_recompile_across_paths_or_rounds(device, check_size, record_property):
    """torch.compile compiles once for the first path; the other paths and a second round add no graph."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    backend = backend_for(device)
    with throughput.compile_backend(backend):
        grid = throughput.build_grid(check_size, device, resolve_precision("auto", device), True, 2, rounds=2)
        start = time.perf_counter()
        next(iter(grid.loops.values())).train_step()  # compiles forward and backward once
        throughput.sync(device)
        record_property("compile_s", time.perf_counter() - start)
        graphs, frames = counters["stats"]["unique_graphs"], counters["frames"]["total"]
        for r in range(2):
            grid.scheduler.run_round(r)
    record_property("backend", backend)
    record_property("graphs", graphs)
    record_property("graph_breaks", sum(counters["graph_break"].values()))
    assert graphs > 0
    assert counters["stats"]["unique_graphs"] == graphs and counters["frames"]["total"] == frames


def path_worker_task(size: throughput.Size, device: torch.device) -> dict[str, Any]:
    """The Ray driver's path worker, with the resources the task scheduler gives it, runs 2 inner steps of path 0
    (in the Ray that is running, else one it starts): where it ran, its report, its state, how far the modules moved."""
    import ray

    from dipaco.model.bank import ModuleBank
    from dipaco.model.topology import topology_from_config
    from dipaco.paths.factory import LoopSettings, PathLoops
    from dipaco.run import apply_overrides
    from dipaco.train.task_actors import PathWorker

    cfg = apply_overrides(Config(), [
        "topology.preset=grid:2x2", f"model.num_layers={size.layers}", f"model.hidden_size={size.hidden}",
        f"model.intermediate_size={size.intermediate}", f"model.num_heads={size.heads}",
        f"train.optim.batch_size={size.batch}", "train.init=random", "train.driver=ray", "outer.sync=async_nesterov"])
    llama = llama_for(size)
    topology = topology_from_config(cfg.topology, size.layers)
    bank = ModuleBank(topology, build_model(llama, seed=0))
    shards = {p: random_tokens(size, 4 * size.batch, 10 + p) for p in range(topology.num_paths)}
    path_loops = PathLoops(shards, LoopSettings(optim=cfg.train.optim, total_steps=10, precision="auto"), seed=0)
    start = time.perf_counter()
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        gpus = ray.cluster_resources().get("GPU", 0) if device.type == "cuda" else 0
        share = {"num_cpus": 1.0, **({"num_gpus": 1.0} if gpus > 0 else {})}  # one worker: what the scheduler gives it
        worker = ray.remote(PathWorker).options(**share, max_restarts=0).remote(1.0, path_loops, llama, topology)
        modules = [bank.params[m].detach().clone() for m in topology.path_modules(0)]
        meta, state, _, *deltas = ray.get(worker.run.options(num_returns=3 + len(topology.parts)).remote(
            0, 2, None, *modules), timeout=120)
        worker_device = ray.get(worker.__ray_call__.remote(lambda self: str(self.device)))
    finally:
        if started:
            ray.shutdown()
    return {"worker_device": worker_device, "meta": meta, "state": state, "seconds": time.perf_counter() - start,
            "moved": sum(float(d.abs().sum()) for d in deltas)}


def test_the_ray_path_worker_runs_a_task_on_the_device(device, check_size, record_property):
    """On a GPU the worker gets it and runs there. On CPU tests/dipaco/train/test_tasks.py runs this task in its
    module's Ray, and train.driver=ray whole."""
    if device.type != "cuda":
        pytest.skip("Ray on a GPU: on CPU, tests/dipaco/train/test_tasks.py runs the same task and train.driver=ray")
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed (pip install 'dipaco[ray]')")
    got = path_worker_task(check_size, device)
    record_property("worker_device", got["worker_device"])
    record_property("seconds", got["seconds"])
    assert got["worker_device"].startswith("cuda") and got["meta"]["tokens"] == 2 * check_size.batch * check_size.seq_len
    assert got["moved"] > 0 and math.isfinite(got["meta"]["loss"]) and got["state"]["step"] == 2


def test_an_imported_llama3_checkpoint_gives_its_logits_then_trains(device, round_size, tmp_path, record_property):
    """Issue 58 on the device: a 125M-shaped Llama checkpoint (random weights, rms_norm_eps 1e-5, Llama-3 RoPE,
    saved by transformers) imported through ``model.init_from``'s code gives the source's fp32 logits, then trains
    bf16 compiled inner steps (on CPU: not compiled, at the tiny size); tokens/s recorded."""
    from transformers import LlamaForCausalLM

    from dipaco.model.source import import_weights, resolve_init_from

    size = round_size
    config = llama_for(size)
    config.rms_norm_eps, config.max_position_embeddings = 1e-5, 8 * size.seq_len
    config.rope_scaling = {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                           "original_max_position_embeddings": size.seq_len, "rope_theta": 500000.0}
    config.rope_parameters = dict(config.rope_scaling)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(58)
        source = LlamaForCausalLM(config).eval()
    source.save_pretrained(tmp_path / "open_model")
    model_cfg, _ = resolve_init_from(ModelConfig(init_from=str(tmp_path / "open_model")), TokenizerConfig(), set())
    assert model_cfg.rms_norm_eps == 1e-5 and model_cfg.rope_scaling["rope_type"] == "llama3"
    imported = build_model(llama_config(model_cfg, size.vocab, size.seq_len, 0, 1), seed=1, device=device)
    import_weights(imported, str(tmp_path / "open_model"))
    ids = random_tokens(size, 2, seed=58).to(device)
    with torch.no_grad():
        diff = float((imported.eval()(input_ids=ids).logits - source.to(device)(input_ids=ids).logits).abs().max())
    del source
    steps, compiled = (20, True) if device.type == "cuda" else (3, False)
    loop = inner_loop(imported, random_tokens(size, 8 * size.batch, seed=59), OptimConfig(warmup_steps=2,
                      batch_size=size.batch), steps + 2, device, compile=compiled)
    with throughput.compile_backend(backend_for(device)):
        loop.run(2)  # compiles
        throughput.sync(device)
        start = time.perf_counter()
        stats = loop.run(steps)
        throughput.sync(device)
    record_property("max_abs_logit_diff", diff)
    record_property("tokens_per_s", steps * size.batch * size.seq_len / (time.perf_counter() - start))
    record_property("compiled", compiled)
    assert diff <= 1e-5 and math.isfinite(stats.loss)

