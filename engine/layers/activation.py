"""MLP activations: gated ones over a fused [gate | up] input (SiluAndMul, GeluAndMul), and plain ones."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import cpu_elementwise


class SiluAndMul(nn.Module):
    fused_cpu = False  # set by cpu_elementwise.install: float32 / bfloat16 CPU tensors take its one-pass kernel
    fused_gpu = False  # set by triton_elementwise.install: CUDA tensors take its one kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_cpu and x.dtype in cpu_elementwise.DTYPES and x.device.type == "cpu":
            return cpu_elementwise.silu_and_mul(x)
        if self.fused_gpu and x.is_cuda:
            from engine.kernels import triton_elementwise  # imported late: TRITON_INTERPRET is read at import
            return triton_elementwise.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)  # in place: one [T, I] tensor fewer to allocate and write


class NewGELU(nn.Module):
    """GPT-2's "gelu_new": the tanh approximation written out, as transformers computes it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def activation(name: str) -> nn.Module:
    """The element-wise activation transformers calls `name`."""
    if name == "silu":
        return nn.SiLU()
    if name == "gelu":
        return nn.GELU()
    if name == "gelu_pytorch_tanh":
        return nn.GELU(approximate="tanh")
    if name == "gelu_new":
        return NewGELU()
    raise ValueError(f"activation {name!r} is not supported")


class GatedActivation(nn.Module):
    """act(gate) * up over a fused [gate | up] input, for any activation (Gemma: GELU-tanh)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.act = activation(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return self.act(gate) * up


def gated_activation(name: str) -> nn.Module:
    return SiluAndMul() if name == "silu" else GatedActivation(name)
