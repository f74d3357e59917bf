"""Separate hosts on one machine: network namespaces joined to a switch, each link shaped (issue 72).

:class:`Sites` builds N network namespaces (``site0`` ... ``siteN-1``), each a host with its own address on one
private subnet, joined to a switch namespace (a Linux bridge) by a veth pair per site. Each site's link is shaped
in both directions by a token bucket (``tc qdisc ... tbf``: rate, burst, queue limit), on the site's end for what
it sends and on the switch's end for what it receives. Where the kernel has ``netem``, a profile's one-way delay is
added with it; this kernel has no netem, and :attr:`Sites.netem` records which was used.

No route leaves the namespaces: the subnet is the only one they know, nothing is NAT-ed, and the switch has no
link to the host's own network. Everything is removed on exit, on an error, on Ctrl-C and on SIGTERM (the handler
raises SystemExit, so the ``with`` block unwinds); deleting a namespace removes its veth ends and their qdiscs.

This is a module of the benchmarks' harness rather than of the library: a lab trains across real machines, and
these namespaces stand in for them in ``python -m bench sites`` and in the 2-site tests.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

SUBNET = "10.213.0"  # a private /24 of the namespaces only: site i is .(i + 1)
RDZV_PORT = 29400  # the c10d rendezvous on site 0 (each namespace has its own ports)
RAY_PORT = 6390  # the Ray head's GCS on site 0


@dataclass(frozen=True)
class LinkProfile:
    """One site's link: the token bucket's rate, burst and queue (``tc-tbf``), and a delay used only with netem."""

    rate: str | None  # tc syntax (100mbit); None: unshaped
    burst: str = "256kb"  # above veth's largest (GSO) packet, so a packet never exceeds the bucket
    limit: str = "2mb"  # bytes queued before tbf drops
    delay_ms: float = 0.0  # one-way, netem only

    def describe(self, netem: bool = False) -> str:
        """The qdiscs as applied: the delay only where netem is there to add it."""
        if self.rate is None:
            return "unshaped"
        return f"tbf rate {self.rate} burst {self.burst} limit {self.limit}" + (
            f", netem delay {self.delay_ms:g}ms" if netem and self.delay_ms else "")


PROFILES: dict[str, LinkProfile] = {
    "unshaped": LinkProfile(None),
    "lan": LinkProfile("1gbit", burst="512kb", limit="4mb", delay_ms=0.2),
    "wan": LinkProfile("100mbit", burst="256kb", limit="2mb", delay_ms=20.0),
    "poor": LinkProfile("10mbit", burst="128kb", limit="512kb", delay_ms=50.0),
}


def profile(name: str) -> LinkProfile:
    """A named profile, or a bare rate (``--rate 30mbit``) with the wan profile's burst and queue."""
    if name in PROFILES:
        return PROFILES[name]
    if name[:1].isdigit():
        return LinkProfile(name, burst="256kb", limit="2mb")
    raise ValueError(f"unknown link profile {name!r}: one of {', '.join(PROFILES)} or a tc rate such as 30mbit")


class SitesUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no ``ip``/``tc``, or the kernel refuses)."""


def _run(cmd: Sequence[str]) -> None:
    done = subprocess.run(list(cmd), capture_output=True, text=True)
    if done.returncode:
        raise SitesUnavailable(f"`{' '.join(cmd)}` failed: {(done.stderr or done.stdout).strip()}")


def unavailable() -> str | None:
    """Why namespaces cannot be made on this machine (one line), or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"dpprobe{os.getpid()}"
    try:
        _run(["ip", "netns", "add", probe])
    except SitesUnavailable as exc:
        return f"cannot create a network namespace: {exc}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def netem_available() -> bool:
    """Whether this kernel has the netem qdisc (tried on the loopback of a scratch namespace)."""
    probe = f"dpnetem{os.getpid()}"
    try:
        _run(["ip", "netns", "add", probe])
        done = subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                               "delay", "1ms"], capture_output=True)
        return done.returncode == 0
    except SitesUnavailable:
        return False
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)


