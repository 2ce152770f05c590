"""The LinearMethod interface and the tensor-parallel shard reader every method loads through.

A linear layer (engine.layers.linear) describes its shard geometry: `output_piece(shard_id)` gives
(offset in this rank's output, start in the checkpoint tensor, size) in output features, and
`input_piece()` gives (start, size) in input features when the input is split (row-parallel).
A method declares, per checkpoint tensor, which axis holds output and input features and how many
features one index along that axis covers (8 for int4 packed into int32, the group size for
scales); `read_piece` turns the layer's geometry into the slice this rank reads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn


class QuantizationError(ValueError):
    """A checkpoint or flag this engine cannot serve; the message is one line naming what is supported."""


class LinearMethod:
    """How one linear layer stores, loads and multiplies its weight."""

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int) -> None:
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def finish_loading(self, layer: nn.Module) -> None:
        """Called once every tensor is loaded (e.g. quantize a staged weight)."""


class QuantizationConfig:
    name = "none"

    def linear_method(self) -> LinearMethod:
        raise NotImplementedError

    def check_device(self, device: torch.device, dtype: torch.dtype) -> None:
        """Raise QuantizationError when this method cannot run on `device` (checked before building)."""


@dataclass(frozen=True, slots=True)
class Layout:
    """Where output and input features live in one checkpoint tensor."""
    out_axis: int | None = None
    in_axis: int | None = None
    out_pack: int = 1          # output features per index along out_axis
    in_pack: int = 1           # input features per index along in_axis
    split_input: bool = True   # False: a row-parallel rank still reads every input index (act-order scales)


def read_piece(layer: nn.Module, layout: Layout, loaded: Any, shard_id: Any, what: str) -> tuple[torch.Tensor, int]:
    """This rank's part of `loaded` and its offset (in output features) within the layer's output."""
    from engine.weights import read_full, shape_of

    if not shape_of(loaded):
        return read_full(loaded), layer.output_piece(shard_id)[0]
    index: list[slice] = [slice(None)] * len(shape_of(loaded))
    offset, start, size = layer.output_piece(shard_id)
    if layout.out_axis is not None:
        index[layout.out_axis] = _indices(start, size, layout.out_pack, what, "output")
    piece = layer.input_piece()
    if layout.in_axis is not None and layout.split_input and piece is not None:
        index[layout.in_axis] = _indices(*piece, layout.in_pack, what, "input")
    return torch.as_tensor(loaded[tuple(index)]), offset


def _indices(start: int, size: int, pack: int, what: str, side: str) -> slice:
    if start % pack or size % pack:
        raise QuantizationError(f"{what}: a shard of {size} {side} features at {start} does not align with "
                                f"{pack} features per stored index; use a --num-shard whose shards are "
                                f"multiples of {pack}")
    return slice(start // pack, (start + size) // pack)


def store(param: nn.Parameter, tensor: torch.Tensor, out_axis: int | None, offset: int, what: str) -> None:
    """Copy `tensor` into `param` at `offset` along its output axis (whole when out_axis is None)."""
    target = param.data if out_axis is None else param.data.narrow(out_axis, offset, tensor.shape[out_axis])
    if target.shape != tensor.shape:
        raise ValueError(f"{what}: checkpoint shard of shape {tuple(tensor.shape)} does not fit "
                         f"{tuple(target.shape)}")
    target.copy_(tensor)


def add_param(layer: nn.Module, name: str, tensor: torch.Tensor,
              loader: Callable[[nn.Parameter, Any, Any], None], optional: bool = False) -> nn.Parameter:
    """Register `name` on `layer` with its loader; `optional` ones may be absent from the checkpoint."""
    param = nn.Parameter(tensor, requires_grad=False)
    param.weight_loader = loader
    param.optional = optional
    layer.register_parameter(name, param)
    return param


def simple_loader(layer: nn.Module, name: str, layout: Layout, param_out_axis: int | None,
                  convert: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> Callable[..., None]:
    """A loader that reads this rank's piece, converts it and stores it at its output offset."""
    def load(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        tensor, offset = read_piece(layer, layout, loaded, shard_id, name)
        store(param, convert(tensor).to(param.dtype), param_out_axis, offset, name)
    return load
