"""Path/module arithmetic: which modules make up each path, and which paths contain each module.

A path is one dense LM: embedding -> level 0 -> ... -> level L-1 -> final norm + LM head. Each of
these *parts* holds one or more interchangeable *modules*:

* a grid level has K_l modules, and a path picks one of them (its digit for that level);
* a shared part (a level with K=1, or a shared embedding/head) has one module used by every path;
* a path-specific part has one module per path, never shared.

Path numbering is mixed radix over the grid levels' K_l, level 0 most significant, with the
replica digit last (least significant): ``p = ((k_0 * K_1 + k_1) * ... ) * R + r``. The routing
package numbers k-means clusters the same way, so a product-k-means cluster tuple *is* a path.

Modules carry one global id (0..num_modules-1), numbered part by part in forward order.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import cached_property

from dipaco.config import TopologyConfig, resolved_part_sharing
from dipaco.errors import ConfigError

EMBEDDING = "embedding"
HEAD = "head"


@dataclass(frozen=True)
class Level:
    blocks: int
    modules: int = 1
    path_specific: bool = False


@dataclass(frozen=True)
class Part:
    """A slot of the path: the embedding, one level of blocks, or the head."""

    name: str  # "embedding", "level0", ..., "head"
    kind: str  # embedding | level | head
    num_modules: int
    path_specific: bool
    layers: range  # transformer block indices (empty for embedding/head)
    first_module: int  # global id of this part's module 0


@dataclass(frozen=True)
class Module:
    id: int
    part: Part
    index: int  # index within its part

    @property
    def name(self) -> str:
        return f"{self.part.name}.{self.index}"


def mixed_radix_encode(digits: Sequence[int], radices: Sequence[int]) -> int:
    index = 0
    for digit, radix in zip(digits, radices, strict=True):
        if not 0 <= digit < radix:
            raise ValueError(f"digit {digit} out of range for radix {radix}")
        index = index * radix + digit
    return index


def mixed_radix_decode(index: int, radices: Sequence[int]) -> tuple[int, ...]:
    digits = []
    for radix in reversed(radices):
        index, digit = divmod(index, radix)
        digits.append(digit)
    if index:
        raise ValueError("index out of range for the given radices")
    return tuple(reversed(digits))


class Topology:
    """Levels of modules plus replicas; answers ``path_modules(p)`` and ``paths_through(m)``."""

    def __init__(
        self,
        levels: Sequence[Level],
        replicas: int = 1,
        embedding: str = "shared",
        head: str = "shared",
    ) -> None:
        if not levels:
            raise ConfigError("topology: at least one level is required")
        for i, level in enumerate(levels):
            if level.blocks < 1 or level.modules < 1:
                raise ConfigError(f"topology.levels[{i}]: blocks and modules must be >= 1, got {level}")
            if level.path_specific and level.modules != 1:
                raise ConfigError(
                    f"topology.levels[{i}]: a path_specific level has one module per path; leave modules=1"
                )
        if replicas < 1:
            raise ConfigError(f"topology.replicas: must be >= 1, got {replicas}")
        for key, value in (("embedding", embedding), ("head", head)):
            if value not in ("shared", "path"):
                raise ConfigError(f"topology.{key}: {value!r} is not one of shared, path")
        self.levels = tuple(levels)
        self.replicas = replicas
        self.embedding = embedding
        self.head = head
        self.radices = tuple(lv.modules for lv in self.levels if not lv.path_specific) + (replicas,)
        self.num_paths = math.prod(self.radices)
        self.num_layers = sum(lv.blocks for lv in self.levels)
        self.parts = self._build_parts()
        self.modules = tuple(
            Module(part.first_module + i, part, i) for part in self.parts for i in range(part.num_modules)
        )

    def _build_parts(self) -> tuple[Part, ...]:
        specs: list[tuple[str, str, int, bool, range]] = []
        specs.append((EMBEDDING, EMBEDDING, 1, self.embedding == "path", range(0)))
        start = 0
        for i, lv in enumerate(self.levels):
            specs.append((f"level{i}", "level", lv.modules, lv.path_specific, range(start, start + lv.blocks)))
            start += lv.blocks
        specs.append((HEAD, HEAD, 1, self.head == "path", range(0)))
        parts, first = [], 0
        for name, kind, k, path_specific, layers in specs:
            n = self.num_paths if path_specific else k
            parts.append(Part(name, kind, n, path_specific, layers, first))
            first += n
        return tuple(parts)

    # --- presets -------------------------------------------------------------------------------
    @classmethod
    def dense(cls, num_layers: int, **kw) -> Topology:
        return cls([Level(num_layers, 1)], **kw)

    @classmethod
    def diloco(cls, num_layers: int, replicas: int, **kw) -> Topology:
        return cls([Level(num_layers, 1)], replicas=replicas, **kw)

    @classmethod
    def flat_moe(cls, num_layers: int, paths: int, **kw) -> Topology:
        return cls([Level(num_layers, paths)], **kw)

    @classmethod
    def grid(cls, num_layers: int, shape: Sequence[int], **kw) -> Topology:
        if len(shape) > num_layers:
            raise ConfigError(f"topology: a {len(shape)}-level grid needs at least {len(shape)} layers")
        base, extra = divmod(num_layers, len(shape))
        # Earlier levels take the leftover blocks so every block belongs to exactly one level.
        return cls([Level(base + (i < extra), k) for i, k in enumerate(shape)], **kw)

    @classmethod
    def from_preset(cls, preset: str, num_layers: int, **kw) -> Topology:
        name, _, arg = preset.partition(":")
        try:
            if name == "dense" and not arg:
                return cls.dense(num_layers, **kw)
            if name == "diloco":
                return cls.diloco(num_layers, int(arg), **kw)
            if name == "moe":
                return cls.flat_moe(num_layers, int(arg), **kw)
            if name == "grid" and re.fullmatch(r"\d+(x\d+)*", arg):
                return cls.grid(num_layers, [int(k) for k in arg.split("x")], **kw)
        except ValueError:
            pass
        raise ConfigError(
            f"topology.preset: {preset!r} is not one of dense, diloco:R, moe:P, grid:KxK (e.g. grid:2x2)"
        )

    # --- arithmetic ----------------------------------------------------------------------------
    def _check_path(self, path: int) -> None:
        if not 0 <= path < self.num_paths:
            raise IndexError(f"path {path} out of range [0, {self.num_paths})")

    def path_digits(self, path: int) -> tuple[int, ...]:
        """(k_0, ..., k_{L'-1}, replica) over the grid (non path-specific) levels."""
        self._check_path(path)
        return mixed_radix_decode(path, self.radices)

    def path_index(self, digits: Sequence[int]) -> int:
        return mixed_radix_encode(digits, self.radices)

    def module_index(self, part: Part, path: int) -> int:
        """Which of ``part``'s modules ``path`` uses."""
        if part.path_specific:
            return path
        if part.kind != "level" or part.num_modules == 1:
            return 0
        grid_levels = [p for p in self.parts if p.kind == "level" and not p.path_specific]
        return self.path_digits(path)[grid_levels.index(part)]

    def path_modules(self, path: int) -> tuple[int, ...]:
        """Global module ids of ``path``, one per part in forward order."""
        self._check_path(path)
        return tuple(part.first_module + self.module_index(part, path) for part in self.parts)

    @cached_property
    def _paths_through(self) -> tuple[tuple[int, ...], ...]:
        members: list[list[int]] = [[] for _ in self.modules]
        for p in range(self.num_paths):
            for m in self.path_modules(p):
                members[m].append(p)
        return tuple(tuple(ps) for ps in members)

    def paths_through(self, module: int) -> tuple[int, ...]:
        """Paths that contain global module id ``module``."""
        return self._paths_through[module]

    def shared_blocks(self) -> list[list[int]]:
        """(P, P): how many transformer blocks paths p and q both go through (a path's own on the diagonal).

        What two paths' shards have to agree on; ``route.arrange`` puts alike clusters where it is large."""
        block_count = [len(m.part.layers) for m in self.modules]
        members = [set(self.path_modules(p)) for p in range(self.num_paths)]
        return [[sum(block_count[m] for m in a & b) for b in members] for a in members]

    def part_assignment(self, part: Part) -> list[int]:
        """For each path, the index of the module it uses in ``part`` (the index for index_add_)."""
        return [self.module_index(part, p) for p in range(self.num_paths)]

    def describe(self) -> str:
        shape = "x".join(str(r) for r in self.radices[:-1]) or "1"
        reps = f" x {self.replicas} replicas" if self.replicas > 1 else ""
        return f"{self.num_paths} paths ({shape}{reps}), {len(self.modules)} modules, {self.num_layers} blocks"

    def to_dict(self) -> dict:
        return {
            "levels": [asdict(lv) for lv in self.levels],
            "replicas": self.replicas,
            "embedding": self.embedding,
            "head": self.head,
            "radices": list(self.radices),
            "num_paths": self.num_paths,
        }

    @classmethod
    def from_dict(cls, data: dict) -> Topology:
        """The topology :meth:`to_dict` wrote (its derived keys are checked against the rebuilt one)."""
        levels = [Level(int(lv["blocks"]), int(lv["modules"]), bool(lv["path_specific"])) for lv in data["levels"]]
        topology = cls(levels, replicas=int(data["replicas"]), embedding=data["embedding"], head=data["head"])
        if data.get("num_paths", topology.num_paths) != topology.num_paths:
            raise ValueError(f"topology: num_paths {data['num_paths']} does not match its levels "
                             f"({topology.num_paths} paths)")
        return topology


def check_topology(topo_cfg: TopologyConfig) -> None:
    """The ``topology`` keys a type cannot check; the rest is checked when the topology is built. A job checks the
    built topology against ``model.num_layers`` before it starts (``dipaco.cli``): a script may apply overrides in
    stages whose intermediate configs do not fit (a deeper model first, its preset after)."""
    if topo_cfg.replicas <= 0:
        raise ConfigError(f"topology.replicas: must be > 0, got {topo_cfg.replicas}")


def topology_from_config(topo_cfg: TopologyConfig, num_layers: int) -> Topology:
    """Builds the Topology a config describes and checks it covers ``model.num_layers`` blocks."""
    embedding, head = resolved_part_sharing(topo_cfg)
    kw = dict(embedding=embedding, head=head)
    if topo_cfg.preset:
        topology = Topology.from_preset(topo_cfg.preset, num_layers, **kw)
    else:
        levels = [Level(lv.blocks, lv.modules, lv.path_specific) for lv in topo_cfg.levels]
        topology = Topology(levels, replicas=topo_cfg.replicas, **kw)
    if topology.num_layers != num_layers:
        raise ConfigError(
            f"topology.levels: the levels hold {topology.num_layers} blocks but model.num_layers={num_layers}"
        )
    return topology
