"""One level's modules as stacked weights: every module's decoder blocks in one batched matmul per projection.

Module batching (:mod:`dipaco.serve.module_batch`) runs each module of a level on the rows whose path goes
through it. Run as K separate ``LlamaDecoderLayer`` calls, a level of K modules costs K times a pinned pass's
calls, each on a K-th of the rows; on a CPU at these widths the calls' fixed cost dominates. Here a level's K
modules run as one: their weights are stacked ([K, out, in] per projection, q/k/v and gate/up concatenated), the
rows are laid out module by module, padded to the largest group (``GroupLayout``), and each projection is one
``torch.bmm``. Attention has no weights, so it runs on the batch's rows in batch order, with the level's one KV
cache and transformers' own rotary and attention functions.

The arithmetic is ``LlamaDecoderLayer.forward``'s (RMSNorm in float32, residuals, SiLU-gated MLP); only the
matmuls' kernels differ (``bmm`` where a layer calls ``linear``), so a row's logits can differ from its path's in
the last bits of float32, as batching's padding can. The exactness tests require the same tokens.

The stacked tensors are views of the bank's weights when the bank holds the level's modules in one tensor
(:meth:`dipaco.model.bank.ModuleBank.colocate`, which module batching calls): the level then costs no second copy.
The per-module ``LlamaDecoderLayer``s that a one-group level runs (bitwise its path's computation) take views of
the same memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache, LlamaConfig
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, apply_rotary_pos_emb, eager_attention_forward


@dataclass(frozen=True)
class GroupLayout:
    """Rows laid out module by module, each group padded to the largest: ``pad_index`` (length groups x width)
    gathers batch rows into that layout (a pad slot repeats its group's first row), ``inverse`` (length of the
    batch) gathers them back; ``modules`` are the groups' module indices, ascending."""

    modules: torch.Tensor
    pad_index: torch.Tensor
    inverse: torch.Tensor
    width: int

    @staticmethod
    def of(groups: Sequence[tuple[int, torch.Tensor | None]], device: torch.device) -> GroupLayout:
        members = [rows.tolist() for _, rows in groups if rows is not None]
        width = max(len(rows) for rows in members)
        pad, inverse = [], [0] * sum(len(rows) for rows in members)
        for g, rows in enumerate(members):
            for j, row in enumerate(rows):
                inverse[row] = g * width + j
            pad += rows + rows[:1] * (width - len(rows))
        modules = [k for k, _ in groups]

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        return GroupLayout(tensor(modules), tensor(pad), tensor(inverse), width)


# A stacked projection: the Llama linear layers it concatenates along their outputs, in a module's flat order.
PROJECTIONS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
               "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}
NORMS = {"input_norm": "input_layernorm", "post_norm": "post_attention_layernorm"}


