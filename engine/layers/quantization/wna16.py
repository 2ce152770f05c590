"""Packed int4/int8 weights with fp16/bf16 activations (W4A16, W8A16): the method GPTQ, AWQ and
compressed-tensors pack-quantized checkpoints share once converted to engine.kernels.quant_gemm's layout.

Each format says which checkpoint tensor fills which of the four layer tensors and how to convert it
(`WNA16Format`); this file owns the group geometry under tensor parallelism and the matmul:
the Triton dequantize-in-the-GEMM kernel on CUDA. On CPU the weight is dequantized ONCE, at load, to
the model dtype (a logged warning gives the memory): dequantizing per forward cost 13 ms against 0.14 ms
for the fp32 matmul itself on one SmolLM2 MLP layer (2-core Zen 4), i.e. ~100x slower steps, while RAM
is rarely what limits the small models served on CPU. The packed tensors are freed after.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

import torch.nn.functional as F

from engine.kernels import quant_gemm
from engine.layers.quantization.base import LinearMethod, QuantizationError, add_param

logger = logging.getLogger(__name__)
_warned: list[bool] = []

# which layer attribute holds each internal tensor, named after the checkpoint tensor that fills it
Names = dict[str, str]


@dataclass(frozen=True, slots=True)
class Geometry:
    """Groups of one layer on this rank."""
    bits: int
    group_size: int       # -1: one group over all input features
    act_order: bool       # g_idx is a permutation: scales stay whole on row-parallel ranks
    input_size: int       # this rank's input features
    full_input: int       # the checkpoint's input features
    split: bool           # row-parallel: the input is split over ranks

    @property
    def pack(self) -> int:
        return 32 // self.bits

    @property
    def shard_groups(self) -> bool:
        """Row-parallel ranks read only their own groups' scales and zeros."""
        return self.split and self.group_size > 0 and not self.act_order

    @property
    def num_groups(self) -> int:
        if self.group_size <= 0:
            return 1
        features = self.input_size if self.shard_groups or not self.split else self.full_input
        return math.ceil(features / self.group_size)

    @property
    def kernel_group_size(self) -> int:
        """What wna16_gemm needs: 0 = gather through g_idx (act-order)."""
        if self.act_order:
            return 0
        return self.input_size if self.group_size <= 0 else self.group_size

    def default_g_idx(self) -> torch.Tensor:
        if self.group_size <= 0:
            return torch.zeros(self.input_size, dtype=torch.int32)
        return (torch.arange(self.input_size) // self.group_size).to(torch.int32)


class WNA16Format:
    """One checkpoint format's tensors. Subclasses register, on `layer`, the four tensors under the
    names in `names` (qweight, scales, zeros, g_idx), each parameter with a loader converting to the
    kernel's layout."""
    label = "wna16"
    names: Names = {"qweight": "qweight", "scales": "scales", "zeros": "qzeros", "g_idx": "g_idx"}

    def __init__(self, bits: int, group_size: int, act_order: bool) -> None:
        self.bits, self.group_size, self.act_order = bits, group_size, act_order

    def register(self, layer: nn.Module, geometry: Geometry, output_size: int) -> None:
        raise NotImplementedError


class WNA16LinearMethod(LinearMethod):
    def __init__(self, fmt: WNA16Format) -> None:
        self.fmt = fmt

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int) -> None:
        split = layer.input_piece() is not None and layer.tp_size > 1
        geometry = Geometry(self.fmt.bits, self.fmt.group_size, self.fmt.act_order, input_size,
                            input_size * layer.tp_size if split else input_size, split)
        check_geometry(self.fmt.label, geometry, layer.tp_size)
        layer.quant_geometry = geometry
        layer.act_dtype = torch.get_default_dtype()  # the model's dtype while it is built
        self.fmt.register(layer, geometry, output_size)

    def _tensors(self, layer: nn.Module) -> list[torch.Tensor]:
        return [getattr(layer, self.fmt.names[key]) for key in ("qweight", "scales", "zeros", "g_idx")]

    def finish_loading(self, layer: nn.Module) -> None:
        tensors = self._tensors(layer)
        geometry = layer.quant_geometry
        if tensors[0].is_cuda and quant_gemm.triton is not None:
            checks = kernel_checks(tensors[0].device, layer.act_dtype)
            if checks["gemm"] == "ok":
                layer.kernel_perm = getattr(layer, "kernel_perm", None)  # sorted once, even if loaded again
                layer.kernel_group = geometry.kernel_group_size if layer.kernel_perm is None else geometry.group_size
                if layer.kernel_perm is None and geometry.act_order and geometry.group_size > 0:
                    found = sort_act_order(tensors[0], tensors[3], geometry.bits, geometry.group_size)
                    if found is not None:  # one scale row per K tile, as without act-order
                        tensors[0].data, tensors[3].data, layer.kernel_perm = found
                        layer.kernel_group = geometry.group_size
                # tiles, splits and GEMV-or-not timed per layer shape and row bucket
                chosen = quant_gemm.choose_configs(layer.act_dtype, *tensors, geometry.bits, layer.kernel_group,
                                                   gemv=checks["gemv"] == "ok", perm=layer.kernel_perm)
                layer.use_gemv = chosen[1].block_m == 0
                _gemv_layers[layer.use_gemv] += 1
                return
        dense = quant_gemm.dequantize(*tensors, layer.quant_geometry.bits, layer.act_dtype).t().contiguous()
        layer.dense_weight = dense
        for tensor in tensors[:3]:
            tensor.data = tensor.data.new_empty(0)
        if not _warned:
            _warned.append(True)
            logger.warning("%s weights on %s: dequantized to %s once at load (%.1f MB for this layer alone, "
                           "%dx its packed size); per-forward dequantization is ~100x slower on CPU",
                           self.fmt.label, dense.device, dense.dtype, dense.numel() * dense.element_size() / 1e6,
                           dense.element_size() * 8 // layer.quant_geometry.bits)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        dense = getattr(layer, "dense_weight", None)
        if dense is not None:  # CPU, or CUDA without triton
            return F.linear(x, dense, bias)
        qweight, scales, zeros, g_idx = self._tensors(layer)
        geometry = layer.quant_geometry
        flat = x.reshape(-1, x.shape[-1])  # wna16_gemm launches what choose_configs chose at load for this shape
        y = quant_gemm.wna16_gemm(flat, qweight, scales, zeros, g_idx, geometry.bits,
                                  getattr(layer, "kernel_group", geometry.kernel_group_size),
                                  perm=getattr(layer, "kernel_perm", None))
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], y.shape[-1])


