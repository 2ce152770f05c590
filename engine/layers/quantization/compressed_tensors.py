"""compressed-tensors checkpoints (llm-compressor, `quant_method: compressed-tensors`).

Served schemes (one scheme for every linear layer; `ignore` may name only the LM head):
- `pack-quantized` int4/int8 weights, group or channel scales, symmetric or not, act-order g_idx
  (W4A16, W8A16): weight_packed int32 [N, K/pack] packed along the input, element k at bits
  (k % pack) * bits, stored as q + 2^(bits-1); weight_scale [N, G]; weight_zero_point int32
  [N/pack, G] packed along the output (asymmetric only); weight_g_idx [K]; weight_shape [2].
  Transposed at load into engine.kernels.quant_gemm's layout (the same kernel as GPTQ/AWQ).
- `float-quantized` (or `naive-quantized`, as the library names FP8 weight-only) FP8 e4m3 weights with
  channel or tensor scales, activations dynamic per token
  (W8A8-FP8) or not quantized (W8A16-FP8): served by the FP8 method (engine.layers.quantization.fp8).
"""
from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from engine.layers.quantization.base import (
    Layout, LinearMethod, QuantizationConfig, QuantizationError, add_param, read_piece, simple_loader)
from engine.layers.quantization.fp8 import Fp8LinearMethod
from engine.layers.quantization.wna16 import (
    Geometry, WNA16Format, WNA16LinearMethod, add_internal, g_idx_loader, internal_tensors, unpack_int32)

SUPPORTED_SCHEMES = ("pack-quantized int4/int8 weights (W4A16, W8A16)",
                     "float-quantized FP8 weights with dynamic per-token FP8 activations or none (W8A8-FP8)")
FP8_FORMATS = ("float-quantized", "naive-quantized")  # the library saves FP8 weight-only as naive-quantized
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class PackQuantizedFormat(WNA16Format):
    label = "compressed-tensors pack-quantized"
    names = {"qweight": "weight_packed", "scales": "weight_scale", "zeros": "weight_zero_point",
             "g_idx": "weight_g_idx"}

    def __init__(self, bits: int, group_size: int, act_order: bool, symmetric: bool) -> None:
        super().__init__(bits, group_size, act_order)
        self.symmetric = symmetric

    def register(self, layer: nn.Module, geometry: Geometry, output_size: int) -> None:
        pack, groups_in = geometry.pack, geometry.group_size if geometry.group_size > 0 else 1
        grouped = Layout(out_axis=0, in_axis=1, in_pack=groups_in, split_input=geometry.shard_groups)
        loaders = {
            "qweight": simple_loader(layer, "weight_packed", Layout(out_axis=0, in_axis=1, in_pack=pack), 1,
                                     lambda t: t.t()),
            "scales": simple_loader(layer, "weight_scale", grouped, 1, lambda t: t.t()),
            "zeros": None if self.symmetric else simple_loader(
                layer, "weight_zero_point", Layout(out_axis=0, in_axis=1, out_pack=pack, in_pack=groups_in,
                                                   split_input=geometry.shard_groups), 1,
                lambda t: unpack_int32(t.t().contiguous(), self.bits)),
            "g_idx": g_idx_loader(layer, geometry, lambda loaded, shard_id: read_piece(
                layer, Layout(in_axis=0), loaded, shard_id, "weight_g_idx")[0]),
        }
        tensors = internal_tensors(geometry, output_size, zero=float(1 << (self.bits - 1)))
        add_internal(layer, self.names, tensors, loaders, optional=("g_idx",))
        add_param(layer, "weight_shape", torch.zeros(2, dtype=torch.int64), _shape_check(geometry), optional=True)


