"""GPTQ checkpoints (AutoGPTQ / GPTQModel, `quant_method: gptq`), int4 and int8.

Tensors per linear: qweight int32 [K/pack, N] packed along the input (the kernel's own layout);
qzeros int32 [G, N/pack] packed along the output; scales [G, N]; g_idx int32 [K] (act-order/desc_act
permutes it; absent or sorted otherwise); optional bias. The original ("gptq", v1) checkpoint format
stores every zero point minus one, so the weight is (q - (z + 1)) * s; GPTQModel's "gptq_v2" stores z.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from engine.layers.quantization.base import Layout, QuantizationConfig, QuantizationError, read_piece, simple_loader
from engine.layers.quantization.wna16 import (
    Geometry, WNA16Format, WNA16LinearMethod, add_internal, g_idx_loader, internal_tensors, unpack_int32)

BITS = (4, 8)
CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


class GPTQFormat(WNA16Format):
    label = "GPTQ"

    def __init__(self, bits: int, group_size: int, act_order: bool, zero_offset: int) -> None:
        super().__init__(bits, group_size, act_order)
        self.zero_offset = zero_offset

    def register(self, layer: nn.Module, geometry: Geometry, output_size: int) -> None:
        pack, groups_in = geometry.pack, geometry.group_size if geometry.group_size > 0 else 1
        grouped = Layout(out_axis=1, in_axis=0, in_pack=groups_in, split_input=geometry.shard_groups)
        zeros_layout = Layout(out_axis=1, in_axis=0, out_pack=pack, in_pack=groups_in,
                              split_input=geometry.shard_groups)
        loaders = {
            "qweight": simple_loader(layer, "qweight", Layout(out_axis=1, in_axis=0, in_pack=pack), 1),
            "scales": simple_loader(layer, "scales", grouped, 1),
            "zeros": simple_loader(layer, "qzeros", zeros_layout, 1,
                                   lambda t: unpack_int32(t, self.bits) + self.zero_offset),
            "g_idx": g_idx_loader(layer, geometry, lambda loaded, shard_id: read_piece(
                layer, Layout(in_axis=0, split_input=True), loaded, shard_id, "g_idx")[0]),
        }
        add_internal(layer, self.names, internal_tensors(geometry, output_size), loaders, optional=("g_idx",))


class GPTQConfig(QuantizationConfig):
    name = "gptq"

    def __init__(self, raw: dict[str, Any]) -> None:
        self.bits = int(raw.get("bits", 4))
        self.group_size = int(raw.get("group_size", 128))
        self.desc_act = bool(raw.get("desc_act", False))
        self.sym = bool(raw.get("sym", True))
        self.checkpoint_format = str(raw.get("checkpoint_format") or raw.get("format") or "gptq")
        if self.bits not in BITS:
            raise QuantizationError(f"GPTQ bits={self.bits} is not supported; supported: bits 4 and 8")
        if self.checkpoint_format not in CHECKPOINT_FORMATS:
            raise QuantizationError(f"GPTQ checkpoint_format={self.checkpoint_format!r} is not supported; "
                                    f"supported: {', '.join(CHECKPOINT_FORMATS)}")
        if self.group_size == 0 or self.group_size < -1:
            raise QuantizationError(f"GPTQ group_size={self.group_size} is invalid; use -1 or a positive size")

    def linear_method(self) -> WNA16LinearMethod:
        zero_offset = 1 if self.checkpoint_format == "gptq" else 0
        return WNA16LinearMethod(GPTQFormat(self.bits, self.group_size, self.desc_act, zero_offset))

    def __repr__(self) -> str:
        return (f"GPTQ(bits={self.bits}, group_size={self.group_size}, desc_act={self.desc_act}, "
                f"sym={self.sym}, format={self.checkpoint_format})")
