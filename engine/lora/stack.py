"""Stacked adapter weights per linear layer, sharded for tensor parallelism like the layer they adapt.

A fused layer (qkv_proj, gate_up_proj) has one slot of `rank` rows per part: A [N, parts * rank, in] holds
each part's A in its slot, B [N, out, parts * rank] each part's B (scale folded in) in its output rows and
its slot's columns, so one shrink and one expand serve all parts. Smaller ranks are zero-padded.

Shards follow the base layer's own geometry (`output_piece`, `input_piece`): a column-parallel layer
keeps A whole and its rows of B; a row-parallel layer keeps its input columns of A and all of B, and
its partial update is summed by the layer's all-reduce like the base product.
"""
from __future__ import annotations

import logging
import re
from typing import Any

import torch
from torch import nn

from engine.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear
from engine.lora.adapter import Adapter
from engine.lora.backend import BACKENDS, GRAPH_BACKENDS
from engine.lora.batch import LoraBatch

logger = logging.getLogger(__name__)


class LayerLora:
    """The adapters of one linear layer; `add(x, y)` adds each token's update to the layer output y."""

    def __init__(self, layer: LinearBase, num_adapters: int, rank: int, batch: LoraBatch, backend: str,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.parts = _parts(layer)
        self.rank, self.batch, self.apply, self.graph_apply = rank, batch, BACKENDS[backend], GRAPH_BACKENDS[backend]
        width = len(self.parts) * rank
        self.a = torch.zeros(num_adapters, width, layer.input_size, dtype=dtype, device=device)
        self.b = torch.zeros(num_adapters, layer.output_size, width, dtype=dtype, device=device)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not self.batch.active:
            return y
        assert x.shape[0] == self.batch.num_tokens, (x.shape, self.batch.num_tokens)
        if self.batch.in_graph:
            return self.graph_apply(x, y, self.a, self.b, self.batch.token_indices)
        return self.apply(x, y, self.a, self.b, self.batch)

    def load(self, layer: LinearBase, index: int, part: Any, a: Any, b: Any, scale: float) -> None:
        """Adapter `index`'s A [r, in] and B [out, r] (lazy safetensors slices) for `part` of the layer."""
        slot = self.parts.index(part) * self.rank
        rank = a.get_shape()[0]
        piece = layer.input_piece()
        a_rows = a[:, piece[0]:piece[0] + piece[1]] if piece is not None else a[:]
        offset, start, size = layer.output_piece(part)
        b_rows = b[start:start + size]
        self.a[index, slot:slot + rank] = torch.as_tensor(a_rows).to(self.a.dtype)
        scaled = torch.as_tensor(b_rows).float() * scale
        self.b[index, offset:offset + size, slot:slot + rank] = scaled.to(self.b.dtype)


def _parts(layer: LinearBase) -> tuple[Any, ...]:
    if isinstance(layer, QKVParallelLinear):
        return ("q", "k", "v")
    if isinstance(layer, MergedColumnParallelLinear):
        return tuple(range(len(layer.output_sizes)))
    return (None,)


class AdapterSet:
    """This rank's adapters: attached to the model's linear layers, with the step's token -> adapter map.

    With `slots` (runtime LoRA) every adaptable layer gets stacks of `slots` rows of rank `rank` up front, the
    start-up adapters fill the first rows, and `load_slot` / `clear_slot` fill and empty a row between steps."""

    def __init__(self, model: nn.Module, adapters: list[Adapter], backend: str, dtype: torch.dtype,
                 device: torch.device, slots: int = 0, rank: int = 0, targets: list[str] = ()) -> None:
        self.names: list[str | None] = [adapter.name for adapter in adapters]
        self.names += [None] * (slots - len(self.names))
        self.backend = backend
        self.batch = LoraBatch()
        self.rank = max([rank, *(adapter.max_rank for adapter in adapters)])
        self.dtype, self.device = dtype, device
        self.model = model
        self.modules = dict(model.named_modules())
        self.layers: dict[str, LayerLora] = {}
        for module in targets:      # runtime LoRA: every layer an adapter may target, before any is loaded
            self._layer(module, adapter_name=None)
        for index, adapter in enumerate(adapters):
            self.load_slot(index, adapter)
        logger.info("LoRA: %d adapters (%s) on %d layers, %d slots, rank <= %d, backend %s", len(adapters),
                    ", ".join(a.name for a in adapters), len(self.layers), len(self.names), self.rank, backend)

    def _layer(self, module: str, adapter_name: str | None) -> tuple[LayerLora, Any]:
        target, part = _route(self.model, module)
        layer = self.modules.get(target)
        if not isinstance(layer, LinearBase):
            raise ValueError(f"LoRA adapter {adapter_name!r}: {module} has no linear layer ({target}) in this model")
        if target not in self.layers:
            self.layers[target] = LayerLora(layer, len(self.names), self.rank, self.batch, self.backend, self.dtype,
                                            self.device)
            layer.lora = self.layers[target]
        return self.layers[target], part

    def load_slot(self, index: int, adapter: Adapter) -> None:
        """Adapter `adapter` into row `index` (0-based; its sequences' adapter index is index + 1)."""
        from safetensors import safe_open

        self.clear_slot(index)
        with safe_open(str(adapter.path / "adapter_model.safetensors"), framework="pt", device="cpu") as handle:
            for module in adapter.modules:
                layer_lora, part = self._layer(module.module, adapter.name)
                layer_lora.load(self.modules[_route(self.model, module.module)[0]], index, part,
                                handle.get_slice(module.a_key), handle.get_slice(module.b_key), module.scale)
        self.names[index] = adapter.name

    def clear_slot(self, index: int) -> None:
        for layer_lora in self.layers.values():
            layer_lora.a[index].zero_()
            layer_lora.b[index].zero_()
        self.names[index] = None

    def set_batch(self, spans: list, device: torch.device) -> None:
        self.batch.set(spans, device)

    def clear_batch(self) -> None:
        self.batch.clear()


def _route(model: nn.Module, module: str) -> tuple[str, Any]:
    """The engine module (and fused part) that holds the checkpoint module `module`."""
    layout = getattr(model, "layout", None)
    name = f"{module}.weight"
    for pattern, replacement in getattr(layout, "renames", ()):
        name = re.sub(pattern, replacement, name)
    packed = getattr(layout, "packed", None) or getattr(model, "packed_modules_mapping", {})
    for fragment, (fused, part) in packed.items():
        if f".{fragment}." in name:
            name = name.replace(f".{fragment}.", f".{fused}.")
            return name.removesuffix(".weight"), part
    return name.removesuffix(".weight"), None