_checks: dict[tuple[torch.device, torch.dtype], dict[str, str]] = {}
_gemv_layers = {True: 0, False: 0}


def kernel_checks(device: torch.device, dtype: torch.dtype) -> dict[str, str]:
    """The Triton kernels' start-up self-check on this device and dtype, once per process (logged). A tiled
    kernel that fails it leaves the layers dequantized (memory, not wrong tokens); a GEMV that fails is not used."""
    key = (device, dtype)
    if key not in _checks:
        _checks[key] = quant_gemm.self_check(device, dtype)
        level = logging.INFO if all(v == "ok" for v in _checks[key].values()) else logging.WARNING
        logger.log(level, "W4A16/W8A16 Triton kernels on %s (%s): %s", device, dtype,
                   ", ".join(f"{name} {verdict}" for name, verdict in _checks[key].items()))
        if _checks[key]["gemm"] != "ok":
            logger.warning("the tiled W4A16/W8A16 kernel failed its self-check: quantized layers are dequantized "
                           "to %s at load (the memory of an unquantized model)", dtype)
    return _checks[key]


def reset_report() -> None:
    """Before a model loads: the GEMV layer counts are per model (the self-check verdicts stay cached)."""
    _gemv_layers[True] = _gemv_layers[False] = 0


def kernel_report() -> dict[str, str]:
    """For /info: each kernel's self-check verdict, and how many layers take the GEMV at decode (chosen per
    layer shape by timing the candidate launches at load). Empty without quantized layers on CUDA."""
    report = {name: verdict for checks in _checks.values() for name, verdict in checks.items()}
    if _gemv_layers[True] or _gemv_layers[False]:
        report["gemv_layers"] = f"{_gemv_layers[True]} of {_gemv_layers[True] + _gemv_layers[False]}"
    return report


def check_geometry(label: str, geometry: Geometry, tp: int) -> None:
    if geometry.input_size % geometry.pack:
        raise QuantizationError(f"{label}: {geometry.input_size} input features per rank are not a multiple of "
                                f"{geometry.pack} ({geometry.bits}-bit values packed in int32)")
    if geometry.shard_groups and geometry.input_size % geometry.group_size:
        raise QuantizationError(f"{label}: group_size={geometry.group_size} does not divide the "
                                f"{geometry.input_size} input features each of --num-shard {tp} ranks holds "
                                f"({geometry.full_input} in all); use a --num-shard that keeps whole groups "
                                "on each rank")


