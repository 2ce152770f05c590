"""Swap a transformers model's nn.Linear layers for oneDNN linears with the weight reordered once at load.

The GEMM is engine/layers/cpu_gemm.py's (the ops Inductor's CPU backend emits), measured faster than torch's
MKL `F.linear` on this AMD CPU (docs/benchmarks.md); `cpu_gemm.choose` self-checks it against F.linear first
and the model keeps its plain linears when the check fails. The rest of the forward stays the library's.
"""
from __future__ import annotations

import torch

from engine.layers import cpu_gemm


class PackedLinear(torch.nn.Module):
    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = cpu_gemm.pack(linear.weight)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_gemm.linear(x, self.packed, self.bias)


def pack_linears(model: torch.nn.Module) -> int:
    """Replace every nn.Linear whose weight no other module shares; returns how many were replaced."""
    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is torch.nn.Linear and uses.get(id(child.weight), 0) == 1]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    return len(swaps)