@dataclass
class StackedBlock:
    """One decoder block of every module of a level: weights [K, out, in], norms [K, hidden], biases [K, out]."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_bias: torch.Tensor | None
    gate_up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None

    def select(self, modules: torch.Tensor) -> StackedBlock:
        def take(t: torch.Tensor | None) -> Any:
            return None if t is None else t.index_select(0, modules)

        return StackedBlock(**{k: take(t) for k, t in vars(self).items()})


class GroupedLevel:
    """A level's K modules, each ``len(layers)`` Llama decoder blocks, stacked for batched matmuls."""

    def __init__(self, config: LlamaConfig, module_states: Sequence[dict[str, torch.Tensor]], layers: range) -> None:
        self.config = config
        self.eps = config.rms_norm_eps
        self.num_modules = len(module_states)
        first_layer = f"model.layers.{layers[0]}."
        # rows of each linear layer within its stacked projection
        self.rows = {n: module_states[0][first_layer + n + ".weight"].shape[0] for ns in PROJECTIONS.values() for n in ns}
        self.split = [self.rows[n] for n in PROJECTIONS["qkv"]]
        self.blocks = [self._stack(module_states, f"model.layers.{layer}.") for layer in layers]
        # each module's blocks as transformers layers whose weights are views of the stacked tensors
        self.modules = [self._layers(k, len(layers)) for k in range(self.num_modules)]
        first: LlamaDecoderLayer = self.modules[0][0]
        self.attention_module = first.self_attn  # what the attention function reads: is_causal, num_key_value_groups
        self.scaling: float = first.self_attn.scaling
        self.head_dim: int = first.self_attn.head_dim
        self.act_fn: Callable[[torch.Tensor], torch.Tensor] = first.mlp.act_fn
        self.attention: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward)

    @staticmethod
    def _stack(states: Sequence[dict[str, torch.Tensor]], prefix: str) -> StackedBlock:
        def stacked(names: Sequence[str], kind: str) -> torch.Tensor | None:
            if prefix + names[0] + kind not in states[0]:
                return None  # no biases
            return stack([[s[prefix + n + kind] for n in names] for s in states])

        fields: dict[str, Any] = {field: stacked((name,), ".weight") for field, name in NORMS.items()}
        for field, names in PROJECTIONS.items():
            fields[field], fields[field + "_bias"] = stacked(names, ".weight"), stacked(names, ".bias")
        return StackedBlock(**fields)

    def _layers(self, k: int, count: int) -> nn.ModuleList:
        """Module ``k``'s blocks as ``LlamaDecoderLayer``s numbered 0.. within the level's cache."""
        with torch.device("meta"):
            layers = nn.ModuleList([LlamaDecoderLayer(self.config, j) for j in range(count)])
        state: dict[str, torch.Tensor] = {}
        for j, block in enumerate(self.blocks):
            state.update({f"{j}.{name}.weight": getattr(block, field)[k] for field, name in NORMS.items()})
            for field, names in PROJECTIONS.items():
                for kind, stacked in ((".weight", getattr(block, field)), (".bias", getattr(block, field + "_bias"))):
                    if stacked is not None:
                        for name, piece in zip(names, stacked[k].split([self.rows[n] for n in names]), strict=True):
                            state[f"{j}.{name}{kind}"] = piece
        layers.load_state_dict(state, assign=True)
        return layers.eval()

    def weights_for(self, layout: GroupLayout) -> list[StackedBlock]:
        """The stacked blocks of the layout's modules: the level's own when every module has rows, else a
        selection (a copy: callers keep it while the layout stays)."""
        if len(layout.modules) == self.num_modules:  # ascending and distinct: every module, in order
            return self.blocks
        return [b.select(layout.modules) for b in self.blocks]

    def forward(self, hidden: torch.Tensor, layout: GroupLayout, blocks: Sequence[StackedBlock], cache: DynamicCache,
                causal_mask: torch.Tensor | None, position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The level's blocks on ``hidden`` [rows, T, hidden] in batch order; ``blocks``: :meth:`weights_for` the
        layout; ``cache`` holds every row's keys and values of this level, in batch order, one layer per block."""
        groups, width = len(layout.modules), layout.width
        rows, length, size = hidden.shape
        cos, sin = position_embeddings
        residual = hidden.index_select(0, layout.pad_index).view(groups, width * length, size)
        for j, block in enumerate(blocks):
            x = self._norm(residual, block.input_norm)
            qkv = _bmm(x, block.qkv, block.qkv_bias).view(groups * width, length, -1).index_select(0, layout.inverse)
            q, k, v = (t.reshape(rows, length, -1, self.head_dim).transpose(1, 2) for t in qkv.split(self.split, dim=-1))
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            k, v = cache.update(k, v, j)
            attended, _ = self.attention(self.attention_module, q, k, v, causal_mask, dropout=0.0, scaling=self.scaling)
            attended = attended.reshape(rows, length, -1).index_select(0, layout.pad_index).view(groups, width * length, -1)
            residual = residual + _bmm(attended, block.o, block.o_bias)
            gate, up = _bmm(self._norm(residual, block.post_norm), block.gate_up, block.gate_up_bias).chunk(2, dim=-1)
            residual = residual + _bmm(self.act_fn(gate) * up, block.down, block.down_bias)
        return residual.view(groups * width, length, size).index_select(0, layout.inverse)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``LlamaRMSNorm`` with each group's own weight: x [groups, n, hidden], weight [groups, hidden]."""
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight.unsqueeze(1) * x32.to(x.dtype)


def stack(parts: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
    """[modules, rows, ...]: each module's tensors concatenated along dim 0, stacked. A view when every module's
    tensors lie end to end and the modules at equal spacing in one storage (a level the bank colocated,
    :meth:`dipaco.model.bank.ModuleBank.colocate`), else a copy."""
    firsts = [ts[0] for ts in parts]
    shape = (sum(t.shape[0] for t in parts[0]), *parts[0][0].shape[1:])
    size = sum(t.numel() for t in parts[0])
    storage = firsts[0].untyped_storage().data_ptr()
    spacing = firsts[1].storage_offset() - firsts[0].storage_offset() if len(firsts) > 1 else size
    adjacent = all(t.is_contiguous() and t.untyped_storage().data_ptr() == storage for ts in parts for t in ts) and all(
        b.storage_offset() == a.storage_offset() + a.numel() for ts in parts for a, b in zip(ts, ts[1:]))
    even = spacing >= size and all(t.storage_offset() == firsts[0].storage_offset() + k * spacing for k, t in enumerate(firsts))
    if adjacent and even:
        strides = torch.empty(shape, device="meta").stride()
        return firsts[0].as_strided((len(parts), *shape), (spacing, *strides), firsts[0].storage_offset())
    return torch.stack([torch.cat(list(ts)) for ts in parts])


def _bmm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [groups, n, in] through each group's linear layer, weight [groups, out, in]."""
    if bias is None:
        return torch.bmm(x, weight.transpose(1, 2))
    return torch.baddbmm(bias.unsqueeze(1), x, weight.transpose(1, 2))
