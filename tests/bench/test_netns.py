"""Sites as network namespaces (bench.netns): profiles, the refusal without root, links that carry, shape and
cut traffic, and nothing left behind."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from bench import netns
from bench.netns import PROFILES, Sites, SitesUnavailable, profile, unavailable

live = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

# a one-shot TCP echo between two sites, from inside their namespaces
SERVER = ("import socket,sys; s=socket.create_server(('{addr}',5555)); print('up',flush=True); c,_=s.accept(); "
          "c.sendall(c.recv(16))")
CLIENT = ("import socket,sys; c=socket.create_connection(('{addr}',5555),timeout=3); c.sendall(b'ping'); "
          "sys.stdout.write(c.recv(16).decode())")


def test_profiles_and_bare_rates():
    assert PROFILES["poor"].rate == "10mbit" and PROFILES["wan"].rate == "100mbit" and PROFILES["lan"].rate == "1gbit"
    assert profile("30mbit").rate == "30mbit"
    with pytest.raises(ValueError, match="unknown link profile 'dialup'"):
        profile("dialup")


def test_without_root_it_refuses_in_one_line(monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(SitesUnavailable, match="need root"):
        with Sites(2, PROFILES["wan"]):
            pass


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _wait_until_inside(netns: str, pid: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if str(pid) in subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout.split():
            return
        time.sleep(0.05)
    raise AssertionError(f"pid {pid} never entered {netns}")


def _echo(sites: Sites) -> subprocess.CompletedProcess:
    server = subprocess.Popen(sites[0].command([sys.executable, "-c", SERVER.format(addr=sites[0].address)]),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "up"
        return subprocess.run(sites[1].command([sys.executable, "-c", CLIENT.format(addr=sites[0].address)]),
                              capture_output=True, text=True, timeout=30)
    finally:
        server.kill()
        server.wait()


@live
def test_sites_talk_over_shaped_links_a_cut_link_carries_nothing_and_all_is_removed():
    before = _namespaces()
    with Sites(2, PROFILES["poor"], tag="t") as sites:
        assert len(_namespaces() - before) == 3  # two sites and the switch
        shown = subprocess.run(["tc", "-n", sites[1].netns, "qdisc", "show", "dev", sites[1].device],
                               capture_output=True, text=True).stdout
        assert "tbf" in shown and "10Mbit" in shown
        assert sites.describe()["netem"] is False or "netem" in shown
        sent, received = sites.link_bytes(1)
        assert _echo(sites).stdout == "ping"
        after = sites.link_bytes(1)
        assert after[0] > sent and after[1] > received  # the echo went out over site 1's link and came back
        sites.cut(1)
        assert _echo(sites).returncode != 0
        sites.restore(1)
        assert _echo(sites).stdout == "ping"
        sleeper = subprocess.Popen(sites[1].command(["sleep", "600"]), start_new_session=True)
        _wait_until_inside(sites[1].netns, sleeper.pid)  # `ip netns exec` enters the namespace, then execs
        sites.kill(1)  # every process in the site's namespace, whatever its session
        assert sleeper.wait(timeout=10) == -9
    assert _namespaces() == before


@live
def test_an_error_inside_the_block_still_removes_every_namespace():
    before = _namespaces()
    with pytest.raises(RuntimeError, match="inside"):
        with Sites(2, PROFILES["wan"], tag="e"):
            raise RuntimeError("inside")
    assert _namespaces() == before
