"""One level's modules as stacked weights: every module's decoder blocks in one batched matmul per projection.

Module batching (:mod:`dipaco.serve.module_batch`) runs each module of a level on the rows whose path goes
through it. Run as K separate ``LlamaDecoderLayer`` calls, a level of K modules costs K times a pinned pass's
calls, each on a K-th of the rows; on a CPU at these widths the calls' fixed cost dominates. Here a level's K
modules run as one: their weights are stacked ([K, in, out] per projection, q/k/v and gate/up concatenated) and
the rows laid out module by module (``GroupLayout``). A decoding step pads each group to the largest and runs each
projection as one ``torch.bmm``; a prefill, whose rows are a prompt long, packs the groups end to end and runs one
matmul per group, so no padding is computed. Attention has no weights, so it runs on the batch's rows in batch
order, with the level's one KV cache and transformers' own rotary and attention functions.

The arithmetic is ``LlamaDecoderLayer.forward``'s (RMSNorm in float32, residuals, SiLU-gated MLP); only the
matmuls' kernels differ (``bmm`` or ``mm`` on [in, out] where a layer calls ``linear``), so a row's logits can
differ from its path's in the last bits of float32, as batching's padding can. The exactness tests require the
same tokens.

Memory: the norms and biases are views of the bank's weights (the bank holds a level's modules in one tensor,
:meth:`dipaco.model.bank.ModuleBank.colocate`, which module batching calls, so a stack of them is a view). The
projections' stacks are views too except on a CPU, where :func:`kernel_layout` holds them once more, transposed.
The per-module ``LlamaDecoderLayer``s that a one-group level runs (bitwise its path's computation) are views of
the bank's weights.
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
    """A batch's rows laid out module by module, in slots: ``order`` (slot -> batch row) gathers them into the
    layout and ``inverse`` (batch row -> slot) gathers them back; ``modules`` are the groups' module indices,
    ascending, ``spans`` each group's slots and ``slot_modules`` each slot's module.

    Padded (``width`` > 0, a decoding step's layout): each group is padded to ``width`` slots, a pad slot repeating
    its group's first row, and each projection is one ``torch.bmm``. Packed (``width`` 0, a prefill's): the groups'
    rows end to end, one matmul per group. At one token a row the bmm's single call costs less than the padding;
    at a prompt's length the padding costs more than K calls (docs/notes/2026-11-29-module-batch-kernels.md)."""

    modules: torch.Tensor
    order: torch.Tensor
    inverse: torch.Tensor
    slot_modules: torch.Tensor
    spans: tuple[tuple[int, int], ...]
    width: int

    @staticmethod
    def of(groups: Sequence[tuple[int, torch.Tensor | None]], device: torch.device, padded: bool = True) -> GroupLayout:
        members = [(k, rows.tolist()) for k, rows in groups if rows is not None]
        width = max(len(rows) for _, rows in members) if padded else 0
        order: list[int] = []
        inverse = [0] * sum(len(rows) for _, rows in members)
        spans, slot_modules = [], []
        for k, rows in members:
            start = len(order)
            for j, row in enumerate(rows):
                inverse[row] = start + j
            order += rows + rows[:1] * (width - len(rows))
            spans.append((start, len(order)))
            slot_modules += [k] * (len(order) - start)

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        return GroupLayout(tensor([k for k, _ in members]), tensor(order), tensor(inverse), tensor(slot_modules),
                           tuple(spans), width)

    def project(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x`` [slots, T, in] through each slot's module's linear layer. Padded: ``weight`` [groups, in, out] and
        ``bias`` [groups, out], the groups' own; packed: every module's, indexed by module."""
        slots, length, size = x.shape
        if self.width:
            grouped = x.reshape(len(self.spans), self.width * length, size)
            if bias is None:
                return torch.bmm(grouped, weight).view(slots, length, -1)
            return torch.baddbmm(bias.unsqueeze(1), grouped, weight).view(slots, length, -1)
        out = x.new_empty(slots, length, weight.shape[-1])
        for k, (start, end) in zip(self.modules.tolist(), self.spans, strict=True):
            rows_in, rows_out = x[start:end].reshape(-1, size), out[start:end].view(-1, weight.shape[-1])
            if bias is None:
                torch.mm(rows_in, weight[k], out=rows_out)
            else:
                torch.addmm(bias[k], rows_in, weight[k], out=rows_out)
        return out


# A stacked projection: the Llama linear layers it concatenates along their outputs, in a module's flat order.
PROJECTIONS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
               "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}
NORMS = {"input_norm": "input_layernorm", "post_norm": "post_attention_layernorm"}


@dataclass
class StackedBlock:
    """One decoder block of every module of a level: projection weights [K, in, out] (:func:`kernel_layout`),
    biases [K, out], norms [K, hidden]; or, as :meth:`GroupedLevel.weights_for` a layout gives it, norms per slot
    [slots, 1, hidden] and the projections a :class:`GroupLayout` of that kind reads."""

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

    def for_layout(self, layout: GroupLayout) -> StackedBlock:
        every_module = len(layout.modules) == self.input_norm.shape[0]  # ascending and distinct: every module, in order

        def norm(t: torch.Tensor) -> torch.Tensor:
            return t.index_select(0, layout.slot_modules).unsqueeze(1)

        def projection(t: torch.Tensor | None) -> Any:
            if t is None or not layout.width or every_module:  # packed layouts index every module's
                return t
            return t.index_select(0, layout.modules)

        fields = {k: norm(t) if k in NORMS else projection(t) for k, t in vars(self).items()}
        return StackedBlock(**fields)


class GroupedLevel:
    """A level's K modules, each ``len(layers)`` Llama decoder blocks, stacked for batched matmuls."""

    def __init__(self, config: LlamaConfig, module_states: Sequence[dict[str, torch.Tensor]], layers: range) -> None:
        self.config = config
        self.eps = config.rms_norm_eps
        first_layer = f"model.layers.{layers[0]}."
        self.split = [module_states[0][first_layer + n + ".weight"].shape[0] for n in PROJECTIONS["qkv"]]  # q, k, v
        self.blocks = [self._stack(module_states, f"model.layers.{layer}.") for layer in layers]
        # each module's blocks as transformers layers on its own weights (views of them): a path's computation
        self.modules = [self._layers(state, layers) for state in module_states]
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
            weight = stacked(names, ".weight")
            assert weight is not None  # every projection has weights
            fields[field], fields[field + "_bias"] = kernel_layout(weight), stacked(names, ".bias")
        return StackedBlock(**fields)

    def _layers(self, state: dict[str, torch.Tensor], layers: range) -> nn.ModuleList:
        """A module's blocks as ``LlamaDecoderLayer``s numbered 0.. within the level's cache."""
        with torch.device("meta"):
            blocks = nn.ModuleList([LlamaDecoderLayer(self.config, j) for j in range(len(layers))])
        own: dict[str, torch.Tensor] = {}
        for j, layer in enumerate(layers):
            prefix = f"model.layers.{layer}."
            own.update({f"{j}.{key[len(prefix):]}": t for key, t in state.items() if key.startswith(prefix)})
        blocks.load_state_dict(own, assign=True)
        return blocks.eval()

    def weights_for(self, layout: GroupLayout) -> list[StackedBlock]:
        """The stacked blocks as ``layout`` reads them (norms gathered per slot; a padded layout of some modules
        selects theirs, a copy): callers keep them while the layout stays."""
        return [b.for_layout(layout) for b in self.blocks]

    def forward(self, hidden: torch.Tensor, layout: GroupLayout, blocks: Sequence[StackedBlock], cache: DynamicCache,
                causal_mask: torch.Tensor | None, position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The level's blocks on ``hidden`` [rows, T, hidden] in batch order; ``blocks``: :meth:`weights_for` the
        layout; ``cache`` holds every row's keys and values of this level, in batch order, one layer per block."""
        rows, length, _ = hidden.shape
        cos, sin = position_embeddings
        residual = hidden.index_select(0, layout.order)  # [slots, T, hidden]
        for j, block in enumerate(blocks):
            qkv = layout.project(self._norm(residual, block.input_norm), block.qkv, block.qkv_bias)
            qkv = qkv.index_select(0, layout.inverse)
            q, k, v = (t.reshape(rows, length, -1, self.head_dim).transpose(1, 2) for t in qkv.split(self.split, dim=-1))
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            k, v = cache.update(k, v, j)
            attended, _ = self.attention(self.attention_module, q, k, v, causal_mask, dropout=0.0, scaling=self.scaling)
            attended = attended.reshape(rows, length, -1).index_select(0, layout.order)
            residual = residual + layout.project(attended, block.o, block.o_bias)
            gate, up = layout.project(self._norm(residual, block.post_norm), block.gate_up, block.gate_up_bias).chunk(2, -1)
            residual = residual + layout.project(self.act_fn(gate) * up, block.down, block.down_bias)
        return residual.index_select(0, layout.inverse)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``LlamaRMSNorm`` with each slot's module's weight: x [slots, T, hidden], weight [slots, 1, hidden]."""
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * x32.to(x.dtype)


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


def kernel_layout(weights: torch.Tensor) -> torch.Tensor:
    """Stacked linear weights [K, out, in] as the batched matmul reads them, [K, in, out]. On a CPU that is a
    contiguous copy: torch's CPU ``bmm`` on the transposed view is slower at a decoding step's
    widths (docs/notes/2026-11-29-module-batch-kernels.md), so the levels' weights are held twice there. Elsewhere it
    is the view: cuBLAS takes a transposed operand as it lies."""
    transposed = weights.transpose(1, 2)
    return transposed.contiguous() if weights.device.type == "cpu" else transposed