def _shape_check(geometry: Geometry):
    def load(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        shape = [int(v) for v in torch.as_tensor(loaded[:]).reshape(-1)]
        if len(shape) != 2 or shape[1] != geometry.full_input:
            raise ValueError(f"weight_shape {shape} does not match a linear layer with {geometry.full_input} "
                             "input features")
        param.data.copy_(torch.tensor(shape))
    return load


class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"

    def __init__(self, raw: dict[str, Any]) -> None:
        groups = list((raw.get("config_groups") or {}).values())
        if not groups:
            raise QuantizationError("compressed-tensors quantization_config has no config_groups")
        first = {k: v for k, v in groups[0].items() if k != "targets"}
        if any({k: v for k, v in g.items() if k != "targets"} != first for g in groups[1:]):
            raise QuantizationError("compressed-tensors: several quantization schemes in one checkpoint are not "
                                    f"supported; supported: one scheme of {'; '.join(SUPPORTED_SCHEMES)}")
        _check_targets([t for g in groups for t in g.get("targets", [])], raw.get("ignore") or [])
        if raw.get("kv_cache_scheme"):
            raise QuantizationError("compressed-tensors kv_cache_scheme (FP8 KV cache) is not supported; "
                                    "supported: weight/activation schemes only")
        status = raw.get("quantization_status", "compressed")
        if status != "compressed":
            raise QuantizationError(f"compressed-tensors quantization_status={status!r} is not supported; "
                                    "supported: 'compressed' checkpoints (as llm-compressor saves them)")
        self.format = groups[0].get("format") or raw.get("format") or ""
        self.weights = groups[0].get("weights") or {}
        self.activations = groups[0].get("input_activations")
        self.method = self._choose()

    def _choose(self) -> LinearMethod:
        w, a, fmt = self.weights, self.activations, self.format
        strategy, bits = w.get("strategy"), int(w.get("num_bits", 0))
        if fmt == "pack-quantized" and w.get("type") == "int" and bits in (4, 8) and a is None \
                and strategy in ("group", "channel"):
            group_size = int(w.get("group_size") or -1) if strategy == "group" else -1
            act_order = w.get("actorder") == "group"
            return WNA16LinearMethod(PackQuantizedFormat(bits, group_size, act_order, bool(w.get("symmetric", True))))
        if fmt in FP8_FORMATS and w.get("type") == "float" and bits == 8 and strategy in ("channel", "tensor") \
                and (a is None or (a.get("type") == "float" and a.get("num_bits") == 8 and a.get("dynamic") is True
                                   and a.get("strategy") == "token")):
            return Fp8LinearMethod(quantize_at_load=False, per_tensor_scales=strategy == "tensor",
                                   quantize_activations=a is not None)
        act = "none" if a is None else f"{a.get('type')}{a.get('num_bits')} {a.get('strategy')}" \
            f"{' dynamic' if a.get('dynamic') else ' static'}"
        raise QuantizationError(f"compressed-tensors scheme format={fmt!r}, weights {w.get('type')}{bits} "
                                f"{strategy}, activations {act} is not supported; supported: "
                                f"{'; '.join(SUPPORTED_SCHEMES)}")

    def linear_method(self) -> LinearMethod:
        return self.method

    def __repr__(self) -> str:
        return f"compressed-tensors({self.format}, weights={self.weights}, activations={self.activations})"


def _check_targets(targets: list[str], ignore: list[str]) -> None:
    """Every decoder linear layer must be quantized and nothing else may be ignored: the method is one
    object for all linear layers."""
    names = [f"model.layers.0.{'self_attn' if n.endswith(('q_proj', 'k_proj', 'v_proj', 'o_proj')) else 'mlp'}.{n}"
             for n in LINEAR_NAMES]

    def matches(pattern: str, name: str) -> bool:
        if pattern == "Linear":
            return True
        if pattern.startswith("re:"):
            return re.match(pattern[3:], name) is not None
        return name == pattern or name.endswith("." + pattern)

    uncovered = [n for n in names if not any(matches(t, n) for t in targets)]
    ignored = [n for n in names if any(matches(p, n) for p in ignore if p != "Linear")]
    if uncovered or ignored:
        raise QuantizationError(f"compressed-tensors targets {targets} / ignore {ignore} leave "
                                f"{(uncovered or ignored)[0].rsplit('.', 1)[-1]} unquantized: per-layer exceptions "
                                "are not supported; supported: targets [Linear], ignore [lm_head]")
