"""Multi-worker training: rank/path assignment, per-module process groups, compressed outer gradients,
and real `torchrun` jobs (gloo on loopback, CPU) against the single-process trainer."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dipaco.checkpoint.store import load_bank_state, rank_files
from dipaco.comm.codecs import dequantize_int8, quantize_int8
from dipaco.comm.groups import module_ranks, plan_groups
from dipaco.comm.placement import check_world_size, paths_by_rank
from dipaco.comm.world import DistEnv, detect_env
from dipaco.config import Config, OuterConfig, save_config
from dipaco.errors import ConfigError
from dipaco.metrics import read_metrics
from dipaco.model.bank import ModuleBank
from dipaco.model.topology import Level, Topology
from dipaco.run import Run
from dipaco.sync.deltas import dropped_paths
from dipaco.tensor_io import load_tensors

REPO = Path(__file__).resolve().parents[3]


# --- rank / path assignment ------------------------------------------------------------------------
def test_paths_go_to_ranks_largest_shard_first_to_the_least_loaded_rank():
    assert paths_by_rank([100, 10, 10, 10], 2) == [(0,), (1, 2, 3)]
    # equal shards: ties by path id, then by rank id
    assert paths_by_rank([5, 5, 5, 5], 2) == [(0, 2), (1, 3)]
    # 9 -> r0, 8 -> r1, 4 -> r2, 3 -> r2 (load 4 < 8 < 9), 1 -> r2 (7 < 8)
    assert paths_by_rank([3, 9, 4, 8, 1], 3) == [(1,), (3,), (0, 2, 4)]
    assert sorted(p for ps in paths_by_rank([7] * 16, 4) for p in ps) == list(range(16))


def test_more_ranks_than_paths_is_a_clear_error_on_every_rank_before_any_collective(run_cfg, monkeypatch):
    with pytest.raises(ConfigError, match=r"3 ranks but the topology has only 2 paths"):
        check_world_size(2, 3)
    dense = replace(run_cfg, topology=replace(run_cfg.topology, preset="dense"))
    for rank in ("0", "1"):  # no peer exists: reaching a collective would hang, so this proves the order
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(ConfigError, match=r"2 ranks but the topology has only 1 paths"):
            Run(dense).train()
    assert not torch.distributed.is_initialized()


def test_torchrun_environment_is_detected():
    assert detect_env({}) == DistEnv()
    env = detect_env({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "TORCHELASTIC_RESTART_COUNT": "2"})
    assert (env.rank, env.world_size, env.local_rank, env.restart_count, env.distributed) == (3, 4, 1, 2, True)
    with pytest.raises(ConfigError, match="RANK=4"):
        detect_env({"WORLD_SIZE": "4", "RANK": "4"})


# --- process-group membership ----------------------------------------------------------------------
def names(topology: Topology, ids) -> set[str]:
    return {topology.modules[m].name for m in ids}


def test_groups_of_a_2x2_grid_hold_exactly_the_ranks_with_a_path_through_each_module():
    topo = Topology.grid(4, [2, 2])  # path p = 2 * k0 + k1
    # rank 0: paths 0 (0,0) and 1 (0,1); rank 1: paths 2 (1,0) and 3 (1,1)
    owners = {0: 0, 1: 0, 2: 1, 3: 1}
    holders = {topo.modules[m].name: r for m, r in module_ranks(topo, owners).items()}
    assert holders == {"embedding.0": (0, 1), "level0.0": (0,), "level0.1": (1,), "level1.0": (0, 1),
                       "level1.1": (0, 1), "head.0": (0, 1)}
    groups = plan_groups(topo, owners)
    assert [(g.ranks, names(topo, g.modules)) for g in groups] == [
        ((0, 1), {"embedding.0", "level1.0", "level1.1", "head.0"})  # level0.* held by one rank: not sent
    ]
    # four ranks, one path each: every level module is shared by exactly two ranks
    groups = plan_groups(topo, {p: p for p in range(4)})
    assert [(g.ranks, names(topo, g.modules)) for g in groups] == [
        ((0, 1), {"level0.0"}), ((0, 1, 2, 3), {"embedding.0", "head.0"}), ((0, 2), {"level1.0"}),
        ((1, 3), {"level1.1"}), ((2, 3), {"level0.1"}),
    ]


def test_groups_with_path_specific_modules_never_include_them():
    # The paper's 16x16 layout in miniature: path-specific embedding and first/last blocks.
    topo = Topology([Level(1, path_specific=True), Level(1, 2), Level(1, 2), Level(1, path_specific=True)],
                    embedding="path")
    owners = {0: 0, 1: 1, 2: 2, 3: 0}
    groups = plan_groups(topo, owners)
    communicated = {topo.modules[m].name for g in groups for m in g.modules}
    assert not any(n.startswith(("embedding.", "level0.", "level3.")) for n in communicated)
    # path p = 2 * k1 + k2 (levels 1 and 2 are the grid); ranks: 0 -> paths 0, 3; 1 -> path 1; 2 -> path 2
    assert [(g.ranks, names(topo, g.modules)) for g in groups] == [
        ((0, 1), {"level1.0", "level2.1"}),  # paths 0, 1 / paths 1, 3
        ((0, 1, 2), {"head.0"}),
        ((0, 2), {"level1.1", "level2.0"}),  # paths 2, 3 / paths 0, 2
    ]
    # every module is in at most one group, and a group's modules have exactly its ranks as holders
    holders = module_ranks(topo, owners)
    for g in groups:
        assert all(holders[m] == g.ranks for m in g.modules)


# --- int8 ------------------------------------------------------------------------------------------
def test_int8_round_trip_is_within_half_a_step_per_chunk():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(10_000, generator=gen) * torch.linspace(1e-4, 3.0, 10_000)  # very different chunk scales
    x[:64] = 0.0  # an all-zero chunk
    for chunk in (64, 1000, 4096):
        q, scale = quantize_int8(x, chunk)
        assert q.dtype == torch.int8 and q.numel() == x.numel() and scale.numel() == -(-x.numel() // chunk)
        err = (dequantize_int8(q, scale, chunk) - x).abs()
        padded = torch.nn.functional.pad(x, (0, (-x.numel()) % chunk)).view(-1, chunk)
        bound = (padded.abs().amax(dim=1) / 127 / 2).repeat_interleave(chunk)[: x.numel()]
        assert torch.all(err <= bound * (1 + 1e-5) + 1e-12)
    q, scale = quantize_int8(torch.zeros(5), 4)
    assert torch.equal(dequantize_int8(q, scale, 4), torch.zeros(5))


def test_drop_decisions_are_seeded_and_the_same_for_every_caller():
    a = [dropped_paths(3, r, 16, 0.5) for r in range(4)]
    assert a == [dropped_paths(3, r, 16, 0.5) for r in range(4)]
    assert len({frozenset(d) for d in a}) > 1 and all(0 < len(d) < 16 for d in a)
    assert dropped_paths(3, 0, 16, 0.0) == set()


# --- real process groups (torch.multiprocessing + gloo on a FileStore) -----------------------------
def _tiny_bank_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=11, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=8)
    return LlamaForCausalLM(cfg)


def _fake_payloads(bank, rank: int, round_index: int):
    """This rank's payloads of one round: deterministic, so every process can compute the exact total."""
    from dipaco.comm.reduce import Payload

    out = {}
    for part in bank.topology.parts:
        gen = torch.Generator().manual_seed(1000 * round_index + 10 * rank + part.first_module)
        values = torch.randn(part.num_modules, bank.numel(part), generator=gen) * (1 + rank) * 0.01 * 3.0
        values[:, :3] += 0.2  # a bias that plain quantization keeps losing
        for i in range(part.num_modules):
            out[part.first_module + i] = Payload(torch.tensor([3.0, 1.0]), values[i])
    return out


