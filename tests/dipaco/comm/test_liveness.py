"""Which peer is lost (heartbeats in a real TCPStore) and how long a lock-step round's collectives wait."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from dipaco.comm.liveness import Heartbeat, RoundTimeout
from dipaco.comm.world import DistEnv, World, attempt_prefix, check_dist
from dipaco.config import DistConfig
from dipaco.errors import ConfigError


def test_the_timeout_follows_the_slowest_round_within_its_floor_and_ceiling():
    timeout = RoundTimeout(ceiling_s=1800.0, factor=3.0, min_s=60.0)
    assert timeout.after(2.0) == 60.0  # fast rounds: the floor
    assert timeout.after(100.0) == 300.0
    assert timeout.after(1000.0) == 1800.0  # never above dist.timeout_s
    assert RoundTimeout(1800.0, factor=0.0).after(5.0) == 1800.0  # 0: always dist.timeout_s


@pytest.mark.parametrize("key,value", [("round_timeout_factor", -1.0), ("round_timeout_factor", float("nan")),
                                       ("round_timeout_min_s", 0.0)])
def test_a_bad_round_timeout_is_refused_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=f"dist.{key}"):
        check_dist(DistConfig(**{key: value}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def store_port():
    port = _free_port()
    host = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    yield port
    del host


def _beating(port: int, rank: int, size: int = 3) -> Heartbeat:
    return Heartbeat.to_store("127.0.0.1", port, "test", rank, size, interval_s=0.05).start()


def test_the_peer_whose_heartbeat_stopped_is_named(store_port):
    beats = [_beating(store_port, r) for r in range(3)]
    try:
        beats[2].stop()
        assert beats[0].lost_ranks() == [2]
        assert beats[1].lost_ranks() == [2]
    finally:
        for b in beats:
            b.stop()


def test_a_rank_whose_own_beats_stopped_says_it_is_the_one_cut_off(store_port):
    beats = [_beating(store_port, r) for r in range(3)]
    try:
        beats[0].stop()
        assert beats[0].lost_ranks() is None
        assert beats[1].lost_ranks() == [0]
    finally:
        for b in beats:
            b.stop()


def test_an_unreachable_store_says_so(store_port):
    beat = _beating(store_port, 0, size=2)
    beat.connect = lambda: (_ for _ in ()).throw(RuntimeError("connection refused"))
    try:
        assert beat.lost_ranks() is None
    finally:
        beat.stop()


def test_a_failed_collective_leads_with_the_lost_rank_and_its_host(store_port):
    beats = [_beating(store_port, r, size=2) for r in range(2)]
    world = World(env=DistEnv(rank=0, world_size=2), heartbeat=beats[0], hosts=["a, pid 1", "b, pid 2"],
                  timeout_s=7.0)
    beats[1].stop()
    try:
        with pytest.raises(Exception, match=r"rank 0: lost rank 1 \(b, pid 2\): no heartbeat .* all-reduce failed: "
                                            r"boom .*wait at most 7s"):
            with world.collective("all-reduce"):
                raise RuntimeError("boom")
    finally:
        beats[0].stop()


def test_a_late_joiner_continues_the_run_its_peers_restarted():
    joiner = World(env=DistEnv(rank=1, world_size=2, restart_count=0))
    assert not joiner.restarted
    joiner.restarts = 1  # what the config check gathered: another node's agent restarted to take it in
    assert joiner.restarted


def test_store_keys_are_per_attempt_only_when_the_agent_keeps_the_store(monkeypatch):
    env = DistEnv(rank=0, world_size=2, restart_count=3)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert attempt_prefix(env) == "dipaco/attempt_3"
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert attempt_prefix(env) == attempt_prefix(DistEnv(rank=1, world_size=2, restart_count=0))