def internal_tensors(geometry: Geometry, output_size: int, zero: float = 0.0) -> dict[str, torch.Tensor]:
    # scales keep fp16's 10 mantissa bits under a bf16 model (GPTQ/AWQ write fp16 scales); the kernel and the
    # CPU dequantization compute in fp32 either way
    dtype = torch.float32 if torch.get_default_dtype() == torch.float32 else torch.float16
    groups = geometry.num_groups
    return {
        "qweight": torch.zeros(geometry.input_size // geometry.pack, output_size, dtype=torch.int32),
        "scales": torch.zeros(groups, output_size, dtype=dtype),
        "zeros": torch.full((groups, output_size), zero, dtype=dtype),
        "g_idx": geometry.default_g_idx(),
    }


def unpack_int32(packed: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """[R, C] int32 -> [R, C * pack] int32 values, element j of a word at bits j*bits (little end first),
    or at bits order.index(j)*bits when the format interleaves (AWQ)."""
    pack = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    values = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [R, C, pack]
    if order is not None:
        values = values[..., [order.index(j) for j in range(pack)]]
    return values.reshape(packed.shape[0], -1)


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[K, N] unsigned ints -> [K / pack, N] int32, row k at bits (k % pack) * bits."""
    pack = 32 // bits
    rows = values.to(torch.int64).reshape(values.shape[0] // pack, pack, values.shape[1])
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=values.device)[None, :, None]
    word = (rows << shifts).sum(dim=1)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def sort_act_order(qweight: torch.Tensor, g_idx: torch.Tensor, bits: int, group_size: int,
                   columns: int = 1024) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """An act-order layer with its weight rows sorted by group: (qweight, g_idx = k // group_size, perm) with
    row k of the new weight the old row perm[k], so x[:, perm] @ new == x @ old (quant_gemm's `perm`), or
    None when the sorted groups are not whole runs of group_size (e.g. a row-parallel shard). Repacked
    `columns` at a time (transient memory: 8 bytes per weight of one slice)."""
    k = g_idx.numel()
    perm = torch.argsort(g_idx.long(), stable=True)
    g_sorted = g_idx.long()[perm]
    if k % group_size or not torch.equal(g_sorted, torch.arange(k, device=g_idx.device) // group_size):
        return None
    sorted_q = torch.empty_like(qweight)
    for start in range(0, qweight.shape[1], columns):
        piece = unpack_int32(qweight[:, start:start + columns].t(), bits).t()  # [K, columns]
        sorted_q[:, start:start + columns] = pack_rows(piece[perm], bits)
    return sorted_q, g_sorted.to(torch.int32), perm.to(torch.int32)


def g_idx_loader(layer: nn.Module, geometry: Geometry, layout_read: Callable[..., Any]) -> Callable[..., None]:
    """g_idx of a fused layer comes once per projection: every copy must agree (same input, same order)."""
    def load(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        tensor = layout_read(loaded, shard_id).to(torch.int32)
        if geometry.shard_groups:  # global group ids -> this rank's
            tensor = tensor - layer.input_piece()[0] // geometry.group_size
        if tensor.shape != param.shape:
            raise ValueError(f"g_idx of shape {tuple(tensor.shape)} does not fit {tuple(param.shape)}")
        seen = getattr(layer, "_g_idx_seen", False)
        if seen and not torch.equal(param.data.cpu(), tensor):
            raise QuantizationError("act-order g_idx differs between the projections fused into one layer "
                                    "(q/k/v or gate/up); this checkpoint cannot be served fused")
        if int(tensor.min()) < 0 or int(tensor.max()) >= geometry.num_groups:
            raise QuantizationError(f"g_idx holds group ids outside [0, {geometry.num_groups}): the checkpoint "
                                    "does not match its quantization_config")
        param.data.copy_(tensor)
        layer._g_idx_seen = True
    return load


def add_internal(layer: nn.Module, names: Names, tensors: dict[str, torch.Tensor],
                 loaders: dict[str, Callable[..., None] | None], optional: tuple[str, ...] = ()) -> None:
    """Register each internal tensor under its checkpoint name: a parameter when the checkpoint fills it
    (a loader given), a buffer otherwise (e.g. AWQ's implicit g_idx)."""
    for key, tensor in tensors.items():
        loader = loaders.get(key)
        if loader is None:
            layer.register_buffer(names[key], tensor, persistent=False)
        else:
            add_param(layer, names[key], tensor, loader, optional=key in optional)