def _arrive_together(store: str, rank: int, world_size: int = 2) -> None:
    """Returns once every rank has started. The spawned ranks import torch and dipaco side by side, which takes
    a loaded machine tens of seconds, and one may then reach the process group more than its 3 s timeout after
    the other; from here on they run the same short steps."""
    Path(f"{store}.started{rank}").touch()
    deadline = time.monotonic() + 600
    while not all(Path(f"{store}.started{r}").exists() for r in range(world_size)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: the other ranks did not start in 600 s")
        time.sleep(0.01)


def _worker(rank: int, store: str, out_dir: str) -> None:
    import torch.distributed as dist

    from dipaco.comm.codecs import build_codec
    from dipaco.comm.feedback import ErrorFeedback
    from dipaco.comm.reduce import Transport
    from dipaco.comm.world import World
    from dipaco.errors import DistributedError
    from dipaco.sync.deltas import outer_gradient
    from dipaco.sync.nesterov import ModuleNesterov

    _arrive_together(store, rank)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=3))
    world = World(env=DistEnv(rank=rank, world_size=2), backend="gloo", timeout_s=3.0)
    topo = Topology.grid(2, [2, 2])
    owners = {0: 0, 3: 0, 1: 1, 2: 1}  # both ranks hold every module: one group [0, 1]
    names = {m.id: m.name for m in topo.modules}
    results = {}

    def transport_for(dtype: str, feedback: bool = True, two_phase_from: int = 3):
        bank = ModuleBank(topo, _tiny_bank_model())
        codec = build_codec(dtype, chunk=16)
        transport = Transport(plan_groups(topo, owners), world, codec, names, 3.0, two_phase_from=two_phase_from)
        if codec.lossy and feedback:
            transport = ErrorFeedback(transport, applied=lambda meta: bool(meta[0] > 0))
        return bank, transport

    # (dtype, error feedback, smallest group that uses reduce-scatter + all-gather instead of all-gather)
    cases = [("fp32", True, 3), ("bf16", False, 3), ("fp16", False, 3), ("int8", False, 3), ("int8", True, 3),
             ("bf16", False, 2), ("int8", False, 2), ("int8", True, 2)]
    for dtype, feedback, two_phase_from in cases:
        bank, transport = transport_for(dtype, feedback, two_phase_from)
        reduced, exact, bound, sent = [], [], [], []
        for r in range(12):
            payloads = _fake_payloads(bank, rank, r)
            a, b = _fake_payloads(bank, 0, r), _fake_payloads(bank, 1, r)
            total = {k: a[k].values + b[k].values for k in payloads}
            # int8 without feedback: each rank's encoding, plus the re-encoded sum in the two-phase scheme
            bound.append({k: float(a[k].values.abs().max() + b[k].values.abs().max()
                                   + total[k].abs().max()) / 254 for k in payloads})
            out = transport.reduce(payloads)
            reduced.append({k: p.values.clone() for k, p in out.payloads.items()})
            exact.append(total)
            sent.append(out.stats.bytes_sent)
            assert all(float(p.meta[0]) == 6.0 for p in out.payloads.values())
        residuals = len(transport.state_dict()) if isinstance(transport, ErrorFeedback) else 0
        results[(dtype, feedback, two_phase_from)] = {"reduced": reduced, "exact": exact, "bound": bound,
                                                      "sent": sent, "residuals": residuals}

    # Replicas: identical after the same step; a perturbed module is named with its ranks.
    bank, transport = transport_for("fp32")
    nesterov = ModuleNesterov(bank, OuterConfig())
    results["groups"] = [(g.ranks, g.modules, h) for g, h in transport.mine]
    out = transport.reduce(_fake_payloads(bank, rank, 0))
    nesterov.step({m: outer_gradient(p) for m, p in out.payloads.items()})

    def replicas():
        return {m: (bank.params[m], nesterov.momentum(m)) for m in transport.modules}

    transport.check_identical(replicas())
    if rank == 1:
        with torch.no_grad():
            bank.params[topo.parts[2].first_module + 1][0] += 1e-7  # level1.1
    try:
        transport.check_identical(replicas())
        results["divergence"] = None
    except DistributedError as exc:
        results["divergence"] = str(exc)

    # A rank that stops answering: its peer fails within dist.timeout_s with a clear error.
    if rank == 1:
        time.sleep(6)
    else:
        start = time.time()
        try:
            transport.reduce(_fake_payloads(bank, rank, 1))
            results["silent_peer"] = None
        except DistributedError as exc:
            results["silent_peer"] = (str(exc), time.time() - start)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    os._exit(0)  # leave without the (now broken) process group's teardown


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    import torch.multiprocessing as mp

    root = tmp_path_factory.mktemp("spawn")
    mp.spawn(_worker, args=(str(root / "store"), str(root)), nprocs=2, join=True)
    return [torch.load(root / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_lossy_reductions_are_bit_identical_on_every_rank_and_close_to_the_exact_sum(spawned):
    for key in spawned[0]:
        if isinstance(key, tuple):
            for a, b in zip(spawned[0][key]["reduced"], spawned[1][key]["reduced"]):
                assert all(torch.equal(a[k], b[k]) for k in a), key
    assert spawned[0]["groups"] == [((0, 1), tuple(range(6)), None)]  # both hold all: the world group
    fp32 = spawned[0][("fp32", True, 3)]
    for got, want in zip(fp32["reduced"], fp32["exact"]):
        assert all(torch.allclose(got[k], want[k], rtol=0, atol=1e-6) for k in got)
    for key, rtol in ((("bf16", False, 3), 2**-8), (("fp16", False, 3), 2**-11), (("bf16", False, 2), 2**-8)):
        res = spawned[0][key]
        for got, want in zip(res["reduced"], res["exact"]):
            for k in got:  # contributions (and, two-phase, their sum) each rounded to the type's precision
                assert torch.all((got[k] - want[k]).abs() <= 3 * rtol * (want[k].abs() + 0.1) + 1e-6), key
    for key in (("int8", False, 3), ("int8", False, 2)):
        res = spawned[0][key]
        for got, want, bound in zip(res["reduced"], res["exact"], res["bound"]):
            assert all(float((got[k] - want[k]).abs().max()) <= bound[k] * 1.001 for k in got), key
    # bytes per round: fp32 ring all-reduce (2 ranks: 1x the buffer) vs all-gathers of 2- and 1-byte payloads
    sent = {key: spawned[0][key]["sent"][0] for key in spawned[0] if isinstance(key, tuple)}
    assert 1.9 < sent[("fp32", True, 3)] / sent[("bf16", False, 3)] < 2.0
    assert 3.0 < sent[("fp32", True, 3)] / sent[("int8", True, 3)] <= 3.2  # 1 byte + a 4-byte scale per 16 values
    # the two-phase scheme sends 2 (n-1)/n of the encoded bytes: the same as an all-gather for n = 2
    assert 0.9 < sent[("int8", True, 2)] / sent[("int8", True, 3)] < 1.25


def test_int8_error_feedback_keeps_the_accumulated_error_bounded(spawned):
    def accumulated_error(res) -> list[float]:
        errors, acc = [], None
        for got, want in zip(res["reduced"], res["exact"]):
            diff = torch.cat([(got[k] - want[k]).reshape(-1) for k in got])
            acc = diff if acc is None else acc + diff
            errors.append(float(acc.abs().max()))
        return errors

    for two_phase_from in (3, 2):  # all-gather, and reduce-scatter + all-gather
        plain = accumulated_error(spawned[0][("int8", False, two_phase_from)])
        feedback = accumulated_error(spawned[0][("int8", True, two_phase_from)])
        assert plain[-1] > 2.5 * plain[0]  # without feedback the rounding of the bias piles up round after round
        assert feedback[-1] <= 1.5 * max(feedback[:2])  # with it, the error stays at one round's size
        assert plain[-1] > 2 * feedback[-1]
        assert spawned[0][("int8", True, two_phase_from)]["residuals"] == 6
        assert spawned[0][("int8", False, two_phase_from)]["residuals"] == 0


def test_diverged_module_and_silent_peer_are_clear_errors(spawned):
    for rank in range(2):
        msg = spawned[rank]["divergence"]
        assert msg is not None and "module level1.1 diverged" in msg and "ranks [0, 1]" in msg
    msg, seconds = spawned[0]["silent_peer"]
    assert "rank 0: all-reduce of modules" in msg and "wait at most 3s: dist.timeout_s" in msg
    assert seconds < 10


# --- torchrun end to end ---------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(cfg_file: Path, *overrides: str, nproc: int = 2, extra: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *extra,
            "-m", "dipaco", "train", "--config", str(cfg_file), *overrides]


def launch(cmd: list[str]) -> subprocess.Popen:
    """A torchrun job in its own session, so that a failing test can kill the agent and all its workers."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env,
                            start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    try:
        return proc.communicate(timeout=timeout)[0]
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # nothing is left after a clean exit; a hung job is ended here
        except ProcessLookupError:
            pass


def final_bank(cfg: Config, name: str) -> dict[str, torch.Tensor]:
    ckpt = sorted((Path(cfg.run.dir) / "train" / name / "checkpoints").glob("round_*"))[-1]
    return load_bank_state(ckpt)


# micro_batch_size: each rank's path steps accumulate micro-batches, as one process's do
E2E = ("train.rounds=3", "train.inner_steps=8", "dist.check_replicas=true", "dist.timeout_s=60", "train.optim.micro_batch_size=4")


@pytest.fixture(scope="module")
def two_ranks(prepared_run, tmp_path_factory):
    """One uninterrupted 2-rank job, shared by the tests below."""
    import shutil

    root = tmp_path_factory.mktemp("e2e")
    shutil.copytree(prepared_run.run.dir, root / "run")
    cfg = replace(prepared_run, run=replace(prepared_run.run, dir=str(root / "run")))
    save_config(cfg, root / "cfg.yaml")
    proc = launch(torchrun(root / "cfg.yaml", *E2E, "train.name=two"))
    out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    return cfg, root / "cfg.yaml", out


def test_one_and_two_ranks_train_the_same_bank(two_ranks):
    cfg, _, out = two_ranks
    single = Run(replace(cfg, train=replace(cfg.train, name="single", rounds=3, inner_steps=8,
                                            optim=replace(cfg.train.optim, micro_batch_size=4)))).train()
    a, b = final_bank(cfg, "single"), final_bank(cfg, "two")
    assert a.keys() == b.keys()
    for k in a:  # equal up to the order of the fp32 additions (docs/guide.md: Multi-worker training)
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6)
    assert single.sync.transport.mine == [] and "rank 0: paths" in out


def test_two_rank_checkpoint_writes_every_module_once_and_logs_bytes(two_ranks):
    cfg, _, _ = two_ranks
    exp_dir = Path(cfg.run.dir) / "train" / "two"
    ckpt = sorted((exp_dir / "checkpoints").glob("round_*"))[-1]
    files = rank_files(ckpt, "bank.safetensors")
    assert sorted(files) == [0, 1]
    keys = [set(load_tensors(f)) for f in files.values()]
    assert not keys[0] & keys[1]
    assert {k.split("/")[0] for k in keys[0] | keys[1]} == {f"{p}.{i}" for p in ("level0", "level1") for i in (0, 1)} | {
        "embedding.0", "head.0"}
    assert (ckpt / "MANIFEST.json").is_file() and not list(ckpt.parent.glob(".round_*"))

    comm = read_metrics(exp_dir / "metrics.jsonl", "comm")
    assert [(r["round"], r["rank"]) for r in comm] == [(r, k) for r in (1, 2, 3) for k in (0, 1)]
    rec = comm[0]
    assert rec["bytes_sent"] == rec["bytes_received"] > 0
    assert rec["bytes_sent"] == pytest.approx(sum(m["bytes_sent"] for m in rec["modules"].values()))
    assert all(m["ranks"] == [0, 1] for m in rec["modules"].values())
    assert rec["ddp_over_sent"] >= cfg.train.inner_steps  # the same inner steps under DDP send far more
    paths = read_metrics(exp_dir / "metrics.jsonl", "path")
    assert [(r["round"], r["path"]) for r in paths] == [(r, p) for r in (1, 2, 3) for p in range(4)]


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def _rank_of(pid: int) -> str | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((e[5:].decode() for e in env if e.startswith(b"RANK=")), None)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the worker processes through /proc")
def test_sigkilled_worker_restarts_and_reaches_the_identical_bank(two_ranks):
    cfg, cfg_file, _ = two_ranks
    cmd = torchrun(cfg_file, *E2E, "train.name=killed", extra=("--max-restarts", "1"))
    proc = launch(cmd)
    first = Path(cfg.run.dir) / "train" / "killed" / "checkpoints" / "round_000001"
    killed = None
    deadline = time.time() + 180
    while killed is None and proc.poll() is None and time.time() < deadline:
        if first.exists():  # round 2 is under way: kill rank 1 in the middle of it
            for child in _children(proc.pid):
                if _rank_of(child) == "1":
                    os.kill(child, signal.SIGKILL)
                    killed = child
        time.sleep(0.01)
    out = finish(proc)
    assert killed is not None, out[-3000:]
    assert proc.returncode == 0, out[-3000:]
    assert "restart 1 of the worker group: continuing from round_00000" in out
    a, b = final_bank(cfg, "two"), final_bank(cfg, "killed")
    assert all(torch.equal(a[k], b[k]) for k in a)  # bit-exact on CPU with gloo
    paths = read_metrics(Path(cfg.run.dir) / "train" / "killed" / "metrics.jsonl", "path")
    assert [(r["round"], r["path"]) for r in paths] == [(r, p) for r in (1, 2, 3) for p in range(4)]


def test_config_that_differs_between_nodes_is_refused_on_both(two_ranks):
    _, cfg_file, _ = two_ranks
    port = free_port()
    procs = []
    for node, lr in ((0, "0.7"), (1, "0.5")):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
               "-m", "dipaco", "train", "--config", str(cfg_file), "train.name=mismatch", f"outer.lr={lr}"]
        procs.append(launch(cmd))
    outs = [finish(p, timeout=180) for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode != 0
        assert "error: dist: the config differs between ranks (outer.lr: 0.7 (rank 0) vs 0.5 (rank 1))" in out, out[-2000:]


def test_dropped_contributions_leave_their_modules_untouched(run_cfg):
    cfg = replace(run_cfg, outer=replace(run_cfg.outer, drop_prob=0.5),
                  train=replace(run_cfg.train, rounds=3))
    exp = Run(cfg).train()
    outer = read_metrics(exp.dir / "metrics.jsonl", "outer")
    for rec in outer:
        dropped = set(rec["dropped"])
        assert dropped == dropped_paths(cfg.run.seed, rec["round"] - 1, 4, 0.5)
        survivors = set(range(4)) - dropped
        stepped = {m.name for m in exp.topology.modules if set(exp.topology.paths_through(m.id)) & survivors}
        assert set(rec["outer_grad_norm"]) == stepped
    assert any(rec["dropped"] for rec in outer)


def test_sigterm_mid_round_on_two_ranks_loses_a_step_and_resumes_bit_exactly(two_ranks):
    """Issue 48 under torchrun: SIGTERM to both workers mid-round (as Slurm sends it to a job's processes).
    Each finishes its inner step, the ranks agree to stop before the next sync, and they write one step
    checkpoint together; `--resume` ends with the bank of an uninterrupted 2-rank run, every round logged once."""
    cfg, cfg_file, _ = two_ranks
    longer = ("train.rounds=3", "train.inner_steps=40", "dist.timeout_s=60")
    proc = launch(torchrun(cfg_file, *longer, "train.name=straight40"))
    out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    exp_dir = Path(cfg.run.dir) / "train" / "stopped40"
    first = exp_dir / "checkpoints" / "round_000001"
    proc = launch(torchrun(cfg_file, *longer, "train.name=stopped40"))
    deadline = time.time() + 180
    while not first.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # round 2 is under way
    workers = [c for c in _children(proc.pid) if _rank_of(c) in ("0", "1")]
    assert len(workers) == 2, out
    for pid in workers:
        os.kill(pid, signal.SIGTERM)
    out = finish(proc)
    assert proc.returncode != 0 and "stopped in round" in out, out[-3000:]
    step = sorted((exp_dir / "step_checkpoint").glob("round_*"))
    assert len(step) == 1 and (step[0] / "ranks" / "rank_001").is_dir(), out[-3000:]
    proc = launch(torchrun(cfg_file, *longer, "train.name=stopped40", "--resume"))
    out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    a, b = final_bank(cfg, "straight40"), final_bank(cfg, "stopped40")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not (exp_dir / "step_checkpoint").exists()
    outer = read_metrics(exp_dir / "metrics.jsonl", "outer")
    assert [r["round"] for r in outer] == [1, 2, 3]
