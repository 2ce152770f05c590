"""Rotary position embedding (neox/HF "rotate_half" layout) with llama3, linear, dynamic and longrope
scaling, over all of head_dim or its first `rotary_dim` channels (partial rotary)."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from engine.kernels import cpu_elementwise


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling)
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    # "dynamic" (NTK) only changes the base beyond max_position_embeddings, which the engine never
    # reaches, so inside the model's range it equals the default
    return inv_freq


def _llama3(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, a smooth ramp between the two bands."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_context = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelength < old_context / high) * ~(wavelength > old_context / low)
    return torch.where(is_medium, smoothed, scaled)


def _longrope_table(rotary_dim: int, max_position: int, theta: float,
                    scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """Phi-3 LongRoPE: positions past the original context use `long_factor`, the others `short_factor`.

    transformers switches the whole forward to the long factors once the sequence passes the original
    context; per position is the same for tokens decoded one by one from a prompt shorter than it.
    """
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    positions = torch.arange(max_position, dtype=torch.float32)
    tables = [torch.outer(positions, 1.0 / (torch.tensor(scaling[key], dtype=torch.float32) * theta ** exponents))
              for key in ("short_factor", "long_factor")]
    return torch.where(positions[:, None] < original, *tables), attention_factor


class RotaryEmbedding(nn.Module):
    fused_cpu = False  # set by cpu_elementwise.install: float32 / bfloat16 CPU q/k are rotated in place by its kernel
    fused_gpu = False  # set by triton_elementwise.install: CUDA q/k are rotated in place, tables read in-kernel

    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: dict[str, Any] | None = None, rotary_dim: int | None = None) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        magnitude = 1.0
        if (scaling or {}).get("rope_type") == "longrope":
            freqs, magnitude = _longrope_table(self.rotary_dim, max_position, theta, scaling)
        else:
            inv_freq = inverse_frequencies(self.rotary_dim, theta, scaling)
            freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq.float())
        cos, sin = freqs.cos() * magnitude, freqs.sin() * magnitude  # [max_position, rotary_dim // 2]
        # over the whole rotary_dim, sin signed for rotate_half: x * cos + rotate_half(x) * sin is one addcmul
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat((-sin, sin), dim=-1), persistent=False)
        self._step: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._step_float: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """Rotate q [T, heads, head_dim] and k [T, kv_heads, head_dim] by their token positions."""
        if self.fused_gpu and q.is_cuda and q.stride(-1) == k.stride(-1) == 1 and positions.stride(0) == 1:
            from engine.kernels import triton_elementwise  # imported late: TRITON_INTERPRET is read at import
            return triton_elementwise.rope_(q, k, positions, self.cos, self.sin)
        cos, sin = self._tables(positions)
        if self.fused_cpu and q.dtype == k.dtype and q.dtype in cpu_elementwise.DTYPES and q.device.type == "cpu" \
                and q.stride(-1) == k.stride(-1) == 1:  # q, k: fresh projections, rotated where they lie
            if cos.dtype != torch.float32:  # a bfloat16 model's tables: the kernel reads them widened (exactly)
                cos, sin = self._float_tables(positions, cos, sin)
            return cpu_elementwise.rope_(q, cos, sin), cpu_elementwise.rope_(k, cos, sin)
        if self.rotary_dim == q.shape[-1]:
            return _rotate(q, cos, sin), _rotate(k, cos, sin)
        d = self.rotary_dim  # partial rotary: the remaining channels pass through
        return (torch.cat((_rotate(q[..., :d], cos, sin), q[..., d:]), dim=-1),
                torch.cat((_rotate(k[..., :d], cos, sin), k[..., d:]), dim=-1))

    def _tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, rotary_dim] of the step's positions, looked up once for every layer sharing them.
        Only on CPU, where each step's positions are a new tensor (CUDA graphs refill a static one)."""
        if positions.device.type != "cpu":
            return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        step = self._step
        if step is None or step[0] is not positions:
            step = self._step = (positions, self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))
        return step[1], step[2]

    def _float_tables(self, positions: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`cos`, `sin` in float32, converted once per step (every layer shares them)."""
        cached = self._step_float
        if cached is None or cached[0] is not positions:
            cached = self._step_float = (positions, cos.float(), sin.float())
        return cached[1], cached[2]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with sin's first half negated beforehand (HF's formula, fewer ops)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.addcmul(x * cos, torch.cat((x2, x1), dim=-1), sin)
