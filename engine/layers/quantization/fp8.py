"""FP8 W8A8: e4m3 weights with per-output-channel scales, activations quantized per token at run time.

Two sources: `--quantize fp8` quantizes a bf16/fp16/fp32 checkpoint at load (each projection's rows
get their own scale, so q/k/v and gate/up quantize piece by piece), and compressed-tensors
`float-quantized` checkpoints (engine.layers.quantization.compressed_tensors) bring e4m3 weights with
per-channel or per-tensor scales (a per-tensor scale is spread over its projection's channels).
On GPUs with rowwise-scaled FP8 GEMMs (compute capability 9.0+: Hopper) the GEMM is `torch._scaled_mm`;
elsewhere the same numerics run dequantized (weight and fake-quantized activations in the activation
dtype: the weight per forward on older GPUs, once at load on CPU), and the log says so.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import fp8_quant
from engine.layers.quantization.base import Layout, LinearMethod, QuantizationConfig, add_param, read_piece, store

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
_logged: set[str] = set()


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (e4m3 [N, K], fp32 scale [N]) with each row's absmax at the top of the e4m3 range."""
    weight = weight.float()
    scale = weight.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
    return (weight / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (e4m3 [M, K], fp32 scale [M, 1]): the dynamic per-token activation scales. On a GPU one
    Triton kernel (engine.kernels.fp8_quant, self-checked), elsewhere its torch reference."""
    return fp8_quant.quantize_tokens(x)


def scaled_mm_usable(device: torch.device) -> bool:
    """Rowwise-scaled `torch._scaled_mm` (per-token x per-channel scales, as here) is a Hopper (9.0+) kernel;
    Ada (8.9) has FP8 tensor cores but torch's rowwise path has not been seen to run there."""
    return (device.type == "cuda" and hasattr(torch, "_scaled_mm")
            and torch.cuda.get_device_capability(device) >= (9, 0))


_checks: dict[torch.device, str] = {}


def scaled_mm_check(device: torch.device) -> str:
    """Start-up self-check of the rowwise-scaled FP8 GEMM on this device, once per process: "ok", or why the
    layers fall back to dequantized weights (same numerics, slower). The GEMM of e4m3 operands with per-row and
    per-column scales against the float32 product of the same operands times their scales, at 1 and 33 rows."""
    if device not in _checks:
        generator = torch.Generator().manual_seed(0)
        verdict = "ok"
        try:
            weight, weight_scale = quantize_rows((torch.randn(272, 512, generator=generator) * 0.05).to(device))
            for rows in (1, 33):
                x = (torch.randn(rows, 512, generator=generator) * 3).to(device, torch.bfloat16)
                xq, x_scale = quantize_tokens(x)
                got = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1),
                                       out_dtype=torch.bfloat16).float()
                want = (xq.float() * x_scale) @ (weight.float() * weight_scale[:, None]).t()
                error = ((got - want).norm() / want.norm()).item()
                if not error < 0.01:
                    verdict = f"differs from the dequantized product by {error:.3g} (relative, {rows} rows)"
                    break
        except Exception as error:  # a GEMM that does not run here must not take the engine down
            verdict = f"raised {type(error).__name__}: {error}"
        if verdict != "ok":
            logger.warning("FP8 torch._scaled_mm failed its self-check on %s (%s): FP8 layers run dequantized",
                           device, verdict)
        _checks[device] = verdict
    return _checks[device]


def kernel_report() -> dict[str, str]:
    """For /info: {"fp8_scaled_mm": "ok" or why not, "fp8_activation_quant": "triton" or "torch (why)"} once
    an FP8 layer was loaded where it can run."""
    return {**{"fp8_scaled_mm": verdict for verdict in _checks.values()}, **fp8_quant.kernel_report()}