@dataclass(frozen=True)
class Site:
    index: int
    netns: str
    address: str
    device: str  # the site's end of its veth pair (the interface gloo binds: GLOO_SOCKET_IFNAME)
    port: str  # the switch's end

    def command(self, cmd: Sequence[str]) -> list[str]:
        """``cmd`` run on this site (inside its namespace)."""
        return ["ip", "netns", "exec", self.netns, *cmd]


class Sites:
    """``with Sites(4, PROFILES["wan"]) as sites:`` four hosts on shaped links; removed on leaving the block.

    :meth:`torchrun` passes ``--local-addr`` and ``is_host`` with the site's own address: torchrun otherwise
    takes the machine's hostname, the same in every namespace and an address none of them has."""

    def __init__(self, n: int, link: LinkProfile | Sequence[LinkProfile], tag: str | None = None) -> None:
        if not 1 <= n <= 200:
            raise ValueError(f"sites: 1 to 200 sites, got {n}")
        self.n = n
        self.links = list(link) if isinstance(link, Sequence) else [link] * n
        if len(self.links) != n:
            raise ValueError(f"sites: {n} sites but {len(self.links)} link profiles")
        tag = tag or str(os.getpid())
        self.switch = f"dpsw{tag}"
        self.sites = [Site(i, f"dps{tag}_{i}", f"{SUBNET}.{i + 1}", f"dpv{i}", f"dpp{tag}_{i}"[:15])
                      for i in range(n)]
        self.netem = False
        self._previous: Any = None
        self._made: list[str] = []

    def __getitem__(self, i: int) -> Site:
        return self.sites[i]

    def __len__(self) -> int:
        return self.n

    def __enter__(self) -> Sites:
        reason = unavailable()
        if reason:
            raise SitesUnavailable(reason)
        self.netem = any(link.delay_ms for link in self.links) and netem_available()
        self._previous = signal.signal(signal.SIGTERM, self._terminated)
        try:
            self._build()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._made.clear()
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    @staticmethod
    def _terminated(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    def _netns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._made.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _build(self) -> None:
        self._netns(self.switch)
        _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
        for site, link in zip(self.sites, self.links):
            self._netns(site.netns)
            _run(["ip", "link", "add", site.device, "netns", site.netns, "type", "veth",
                  "peer", "name", site.port, "netns", self.switch])
            _run(["ip", "-n", self.switch, "link", "set", site.port, "master", "br0"])
            _run(["ip", "-n", self.switch, "link", "set", site.port, "up"])
            _run(["ip", "-n", site.netns, "addr", "add", f"{site.address}/24", "dev", site.device])
            _run(["ip", "-n", site.netns, "link", "set", site.device, "up"])
            self.shape(site.index, link)

    def shape(self, i: int, link: LinkProfile) -> None:
        """Sets site ``i``'s link to ``link``, both directions (replacing what was there)."""
        site = self.sites[i]
        self.links[i] = link
        for netns, dev in ((site.netns, site.device), (self.switch, site.port)):
            subprocess.run(["tc", "-n", netns, "qdisc", "del", "dev", dev, "root"], capture_output=True)
            if link.rate is None:
                continue
            if self.netem and link.delay_ms:
                _run(["tc", "-n", netns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                      "delay", f"{link.delay_ms}ms"])
                _run(["tc", "-n", netns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "tbf",
                      "rate", link.rate, "burst", link.burst, "limit", link.limit])
            else:
                _run(["tc", "-n", netns, "qdisc", "add", "dev", dev, "root", "tbf",
                      "rate", link.rate, "burst", link.burst, "limit", link.limit])

    def cut(self, i: int) -> None:
        """Site ``i`` loses its link (``ip link set ... down`` on its end): packets vanish, nothing resets."""
        _run(["ip", "-n", self.sites[i].netns, "link", "set", self.sites[i].device, "down"])

    def kill(self, i: int) -> None:
        """Every process on site ``i`` is SIGKILLed (``ip netns pids``): a lost machine, its sockets reset. Killing
        torchrun's process group is not enough: its workers run in sessions of their own."""
        pids = subprocess.run(["ip", "netns", "pids", self.sites[i].netns], capture_output=True, text=True).stdout
        for pid in pids.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass

    def restore(self, i: int) -> None:
        """Site ``i``'s link comes back."""
        _run(["ip", "-n", self.sites[i].netns, "link", "set", self.sites[i].device, "up"])

    def environment(self, i: int) -> dict[str, str]:
        """What a process on site ``i`` needs beyond its namespace, as on real machines (docs/guide.md,
        "Across machines"): gloo binds the site's own interface (its default, the address the hostname
        resolves to, is not inside the namespace); rank 0 hosts the job's store afresh at each rendezvous,
        because torchrun's shared agent store never tells a node that joins late where the workers' store is."""
        return {"GLOO_SOCKET_IFNAME": self.sites[i].device, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

    def torchrun(self, i: int, program: Sequence[str], nnodes: str, job: str, nproc: int = 1,
                 max_restarts: int = 3, rdzv_conf: str = "", port: int = RDZV_PORT) -> list[str]:
        """``torchrun`` on site ``i`` for an elastic job of ``nnodes`` (``N`` or ``MIN:MAX``) nodes, one per site,
        with the c10d rendezvous hosted by site 0: the command a lab runs on each machine, in the site's namespace.
        ``program``: what follows torchrun's own flags (``-m dipaco train ...``)."""
        site = self.sites[i]
        conf = ",".join(c for c in (rdzv_conf, f"is_host={int(i == 0)}") if c)
        return site.command([sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes,
                             "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
                             "--rdzv-endpoint", f"{self.sites[0].address}:{port}", "--rdzv-id", job,
                             "--rdzv-conf", conf, "--local-addr", site.address, "--max-restarts", str(max_restarts),
                             *program])

    def link_bytes(self, i: int) -> tuple[int, int]:
        """(sent, received) bytes of site ``i``'s interface so far: everything its link carried."""
        site = self.sites[i]
        counts = []
        for counter in ("tx_bytes", "rx_bytes"):
            path = f"/sys/class/net/{site.device}/statistics/{counter}"
            done = subprocess.run(site.command(["cat", path]), capture_output=True, text=True, check=True)
            counts.append(int(done.stdout))
        return counts[0], counts[1]

    def describe(self) -> dict[str, Any]:
        return {"sites": self.n, "links": [link.describe(self.netem) for link in self.links],
                "netem": self.netem, "shaping": "tbf + netem" if self.netem else "tbf (no netem in this kernel)"}


class RayCluster:
    """``with RayCluster(sites, env) as cluster:`` a Ray cluster on the sites, as a lab runs one on its machines:
    :meth:`start` site 0 as the head (GCS on :data:`RAY_PORT`), any other site as a node that joins it, before the
    run or during it. Every machine shares one token (Ray's token auth, which Ray 2.60's head turns on) and, here,
    one session directory. Leaving the block kills every process on the sites (Ray's stay in their namespaces) and
    removes the session directory."""

    def __init__(self, sites: Sites, env: Mapping[str, str]) -> None:
        self.sites = sites
        self.env = {**env, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token",
                    "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        self.temp_dir = ""
        self.address = f"{sites[0].address}:{RAY_PORT}"  # what ray.address names

    def __enter__(self) -> RayCluster:
        self.temp_dir = tempfile.mkdtemp(prefix="dpray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
        return self

    def __exit__(self, *exc: object) -> None:
        for i in range(len(self.sites)):
            self.sites.kill(i)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def environment(self, i: int) -> dict[str, str]:
        """What a process on site ``i`` needs: the cluster's token and the site's own (:meth:`Sites.environment`)."""
        return {**self.env, **self.sites.environment(i)}

    def start(self, i: int, cpus: int = 1) -> None:
        """``ray start`` on site ``i`` with ``cpus`` CPUs and a small object store."""
        site = self.sites[i]
        role = ["--head", f"--port={RAY_PORT}", "--include-dashboard=false"] if i == 0 else [f"--address={self.address}"]
        ray = str(Path(sys.executable).parent / "ray")
        cmd = site.command([ray, "start", *role, "--node-ip-address", site.address, "--num-cpus", str(cpus),
                            "--object-store-memory", str(200 * 2**20), "--disable-usage-stats",
                            f"--temp-dir={self.temp_dir}"])
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=self.environment(i))
        if done.returncode:
            raise RuntimeError(f"ray start on site {i} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
