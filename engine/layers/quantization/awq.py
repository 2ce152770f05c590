"""AWQ checkpoints (AutoAWQ `version: gemm`, `quant_method: awq`), int4.

Tensors per linear: qweight int32 [K, N/8] and qzeros int32 [G, N/8], both packed along the OUTPUT
with AutoAWQ's interleaved order (word nibble i holds column ORDER[i] of its 8), scales [G, N];
no g_idx (groups are sorted), zero points stored as is: weight = (q - z) * s. qweight is repacked
along the input at load into the kernel's layout.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from engine.layers.quantization.base import Layout, QuantizationConfig, QuantizationError, simple_loader
from engine.layers.quantization.wna16 import (
    Geometry, WNA16Format, WNA16LinearMethod, add_internal, internal_tensors, pack_rows, unpack_int32)

ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # column (within 8) stored at nibble i
VERSIONS = ("gemm",)


class AWQFormat(WNA16Format):
    label = "AWQ"

    def register(self, layer: nn.Module, geometry: Geometry, output_size: int) -> None:
        groups_in = geometry.group_size if geometry.group_size > 0 else 1
        grouped = Layout(out_axis=1, in_axis=0, in_pack=groups_in, split_input=geometry.shard_groups)
        zeros_layout = Layout(out_axis=1, in_axis=0, out_pack=8, in_pack=groups_in,
                              split_input=geometry.shard_groups)
        loaders = {
            "qweight": simple_loader(layer, "qweight", Layout(out_axis=1, in_axis=0, out_pack=8), 1,
                                     lambda t: pack_rows(unpack_int32(t, 4, ORDER), 4)),
            "scales": simple_loader(layer, "scales", grouped, 1),
            "zeros": simple_loader(layer, "qzeros", zeros_layout, 1, lambda t: unpack_int32(t, 4, ORDER)),
            "g_idx": None,
        }
        add_internal(layer, self.names, internal_tensors(geometry, output_size), loaders)


class AWQConfig(QuantizationConfig):
    name = "awq"

    def __init__(self, raw: dict[str, Any]) -> None:
        self.bits = int(raw.get("bits", raw.get("w_bit", 4)))
        self.group_size = int(raw.get("group_size", raw.get("q_group_size", 128)))
        self.version = str(raw.get("version", "gemm")).lower()
        if self.bits != 4:
            raise QuantizationError(f"AWQ bits={self.bits} is not supported; supported: 4")
        if self.version not in VERSIONS:
            raise QuantizationError(f"AWQ version={self.version!r} is not supported; supported: "
                                    f"{', '.join(VERSIONS)} (AutoAWQ's default layout)")
        if self.group_size == 0 or self.group_size < -1:
            raise QuantizationError(f"AWQ group_size={self.group_size} is invalid; use -1 or a positive size")

    def linear_method(self) -> WNA16LinearMethod:
        return WNA16LinearMethod(AWQFormat(self.bits, self.group_size, act_order=False))

    def __repr__(self) -> str:
        return f"AWQ(bits={self.bits}, group_size={self.group_size}, version={self.version})"