class Fp8LinearMethod(LinearMethod):
    """`weight` e4m3 [N, K] and `weight_scale` fp32 [N]; `quantize_at_load` reads a float checkpoint."""

    def __init__(self, quantize_at_load: bool, per_tensor_scales: bool = False,
                 quantize_activations: bool = True) -> None:
        self.quantize_at_load, self.per_tensor_scales = quantize_at_load, per_tensor_scales
        self.quantize_activations = quantize_activations

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int) -> None:
        layer.act_dtype = torch.get_default_dtype()  # the model's dtype while it is built
        weight = torch.zeros(output_size, input_size, dtype=FP8)
        scale = torch.ones(output_size, dtype=torch.float32)
        if self.quantize_at_load:
            add_param(layer, "weight", weight, self._quantizing_loader(layer))
            layer.register_buffer("weight_scale", scale, persistent=False)
        else:
            add_param(layer, "weight", weight, self._fp8_loader(layer))
            add_param(layer, "weight_scale", scale, self._scale_loader(layer))

    def _quantizing_loader(self, layer: nn.Module):
        def load(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
            tensor, offset = read_piece(layer, Layout(out_axis=0, in_axis=1), loaded, shard_id, "weight")
            quantized, scale = quantize_rows(tensor.to(param.device))
            store(param, quantized, 0, offset, "weight")
            store(layer.weight_scale, scale, 0, offset, "weight_scale")
        return load

    def _fp8_loader(self, layer: nn.Module):
        def load(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
            tensor, offset = read_piece(layer, Layout(out_axis=0, in_axis=1), loaded, shard_id, "weight")
            if tensor.dtype != FP8:
                raise ValueError(f"weight of dtype {tensor.dtype} where the checkpoint's quantization_config "
                                 "promises float8_e4m3fn")
            store(param, tensor, 0, offset, "weight")
        return load

    def _scale_loader(self, layer: nn.Module):
        def load(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
            layout = Layout() if self.per_tensor_scales else Layout(out_axis=0)
            tensor, offset = read_piece(layer, layout, loaded, shard_id, "weight_scale")
            tensor = tensor.float().reshape(-1)
            if self.per_tensor_scales:  # one scale per projection, spread over its channels
                tensor = tensor.expand(layer.output_piece(shard_id)[2])
            store(param, tensor, 0, offset, "weight_scale")
        return load

    def finish_loading(self, layer: nn.Module) -> None:
        device = layer.weight.device
        layer.fp8_scaled_mm = scaled_mm_usable(device) and layer.weight.shape[0] % 16 == 0 \
            and layer.weight.shape[1] % 16 == 0 and scaled_mm_check(device) == "ok"
        if device.type == "cuda" and self.quantize_activations:
            fp8_quant.self_check(device)    # at load, never first inside a CUDA-graph capture
        if device.type == "cpu":  # as engine.layers.quantization.wna16: dequantize once, at load, on CPU
            layer.dense_weight = self._dequantized(layer, layer.act_dtype)
            layer.weight.data = layer.weight.data.new_empty(0)
        key = f"{device}:{layer.fp8_scaled_mm}"
        if key not in _logged:
            _logged.add(key)
            if layer.fp8_scaled_mm:
                logger.info("FP8 linear layers run torch._scaled_mm on %s", torch.cuda.get_device_name(device))
            else:
                logger.warning("FP8 linear layers on %s: no FP8 GEMM here (rowwise torch._scaled_mm needs CUDA "
                               "compute capability 9.0+); the weights are dequantized %s and activations still rounded "
                               "to FP8 per token (same numerics, slower%s)", device,
                               "once at load" if device.type == "cpu" else "per forward",
                               ", 4x the FP8 weight memory" if device.type == "cpu" else "")

    @staticmethod
    def _dequantized(layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        return (layer.weight.float() * layer.weight_scale[:, None]).to(dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        dense = getattr(layer, "dense_weight", None)
        if not self.quantize_activations:  # W8A16-FP8: only the weight is FP8
            return F.linear(x, dense if dense is not None else self._dequantized(layer, x.dtype), bias)
        xq, x_scale = quantize_tokens(flat)
        if getattr(layer, "fp8_scaled_mm", False):
            y = torch._scaled_mm(xq, layer.weight.t(), scale_a=x_scale, scale_b=layer.weight_scale.view(1, -1),
                                 out_dtype=torch.bfloat16).to(x.dtype)
            y = y if bias is None else y + bias
        else:
            x_deq = (xq.float() * x_scale).to(x.dtype)
            y = F.linear(x_deq, dense if dense is not None else self._dequantized(layer, x.dtype), bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])


class Fp8Config(QuantizationConfig):
    """`--quantize fp8`: quantize a float checkpoint at load."""
    name = "fp8"

    def linear_method(self) -> Fp8LinearMethod:
        return Fp8LinearMethod(quantize_at_load=True)

    def __repr__(self) -> str:
        return "FP8(at load: per-channel weight scales, dynamic per-token activation scales)"
