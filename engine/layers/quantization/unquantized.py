"""Plain float weights: y = x W^T + b, through the oneDNN-prepacked weight on CPU (cpu_gemm)."""
from __future__ import annotations

import torch
from torch import nn

from engine.layers import cpu_gemm
from engine.layers.quantization.base import Layout, LinearMethod, add_param, simple_loader

WEIGHT = Layout(out_axis=0, in_axis=1)


class UnquantizedLinearMethod(LinearMethod):
    def create_weights(self, layer: nn.Module, input_size: int, output_size: int) -> None:
        # `packed_weight` marks the layer for cpu_gemm.prepack_model; only unquantized layers have it
        layer.packed_weight = None
        add_param(layer, "weight", torch.empty(output_size, input_size),
                  simple_loader(layer, "weight", WEIGHT, 0))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return cpu_gemm.matmul(x, layer.weight, layer.packed_weight, bias)
