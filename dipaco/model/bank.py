"""ModuleBank: the one global copy of every module's parameters.

Each module is stored as a single flat fp32 ``nn.Parameter`` (its tensors concatenated in the
order :func:`dipaco.model.llama.part_parameter_names` gives). Flat storage makes the outer step a few
vector ops per module, and lets modules of one part be reduced together with ``index_add_``.

The bank composes a path by copying the path's modules into a path model *in place*, so the
path's inner AdamW state keeps pointing at the same parameter tensors across rounds.

A bank may *hold* only some modules (a rank of a distributed run holds the modules of its own
paths, as a DiPaCo worker does: Douillard et al., arXiv 2403.10616, section 2.3). The modules it
does not hold keep an empty placeholder in ``params`` (so ``params[module_id]`` stays valid) and
are absent from ``state_dict``; composing a path through one of them is an error.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence

import torch
from torch import nn
from transformers import PreTrainedModel

from dipaco.errors import CheckpointError
from dipaco.model.llama import block_prefix, check_covers_model, part_parameter_names
from dipaco.model.topology import Part, Topology


class ModuleBank:
    def __init__(self, topology: Topology, template: PreTrainedModel, modules: Iterable[int] | None = None) -> None:
        """Shapes come from ``template`` (any path-sized model); every held module starts as a copy of it.

        ``modules``: global ids of the modules to hold (default: all).
        """
        check_covers_model(template, topology)
        self.topology = topology
        named = dict(template.named_parameters())
        self.param_names = {part.name: part_parameter_names(template, part) for part in topology.parts}
        self.param_shapes = {
            part.name: [named[n].shape for n in names] for part, names in zip(topology.parts, self.param_names.values())
        }
        self.held: tuple[int, ...] = tuple(range(len(topology.modules))) if modules is None else tuple(sorted(set(modules)))
        self._held = held = frozenset(self.held)
        device = next(template.parameters()).device
        self.params: list[nn.Parameter] = []
        for module in topology.modules:
            if module.id in held:
                flat = self._flatten([named[n] for n in self.param_names[module.part.name]]).to(torch.float32)
            else:
                flat = torch.empty(0, device=device)
            self.params.append(nn.Parameter(flat, requires_grad=False))

    @staticmethod
    def _flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1) for t in tensors])

    def _path_params(self, model: PreTrainedModel, part: Part) -> list[torch.Tensor]:
        named = dict(model.named_parameters())
        return [named[n] for n in self.param_names[part.name]]

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def numel(self, part: Part) -> int:
        return sum(s.numel() for s in self.param_shapes[part.name])

    def block_spans(self, part: Part) -> list[tuple[int, int]]:
        """[start, stop) of each decoder block of a level ``part`` in its modules' flat vectors, in
        forward order (a block's parameters are consecutive: :func:`part_parameter_names`)."""
        spans, offset = [], 0
        sizes = dict(zip(self.param_names[part.name], (s.numel() for s in self.param_shapes[part.name])))
        for layer in part.layers:
            numel = sum(n for name, n in sizes.items() if name.startswith(block_prefix(layer)))
            spans.append((offset, offset + numel))
            offset += numel
        if offset != self.numel(part):
            raise ValueError(f"{part.name}: its parameters are not its blocks' parameters in block order")
        return spans

    def holds(self, module_id: int) -> bool:
        return module_id in self._held

    @property
    def held_params(self) -> list[nn.Parameter]:
        return [self.params[m] for m in self.held]

    @torch.no_grad()
    def load_path(self, path: int, model: PreTrainedModel, modules: Collection[int] | None = None,
                  keep: float = 0.0, spans: Mapping[int, Sequence[tuple[int, int]]] | None = None) -> None:
        """Overwrites ``model``'s parameters in place with the modules of ``path``.

        ``modules``: only the parts whose module is one of these (default: every part). ``spans``:
        for the modules it names, only these [start, stop) ranges of the module's flat vector (a
        slice of a module: Streaming DiLoCo's ``blocks:K`` fragments); the others whole. ``keep``:
        mix instead of overwriting, theta_path <- keep * theta_path + (1 - keep) * theta_bank
        (Streaming DiLoCo's alpha); 0 copies the bank's values exactly.
        """
        chosen = [(part, m) for part, m in zip(self.topology.parts, self.topology.path_modules(path))
                  if modules is None or m in modules]
        missing = [self.module_name(m) for _, m in chosen if not self.holds(m)]
        if missing:
            raise ValueError(f"path {path} goes through modules this bank does not hold: {missing}")
        for part, module_id in chosen:
            targets = self._path_params(model, part)
            ranges = (spans or {}).get(module_id, ((0, self.params[module_id].numel()),))
            offset = 0  # of the target tensor in the module's flat vector
            for target, chunk in zip(targets, torch.split(self.params[module_id], [t.numel() for t in targets])):
                flat = target.view(-1)
                for start, stop in ranges:
                    lo, hi = max(start, offset) - offset, min(stop, offset + flat.numel()) - offset
                    if lo >= hi:
                        continue
                    if keep:
                        flat[lo:hi].mul_(keep).add_(chunk[lo:hi], alpha=1.0 - keep)
                    else:
                        flat[lo:hi].copy_(chunk[lo:hi])
                offset += flat.numel()

    @torch.no_grad()
    def add_to_path(self, model: PreTrainedModel, part: Part, vector: torch.Tensor, alpha: float = 1.0) -> None:
        """theta_path[part] += alpha * vector (a flat vector in the bank's layout of ``part``)."""
        targets = self._path_params(model, part)
        for target, chunk in zip(targets, torch.split(vector, [t.numel() for t in targets])):
            target.add_(chunk.view_as(target).to(target.device, target.dtype), alpha=alpha)

    @torch.no_grad()
    def path_vector(self, model: PreTrainedModel, part: Part) -> torch.Tensor:
        """The path model's parameters for ``part`` as one flat fp32 vector on the bank's device."""
        return self._flatten(self._path_params(model, part)).to(self.device, torch.float32)

    def compose(self, path: int, model: PreTrainedModel) -> PreTrainedModel:
        """Convenience: load ``path`` into ``model`` and return it."""
        self.load_path(path, model)
        return model

    # --- (de)serialisation: readable names, unflattened tensors -------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Held modules only, as ``"<module name>/<llama parameter name>"``."""
        out = {}
        for module in (self.topology.modules[m] for m in self.held):
            names = self.param_names[module.part.name]
            shapes = self.param_shapes[module.part.name]
            chunks = torch.split(self.params[module.id], [s.numel() for s in shapes])
            for name, shape, chunk in zip(names, shapes, chunks):
                out[f"{module.name}/{name}"] = chunk.view(shape)
        return out

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        expected = self.state_dict()
        if set(state) != set(expected):
            missing = sorted(set(expected) - set(state))[:3]
            extra = sorted(set(state) - set(expected))[:3]
            raise CheckpointError(
                f"bank does not match the topology: missing {missing}, unexpected {extra}"
            )
        for key, target in expected.items():
            if state[key].shape != target.shape:
                raise CheckpointError(f"bank tensor {key}: shape {tuple(state[key].shape)}, expected {tuple(target.shape)}")
            target.copy_(state[key])

    def module_name(self, module_id: int) -> str:
        return self.topology.modules[module_id].name

    @torch.no_grad()
    def colocate(self, module_ids: Sequence[int]) -> torch.Tensor:
        """Moves these modules' flat vectors (of one part: equal sizes) into the rows of one [modules, n] tensor
        and returns it: the same weights at equal spacing in one storage, so that a view can stack them (module
        batching's grouped levels, :mod:`dipaco.serve.grouped_level`). Values are unchanged; views taken of the
        old vectors before the move no longer follow the bank."""
        sizes = {self.params[m].numel() for m in module_ids}
        if len(sizes) != 1 or not all(self.holds(m) for m in module_ids):
            raise ValueError(f"colocate needs held modules of one size, got modules {list(module_ids)} of sizes {sizes}")
        rows = torch.stack([self.params[m].detach() for m in module_ids])
        for m, row in zip(module_ids, rows, strict=True):
            self.params[m] = nn.Parameter(row, requires_grad=False)
        return rows
