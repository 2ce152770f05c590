"""Linear layers on CPU through oneDNN with the weight reordered once at load.

Why: torch's CPU `F.linear` in fp32 goes to MKL sgemm, which repacks the weight on every call and
takes a generic path on AMD CPUs. oneDNN with a pre-reordered weight was 1.2-4x faster on every
decode and prefill shape of SmolLM2 measured on an AMD EPYC (Zen 4) VM (docs/benchmarks.md), and the
forwards of a small model on CPU are almost all GEMM. The reorder costs one copy of each weight at
load; the plain weight is freed afterwards (except where it is shared, e.g. tied embeddings).

The ops used (`torch.ops.mkldnn._reorder_linear_weight`, `_linear_pointwise`) are the ones
Inductor's CPU backend emits; they are private, so `choose` runs them against `F.linear` first and
falls back to aten when they are missing, raise, or disagree.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F

from engine.kernels import choice


SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] -> an opaque oneDNN tensor for `linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def matmul(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
           bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b through the packed weight when the layer has one, else F.linear."""
    return F.linear(x, weight, bias) if packed is None else linear(x, packed, bias)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    shape = x.shape
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]).contiguous(), packed, bias, "none", [], "")
    return y.reshape(*shape[:-1], y.shape[-1])


def choose(wanted: str, device: torch.device, dtype: torch.dtype) -> str:
    """'onednn' or 'aten' for this device and dtype; raises when `wanted` cannot be honoured."""
    return choice.choose(wanted, "onednn", "aten", lambda: _unusable(device, dtype), what="CPU GEMM backend",
                         flag="--cpu-gemm", device=device)


def _unusable(device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type != "cpu":
        return f"device is {device.type}"
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} (oneDNN path covers float32 and bfloat16)"
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "this torch build has no oneDNN linear"
    try:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(48, 40, generator=generator, dtype=dtype)
        bias = torch.randn(48, generator=generator, dtype=dtype)
        x = torch.randn(2, 3, 40, generator=generator, dtype=dtype)
        got, want = linear(x, pack(weight), bias).float(), F.linear(x, weight, bias).float()
    except Exception as error:  # a private op that changed or broke: fall back, never fail the load
        return f"self-check raised {type(error).__name__}: {error}"
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    if got.shape != want.shape or not torch.allclose(got, want, atol=tolerance, rtol=tolerance):
        return "self-check disagrees with F.linear"
    return None


def prepack_model(model: torch.nn.Module) -> int:
    """Reorder the weight of every layer with a `packed_weight` slot; free the plain weight unless
    another module shares it (tied embeddings). Returns the number of layers packed."""
    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    packed = 0
    for module in model.modules():
        if hasattr(module, "prepack_cpu_gemm"):  # layers with stacked weights (engine/layers/fused_moe.py)
            packed += module.prepack_cpu_gemm()
            continue
        if not hasattr(module, "packed_weight") or module.packed_weight is not None:
            continue
        module.packed_weight = pack(module.weight)
        if uses.get(id(module.weight), 0) == 1:
            module.weight.data = module.weight.data.new_empty(0)
        packed += 1
    return packed
