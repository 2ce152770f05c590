"""Norms with an optional fused residual add: RMSNorm (float32 like the reference), Gemma's (1 + w)
RMSNorm, LayerNorm with bias, and an RMSNorm over a tensor-parallel split dimension."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import all_reduce, tp_size
from engine.kernels import cpu_elementwise
from engine.weights import read_shard


class RMSNorm(nn.Module):
    fused_cpu = False  # set by cpu_elementwise.install: float32 / bfloat16 CPU tensors take its one-pass kernel
    fused_gpu = False  # set by triton_elementwise.install: CUDA tensors of the weight's dtype take its kernel

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and self.weight.dtype == torch.float32:  # one fused op, the same bits
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or with `residual`: (norm(x + residual), x + residual)."""
        if self.fused_cpu and x.dtype in cpu_elementwise.DTYPES and x.dtype == self.weight.dtype \
                and x.device.type == "cpu" and (residual is None or residual.dtype == x.dtype):
            return cpu_elementwise.add_rms_norm(x, residual, self.weight, self.eps)
        if self.fused_gpu and x.is_cuda and x.dtype == self.weight.dtype:
            from engine.kernels import triton_elementwise  # imported late: TRITON_INTERPRET is read at import
            return triton_elementwise.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self.norm(x)
        x = x + residual
        return self.norm(x), x


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is stored as an offset from 1 and applied in float32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        self.weight.data.zero_()

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class LayerNorm(RMSNorm):
    """LayerNorm with bias (StarCoder2, GPT-2), with the same fused residual add as RMSNorm."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__(hidden_size, eps)
        self.bias = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


class ShardedRMSNorm(RMSNorm):
    """RMSNorm over a feature dimension split across tensor-parallel ranks (OLMo 2's q/k norm over all
    heads). Each rank holds `size` features from `start`; the mean square is all-reduced.

    Ranks that hold a replicated kv head count it once per replica on both sides of the mean, so the
    mean over `size * tp_size` summed features is still right.
    """

    def __init__(self, size: int, start: int, eps: float = 1e-6) -> None:
        super().__init__(size, eps)
        self.start = start
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        param.data.copy_(read_shard(loaded, 0, self.start, param.shape[0]))

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        square_sum = all_reduce(y.pow(2).sum(-1, keepdim=True))
        y = y * torch.rsqrt(square_sum / (y.shape[-1] * tp_size()) + self.eps)
        return self.weight * y.to(x.dtype)
